"""The tool-call format of keelrl's text environments, and its parser.

An action is free text containing exactly one tool call:

    <call>NAME ARGS
    BODY</call>

The first line inside the tags is the tool's name followed by its arguments on that line
(split on whitespace); everything after the first newline, up to </call>, is the body (it
may span lines, e.g. replacement code). Text before <call> is allowed and ignored (the
policy's reasoning); text after </call> is ignored too, since generation stops at </call>
(`STOP` is the stop string for samplers). One newline right before </call> ends the body's
last line rather than adding an empty one. Examples:

    <call>read</call>
    <call>replace 2
        return 3 if config.get("retries") is None else config["retries"]</call>
    <call>test</call>
    <call>submit</call>

`parse_action` returns a `ToolCall` or raises `ActionError` whose message says what was
wrong and what is accepted, ready to be shown to the policy as an error observation.

This is the `call` format of `keelrl.envs.formats`, which also holds the model-native formats
(hermes, json). A tool is declared once, as a `ToolSpec`: its `params` and `body_param` name its
arguments, so the JSON formats pass them by name and `ToolSpec.schema()` gives the OpenAI-style
function schema a chat template renders; `tool_from_function` builds one from a Python
function's signature and docstring.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

OPEN, STOP = "<call>", "</call>"


class ActionError(ValueError):
    """A malformed or unknown tool call; str() is the error observation for the policy."""


JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
"""The Python annotations a tool parameter may have, and their JSON schema types (`tool_from_function`)."""

BODIES = ("none", "optional", "required")


@dataclass(frozen=True)
class ToolSpec:
    """A tool's name, its usage line (shown in errors and prompts), its argument count and the
    names of its arguments. Stable public API: fields are only appended, with defaults."""

    name: str
    usage: str
    """The call format's usage line (`<call>read [PATH]</call>`); other formats write their own."""
    description: str
    min_args: int = 0
    max_args: int = 0
    body: str = "none"
    """none (no body allowed) | optional | required."""
    params: tuple[str, ...] = ()
    """The names of the positional arguments, in order (the JSON formats pass them by name). It
    holds at least `min_args` names and at most `max_args`; empty: the JSON formats can pass no
    positional argument (a tool with min_args > 0 then cannot be used with them)."""
    body_param: str = "body"
    """The name of the body in the JSON formats (when `body` is not none)."""
    param_types: Mapping[str, str] = field(default_factory=dict, hash=False)
    """JSON schema types by parameter name (string, integer, number, boolean); unnamed: string."""
    param_descriptions: Mapping[str, str] = field(default_factory=dict, hash=False)
    """One-line descriptions by parameter name, for the schema (unnamed: none)."""

    def __post_init__(self) -> None:
        where = f"tool {self.name!r}"
        if self.body not in BODIES:
            raise ValueError(f"{where}: body must be one of {', '.join(BODIES)}, got {self.body!r}")
        if not 0 <= self.min_args <= self.max_args:
            raise ValueError(f"{where}: needs 0 <= min_args <= max_args, got {self.min_args} and {self.max_args}")
        if self.params and not self.min_args <= len(self.params) <= self.max_args:
            raise ValueError(f"{where}: params {self.params} must name between min_args={self.min_args} and "
                             f"max_args={self.max_args} arguments")
        names = self.param_names()
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"{where}: parameter names must be distinct non-empty strings, got {names}")
        for label, mapping in (("param_types", self.param_types), ("param_descriptions", self.param_descriptions)):
            unknown = [key for key in mapping if key not in names]
            if unknown:
                raise ValueError(f"{where}: {label} names {unknown}, which are not its parameters {names}")
        bad = {k: v for k, v in self.param_types.items() if v not in JSON_TYPES.values()}
        if bad:
            raise ValueError(f"{where}: param_types {bad}; a type is one of {', '.join(JSON_TYPES.values())}")
        if self.body != "none" and self.param_type(self.body_param) != "string":
            raise ValueError(f"{where}: the body {self.body_param!r} is text; its type must be string")

    def param_names(self) -> tuple[str, ...]:
        """The positional parameters' names, then the body's (when the tool takes one)."""
        return self.params + ((self.body_param,) if self.body != "none" else ())

    def param_type(self, name: str) -> str:
        """The JSON schema type of parameter `name` (string unless `param_types` says otherwise)."""
        return self.param_types.get(name, "string")

    def required(self) -> tuple[str, ...]:
        """The parameters a call must give: the first `min_args`, and the body when it is required."""
        return self.params[:self.min_args] + ((self.body_param,) if self.body == "required" else ())

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function tool: {"type": "function", "function": {name, description,
        parameters: a JSON schema object}}. ValueError when the tool takes positional arguments
        it does not name (`params`)."""
        if len(self.params) < self.min_args:
            raise ValueError(f"tool {self.name!r} takes {self.min_args} or more arguments but names "
                             f"{len(self.params)} (ToolSpec.params): a JSON schema passes arguments by name")
        properties: dict[str, Any] = {}
        for name in self.param_names():
            properties[name] = {"type": self.param_type(name)}
            if name in self.param_descriptions:
                properties[name]["description"] = self.param_descriptions[name]
        parameters = {"type": "object", "properties": properties, "required": list(self.required())}
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": parameters}}

    def arguments(self, call: ToolCall) -> dict[str, str]:
        """`call`'s arguments by name: its positional args under `params`, its body (when not
        empty) under `body_param`. ValueError when it has more args than `params` names."""
        if len(call.args) > len(self.params):
            raise ValueError(f"tool {self.name!r} names {len(self.params)} parameters {self.params}; "
                             f"the call has {len(call.args)} arguments")
        named = dict(zip(self.params, call.args))
        if self.body != "none" and (call.body or self.body == "required"):
            named[self.body_param] = call.body
        return named


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: tuple[str, ...]
    body: str


def describe_tools(tools: Mapping[str, ToolSpec]) -> str:
    """The tool list as the agent sees it in the prompt and in error observations."""
    lines = ["Act with exactly one tool call per turn:"]
    lines += [f"  {spec.usage}  - {spec.description}" for spec in tools.values()]
    return "\n".join(lines)


def parse_action(text: str, tools: Mapping[str, ToolSpec], max_chars: int = 4000) -> ToolCall:
    """Parse one tool call out of `text` (see the module docstring) or raise ActionError."""
    if len(text) > max_chars:
        raise ActionError(f"error: the action is {len(text)} characters long; the limit is {max_chars}.\n"
                          + describe_tools(tools))
    start = text.find(OPEN)
    if start < 0:
        raise ActionError(f"error: no tool call found; wrap it as {OPEN}NAME ...{STOP}.\n" + describe_tools(tools))
    end = text.find(STOP, start)
    if end < 0:
        raise ActionError(f"error: the tool call is not closed with {STOP}.\n" + describe_tools(tools))
    inner = text[start + len(OPEN):end]
    if OPEN in inner or text.find(OPEN, end) >= 0:
        raise ActionError("error: more than one tool call; make exactly one per turn.\n" + describe_tools(tools))
    head, _, body = inner.partition("\n")
    if body.endswith("\n"):  # "...last line\n</call>": the newline ends the line, it adds none
        body = body[:-1]
    words = head.split()
    if not words:
        raise ActionError("error: empty tool call; name a tool.\n" + describe_tools(tools))
    name, args = words[0], tuple(words[1:])
    spec = tools.get(name)
    if spec is None:
        raise ActionError(f"error: unknown tool {name!r}; the tools are {', '.join(tools)}.\n" + describe_tools(tools))
    if not spec.min_args <= len(args) <= spec.max_args:
        raise ActionError(f"error: {name} takes {_count(spec)}, got {len(args)}; usage: {spec.usage}")
    if spec.body == "none" and body.strip():
        raise ActionError(f"error: {name} takes no body after its first line; usage: {spec.usage}")
    if spec.body == "required" and not body:
        raise ActionError(f"error: {name} needs a body on the lines after its name; usage: {spec.usage}")
    return ToolCall(name=name, args=args, body=body)


def _count(spec: ToolSpec) -> str:
    if spec.min_args == spec.max_args:
        return f"{spec.min_args} argument{'s' if spec.min_args != 1 else ''}"
    return f"{spec.min_args} to {spec.max_args} arguments"


def tool_from_function(fn: Callable[..., Any], *, body_param: str = "") -> ToolSpec:
    """A ToolSpec declared by a Python function: its name, the first line of its docstring as the
    description, its parameters in order as `params` (those without a default are required), their
    annotations as JSON types (str, int, float, bool, or one of them or None; unannotated: str) and
    the descriptions a Google-style "Args:" section of the docstring gives them. `body_param` names
    the parameter that is the call's body (text on the lines after the call's first line in the
    call format; a str, required when it has no default).

    TypeError for a parameter that cannot be a tool argument (*args, **kwargs, another annotation),
    a `body_param` that is not a parameter, or a function without a docstring."""
    name = getattr(fn, "__name__", "")
    doc = inspect.getdoc(fn) or ""
    lines = [line.strip() for line in doc.splitlines()]
    if not name or not any(lines):
        raise TypeError(f"tool_from_function({fn!r}): a tool needs a named function with a docstring "
                        f"(its first line is the tool's description)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: read them as written
        hints = dict(getattr(fn, "__annotations__", {}))
    params, types_, required = [], {}, {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name!r}: parameter {param.name!r} is *args or **kwargs; a tool's "
                            f"parameters are named")
        types_[param.name] = _json_type(name, param.name, hints.get(param.name, str))
        required[param.name] = param.default is param.empty
        if param.name != body_param:
            params.append(param.name)
    if body_param and body_param not in types_:
        raise TypeError(f"tool {name!r}: body_param {body_param!r} is not one of its parameters {list(types_)}")
    for before, after in zip(params, params[1:]):
        if required[after] and not required[before]:  # a keyword-only parameter without a default
            raise TypeError(f"tool {name!r}: parameter {after!r} has no default but follows {before!r}, "
                            f"which has one: arguments are positional, the required ones first")
    min_args = sum(required[p] for p in params)
    body = "none" if not body_param else "required" if required[body_param] else "optional"
    words = [p.upper() if required[p] else f"[{p.upper()}]" for p in params]
    body_usage = "\\n" + body_param.upper() if body_param else ""  # usage lines write the newline as \n
    usage = f"<call>{' '.join([name, *words])}{body_usage}</call>"
    return ToolSpec(name=name, usage=usage, description=next(line for line in lines if line), min_args=min_args,
                    max_args=len(params), body=body, params=tuple(params), body_param=body_param or "body",
                    param_types={p: t for p, t in types_.items() if t != "string"},
                    param_descriptions=_arg_docs(doc, list(types_)))


def _json_type(tool: str, param: str, annotation: Any) -> str:
    """The JSON type of a parameter annotated `annotation` (X | None counts as X)."""
    if isinstance(annotation, str):  # an annotation that did not resolve, as written
        written = {"str": str, "int": int, "float": float, "bool": bool}
        parts = [part.strip() for part in annotation.replace("Optional[", "").rstrip("]").split("|")]
        kinds = [written.get(part) for part in parts if part != "None"]
        annotation = kinds[0] if len(kinds) == 1 and kinds[0] is not None else annotation
    elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        annotation = kinds[0] if len(kinds) == 1 else annotation
    if annotation in JSON_TYPES:
        return JSON_TYPES[annotation]
    raise TypeError(f"tool {tool!r}: parameter {param!r} is annotated {annotation!r}; a tool parameter is "
                    f"str, int, float or bool (or one of them | None)")


def _arg_docs(doc: str, names: list[str]) -> dict[str, str]:
    """The one-line descriptions a Google-style "Args:" section gives the parameters `names`."""
    found: dict[str, str] = {}
    inside = False
    for line in doc.splitlines():
        if re.fullmatch(r"\s*(Args|Arguments|Parameters)\s*:\s*", line):
            inside = True
            continue
        if inside and line.strip() and not line.startswith((" ", "\t")):
            inside = False  # the next section
        match = re.fullmatch(r"\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)", line) if inside else None
        if match and match.group(1) in names:
            found[match.group(1)] = match.group(2).strip()
    return found
