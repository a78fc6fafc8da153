"""A scripted teacher for the coding tasks, behaving like the lecture's trajectory.

For each episode it draws, from its own seeded RNG, whether it will succeed (probability
`success_rate`) and whether it first makes the plausible mistake (probability
`mistake_rate`, when the task ships a `wrong_fix`: for the running example, switching to
`config.get("retries", 3)`, which fixes 0 but breaks None). Then it acts:

    success, mistake:    read -> wrong fix -> test (a case fails) -> real fix -> test -> submit
    success, no mistake: read -> real fix -> test -> submit
    failure:             read -> wrong fix (or nothing, if the task has none) -> test -> submit

Without `read_first` (the prompt shows the file) the opening read is left out, so the
first action is already the fix (or the mistake). A policy names the turns of its mistake
(`mistake_turns`): the warm start leaves them out of its loss unless
`warm_start.imitate_mistakes` is set, so the student learns the recovery, not the error.

Edits are computed from the difference between the current file and the target file: one
`replace` when a single line changes, otherwise one `edit` of the changed block. The teacher
supplies warm-start demonstrations and a predictable policy for rollout-loop tests.

`recovery` continues from the student's own first edit instead of the task's wrong fix (the
warm start's `own_mistakes` round, in the manner of DAgger: the expert labels the states the
learner reaches):

    student's edit (fails a visible test) -> test -> real fix from that file state -> test -> submit

The teacher builds `ToolCall`s and writes them in its `tool_format` (keelrl.envs.formats), which
must be the environment's; `edit_call` and `move_calls` give the calls themselves.
"""

from __future__ import annotations

import difflib
import random
from dataclasses import dataclass
from typing import Sequence

from keelrl.envs.base import Turn
from keelrl.envs.coding import CODING_TOOLS, CodingEnv, count_occurrences, split_lines, visible_counts
from keelrl.envs.formats import format_of
from keelrl.envs.tasks import Task
from keelrl.envs.tools import ToolCall


def edit_action(path: str, current: str, target: str, *, default_path: str, tool_format: str = "call") -> str | None:
    """`edit_call`'s call written in `tool_format` (None if `current` equals `target`)."""
    call = edit_call(path, current, target, default_path=default_path)
    return None if call is None else format_of(tool_format).render(call, CODING_TOOLS)


def edit_call(path: str, current: str, target: str, *, default_path: str) -> ToolCall | None:
    """One tool call turning `current` into `target` (None if they are equal).

    Lines are compared as `CodingEnv` splits them. A single changed line becomes `replace`,
    unless its new text is one empty line (an empty `replace` body deletes the line).
    Anything else becomes `edit` of the changed block. `edit` swaps text, not lines, so the
    block is widened by a neighbouring line when OLD or NEW would otherwise be empty (an
    empty NEW would leave a blank line behind), then until OLD occurs exactly once.
    `current` must hold a non-blank line (a file of blank lines has no unique block).
    """
    old_lines, new_lines = split_lines(current), split_lines(target)
    if old_lines == new_lines:
        return None
    opcodes = [op for op in difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False).get_opcodes()
               if op[0] != "equal"]
    first_old, last_old = opcodes[0][1], opcodes[-1][2]
    first_new, last_new = opcodes[0][3], opcodes[-1][4]
    path_args = () if path == default_path else (path,)
    changed = new_lines[first_new:last_new]
    if last_old - first_old == 1 and changed != [""]:
        return ToolCall("replace", (str(first_old + 1), *path_args), "\n".join(changed))
    start, end = first_old, last_old
    if start == end or not changed:  # anchor on a neighbouring line
        start, end = (start - 1, end) if start > 0 else (start, min(end + 1, len(old_lines)))
    while count_occurrences(current, "\n".join(old_lines[start:end])) != 1 and (start > 0 or end < len(old_lines)):
        start, end = max(0, start - 1), min(len(old_lines), end + 1)
    old_block = "\n".join(old_lines[start:end])
    new_block = "\n".join(old_lines[start:first_old] + changed + old_lines[last_old:end])
    return ToolCall("edit", path_args, f"{old_block}\n>>>\n{new_block}")


def move_calls(files: dict[str, str], target_files: dict[str, str], default_path: str) -> list[ToolCall]:
    """The edits (`edit_call`, one per changed file, in path order) taking `files` to
    `target_files`; `files` is updated in place."""
    calls = []
    for path in sorted(target_files):
        call = edit_call(path, files.get(path, ""), target_files[path], default_path=default_path)
        if call is not None:
            calls.append(call)
            files[path] = target_files[path]
    return calls


def moves(files: dict[str, str], target_files: dict[str, str], default_path: str,
          tool_format: str = "call") -> list[str]:
    """`move_calls`' calls written in `tool_format`; `files` is updated in place."""
    fmt = format_of(tool_format)
    return [fmt.render(call, CODING_TOOLS) for call in move_calls(files, target_files, default_path)]


@dataclass
class TeacherPlan:
    """What the teacher decided for one episode, and the actions that carry it out."""

    succeed: bool
    mistake: bool
    actions: list[str]
    mistake_turns: frozenset[int] = frozenset()
    """Indices into `actions` of the plausible mistake's edits (a warm start may leave them out of
    its loss, so the student learns the recovery without learning to err)."""


class ScriptedTeacher:
    """A policy over `CodingEnv` with a configurable success rate (see the module docstring)."""

    recovery_turns = 5
    """The fewest turns a `recovery` continuation takes: the student's edit, test, a one-move fix,
    test, submit. The warm start's own-mistakes round needs env.max_turns at least this."""

    def __init__(self, success_rate: float = 0.8, mistake_rate: float = 0.5, seed: int = 0,
                 read_first: bool = True, tool_format: str = "call") -> None:
        for name, value in (("success_rate", success_rate), ("mistake_rate", mistake_rate)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        self.success_rate = success_rate
        self.mistake_rate = mistake_rate
        self.rng = random.Random(seed)
        self.read_first = read_first
        """Open with `read` (False when the prompt already shows the file: `show_file`)."""
        self.tool_format = tool_format
        """The format its actions are written in (the environment's `tool_format`)."""
        self.format = format_of(tool_format)

    def _write(self, *calls: ToolCall) -> list[str]:
        return [self.format.render(call, CODING_TOOLS) for call in calls]

    def plan(self, task: Task) -> TeacherPlan:
        """Decide success and mistake for one episode and script its actions."""
        succeed = self.rng.random() < self.success_rate
        has_mistake = bool(task.wrong_fix)
        mistake = has_mistake and (not succeed or self.rng.random() < self.mistake_rate)
        files = dict(task.files)
        read, test, submit = ToolCall("read", (), ""), ToolCall("test", (), ""), ToolCall("submit", (), "")
        actions = self._write(read) if self.read_first else []
        mistake_turns: frozenset[int] = frozenset()

        if mistake:
            first = len(actions)
            actions += self._write(*move_calls(files, task.wrong_fix, task.entry_file))
            mistake_turns = frozenset(range(first, len(actions)))
            actions += self._write(test)
        if succeed:
            actions += self._write(*move_calls(files, task.reference_fix, task.entry_file))
            actions += self._write(test)
        elif not mistake:
            actions += self._write(test)
        actions += self._write(submit)
        return TeacherPlan(succeed=succeed, mistake=mistake, actions=actions, mistake_turns=mistake_turns)

    def recovery(self, task: Task, first_action: str, env: CodingEnv) -> "ScriptedPolicy | None":
        """A policy replaying a student's `first_action` on `task`, then the teacher's continuation,
        which it plans by playing the action in `env` (just reset on `task`): test, the real fix
        from the file state the action left, test, submit; the student's action is the plan's
        mistake (turn 0). None when there is nothing to recover from (the action is not an edit
        the environment accepted, or its file passes every visible test), and when the fix from
        that file takes other tools than the fix from the task's file: a student's edit elsewhere
        turns a one-line `replace` into an `edit` of a block, a form the clean demonstrations do
        not teach and that often overruns the action's token budget."""
        _, done, info = env.step(first_action)
        if done or "error" in info or info.get("tool") not in ("replace", "edit"):
            return None
        files = env.current_files()
        # with shaping on, the step has just run the visible tests on these files
        passed, total = ((info["visible_passed"], info["visible_total"]) if "visible_total" in info
                         else visible_counts(task, files, env.sandbox))
        if total and passed == total:
            return None
        fix = move_calls(files, task.reference_fix, task.entry_file)
        clean = move_calls(dict(task.files), task.reference_fix, task.entry_file)
        if [call.name for call in fix] != [call.name for call in clean]:
            return None  # a fix of another form than the clean path's (an `edit` block for a `replace`)
        test, submit = ToolCall("test", (), ""), ToolCall("submit", (), "")
        actions = [first_action, *self._write(test, *fix, test, submit)]
        return ScriptedPolicy(TeacherPlan(succeed=True, mistake=True, actions=actions, mistake_turns=frozenset({0})),
                              finish=self._write(submit)[0])

    def policy(self, task: Task) -> "ScriptedPolicy":
        """A `Policy` callable for one episode of `task`."""
        return ScriptedPolicy(self.plan(task), finish=self._write(ToolCall("submit", (), ""))[0])


class ScriptedPolicy:
    """Replays a TeacherPlan; after the script ends it keeps acting `finish` (submitting)."""

    def __init__(self, plan: TeacherPlan, finish: str = "<call>submit</call>") -> None:
        self.plan = plan
        self.finish = finish

    @property
    def mistake_turns(self) -> frozenset[int]:
        """The turns whose action is the plan's plausible mistake (`TeacherPlan.mistake_turns`)."""
        return self.plan.mistake_turns

    def __call__(self, prompt: str, turns: Sequence[Turn]) -> str:
        index = len(turns)
        return self.plan.actions[index] if index < len(self.plan.actions) else self.finish
