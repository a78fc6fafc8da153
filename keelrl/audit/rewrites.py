"""Behaviour-preserving rewrites of the reference fix: candidates a sound verifier passes in full."""

from __future__ import annotations

import ast
import builtins
import copy
from typing import Callable, Iterator, Mapping, Sequence

from keelrl.audit.probes import Probe, REWRITE
from keelrl.envs.tasks import Task
from keelrl.registry import Registry


# ------------------------------------------------------------------------------ rewrites

Rewrite = Callable[[ast.Module, ast.FunctionDef], bool]
"""Transform the entry function (and, if needed, the module) in place; False: nothing to do."""
REWRITES: Registry[Rewrite] = Registry("rewrite", ("tree", "function"))
"""Rewrite name -> the transformation, in the order the audit tries them."""


def _names_in(tree: ast.AST) -> set[str]:
    """Every identifier the module binds or reads: a fresh name must avoid all of them."""
    names = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _fresh(base: str, taken: set[str]) -> str:
    name = base
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def _has_nested_scope(function: ast.FunctionDef) -> bool:
    """Lambdas, nested functions and classes: their own scopes would need their own renaming rules."""
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
               for node in ast.walk(function) if node is not function)


def _split_docstring(function: ast.FunctionDef) -> tuple[list[ast.stmt], list[ast.stmt]]:
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[:1], body[1:]
    return [], body


def _positional_params(function: ast.FunctionDef) -> list[str]:
    return [arg.arg for arg in function.args.posonlyargs + function.args.args]


def _simple_signature(function: ast.FunctionDef) -> bool:
    """Only positional parameters without defaults (every bundled task's entry function)."""
    arguments = function.args
    return not (arguments.vararg or arguments.kwarg or arguments.kwonlyargs or arguments.defaults
                or arguments.posonlyargs or function.decorator_list)


def _rename(nodes: Sequence[ast.AST], mapping: Mapping[str, str]) -> None:
    for statement in nodes:
        for node in ast.walk(statement):
            if isinstance(node, ast.Name) and node.id in mapping:
                node.id = mapping[node.id]


@REWRITES.register("rename_locals", summary="every local variable renamed")
def _rename_locals(tree: ast.Module, function: ast.FunctionDef) -> bool:
    """Every local variable (assigned in the function, loop and comprehension targets) gets a new name."""
    if _has_nested_scope(function):
        return False
    declared = {name for node in ast.walk(function) if isinstance(node, (ast.Global, ast.Nonlocal))
                for name in node.names}
    module_level = {statement.name for statement in tree.body
                    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    module_level |= {node.id for statement in tree.body if not isinstance(statement, ast.FunctionDef)
                     for node in ast.walk(statement) if isinstance(node, ast.Name)}
    stored = {node.id for node in ast.walk(function) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    local = sorted(stored - set(_positional_params(function)) - declared - module_level)
    if not local:
        return False
    taken = _names_in(tree)
    _rename(function.body, {name: _fresh(f"{name}_local", taken) for name in local})
    return True


@REWRITES.register("alias_params", summary="each parameter copied into a local that is used instead")
def _alias_params(tree: ast.Module, function: ast.FunctionDef) -> bool:
    """Each parameter is copied into a local at the top and only the local is used (same signature)."""
    params = _positional_params(function)
    if not params or _has_nested_scope(function) or any(
            isinstance(node, (ast.Global, ast.Nonlocal)) for node in ast.walk(function)):
        return False
    taken = _names_in(tree)
    mapping = {param: _fresh(f"{param}_arg", taken) for param in params}
    docstring, body = _split_docstring(function)
    _rename(body, mapping)
    aliases: list[ast.stmt] = [ast.Assign(targets=[ast.Name(mapping[param], ast.Store())],
                                          value=ast.Name(param, ast.Load())) for param in params]
    function.body = docstring + aliases + body
    return True


_MIRRORED: dict[type, type] = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE,
                               ast.Eq: ast.Eq, ast.NotEq: ast.NotEq, ast.Is: ast.Is, ast.IsNot: ast.IsNot}
_PURE_CALLS = {"len", "abs", "min", "max", "sum", "sorted", "list", "str", "int"}


def _pure(node: ast.AST) -> bool:
    """No call with side effects: builtins that only read, and `.get`/`.strip`-style reads."""
    for inner in ast.walk(node):
        if isinstance(inner, (ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr)):
            return False
        if isinstance(inner, ast.Call):
            called = inner.func
            if isinstance(called, ast.Name) and called.id in _PURE_CALLS:
                continue
            if isinstance(called, ast.Attribute) and called.attr in ("get", "strip", "lower", "upper", "split"):
                continue
            return False
    return True


@REWRITES.register("mirror_comparisons", summary="comparisons mirrored: `a < b` as `b > a`")
def _mirror_comparisons(tree: ast.Module, function: ast.FunctionDef) -> bool:
    """`a < b` as `b > a`, `x is None` as `None is x`...: single comparisons of side-effect-free operands."""
    changed = False
    for node in ast.walk(function):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _MIRRORED \
                and _pure(node.left) and _pure(node.comparators[0]):
            node.left, node.comparators = node.comparators[0], [node.left]
            node.ops = [_MIRRORED[type(node.ops[0])]()]
            changed = True
    return changed


def _none_tests(function: ast.FunctionDef) -> Iterator[tuple[ast.Compare, bool]]:
    """(comparison, negated) for every `x is None` / `x is not None` (None on either side)."""
    for node in ast.walk(function):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)):
            if _is_none(node.comparators[0]) or _is_none(node.left):
                if _is_none(node.left):
                    node.left, node.comparators = node.comparators[0], [node.left]
                yield node, isinstance(node.ops[0], ast.IsNot)


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


@REWRITES.register("none_equality", summary="`x is None` as `x == None`")
def _none_equality(tree: ast.Module, function: ast.FunctionDef) -> bool:
    """`x is None` as `x == None` (the same for JSON values, which have no custom __eq__)."""
    changed = False
    for node, negated in list(_none_tests(function)):
        node.ops = [ast.NotEq() if negated else ast.Eq()]
        changed = True
    return changed


@REWRITES.register("none_membership", summary="`x is None` as `x in (None,)`")
def _none_membership(tree: ast.Module, function: ast.FunctionDef) -> bool:
    """`x is None` as `x in (None,)` (membership tests identity first, then ==)."""
    changed = False
    for node, negated in list(_none_tests(function)):
        node.ops = [ast.NotIn() if negated else ast.In()]
        node.comparators = [ast.Tuple(elts=[ast.Constant(None)], ctx=ast.Load())]
        changed = True
    return changed


def _statement_lists(function: ast.FunctionDef) -> Iterator[list[ast.stmt]]:
    for node in ast.walk(function):
        for name in ("body", "orelse", "finalbody"):
            statements = getattr(node, name, None)
            if isinstance(statements, list) and statements and isinstance(statements[0], ast.stmt):
                yield statements


def _assigned_name(statement: ast.stmt) -> str | None:
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
        return statement.targets[0].id
    return None


def _conditional_style_of(statements: list[ast.stmt], index: int) -> tuple[int, list[ast.stmt]] | None:
    """How many statements at `index` to replace, and with what; None when no pattern fits."""
    statement = statements[index]
    following = statements[index + 1] if index + 1 < len(statements) else None
    if isinstance(statement, ast.If):
        test, body, orelse = statement.test, statement.body, statement.orelse
        if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
            if len(orelse) == 1 and isinstance(orelse[0], ast.Return) and orelse[0].value is not None:
                return 1, [ast.Return(ast.IfExp(test, body[0].value, orelse[0].value))]
            if not orelse and isinstance(following, ast.Return) and following.value is not None:
                return 2, [ast.Return(ast.IfExp(test, body[0].value, following.value))]
        name = _assigned_name(body[0]) if len(body) == 1 else None
        if name is not None:
            assert isinstance(body[0], ast.Assign)
            if len(orelse) == 1 and _assigned_name(orelse[0]) == name:
                assert isinstance(orelse[0], ast.Assign)
                return 1, [ast.Assign(targets=[ast.Name(name, ast.Store())],
                                      value=ast.IfExp(test, body[0].value, orelse[0].value))]
            # `if c: x = a` keeps x otherwise: `x = a if c else x`, when x is already bound above
            if not orelse and any(_assigned_name(earlier) == name for earlier in statements[:index]):
                return 1, [ast.Assign(targets=[ast.Name(name, ast.Store())],
                                      value=ast.IfExp(test, body[0].value, ast.Name(name, ast.Load())))]
    if isinstance(statement, ast.Return) and isinstance(statement.value, ast.IfExp):
        choice = statement.value
        return 1, [ast.If(test=choice.test, body=[ast.Return(choice.body)], orelse=[]), ast.Return(choice.orelse)]
    name = _assigned_name(statement)
    if name is not None and isinstance(statement, ast.Assign) and isinstance(statement.value, ast.IfExp):
        choice = statement.value
        return 1, [ast.If(test=choice.test, body=[ast.Assign(targets=[ast.Name(name, ast.Store())], value=choice.body)],
                          orelse=[ast.Assign(targets=[ast.Name(name, ast.Store())], value=choice.orelse)])]
    return None


@REWRITES.register("conditional_style", summary="if-statements as conditional expressions and back")
def _conditional_style(tree: ast.Module, function: ast.FunctionDef) -> bool:
    """if-statements that pick a value as conditional expressions, and conditional expressions as if/else."""
    changed = False
    for statements in list(_statement_lists(function)):
        rewritten: list[ast.stmt] = []
        index = 0
        while index < len(statements):
            found = _conditional_style_of(statements, index)
            if found is None:
                rewritten.append(statements[index])
                index += 1
            else:
                count, replacement = found
                rewritten += replacement
                index += count
                changed = True
        statements[:] = rewritten
    return changed


@REWRITES.register("return_via_variable", summary="`return e` through a variable")
def _return_via_variable(tree: ast.Module, function: ast.FunctionDef) -> bool:
    """`return e` as `result = e` then `return result`."""
    if _has_nested_scope(function):
        return False
    name = _fresh("result", _names_in(tree))
    changed = False
    for statements in list(_statement_lists(function)):
        rewritten: list[ast.stmt] = []
        for statement in statements:
            if isinstance(statement, ast.Return) and statement.value is not None:
                rewritten += [ast.Assign(targets=[ast.Name(name, ast.Store())], value=statement.value),
                              ast.Return(ast.Name(name, ast.Load()))]
                changed = True
            else:
                rewritten.append(statement)
        statements[:] = rewritten
    return changed


@REWRITES.register("helper_function", summary="the body moved into a module-level helper")
def _helper_function(tree: ast.Module, function: ast.FunctionDef) -> bool:
    """The body moves into a new module-level helper; the entry function calls it with its arguments."""
    if not _simple_signature(function) or any(isinstance(node, (ast.Global, ast.Nonlocal, ast.Yield, ast.YieldFrom))
                                              for node in ast.walk(function)):
        return False
    docstring, body = _split_docstring(function)
    helper = copy.deepcopy(function)
    helper.name = _fresh(f"_{function.name}_impl", _names_in(tree))
    helper.body = body
    params = _positional_params(function)
    function.body = docstring + [ast.Return(ast.Call(func=ast.Name(helper.name, ast.Load()),
                                                     args=[ast.Name(param, ast.Load()) for param in params],
                                                     keywords=[]))]
    tree.body.insert(tree.body.index(function) + 1, helper)
    return True


@REWRITES.register("docstring_comments", summary="another docstring, and comments")
def _docstring_comments(tree: ast.Module, function: ast.FunctionDef) -> bool:
    """A different docstring (comments are added after unparsing, see `rewrite_source`)."""
    docstring = ast.Expr(ast.Constant("Rewritten for keel audit: other words, the same behaviour."))
    function.body = [docstring] + _split_docstring(function)[1]
    return True


def rewrite_source(source: str, function_name: str, rewrite: str) -> str | None:
    """`source` with `rewrite` applied to the function `function_name`; None when it does not apply."""
    tree = ast.parse(source)
    function = next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function_name),
                    None)
    if function is None or not REWRITES[rewrite](tree, function):
        return None
    text = ast.unparse(ast.fix_missing_locations(tree)) + "\n"
    if rewrite == "docstring_comments":
        lines = text.split("\n")
        at = next(index for index, line in enumerate(lines) if line.startswith(f"def {function_name}("))
        lines[at:at] = ["# Comments and docstrings do not change what the code does.",
                        "# This one was added by keel audit."]
        text = "\n".join(lines)
    compile(text, "<rewrite>", "exec")  # a rewrite that does not even compile is a bug here
    return text


def rewrite_probes(task: Task) -> list[Probe]:
    """The reference fix put through each applicable rewrite (see `REWRITES`)."""
    fixed = task.fixed_files()[task.entry_file]
    probes = []
    for name in REWRITES:
        text = rewrite_source(fixed, task.entry_function, name)
        if text is not None and text != fixed:
            probes.append(Probe(name, name, REWRITE, {**task.reference_fix, task.entry_file: text}))
    return probes
