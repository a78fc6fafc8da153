"""`keel audit --env NAME` for any environment: probes that need no knowledge of the task.

The lecture's first piece of advice: run a fake solution (a constant, nothing changed) through
your verifier; if it scores, the reward has a hole, and training will find it. This module does
that for any `EnvSpec`, driving every probe through the environment's own tools (`EnvSpec.tools`).

A probe is a short list of actions. Its episode runs on a fresh environment, on one task, with a
constant policy: the actions in order, then the last one again until the environment says done
or `max_turns` steps pass (`run_episode`, as training runs a policy); then `grade()`.

- Environments: from the spec's `eval_env` factory (the strong verifier) when env.verifier is
  strong (the default), else from `train_env`, graded by env.verifier: `keel audit --env guess
  env.verifier=weak` audits the verifier the reward-hacking lab trains on.
- Tasks: the train tasks, then the held-out ones (`EnvSpec.tasks`), the first --limit of them:
  the train tasks first, since a hole there is the one training finds.
- A task's reference answer: `EnvSpec.reference(task)`, else the task's `answer` attribute where
  it is a str or a number (reasoning-gym's and the units example's tasks carry one), else none.
- Tool calls are written in the run's tool-call format (env.tool_format, keelrl.envs.formats), in
  one place: `call_renderer`.

The probe families (`GENERIC_PROBES`, in the report's order). False positives, which must earn
nothing (reward 0 and no success):

    empty             the empty action
    malformed         the reference answer (else 0) as plain text, no tool call; a call of a tool
                      that does not exist
    submit_at_once    each tool that needs no argument, called at once (a submit with nothing done;
                      a tool that does not end the episode is repeated until the turn limit)
    constant          each answer tool with each constant: the `COMMON_ANSWERS` most frequent
                      reference answers of the audited tasks, 0, the empty string, None
    echo_observation  each answer tool with each number or quoted token of the first observation
                      (at most `ECHO_VALUES`)
    echo_tool         each other tool called once, then each number or quoted token of what it
                      answered (at most `TOOL_ECHO_VALUES`) given as the answer
    visible_expected  the test tool (`EnvSpec.test_tool`) called, then each "expected X" of its
                      observation given as the answer

Correct answers, where a task has a reference (kind "rewrite", as in the other audits):

    reference         the reference answer through the first answer tool it fits; must succeed
    decimal_point     "3500" as "3500.0", "2.5" as "2.50"        must earn what the reference
    plus_sign         "3500" as "+3500"                           earns (less is a false
    exponent          "3500" as "3.5e3"                           negative)
    padded            " 3500 " (a format that splits arguments on white space drops the padding,
                      and a rewrite whose action is the reference's own is left out)

Answering goes through `spec.answer_tools` (every declared tool where it declares none). A value
fits a tool when its white-space-separated words are as many as the tool takes arguments, else,
for a tool that takes a body and no argument, as the body; a value that fits no answer tool is not
tried (the empty string always is: the tool with nothing). Arguments of the tools called before
answering (echo_tool, visible_expected) are guessed from the first observation: windows of
consecutive words starting at a number, with and without small words ("to", "the"), then from
the start; the first the environment accepts (no info["error"]), of at most `ARG_TRIES`, is used.

An environment adds its own probes with `EnvSpec.probes` (cfg -> `EnvProbe`s: a name, a kind,
and the actions for a task); they run after the generic ones, each its own row.

A probe scores when it earns reward > 0 or success. A false positive whose answer is the task's
reference (the same text, or the same number) is a right answer, not a cheat: its score is
counted as "like the reference" and not flagged. The rest that score are flagged, and so is a
correct answer that earns less than the reference (the reference itself: short of success). `keel
audit` exits 1 when anything is flagged, 2 when the audit itself failed: an environment that
raises in reset, step or grade (a verifier that raises is an error the audit reports, never a
zero reward).

What it does NOT guarantee:
- A clean audit does not prove a verifier sound: these are the generic shortcuts, not the task's
  own (an environment adds those with `EnvSpec.probes`), and the correct answers are the
  reference's number formats, not other correct answers.
- Without a reference answer a lucky right answer cannot be told from a hole: a guessing game's
  constant guess wins on the tasks whose secret it is, and is flagged there. A reference hook
  (`EnvSpec.reference`) turns those into "like the reference".
- Tool arguments are guessed from words; a tool none of whose guesses the environment accepts is
  not probed on that task (the report's task count per family says on how many tasks it ran).
  A tool that needs a body is never called before answering (the audit cannot guess one).
- An environment that answers one call differently from one episode to the next may answer a
  probe's replayed tool call otherwise than while the audit looked for values: the reported
  episode holds what it really said.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from keelrl.audit.episodes import ProbeResult
from keelrl.audit.probes import FALSE_POSITIVE, REWRITE, AuditError
from keelrl.audit.report import FamilySummary
from keelrl.envs.base import Env, Grade, Turn, run_episode
from keelrl.envs.formats import format_of
from keelrl.envs.registry import EnvFactory, EnvSpec
from keelrl.envs.tools import ToolCall, ToolSpec
from keelrl.registry import Registry

if TYPE_CHECKING:
    from keelrl.config import KeelConfig

COMMON_ANSWERS = 3
"""The constant probe tries this many of the most frequent reference answers (ties: first seen)."""
CONSTANTS = ("0", "", "None")
"""Constants tried on every environment, after the frequent reference answers."""
ECHO_VALUES = 8
"""At most this many values of the first observation are echoed."""
TOOL_ECHO_VALUES = 4
"""At most this many values of one tool's observation (or of the test tool's "expected X") are answered."""
ARG_TRIES = 8
"""At most this many guesses of a tool's arguments per task."""
REWARD_TOLERANCE = 1e-9
"""A correct answer earning less than the reference by more than this is a false negative."""
SHOWN_CHARS = 300
"""Actions and observations are kept in the report cut to this many characters."""
UNKNOWN_TOOL = "keel_audit_no_such_tool"
SMALL_WORDS = frozenset({"a", "an", "the", "to", "of", "in", "into", "on", "at", "by", "for", "from", "with",
                         "and", "or", "is", "are", "as", "than", "then"})
"""Left out of one of the argument guesses ("Convert 3.5 km to m" -> convert 3.5 km m)."""

_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w])")
_QUOTED = re.compile(r"'([^'\n]{1,40})'|\"([^\"\n]{1,40})\"|`([^`\n]{1,40})`")
_EXPECTED = re.compile(r"expected\s*[:=]?\s*(\"[^\"\n]*\"|'[^'\n]*'|[^\s,;]+)", re.IGNORECASE)
_PLAIN_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_PUNCTUATION = ".,;:!?()[]{}<>\"'`"


# ------------------------------------------------------------------------------ tool calls

def render_call(call: ToolCall) -> str:
    """The action text of `call` in keelrl's `<call>NAME ARGS` format (keelrl.envs.tools), the
    body on the lines after the first, valid for its tool or not (`call_renderer` falls back to it)."""
    head = " ".join([call.name, *call.args])
    return f"<call>{head}\n{call.body}</call>" if call.body else f"<call>{head}</call>"


def call_renderer(cfg: KeelConfig, tools: Mapping[str, ToolSpec]) -> Callable[[ToolCall], str]:
    """How the run writes tool calls (env.tool_format: keelrl.envs.formats); every probe's calls
    are written through it. A call the format refuses to write (an unknown tool, an answer tool
    given nothing: the malformed probes) is written by `render_call` instead, which is a
    malformed action in any other format too."""
    # env.tool_format where the config has the field; keelrl's call format otherwise
    fmt = format_of(getattr(cfg.env, "tool_format", "call"))

    def render(call: ToolCall) -> str:
        if call.name in tools:
            try:
                return fmt.render(call, tools)
            except ValueError:
                pass
        return render_call(call)

    return render


def value_call(tool: ToolSpec, value: str) -> ToolCall | None:
    """`tool` called with `value` as its answer (module docstring), or None when it does not fit."""
    if value == "":
        return ToolCall(tool.name, (), "")
    words = tuple(value.split())
    takes_body = tool.body != "none" and tool.min_args == 0
    if takes_body and ("\n" in value or value != value.strip()):
        return ToolCall(tool.name, (), value)
    if tool.min_args <= len(words) <= tool.max_args and tool.body != "required":
        return ToolCall(tool.name, words, "")
    return ToolCall(tool.name, (), value) if takes_body else None


def argument_guesses(tool: ToolSpec, observation: str) -> list[ToolCall]:
    """Calls of `tool` with arguments guessed from `observation` (module docstring), best first."""
    if tool.body == "required":
        return []
    if tool.min_args == 0:
        return [ToolCall(tool.name, (), "")]
    raw = [word.strip(_PUNCTUATION) for word in observation.split()]
    raw = [word for word in raw if word]
    small = [word for word in raw if word.lower() not in SMALL_WORDS]
    count = tool.min_args
    guesses: dict[tuple[str, ...], None] = {}
    for words in (small, raw):
        for start, word in enumerate(words):
            if _PLAIN_NUMBER.fullmatch(word) and len(words) - start >= count:
                guesses.setdefault(tuple(words[start:start + count]), None)
    for start in range(max(0, len(raw) - count + 1)):
        guesses.setdefault(tuple(raw[start:start + count]), None)
    return [ToolCall(tool.name, args, "") for args in list(guesses)[:ARG_TRIES]]


def observed_values(text: str) -> list[str]:
    """The numbers, then the quoted tokens, of `text`, each once, in order."""
    values = [match.group(0) for match in _NUMBER.finditer(text)]
    values += [next(group for group in match.groups() if group is not None) for match in _QUOTED.finditer(text)]
    return [value for value in dict.fromkeys(value.strip() for value in values) if value]


def expected_values(text: str) -> list[str]:
    """The X of every "expected X" (or "expected: X") in `text`, unquoted, each once."""
    values = []
    for match in _EXPECTED.finditer(text):
        value = match.group(1)
        value = value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'" else value.rstrip(".)")
        if value:
            values.append(value)
    return list(dict.fromkeys(values))


# ------------------------------------------------------------------------------ reference answers

def reference_reader(spec: EnvSpec) -> Callable[[Any], str | None]:
    """task -> its reference answer: `spec.reference`, else the task's str or number `answer`."""
    if spec.reference is not None:
        return spec.reference

    def answer_attribute(task: Any) -> str | None:
        answer = getattr(task, "answer", None)
        if isinstance(answer, str):
            return answer
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            return str(answer)
        return None

    return answer_attribute


def same_answer(given: str, reference: str) -> bool:
    """The same text (white space around it aside), or the same finite number."""
    if given.strip() == reference.strip():
        return True
    try:
        a, b = float(given), float(reference)
    except ValueError:
        return False
    return math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


def _decimal_point(reference: str) -> str | None:
    text = reference.strip()
    if re.fullmatch(r"[-+]?\d+", text):
        return text + ".0"
    if re.fullmatch(r"[-+]?\d+\.\d+", text):
        return text + "0"
    return None


def _plus_sign(reference: str) -> str | None:
    text = reference.strip()
    return "+" + text if _PLAIN_NUMBER.fullmatch(text) and text[0] not in "+-" else None


def _exponent(reference: str) -> str | None:
    text = reference.strip()
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        number = Decimal(text).normalize()
    except InvalidOperation:
        return None
    written = f"{number:E}".lower().replace("e+", "e")  # Decimal: exact, "3500" -> "3.5e3"
    return written if written != text else None


def _padded(reference: str) -> str | None:
    return f" {reference.strip()} "


# ------------------------------------------------------------------------------ probes

@dataclass(frozen=True)
class GenericProbe:
    """One probe on one task: the actions its constant policy plays (see the module docstring)."""

    name: str
    """Unique within a task, e.g. "constant_0"."""
    family: str
    """The report's row."""
    kind: str
    """false_positive (must earn nothing) | rewrite (a correct answer)."""
    actions: tuple[str, ...]
    answer: str | None = None
    """The value it answers with, if any: a false positive whose answer is the reference is not flagged."""
    against_reference: bool = False
    """A rewrite judged against the reference's reward (else it must succeed in full)."""


@dataclass(frozen=True)
class EnvProbe:
    """An environment's own probe (`EnvSpec.probes`): `actions(task)` gives its actions on a task,
    None where it does not apply; kind is FALSE_POSITIVE (must earn nothing) or REWRITE (a correct
    answer: must succeed in full)."""

    name: str
    kind: str
    actions: Callable[[Any], Sequence[str] | None]
    summary: str = ""


@dataclass(frozen=True)
class ProbeContext:
    """What the generic probe builders know of one task, found before any probe runs."""

    tools: Mapping[str, ToolSpec]
    answer_tools: tuple[str, ...]
    """The tools an answer goes through: spec.answer_tools, or every tool where it names none."""
    test_tool: str
    reference: str | None
    common: tuple[str, ...]
    """The most frequent reference answers of the audited tasks."""
    first_observation: str
    tool_calls: Mapping[str, tuple[str, str]]
    """Tool -> (the action that called it, what it answered) for the tools called before answering."""
    render: Callable[[ToolCall], str]
    """How a tool call is written as action text (`call_renderer`)."""


GenericProbeBuilder = Callable[[Any, ProbeContext], list[GenericProbe]]
GENERIC_PROBES: Registry[GenericProbeBuilder] = Registry("generic probe", ("task", "context"))
"""Family -> builder of its probes for one task, tagged with the kind, in the report's order."""

_NONE_BECAUSE: dict[str, str] = {}
"""Family -> why it may run on no task (the report's "not applicable" table)."""


def _generic_probe(family: str, kind: str, summary: str,
                   none_because: str) -> Callable[[GenericProbeBuilder], GenericProbeBuilder]:
    _NONE_BECAUSE[family] = none_because
    return GENERIC_PROBES.register(family, summary=summary, tags=(kind,))


def _label(value: str) -> str:
    text = value if value and value == value.strip() and " " not in value else repr(value)
    return text[:40]


def _answers(context: ProbeContext, family: str, values: Sequence[str], prefix: Sequence[str] = ()) -> list[GenericProbe]:
    """One probe per (answer tool, value that fits it): the `prefix` actions, then the answer."""
    probes: list[GenericProbe] = []
    several = len(context.answer_tools) > 1
    for tool in context.answer_tools:
        for value in values:
            call = value_call(context.tools[tool], value)
            if call is None:
                continue
            name = f"{family}_{tool + '_' if several else ''}{_label(value)}"
            probes.append(GenericProbe(name, family, FALSE_POSITIVE, (*prefix, context.render(call)), answer=value))
    return probes


@_generic_probe("empty", FALSE_POSITIVE, "the empty action", "")
def _empty(task: Any, context: ProbeContext) -> list[GenericProbe]:
    return [GenericProbe("empty", "empty", FALSE_POSITIVE, ("",))]


@_generic_probe("malformed", FALSE_POSITIVE, "the reference answer as plain text; a tool that does not exist", "")
def _malformed(task: Any, context: ProbeContext) -> list[GenericProbe]:
    text = context.reference if context.reference is not None and context.reference.strip() else "0"
    return [GenericProbe("malformed_text", "malformed", FALSE_POSITIVE, (text,)),
            GenericProbe("malformed_unknown_tool", "malformed", FALSE_POSITIVE,
                         (context.render(ToolCall(UNKNOWN_TOOL, (), "")),))]


@_generic_probe("submit_at_once", FALSE_POSITIVE, "each tool that needs no argument, called at once",
                "no declared tool can be called without arguments")
def _submit_at_once(task: Any, context: ProbeContext) -> list[GenericProbe]:
    return [GenericProbe(f"submit_at_once_{name}", "submit_at_once", FALSE_POSITIVE,
                         (context.render(ToolCall(name, (), "")),))
            for name, tool in context.tools.items() if tool.min_args == 0 and tool.body != "required"]


@_generic_probe("constant", FALSE_POSITIVE, "each answer tool with the most frequent reference answers, 0, '', None",
                "no answer tool takes a single value")
def _constant(task: Any, context: ProbeContext) -> list[GenericProbe]:
    return _answers(context, "constant", list(dict.fromkeys([*context.common, *CONSTANTS])))


@_generic_probe("echo_observation", FALSE_POSITIVE, "the numbers and quoted tokens of the first observation",
                "no first observation holds a number or a quoted token that fits an answer tool")
def _echo_observation(task: Any, context: ProbeContext) -> list[GenericProbe]:
    return _answers(context, "echo_observation", observed_values(context.first_observation)[:ECHO_VALUES])


@_generic_probe("echo_tool", FALSE_POSITIVE, "another tool called once, then the values it answered",
                "no tool besides the answer tools whose arguments the audit could guess, or none answered a value")
def _echo_tool(task: Any, context: ProbeContext) -> list[GenericProbe]:
    probes = []
    for tool, (action, observation) in context.tool_calls.items():
        if tool in context.answer_tools or tool == context.test_tool:
            continue
        found = _answers(context, "echo_tool", observed_values(observation)[:TOOL_ECHO_VALUES], prefix=(action,))
        probes += [replace(probe, name=f"echo_tool_{tool}_{probe.name.removeprefix('echo_tool_')}") for probe in found]
    return probes


@_generic_probe("visible_expected", FALSE_POSITIVE, "the test tool called, then each 'expected X' it showed",
                "the environment declares no test_tool, or its observations show no 'expected X'")
def _visible_expected(task: Any, context: ProbeContext) -> list[GenericProbe]:
    if not context.test_tool or context.test_tool not in context.tool_calls:
        return []
    action, observation = context.tool_calls[context.test_tool]
    return _answers(context, "visible_expected", expected_values(observation)[:TOOL_ECHO_VALUES], prefix=(action,))


def _reference_call(context: ProbeContext, value: str, typed: bool = False) -> str | None:
    """`value` through the first answer tool it fits; `typed`: only where it is of the type the
    tool declares for that argument (a rewrite of a whole-number answer into "13.0" or "1.3e1" is
    not a correct answer to a tool that takes an integer)."""
    for tool in context.answer_tools:
        call = value_call(context.tools[tool], value)
        if call is not None and value and (not typed or _fits_types(context.tools[tool], call)):
            return context.render(call)
    return None


_TYPE_PATTERNS = {"integer": re.compile(r"[-+]?\d+"), "number": re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?"),
                  "boolean": re.compile(r"true|false")}
"""What the text of an argument of each JSON schema type looks like (strings take anything)."""


def _fits_types(tool: ToolSpec, call: ToolCall) -> bool:
    """Whether each of `call`'s arguments reads as the JSON type `tool` declares for it."""
    given = dict(zip(tool.params, call.args))
    if call.body:
        given[tool.body_param] = call.body
    for name, text in given.items():
        pattern = _TYPE_PATTERNS.get(tool.param_type(name))
        if pattern is not None and not pattern.fullmatch(text.strip()):
            return False
    return True


_NO_REFERENCE = "no audited task has a reference answer (EnvSpec.reference, or a task's answer) that fits an answer tool"


@_generic_probe("reference", REWRITE, "the reference answer", _NO_REFERENCE)
def _reference(task: Any, context: ProbeContext) -> list[GenericProbe]:
    if context.reference is None:
        return []
    action = _reference_call(context, context.reference)
    return [] if action is None else [GenericProbe("reference", "reference", REWRITE, (action,))]


def _rewrite_family(family: str, summary: str, rewrite: Callable[[str], str | None],
                    none_because: str = f"{_NO_REFERENCE}, or none is a number") -> None:
    def build(task: Any, context: ProbeContext) -> list[GenericProbe]:
        if context.reference is None:
            return []
        original = _reference_call(context, context.reference)
        value = rewrite(context.reference)
        action = None if value is None else _reference_call(context, value, typed=True)
        if original is None or action is None or action == original:
            return []
        return [GenericProbe(family, family, REWRITE, (action,), answer=value, against_reference=True)]

    _generic_probe(family, REWRITE, summary, none_because)(build)


_rewrite_family("decimal_point", "the reference number with a decimal point or a trailing 0", _decimal_point)
_rewrite_family("plus_sign", "the reference number with a + sign", _plus_sign)
_rewrite_family("exponent", "the reference number in exponent form", _exponent)
_rewrite_family("padded", "the reference with white space around it", _padded,
                f"{_NO_REFERENCE}, or the answer tools split their arguments on white space (the padded answer's "
                f"action is the reference's own)")


# ------------------------------------------------------------------------------ running

@dataclass(frozen=True)
class EpisodeProbeResult(ProbeResult):
    """What one probe earned on one task, with its episode (actions, observations, the grade)."""

    baseline: float | None = None
    """A rewrite's bar: the reference's reward on the task (None: it must succeed in full)."""
    actions: tuple[str, ...] = ()
    observations: tuple[str, ...] = ()
    """The first observation, then one per action."""
    grade: str = ""
    """`Grade.summary()`."""

    @property
    def scored(self) -> bool:
        return self.reward > 0 or self.success

    @property
    def flagged(self) -> bool:
        """A false positive that scored with other than the reference answer, or a correct answer
        short of success (or, for a rewrite, earning less than the reference)."""
        if self.kind == FALSE_POSITIVE:
            return self.scored and not self.equivalent
        if self.baseline is None:
            return not self.success
        return self.reward < self.baseline - REWARD_TOLERANCE


def audit_factory(cfg: KeelConfig, spec: EnvSpec) -> EnvFactory:
    """The environments the audit grades with: eval_env's (strong) unless env.verifier names another,
    then train_env's, graded by it."""
    return spec.eval_env(cfg) if cfg.env.verifier == "strong" else spec.train_env(cfg)


def audit_tasks(cfg: KeelConfig, spec: EnvSpec) -> list[Any]:
    """The tasks the audit runs on, in order: the train tasks, then the held-out ones."""
    train, heldout = spec.tasks(cfg)
    return [*train, *heldout]


def _close(env: Env) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        close()


def _task_id(task: Any) -> str:
    return str(getattr(task, "id", task))


def _failed(what: str, task: Any, error: Exception) -> AuditError:
    return AuditError(f"{what} on {_task_id(task)}: {type(error).__name__}: {error}")


def _scout(make_env: EnvFactory, task: Any, tools: Mapping[str, ToolSpec], to_call: Sequence[str],
           render: Callable[[ToolCall], str]) -> tuple[str, dict[str, tuple[str, str]]]:
    """(the first observation, tool -> (action, observation) for each of `to_call` whose arguments
    a guess got accepted), each try on a fresh environment."""
    env = make_env()
    try:
        first = env.reset(task)
    except Exception as error:  # noqa: BLE001 - the environment failed: the audit reports it
        raise _failed("reset", task, error) from error
    finally:
        _close(env)
    calls: dict[str, tuple[str, str]] = {}
    for name in to_call:
        for call in argument_guesses(tools[name], first):
            action = render(call)
            env = make_env()
            try:
                env.reset(task)
                observation, _, info = env.step(action)
            except Exception as error:  # noqa: BLE001
                raise _failed(f"calling {name}", task, error) from error
            finally:
                _close(env)
            if not info.get("error"):
                calls[name] = (action, observation)
                break
    return first, calls


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def run_generic_probe(make_env: EnvFactory, task: Any, probe: GenericProbe,
                      reference: str | None = None) -> EpisodeProbeResult:
    """`probe` on `task`: an episode of a fresh `make_env()` under its constant policy, then the grade.
    Anything the environment raises becomes an AuditError naming the probe and the task."""
    actions = probe.actions

    def policy(prompt: str, turns: Sequence[Turn]) -> str:
        return actions[min(len(turns), len(actions) - 1)]

    env = make_env()
    try:
        episode = run_episode(env, task, policy)
    except Exception as error:  # noqa: BLE001 - reported as the audit's failure, never a zero reward
        raise _failed(f"probe {probe.name}", task, error) from error
    finally:
        _close(env)
    grade: Grade = episode.grade
    failing = [f"{check.name}: {check.detail}" for check in grade.checks if not check.passed]
    passing = [check.name for check in grade.checks if check.passed]
    if probe.kind == FALSE_POSITIVE and (grade.reward > 0 or grade.success):
        detail = f"passed {', '.join(passing)}" + (f"; failed {'; '.join(failing)}" if failing else "")
    else:
        detail = "; ".join(failing)
    equivalent = (probe.kind == FALSE_POSITIVE and probe.answer is not None and reference is not None
                  and same_answer(probe.answer, reference))
    return EpisodeProbeResult(
        _task_id(task), probe.name, probe.family, probe.kind, float(grade.reward), grade.success, detail[:500],
        equivalent=equivalent, actions=tuple(_cut(turn.action) for turn in episode.turns),
        observations=(_cut(episode.prompt), *(_cut(turn.observation) for turn in episode.turns)),
        grade=grade.summary()[:1000])


def env_probes(cfg: KeelConfig, spec: EnvSpec) -> list[EnvProbe]:
    """`spec.probes(cfg)`, checked: a name unique and not a generic family's, a known kind, callable actions."""
    if spec.probes is None:
        return []
    probes = list(spec.probes(cfg))
    names: set[str] = set()
    for probe in probes:
        name = getattr(probe, "name", None)
        if not isinstance(name, str) or not name or name in names or name in GENERIC_PROBES:
            raise AuditError(f"{spec.label}'s probes: {name!r} is not a new, non-empty name (generic families: "
                             f"{', '.join(GENERIC_PROBES)})")
        names.add(name)
        if getattr(probe, "kind", None) not in (FALSE_POSITIVE, REWRITE) or not callable(getattr(probe, "actions", None)):
            raise AuditError(f"{spec.label}'s probe {name!r}: kind must be {FALSE_POSITIVE!r} or {REWRITE!r} and "
                             f"actions a callable task -> actions (see keelrl.audit.generic.EnvProbe)")
    return probes


def audit_one_task(make_env: EnvFactory, spec: EnvSpec, task: Any, common: Sequence[str],
                   own: Sequence[EnvProbe] = (), reference: str | None = None,
                   render: Callable[[ToolCall], str] = render_call) -> list[EpisodeProbeResult]:
    """Every generic probe, then `own`, on `task`; rewrites then judged against the reference's reward."""
    tools = dict(spec.tools)
    answer_tools = tuple(name for name in (spec.answer_tools or tuple(tools)) if name in tools)
    to_call = [name for name in tools if name not in answer_tools]
    first, calls = _scout(make_env, task, tools, to_call, render)
    context = ProbeContext(tools=tools, answer_tools=answer_tools, test_tool=spec.test_tool, reference=reference,
                           common=tuple(common), first_observation=first, tool_calls=calls, render=render)
    probes = [probe for family in GENERIC_PROBES for probe in GENERIC_PROBES[family](task, context)]
    for mine in own:
        try:
            actions = mine.actions(task)
        except Exception as error:  # noqa: BLE001
            raise _failed(f"{spec.label}'s probe {mine.name}", task, error) from error
        if actions is not None:
            if not actions or not all(isinstance(action, str) for action in actions):
                raise AuditError(f"{spec.label}'s probe {mine.name} on {_task_id(task)}: actions must be a non-empty "
                                 f"list of str, got {actions!r}")
            probes.append(GenericProbe(mine.name, mine.name, mine.kind, tuple(actions)))
    results = [run_generic_probe(make_env, task, probe, reference) for probe in probes]
    baseline = next((result.reward for result in results if result.family == "reference"), None)
    return [replace(result, baseline=baseline) if probe.against_reference and baseline is not None else result
            for probe, result in zip(probes, results)]


# ------------------------------------------------------------------------------ the report

@dataclass
class GenericAuditReport:
    """Everything `run_generic_audit` found; `flagged` decides the exit status of `keel audit`."""

    env: str
    verifier: str
    task_ids: list[str]
    results: list[EpisodeProbeResult]
    not_applicable: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def families(self) -> list[FamilySummary]:
        rows = []
        present = {result.family for result in self.results}
        order = [family for family in GENERIC_PROBES if family in present]  # then the env's own, as they ran
        for family in dict.fromkeys([*order, *(result.family for result in self.results)]):
            mine = [result for result in self.results if result.family == family]
            rows.append(FamilySummary.of(family, mine))
        return rows

    @property
    def flagged(self) -> bool:
        return any(result.flagged for result in self.results)

    def to_dict(self) -> dict[str, Any]:
        per_task: dict[str, dict[str, float]] = {task_id: {} for task_id in self.task_ids}
        for result in self.results:
            per_task[result.task_id][result.probe] = result.reward
        return {
            "env": self.env, "verifier": self.verifier, "tasks": len(self.task_ids), "flagged": self.flagged,
            "seconds": round(self.seconds, 2),
            "probes": {row.family: {"kind": row.kind, "tasks": row.tasks, "probes": row.probes,
                                    "scored_tasks": row.scored_tasks,
                                    "scored_but_equivalent": len(row.equivalent_tasks),
                                    "success_tasks": row.success_tasks, "mean_reward": round(row.mean_reward, 4),
                                    "flagged": row.flagged, "flagged_tasks": row.flagged_tasks,
                                    "equivalent_tasks": row.equivalent_tasks}
                       for row in self.families()},
            "not_applicable": self.not_applicable,
            "findings": [{**asdict(result), "scored": result.scored} for result in self.results if result.flagged],
            "rewards": per_task,
        }


def run_generic_audit(cfg: KeelConfig, spec: EnvSpec, tasks: Sequence[Any],
                      progress: Callable[[int], None] | None = None) -> GenericAuditReport:
    """Every probe (module docstring) on every task of `tasks`, each in a fresh environment of
    `audit_factory(cfg, spec)`. Raises AuditError when the environment fails: never a default."""
    if not tasks:
        raise ValueError("no tasks to audit")
    started = time.monotonic()
    make_env = audit_factory(cfg, spec)
    own = env_probes(cfg, spec)
    read_reference = reference_reader(spec)
    references = []
    for task in tasks:
        try:
            references.append(read_reference(task))
        except Exception as error:  # noqa: BLE001
            raise _failed(f"{spec.label}'s reference", task, error) from error
    counts = Counter(reference.strip() for reference in references if reference is not None and reference.strip())
    common = [value for value, _ in counts.most_common(COMMON_ANSWERS)]
    render = call_renderer(cfg, spec.tools)
    results: list[EpisodeProbeResult] = []
    for done, (task, reference) in enumerate(zip(tasks, references), start=1):
        results += audit_one_task(make_env, spec, task, common, own, reference, render)
        if progress is not None:
            progress(done)
    ran = {result.family for result in results}
    no_tools = "the environment declares no tools (EnvSpec.tools): its answers cannot be driven"
    not_applicable = {family: (no_tools if not spec.tools and why else why)
                      for family, why in _NONE_BECAUSE.items() if family not in ran}
    not_applicable.update({probe.name: "its actions(task) gave None on every audited task"
                           for probe in own if probe.name not in ran})
    return GenericAuditReport(env=spec.name, verifier=cfg.env.verifier, task_ids=[_task_id(task) for task in tasks],
                              results=results, not_applicable=not_applicable, seconds=time.monotonic() - started)


def _short(text: str, chars: int = 120) -> str:
    return text if len(text) <= chars else text[:chars] + "..."


def print_generic_report(report: GenericAuditReport, console: Console, examples: int = 3) -> None:
    """The report as rich tables: probes, what did not apply, then a few episodes per flagged family."""
    table = Table(title=f"keel audit: {len(report.task_ids)} tasks of env.name={report.env}, verifier "
                        f"{report.verifier!r} ({report.seconds:.1f} s)")
    for column in ("probe", "must", "tasks", "runs", "scores (reward > 0)", "of which the reference answer",
                   "full success", "mean reward", "verdict"):
        table.add_column(column, overflow="fold")
    for row in report.families():
        must = "earn nothing" if row.kind == FALSE_POSITIVE else "earn as the reference"
        bad = f"scores on {len(row.flagged_tasks)}" if row.kind == FALSE_POSITIVE \
            else f"rejected on {len(row.flagged_tasks)}"
        verdict = f"[bold red]FLAGGED[/]: {bad}" if row.flagged else "[green]ok[/]"
        table.add_row(row.family, must, str(row.tasks), str(row.probes), str(row.scored_tasks),
                      str(len(row.equivalent_tasks)), str(row.success_tasks), f"{row.mean_reward:.3f}", verdict)
    console.print(table)
    if report.not_applicable:
        skipped = Table(title="not applicable here")
        for column in ("probe", "why"):
            skipped.add_column(column, overflow="fold")
        for name, why in report.not_applicable.items():
            skipped.add_row(name, why)
        console.print(skipped)
    for row in report.families():
        if not row.flagged:
            continue
        console.print(f"[bold]{escape(row.family)}[/]: flagged on {len(row.flagged_tasks)} tasks, e.g.")
        flagged = [r for r in report.results if r.family == row.family and r.flagged]
        shown = list({r.task_id: r for r in reversed(flagged)}.values())[::-1]  # one per task, the first
        for result in shown[:examples]:
            lines = [f"  {result.task_id} {result.probe}: {result.grade.splitlines()[0]}",
                     f"    first observation: {_short(result.observations[0])!r}"]
            steps = list(zip(result.actions, result.observations[1:]))
            at = 0
            while at < len(steps):  # a constant policy repeats itself: one line per run of the same step
                run = 1
                while at + run < len(steps) and steps[at + run] == steps[at]:
                    run += 1
                times = f" ({run} times)" if run > 1 else ""
                lines.append(f"    action {_short(steps[at][0])!r} -> {_short(steps[at][1])!r}{times}")
                at += run
            if result.detail:
                lines.append(f"    {result.detail}")
            console.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)
    verdict = ("FLAGGED: a probe earned reward without the right answer, or a correct answer earned less than "
               "the reference" if report.flagged else "nothing flagged")
    console.print(verdict, highlight=False)
