"""Coding tasks: the data a bug-fix episode starts from, and its JSONL format.

One task per line, a JSON object with these fields:

    id              unique string
    kind            bug family, e.g. "falsy_or_default"
    prompt          what the agent is told
    files           {relative path: text}: the buggy repository, test file included
    entry_file      the file that holds the function under test, e.g. "retry.py"
    entry_function  the function's name, e.g. "retry_count"
    test_file       the visible test file (plain asserts); restored before every grading
    visible_tests   [check, ...] the cases written in the test file (the agent may run them)
    hidden_checks   [check, ...] what the grader runs; never shown to the agent
    reference_fix   {relative path: full new text} for every file the fix changes
    wrong_fix       optional, same form: a plausible fix that still fails a hidden check
    brittle_phrase  optional: an incidental source phrase (the `brittle` verifier demands it)
    off_limits      optional: ["module.function", ...] library functions the candidate's files may
                    not call (a real-code task's original: keelrl/envs/_grader.py fences them)

A check is {"name": str, "args": [JSON values], "expected": JSON value} with optional
"raises": exception class name (the call must raise it) and "key": true (the headline case,
the only one the `weak` verifier keeps, like the lecture's retries=0 check).

`validate_task` reports the first problem with the field path; `load_tasks`/`save_tasks` read and
write JSONL (UTF-8; lines end at "\n" only, so a U+2028 inside a JSON string stays in its line),
and every loading error names the file, the line number and the field; a key given twice in one
object is an error, not a silent last-one-wins. `split_of` assigns a task to "train" or
"heldout" deterministically by id and seed.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
"""A module's attribute, "posixpath.join" (an `off_limits` entry)."""
"""Matched with fullmatch: `$` would also accept a trailing newline ("retry_count\n")."""


class TaskError(ValueError):
    """A malformed task; the message names the task id (or line) and the bad field."""


@dataclass(frozen=True)
class Check:
    """Call the entry function with `args`; it must return `expected` (or raise `raises`)."""

    name: str
    args: list[Any]
    expected: Any = None
    raises: str | None = None
    key: bool = False
    weight: float = 1.0
    """Weight of this check in weighted partial credit (must be > 0)."""


@dataclass(frozen=True)
class Task:
    """One bug-fix task (see the module docstring for the meaning of each field)."""

    id: str
    kind: str
    prompt: str
    files: dict[str, str]
    entry_file: str
    entry_function: str
    test_file: str
    visible_tests: list[Check]
    hidden_checks: list[Check]
    reference_fix: dict[str, str]
    wrong_fix: dict[str, str] = field(default_factory=dict)
    brittle_phrase: str = ""
    off_limits: list[str] = field(default_factory=list)

    @property
    def module(self) -> str:
        """Import name of the entry file ("retry.py" -> "retry")."""
        return self.entry_file[:-3].replace("/", ".")

    @property
    def test_module(self) -> str:
        return self.test_file[:-3].replace("/", ".")

    def fixed_files(self) -> dict[str, str]:
        """The repository after the reference fix."""
        return {**self.files, **self.reference_fix}

    def to_json(self) -> str:
        data = asdict(self)
        if not data["off_limits"]:  # optional: a task without it writes what it did before the field
            del data["off_limits"]
        return json.dumps(data, sort_keys=False)


def _check_from(data: Any, where: str) -> Check:
    if not isinstance(data, dict):
        raise TaskError(f"{where}: a check must be an object, got {type(data).__name__}")
    unknown = set(data) - {"name", "args", "expected", "raises", "key", "weight"}
    if unknown:
        raise TaskError(f"{where}: unknown check fields {sorted(unknown)}")
    if not isinstance(data.get("name"), str) or not data["name"]:
        raise TaskError(f"{where}.name: must be a non-empty string")
    if not isinstance(data.get("args"), list):
        raise TaskError(f"{where}.args: must be a list of JSON values")
    if data.get("raises") is not None and not (isinstance(data["raises"], str) and _IDENTIFIER.fullmatch(data["raises"])):
        raise TaskError(f"{where}.raises: must be an exception class name, got {data['raises']!r}")
    if not isinstance(data.get("key", False), bool):
        raise TaskError(f"{where}.key: must be true or false")
    weight = data.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise TaskError(f"{where}.weight: must be a finite number > 0, got {weight!r}")
    return Check(name=data["name"], args=list(data["args"]), expected=data.get("expected"),
                 raises=data.get("raises"), key=bool(data.get("key", False)), weight=float(weight))


def task_from_dict(data: Any, where: str = "task") -> Task:
    """Build and validate a Task from a decoded JSON object."""
    if not isinstance(data, dict):
        raise TaskError(f"{where}: must be a JSON object, got {type(data).__name__}")
    where = f"{where} {_short(data.get('id', '?'))}"
    required = ["id", "kind", "prompt", "files", "entry_file", "entry_function", "test_file",
                "visible_tests", "hidden_checks", "reference_fix"]
    missing = [name for name in required if name not in data]
    if missing:
        raise TaskError(f"{where}: missing fields {missing}")
    known = set(required) | {"wrong_fix", "brittle_phrase", "off_limits"}
    unknown = set(data) - known
    if unknown:
        raise TaskError(f"{where}: unknown fields {sorted(unknown)}")
    for name in ("files", "reference_fix", "wrong_fix"):
        value = data.get(name, {})
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise TaskError(f"{where}.{name}: must map relative paths to file texts")
    task = Task(
        id=data["id"], kind=data["kind"], prompt=data["prompt"], files=dict(data["files"]),
        entry_file=data["entry_file"], entry_function=data["entry_function"], test_file=data["test_file"],
        visible_tests=[_check_from(c, f"{where}.visible_tests[{i}]") for i, c in enumerate(_list(data, "visible_tests", where))],
        hidden_checks=[_check_from(c, f"{where}.hidden_checks[{i}]") for i, c in enumerate(_list(data, "hidden_checks", where))],
        reference_fix=dict(data["reference_fix"]), wrong_fix=dict(data.get("wrong_fix", {})),
        brittle_phrase=data.get("brittle_phrase", ""), off_limits=data.get("off_limits", []))
    validate_task(task, where)
    return task


def _list(data: Mapping[str, Any], name: str, where: str) -> list[Any]:
    value = data[name]
    if not isinstance(value, list):
        raise TaskError(f"{where}.{name}: must be a list of checks")
    return value


def validate_task(task: Task, where: str | None = None) -> None:
    """Raise TaskError naming the first structural problem (behaviour is checked by verifiers).

    `where` starts every message (default: "task 'ID'"); the loader passes "FILE:LINE 'ID'".
    """
    where = where if where is not None else f"task {task.id!r}"
    for name in ("id", "kind", "prompt", "entry_file", "entry_function", "test_file"):
        value = getattr(task, name)
        if not isinstance(value, str) or not value:
            raise TaskError(f"{where}.{name}: must be a non-empty string, got {_short(value)}")
    if not isinstance(task.brittle_phrase, str):
        raise TaskError(f"{where}.brittle_phrase: must be a string, got {_short(task.brittle_phrase)}")
    if not isinstance(task.off_limits, list) or not all(
            isinstance(name, str) and _DOTTED.fullmatch(name) for name in task.off_limits):
        raise TaskError(f"{where}.off_limits: must be a list of dotted names like \"posixpath.join\", "
                        f"got {_short(task.off_limits)}")
    for name in ("files", "reference_fix", "wrong_fix"):
        for path in getattr(task, name):
            _check_path(path, f"{where}.{name}")
    for name in ("entry_file", "test_file"):
        path = getattr(task, name)
        _check_path(path, f"{where}.{name}")
        if not path.endswith(".py"):
            raise TaskError(f"{where}.{name}: must be a .py file, got {path!r}")
        if path not in task.files:
            raise TaskError(f"{where}.{name}: {path!r} is not in files")
    if not _IDENTIFIER.fullmatch(task.entry_function):
        raise TaskError(f"{where}.entry_function: not a Python identifier: {task.entry_function!r}")
    if not task.hidden_checks:
        raise TaskError(f"{where}.hidden_checks: at least one check is needed")
    if not task.reference_fix:
        raise TaskError(f"{where}.reference_fix: a task must ship its fix")
    if task.test_file in task.reference_fix:
        raise TaskError(f"{where}.reference_fix: must not change the test file {task.test_file!r}")
    for name in ("visible_tests", "hidden_checks"):
        names = [check.name for check in getattr(task, name)]
        if len(set(names)) != len(names):
            raise TaskError(f"{where}.{name}: check names must be unique, got {names}")
        for check in getattr(task, name):
            if not _IDENTIFIER.fullmatch(check.name):
                raise TaskError(f"{where}.{name}: check name {check.name!r} must be an identifier")
            try:
                json.dumps([check.args, check.expected], allow_nan=False)
            except (TypeError, ValueError) as error:
                raise TaskError(f"{where}.{name}.{check.name}: args/expected must be JSON: {error}") from None


def _check_path(path: str, where: str) -> None:
    parts = Path(path).parts
    if not parts or "\x00" in path or Path(path).is_absolute() or ".." in parts or parts[0] == ".git":
        raise TaskError(f"{where}: {path!r} must be a relative path to a file inside the repository (not .git)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook of the loader: a key given twice is an error, not last-one-wins."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKey(key)
        data[key] = value
    return data


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def load_tasks(path: str | Path) -> list[Task]:
    """Read a JSONL file of tasks; errors name the line number and the field."""
    tasks, seen = [], set()
    # Lines end at b"\n" only: str.splitlines would also cut at U+2028 or \x1c, which JSON
    # strings may hold raw, and shift every later line number.
    for number, raw in enumerate(Path(path).read_bytes().split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            bad = raw[error.start:error.start + 1]
            raise TaskError(f"{path}:{number}: not UTF-8 text (byte {error.start} is {bad!r})") from None
        if not line.strip():
            continue
        try:
            data = json.loads(line, object_pairs_hook=_unique_keys)
        except _DuplicateKey as error:
            raise TaskError(f"{path}:{number}.{error.key}: the key is given twice in one object") from None
        except (ValueError, RecursionError) as error:  # also an int of > 4300 digits, or nesting too deep
            raise TaskError(f"{path}:{number}: not valid JSON: {str(error)[:200]}") from None
        task = task_from_dict(data, where=f"{path}:{number}")
        if task.id in seen:
            raise TaskError(f"{path}:{number}: duplicate task id {task.id!r}")
        seen.add(task.id)
        tasks.append(task)
    return tasks


def save_tasks(tasks: Iterable[Task], path: str | Path) -> int:
    """Write tasks as JSONL; returns how many were written."""
    lines = [task.to_json() for task in tasks]
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return len(lines)


def shift_ints(value: Any, by: int) -> Any:
    """Every int in a JSON value (nested in lists and dict values) plus `by`; bools stay as they are.

    Used to derive inputs near a check's own: hidden variants of key checks, audit probe inputs.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value + by
    if isinstance(value, list):
        return [shift_ints(item, by) for item in value]
    if isinstance(value, dict):
        return {key: shift_ints(item, by) for key, item in value.items()}
    return value


def split_of(task_id: str, seed: int = 0, heldout_fraction: float = 0.25) -> str:
    """'train' or 'heldout', a pure function of (task id, seed): stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}:{task_id}".encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction else "train"


def render_test_file(module: str, function: str, checks: Iterable[Check]) -> str:
    """The visible test file: one plain-assert test function per check.

    A failing test's message names the input, the expected value and what came back, which is
    what the agent sees when it runs the tests.
    """
    lines = [f"from {module} import {function}", ""]
    for check in checks:
        call = f"{function}({', '.join(_py(arg) for arg in check.args)})"
        lines.append(f"def test_{check.name}():")
        if check.raises:
            message = repr(f"{call}: expected {check.raises}, got ")
            lines += ["    try:", f"        got = {call}", f"    except {check.raises}:", "        return",
                      f"    raise AssertionError({message} + repr(got))"]
        else:
            message = repr(f"{call}: expected {_py(check.expected)}, got ")
            lines += [f"    got = {call}", f"    assert got == {_py(check.expected)}, {message} + repr(got)"]
        lines.append("")
    return "\n".join(lines)


def _py(value: Any) -> str:
    """A JSON value as Python source (None, True, dicts...)."""
    return repr(value)
