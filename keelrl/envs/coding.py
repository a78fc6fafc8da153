"""The coding bug-fix environment of the running example.

Each episode gets its own working directory holding the task's files in a git repository
whose only commit is the buggy base (no history contains the fix). The agent acts through
tools, written in the format `tool_format` names (keelrl.envs.formats: call, hermes, json; the
call format's `<call>NAME ARGS\nBODY</call>` by default):

    read [PATH]                 the file with line numbers (default: the file to fix)
    replace LINE [PATH] + body  replace line LINE with the body's lines (empty body deletes it)
    edit [PATH] + OLD >>> NEW   replace the unique occurrence of OLD with NEW
    test                        run the visible tests in the sandbox: pass/fail per case with the failing value
    submit                      end the episode

With `show_tools=True` the rollout shows the tools in the first prompt, through the chat template
(`keelrl.envs.formats.prompt_tools`); the first observation itself never lists them.
With `show_file=True` the first observation already holds the file to fix, as `read` shows
it, so a one-turn episode (`max_turns=1`: one edit, then grading) is a complete attempt.

Edits change the files on disk; `test` runs the working copy as it is (a tampered test file
included); `grade()` runs the verifier's hidden checks on the working copy with the test file
restored from the base commit. A malformed action, an unknown tool, a bad line number or an
ambiguous edit produces an error observation and costs a turn.

Each step's info names the tool (info["tool"]); a `test` step adds its counts
(info["tests_passed"], info["tests_failed"], or info["tests_error"] when the tests could not
run). Per-turn rewards (info["reward"]), off by default:

- `shaping` > 0: potential-based shaping (Ng, Harada and Russell 1999) with the potential
  phi(s) = shaping x the share of the visible tests the code passes, run with the task's own
  test file (an edited test file earns nothing). An edit's turn gets phi(after) - phi(before);
  the episode's last turn also gets -phi(its state), the potential of the end state being 0, so
  an episode's shaping rewards sum to -phi(the task's base code), the same for every attempt at
  a task: the best policy is unchanged, while each edit is credited with the tests it fixed or
  broke. Each edit runs the visible tests once more (info["visible_passed"], info["visible_total"]).
- `malformed_cost`: a rejected action's turn gets -malformed_cost (a penalty, not a potential
  difference: it makes malformed actions worse than they were, which no policy should want).

Lines are split at newlines only (not `str.splitlines`, which also breaks at form feeds and
Unicode separators that Python source may hold inside strings), so `replace` changes exactly
one line and the line numbers `read` shows are the ones `replace` uses. Files are UTF-8.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import weakref
from pathlib import Path
from typing import Any, Sequence

from keelrl.envs.base import Grade
from keelrl.envs.formats import format_of
from keelrl.envs.shaping import shaping_reward
from keelrl.envs.tasks import Task
from keelrl.envs.tools import ActionError, ToolCall, ToolSpec
from keelrl.sandbox import Sandbox
from keelrl.envs.verifiers import DEFAULT_LIMITS, Verifier, make_verifier, run_visible_tests

EDIT_SEPARATOR = ">>>"
"""The line that separates OLD from NEW in an edit body."""

_PATH = {"path": "the file (default: the file to fix)"}
CODING_TOOLS = {
    "read": ToolSpec("read", "<call>read [PATH]</call>", "show a file with line numbers", 0, 1,
                     params=("path",), param_descriptions=_PATH),
    "replace": ToolSpec("replace", "<call>replace LINE [PATH]\\nNEW LINES</call>",
                        "replace one line with the lines after the first (none: delete it)", 1, 2, body="optional",
                        params=("line", "path"), body_param="code", param_types={"line": "integer"},
                        param_descriptions={"line": "the number of the line to replace, as read shows it", **_PATH,
                                            "code": "the new lines (empty: delete the line)"}),
    "edit": ToolSpec("edit", "<call>edit [PATH]\\nOLD\\n>>>\\nNEW</call>",
                     "replace the one occurrence of OLD with NEW", 0, 1, body="required",
                     params=("path",), body_param="change",
                     param_descriptions={**_PATH, "change": f"OLD, then a line holding only {EDIT_SEPARATOR}, then NEW"}),
    "test": ToolSpec("test", "<call>test</call>", "run the visible tests"),
    "submit": ToolSpec("submit", "<call>submit</call>", "finish; hidden checks grade the code"),
}
"""The coding tools (the usage lines are the call format's; keelrl.envs.formats writes the others)."""


PATCH_TOOLS = ("replace", "edit")
"""The coding tools whose calls make up a trajectory's final patch (its `EnvSpec.answer_tools`)."""


def split_lines(text: str) -> list[str]:
    r"""The lines of `text`, split on "\n" only; a final newline ends the last line."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def count_occurrences(text: str, old: str) -> int:
    r"""How many times `old` occurs in `text`, overlapping ones included ("a\na" is twice in "a\na\na")."""
    count, start = 0, text.find(old)
    while start >= 0:
        count, start = count + 1, text.find(old, start + 1)
    return count


def _git(workdir: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=keelrl", "-c", "user.email=keelrl@localhost",
                    "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false", *args],
                   cwd=workdir, check=True, capture_output=True, timeout=30,
                   env={"PATH": "/usr/local/bin:/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(workdir)})


class CodingEnv:
    """Fix a bug in a small repository with read/replace/edit/test/submit tools."""

    read_only_tools = frozenset({"read", "test", "submit"})
    """Tools that cannot change the code (process labels skip them: `EpisodeLimits.label_steps`)."""
    tools = CODING_TOOLS
    """Its tools, for the rollout's prompt (`keelrl.envs.formats.prompt_tools`)."""

    def __init__(self, verifier: str | Verifier = "strong", *, sandbox: Sandbox | None = None,
                 max_turns: int = 12, max_action_chars: int = 4000, use_git: bool = True,
                 show_tools: bool = True, show_file: bool = False, shaping: float = 0.0,
                 malformed_cost: float = 0.0, tool_format: str = "call") -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        for name, value in (("shaping", shaping), ("malformed_cost", malformed_cost)):
            if not 0.0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.shaping, self.malformed_cost = float(shaping), float(malformed_cost)
        self.sandbox = sandbox or Sandbox(DEFAULT_LIMITS)
        self.verifier = make_verifier(verifier, self.sandbox) if isinstance(verifier, str) else verifier
        self.max_turns = max_turns
        self.max_action_chars = max_action_chars
        self.show_tools = show_tools
        """The rollout shows the tools in the first prompt (`keelrl.envs.formats.prompt_tools`)."""
        self.show_file = show_file
        self.tool_format = tool_format
        """The tool-call format actions are parsed in (keelrl.envs.formats)."""
        self.format = format_of(tool_format)
        self.use_git = use_git and shutil.which("git") is not None
        self.task: Task | None = None
        self.workdir: Path | None = None
        self.turn = 0
        self.done = False
        self._grade: Grade | None = None
        self._cleanup: weakref.finalize | None = None
        self._potential = 0.0
        """Shaping: phi of the working copy as it is now."""
        self._info: dict[str, Any] = {}
        """What the current step's tool adds to its info (test counts)."""

    # -- protocol ------------------------------------------------------------------------
    def reset(self, task: Task) -> str:
        self.close()
        self.task = task
        self.workdir = Path(tempfile.mkdtemp(prefix=f"keel-task-{_safe(task.id)}-"))
        # Removed by close(), when the env is garbage-collected, or at interpreter exit
        # (a __del__ can run after shutil is torn down).
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.workdir), ignore_errors=True)
        for path, text in task.files.items():
            target = self.workdir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        if self.use_git:
            _git(self.workdir, "init", "-q")
            _git(self.workdir, "add", "-A")
            _git(self.workdir, "commit", "-q", "-m", "base")
        self.turn, self.done, self._grade = 0, False, None
        if self.shaping > 0:
            self._potential = self.shaping * _base_visible_share(task, self.sandbox)
        files = ", ".join(sorted(task.files))
        shown = f"\n{self._read(self.workdir / task.entry_file)}" if self.show_file else ""
        return (f"{task.prompt}\nThe function to fix is {task.entry_function} in {task.entry_file}. "
                f"Files: {files}.{shown}")

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        if self.task is None or self.workdir is None:
            raise RuntimeError("call reset(task) before step()")
        if self.done:
            raise RuntimeError("the episode is over; call reset(task) to start another")
        self.turn += 1
        self._info = {}
        reward = 0.0
        try:
            call = self.format.parse(action_text, CODING_TOOLS, self.max_action_chars)
            observation, done = self._dispatch(call)
            info: dict[str, Any] = {"tool": call.name, **self._info}
        except ActionError as error:
            observation, done, info = str(error), False, {"error": str(error).splitlines()[0]}
            reward -= self.malformed_cost
        if not done and self.turn >= self.max_turns:
            observation += f"\nturn limit ({self.max_turns}) reached; the episode ends."
            done, info["termination"] = True, "max_turns"
        elif done:
            info["termination"] = "submitted"
        if self.shaping > 0:
            before = self._potential
            if "error" not in info and info["tool"] in PATCH_TOOLS:
                self._potential = self._phi(info)
            reward += shaping_reward(before, self._potential, done)
        if self.shaping > 0 or self.malformed_cost > 0:
            info["reward"] = reward
        self.done = done
        return observation, done, info

    def _phi(self, info: dict[str, Any]) -> float:
        """The shaping potential of the working copy; its visible-test counts go in `info`."""
        assert self.task is not None
        passed, total = visible_counts(self.task, self.current_files(), self.sandbox)
        info["visible_passed"], info["visible_total"] = passed, total
        return self.shaping * (passed / total if total else 0.0)

    def grade(self) -> Grade:
        if self.task is None:
            raise RuntimeError("call reset(task) before grade()")
        if self.done and self._grade is not None:  # a finished episode is graded once
            return self._grade
        grade = self.verifier.grade(self.task, self.current_files())
        if self.done:  # mid-episode grades are not kept: later edits would make them stale
            self._grade = grade
        return grade

    def close(self) -> None:
        """Remove the episode's working directory (reset calls it; so does garbage collection)."""
        if self._cleanup is not None:
            self._cleanup()
            self._cleanup = None
        self.workdir = None

    # -- tools ---------------------------------------------------------------------------
    def current_files(self) -> dict[str, str]:
        """The working copy, without .git."""
        assert self.workdir is not None
        files = {}
        for path in sorted(self.workdir.rglob("*")):
            relative = path.relative_to(self.workdir)
            if path.is_file() and relative.parts[0] != ".git":
                files[str(relative)] = path.read_text(encoding="utf-8", errors="replace")
        return files

    def _path(self, args: tuple[str, ...], index: int) -> Path:
        assert self.task is not None and self.workdir is not None
        name = args[index] if len(args) > index else self.task.entry_file
        root = self.workdir.resolve()
        try:
            target = (self.workdir / name).resolve()
            is_file = target.is_file()
        except (ValueError, OSError) as error:  # a NUL byte, a name too long: the policy's mistake too
            reason = error.strerror if isinstance(error, OSError) else str(error)
            raise ActionError(f"error: {name[:100]!r} is not a valid path ({reason}); "
                              f"files: {', '.join(self.current_files())}") from None
        if root not in target.parents:
            problem = "is outside the repository"
        elif ".git" in target.relative_to(root).parts:
            problem = "is git metadata, not a file of the task"
        elif not is_file:
            problem = "is not a file of the task"
        else:
            return target
        raise ActionError(f"error: {name!r} {problem}; files: {', '.join(self.current_files())}")

    def _dispatch(self, call: ToolCall) -> tuple[str, bool]:
        if call.name == "read":
            return self._read(self._path(call.args, 0)), False
        if call.name == "replace":
            return self._replace(call), False
        if call.name == "edit":
            return self._edit(call), False
        if call.name == "test":
            return self._test(), False
        return "submitted.", True

    def _read(self, path: Path) -> str:
        assert self.workdir is not None
        lines = split_lines(path.read_text(encoding="utf-8"))
        width = len(str(max(len(lines), 1)))
        body = "\n".join(f"{number:>{width}}| {line}" for number, line in enumerate(lines, start=1))
        return f"{path.relative_to(self.workdir)}\n{body}"

    def _replace(self, call: ToolCall) -> str:
        try:
            line_number = int(call.args[0])
        except ValueError:
            raise ActionError(f"error: LINE must be a line number, got {call.args[0]!r}; "
                              f"usage: {self.format.usage(CODING_TOOLS['replace'])}") from None
        path = self._path(call.args, 1)
        lines = split_lines(path.read_text(encoding="utf-8"))
        if not 1 <= line_number <= len(lines):
            raise ActionError(f"error: line {line_number} is out of range; {path.name} has {len(lines)} lines")
        new_lines = call.body.split("\n") if call.body else []
        lines[line_number - 1:line_number] = new_lines
        _write(path, "\n".join(lines) + "\n")
        return self._read(path)

    def _edit(self, call: ToolCall) -> str:
        body_lines = call.body.split("\n")
        if EDIT_SEPARATOR not in body_lines:
            raise ActionError(f"error: separate OLD and NEW with a line holding only {EDIT_SEPARATOR}; "
                              f"usage: {self.format.usage(CODING_TOOLS['edit'])}")
        split = body_lines.index(EDIT_SEPARATOR)
        old, new = "\n".join(body_lines[:split]), "\n".join(body_lines[split + 1:])
        if not old:
            raise ActionError("error: OLD is empty; give the exact text to replace")
        path = self._path(call.args, 0)
        text = path.read_text(encoding="utf-8")
        count = count_occurrences(text, old)
        if count != 1:
            raise ActionError(f"error: OLD occurs {count} times in {path.name}; it must occur exactly once "
                              f"(add neighbouring lines to make it unique)")
        _write(path, text.replace(old, new, 1))
        return self._read(path)

    def _test(self) -> str:
        assert self.task is not None
        results, error = run_visible_tests(self.task, self.current_files(), self.sandbox)
        if error:
            self._info = {"tests_error": True}
            return f"tests could not run: {error}"
        failed = [result for result in results if not result["passed"]]
        self._info = {"tests_passed": len(results) - len(failed), "tests_failed": len(failed)}
        lines = [f"tests: {len(results) - len(failed)} passed, {len(failed)} failed"]
        lines += [f"FAIL {result['name']}: {result['message']}" for result in failed]
        return "\n".join(lines)


def visible_counts(task: Task, files: dict[str, str], sandbox: Sandbox) -> tuple[int, int]:
    """(visible tests passed, visible tests) for `files` run with the task's own test file
    (0 passed when the code or the tests cannot be imported)."""
    runnable = {**files, task.test_file: task.files[task.test_file]} if task.test_file in task.files else dict(files)
    results, error = run_visible_tests(task, runnable, sandbox)
    total = len(results) if not error else _visible_total(task, sandbox)
    return (0 if error else sum(bool(result["passed"]) for result in results)), total


_BASE_SHARES: dict[tuple[str, int], float] = {}
_TOTALS: dict[tuple[str, int], int] = {}
_CACHE_LIMIT = 4096


def _key(task: Task) -> tuple[str, int]:
    return task.id, hash(tuple(sorted(task.files.items())))


def _visible_total(task: Task, sandbox: Sandbox) -> int:
    """How many visible tests the task has (run on its reference fix, which imports)."""
    key = _key(task)
    if key not in _TOTALS:
        if len(_TOTALS) >= _CACHE_LIMIT:
            _TOTALS.clear()
        results, _ = run_visible_tests(task, task.fixed_files(), sandbox)
        _TOTALS[key] = len(results)
    return _TOTALS[key]


def _base_visible_share(task: Task, sandbox: Sandbox) -> float:
    """The share of visible tests the task's base code passes (once per task and process)."""
    key = _key(task)
    if key not in _BASE_SHARES:
        if len(_BASE_SHARES) >= _CACHE_LIMIT:
            _BASE_SHARES.clear()
        passed, total = visible_counts(task, dict(task.files), sandbox)
        _BASE_SHARES[key] = passed / total if total else 0.0
    return _BASE_SHARES[key]


def _write(path: Path, text: str) -> None:
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate in the action: the policy's mistake
        raise ActionError(f"error: the new text is not valid Unicode ({error.reason}); files are UTF-8") from None
    path.write_bytes(data)


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in text)[:40]


class CodingEnvFactory:
    """A picklable `make_env` for CodingEnv (Ray workers build their own sandbox and verifier)."""

    def __init__(self, verifier: str, *, partial_credit: bool = True, max_turns: int = 6,
                 show_tools: bool = False, show_file: bool = False, key_weight: float = 1.0,
                 hidden_paths: Sequence[str] = (), shaping: float = 0.0, malformed_cost: float = 0.0,
                 tool_format: str = "call") -> None:
        format_of(tool_format)  # an unknown name fails here, listing the valid ones
        self.verifier, self.partial_credit, self.key_weight = verifier, partial_credit, key_weight
        self.tool_format = tool_format
        self.shaping, self.malformed_cost = shaping, malformed_cost
        self.hidden_paths = list(hidden_paths)
        self.max_turns, self.show_tools, self.show_file = max_turns, show_tools, show_file
        self._built: tuple[Sandbox, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_built": None}

    def __call__(self) -> CodingEnv:
        if self._built is None:
            sandbox = Sandbox(DEFAULT_LIMITS, hidden_paths=self.hidden_paths or None)
            self._built = (sandbox, make_verifier(self.verifier, sandbox, partial_credit=self.partial_credit,
                                                  key_weight=self.key_weight))
        sandbox, verifier = self._built
        return CodingEnv(verifier, sandbox=sandbox, max_turns=self.max_turns, show_tools=self.show_tools,
                         show_file=self.show_file, shaping=self.shaping, malformed_cost=self.malformed_cost,
                         tool_format=self.tool_format)
