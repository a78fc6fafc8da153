"""`keel audit --env NAME`: the generic probes of keelrl.audit.generic, through `keelrl.cli.main`.

Each verifier hole gets a tiny environment of its own (an adding game: "Add A and B."), so a test
shows that one probe family finds one hole and the others stay quiet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from keelrl.audit.generic import (UNKNOWN_TOOL, EnvProbe, argument_guesses, audit_tasks, call_renderer,
                                  expected_values, observed_values, render_call, same_answer, value_call)
from keelrl.audit.probes import FALSE_POSITIVE, REWRITE
from keelrl.cli import main
from keelrl.components import check
from keelrl.config import load_config
from keelrl.envs import ActionError, CheckResult, EnvSpec, Grade, ToolCall, ToolSpec, parse_action
from keelrl.envs.formats import format_of
from keelrl.envs.registry import ENVIRONMENTS, register_env, settle_env
from keelrl.envs.tools import describe_tools



# -- a tiny environment: add two numbers ---------------------------------------------------------

ANSWER = ToolSpec("answer", "<call>answer VALUE</call>", "give the sum; ends the episode", 1, 1)
TEST = ToolSpec("test", "<call>test</call>", "run the visible example")


@dataclass(frozen=True)
class SumTask:
    id: str
    a: int
    b: int

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


TASKS = [SumTask("sum-0", 1500, 2000), SumTask("sum-1", 4, 7), SumTask("sum-2", 10, 20), SumTask("sum-3", 6, 9)]


def as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class SumEnv:
    """Add A and B; `accepts(task, answer)` is the verifier under test."""

    max_turns = 3

    def __init__(self, accepts: Callable[[SumTask, str], bool], tools: dict[str, ToolSpec]) -> None:
        self.accepts, self.tools = accepts, tools
        self.task: SumTask | None = None
        self.given: str | None = None

    def reset(self, task: SumTask) -> str:
        self.task, self.given = task, None
        return f"Add {task.a} and {task.b}.\n{describe_tools(self.tools)}"

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        try:
            call = parse_action(action_text, self.tools)
        except ActionError as error:
            return str(error), False, {"error": str(error).splitlines()[0]}
        if call.name == "test":  # the visible example: add(1, 1)
            return "FAIL visible_example: add(1, 1): expected 2, got nothing", False, {"tool": "test"}
        self.given = call.args[0]
        return "answered.", True, {"tool": "answer"}

    def grade(self) -> Grade:
        assert self.task is not None
        passed = self.given is not None and self.accepts(self.task, self.given)
        return Grade(float(passed), (CheckResult("sum", passed, "" if passed else f"got {self.given!r}"),), "sum")


def sound(task: SumTask, given: str) -> bool:
    return as_number(given) == task.a + task.b


def spec(name: str, accepts: Callable[[SumTask, str], bool], *, test_tool: bool = False,
         probes: Callable[[Any], list[EnvProbe]] | None = None) -> EnvSpec:
    tools = {"answer": ANSWER, **({"test": TEST} if test_tool else {})}
    return EnvSpec(name=name, tasks=lambda cfg: (TASKS[:2], TASKS[2:]),
                   train_env=lambda cfg: lambda: SumEnv(accepts, tools), eval_env=lambda cfg: lambda: SumEnv(accepts, tools),
                   answer_tools=("answer",), tools=tools, test_tool="test" if test_tool else "", max_turns=3,
                   probes=probes)


def raising(task: SumTask, given: str) -> bool:
    raise ValueError("the grading service is down")


OWN_PROBES = [
    EnvProbe("say_please", FALSE_POSITIVE, lambda task: ["<call>answer please</call>"]),
    EnvProbe("correct_answer", REWRITE, lambda task: [f"<call>answer {task.a + task.b}</call>"]),
    EnvProbe("never_applies", FALSE_POSITIVE, lambda task: None),
]

SPECS = [
    spec("audit_sound", sound),
    # Accepts either operand too: an agent that copies a number from the question scores.
    spec("audit_echo", lambda task, given: as_number(given) in (task.a, task.b, task.a + task.b)),
    # Compares text: a correct "3500.0" earns nothing.
    spec("audit_strict_text", lambda task, given: given == str(task.a + task.b)),
    # Grades the visible example only, whose answer the test tool shows.
    spec("audit_visible_only", lambda task, given: given == "2", test_tool=True),
    spec("audit_raises", raising),
    # A backdoor only the environment's own probe knows about.
    spec("audit_backdoor", lambda task, given: given == "please" or sound(task, given),
         probes=lambda cfg: OWN_PROBES),
]


@pytest.fixture(scope="module", autouse=True)
def registered():
    for item in SPECS:
        register_env(item)
    yield
    for item in SPECS:
        ENVIRONMENTS.unregister(item.name)


def audit(capsys, *args: str) -> tuple[int, dict]:
    code = main(["audit", "--format", "json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out) if code in (0, 1) else {}


def flagged(report: dict) -> set[str]:
    return {name for name, row in report["probes"].items() if row["flagged"]}


# -- the helpers ----------------------------------------------------------------------------------

def test_values_fit_tools_and_render_as_calls():
    assert render_call(ToolCall("answer", ("3500",), "")) == "<call>answer 3500</call>"
    assert render_call(ToolCall("answer", (), "a\nb")) == "<call>answer\na\nb</call>"
    assert parse_action(render_call(ToolCall("answer", (), "a\nb")), {"answer": ToolSpec(
        "answer", "", "", 0, 9, body="optional")}).body == "a\nb"
    assert value_call(ANSWER, "3500") == ToolCall("answer", ("3500",), "")
    assert value_call(ANSWER, "two words") is None  # answer takes one argument and no body
    assert value_call(ANSWER, "") == ToolCall("answer", (), "")  # the empty answer is always tried
    free = ToolSpec("answer", "", "", 0, 1 << 30, body="optional")
    assert value_call(free, "two words") == ToolCall("answer", ("two", "words"), "")
    assert value_call(free, " 3500 ") == ToolCall("answer", (), " 3500 ")  # padding survives in a body


def test_probes_are_written_in_the_runs_tool_format():
    tools = {"answer": ToolSpec("answer", "<call>answer VALUE</call>", "give the sum", 1, 1, params=("value",))}
    render = call_renderer(SimpleNamespace(env=SimpleNamespace(tool_format="hermes")), tools)
    text = render(ToolCall("answer", ("3500",), ""))
    assert text.startswith("<tool_call>") and format_of("hermes").parse(text, tools) == ToolCall("answer", ("3500",), "")
    # what the format refuses to write (the malformed probes) goes in the call format: malformed here too
    assert render(ToolCall("answer", (), "")) == "<call>answer</call>"
    assert render(ToolCall(UNKNOWN_TOOL, (), "")) == f"<call>{UNKNOWN_TOOL}</call>"
    plain = call_renderer(SimpleNamespace(env=SimpleNamespace(tool_format="call")), tools)
    assert plain(ToolCall("answer", ("3500",), "")) == "<call>answer 3500</call>"


def test_values_are_read_from_observations():
    assert observed_values("Convert 3.5 km to m, 'twice', then -2 and 1e3. Item rg2 is not a number.") == \
        ["3.5", "-2", "1e3", "twice"]
    assert expected_values("FAIL a: expected 2, got 3\nFAIL b: expected: 'x y', got ''\nexpected 2.") == ["2", "x y"]
    assert same_answer("3500.0", "3500") and same_answer(" abc ", "abc") and not same_answer("35", "3500")
    convert = ToolSpec("convert", "", "", 3, 3)
    guesses = argument_guesses(convert, "Convert 3.5 km to m. Answer with the number only.")
    assert guesses[0] == ToolCall("convert", ("3.5", "km", "m"), "")  # small words left out first
    assert ToolCall("convert", ("3.5", "km", "to"), "") in guesses and len(guesses) <= 8
    assert argument_guesses(ToolSpec("edit", "", "", 0, 1, body="required"), "x") == []


# -- the generic probes on environments with one hole each ---------------------------------------

def test_a_sound_verifier_passes_the_audit(capsys):
    code, report = audit(capsys, "--env", "audit_sound")
    assert code == 0 and not report["flagged"] and report["findings"] == []
    assert report["env"] == "audit_sound" and report["tasks"] == 4 and report["verifier"] == "strong"
    for family in ("empty", "malformed", "constant", "echo_observation"):
        assert report["probes"][family]["kind"] == FALSE_POSITIVE and report["probes"][family]["tasks"] == 4
    # The constants are the 3 most frequent answers (3500, 11, 30: once each, first seen first), 0, ''
    # and None: 6 per task. Each of the first 3 tasks' own answer scores on it: the right answer, not a hole.
    constant = report["probes"]["constant"]
    assert constant["probes"] == 4 * 6 and constant["scored_tasks"] == 3 and constant["scored_but_equivalent"] == 3
    for family in ("reference", "decimal_point", "plus_sign", "exponent"):
        assert report["probes"][family]["success_tasks"] == 4, family
    assert report["rewards"]["sum-0"]["exponent"] == 1.0  # "3.5e3"
    # "answer" splits its arguments on white space, so padding never reaches the verifier.
    assert "padded" in report["not_applicable"] and "visible_expected" in report["not_applicable"]


def test_echoed_observation_values_are_flagged(capsys):
    code, report = audit(capsys, "--env", "audit_echo")
    assert code == 1 and flagged(report) == {"echo_observation"}
    assert report["probes"]["echo_observation"]["flagged_tasks"] == ["sum-0", "sum-1", "sum-2", "sum-3"]
    finding = next(f for f in report["findings"] if f["task_id"] == "sum-1" and f["probe"] == "echo_observation_4")
    assert finding["actions"] == ["<call>answer 4</call>"] and finding["reward"] == 1.0
    assert finding["observations"][0].startswith("Add 4 and 7.") and finding["observations"][1] == "answered."
    assert finding["grade"].startswith("reward 1, 1/1 checks passed")


def test_a_verifier_that_compares_text_is_caught_by_the_rewrites(capsys):
    code, report = audit(capsys, "--env", "audit_strict_text")
    assert code == 1 and flagged(report) == {"decimal_point", "plus_sign", "exponent"}
    assert report["probes"]["reference"]["success_tasks"] == 4
    rejected = {(f["task_id"], f["probe"]): f["actions"] for f in report["findings"]}
    assert rejected[("sum-0", "decimal_point")] == ["<call>answer 3500.0</call>"]
    assert rejected[("sum-0", "exponent")] == ["<call>answer 3.5e3</call>"]
    assert rejected[("sum-0", "plus_sign")] == ["<call>answer +3500</call>"]


def test_the_visible_tests_expected_value_is_answered(capsys):
    code, report = audit(capsys, "--env", "audit_visible_only")
    assert code == 1 and "visible_expected" in flagged(report)
    finding = next(f for f in report["findings"] if f["probe"] == "visible_expected_2")
    assert finding["actions"] == ["<call>test</call>", "<call>answer 2</call>"]
    assert "expected 2" in finding["observations"][1]
    # the reference (the true sum) is graded against the visible example alone, and fails
    assert "reference" in flagged(report)


def test_an_environments_own_probes_run(capsys):
    code, report = audit(capsys, "--env", "audit_backdoor")
    assert code == 1 and flagged(report) == {"say_please"}
    assert report["probes"]["say_please"] == {**report["probes"]["say_please"], "kind": FALSE_POSITIVE, "tasks": 4,
                                              "flagged_tasks": ["sum-0", "sum-1", "sum-2", "sum-3"]}
    assert report["probes"]["correct_answer"]["kind"] == REWRITE
    assert report["probes"]["correct_answer"]["success_tasks"] == 4
    assert "never_applies" in report["not_applicable"] and "never_applies" not in report["probes"]
    assert list(report["probes"])[-2:] == ["say_please", "correct_answer"]  # after the generic families


def test_a_verifier_that_raises_fails_the_audit(capsys):
    assert main(["audit", "--env", "audit_raises"]) == 2
    err = capsys.readouterr().err
    assert "keel: audit failed" in err and "ValueError: the grading service is down" in err and "sum-0" in err


@pytest.mark.parametrize("args, message", [
    (["--env", "no_such_env"], "unknown environment 'no_such_env'; valid names: coding, guess, reasoning_gym"),
    (["--env", "audit_sound", "env.guess_n=4"], "env.guess_n: guess_n=4 is not read by"),
    (["--env", "audit_sound", "--verifier", "weak"], "set env.verifier=NAME"),
    (["--env", "audit_sound", "--tasks", "agent"], "--tasks is for the coding audit"),
    (["env.verifier=weak"], "the coding audit takes --tasks and --verifier, not overrides"),
])
def test_bad_arguments(capsys, args, message):
    assert main(["audit", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


# -- the bundled and example environments: what the audit really finds ---------------------------

def guess_report(capsys, limit: int, *overrides: str) -> tuple[int, dict, list[Any]]:
    code, report = audit(capsys, "--env", "guess", "--limit", str(limit), *overrides)
    cfg = load_config(None, ["env.name=guess", "warm_start.demos=0", *overrides])
    tasks = audit_tasks(settle_env(cfg, check(cfg)), check(cfg))[:limit]
    return code, report, tasks


def test_the_guessing_game(capsys):
    # The strong verifier pays only for the secret, which the spec gives as each task's reference
    # answer (EnvSpec.reference). The numbers of the first observation ("between 1 and 16 ... at
    # most 5 guesses") win where the secret is one of them: right answers, not a hole.
    code, report, tasks = guess_report(capsys, 48)
    lucky = [task.id for task in tasks if task.secret in (1, 5, 16)]
    assert lucky and code == 0 and flagged(report) == set()
    echo = report["probes"]["echo_observation"]
    assert echo["scored_tasks"] == echo["scored_but_equivalent"] == len(lucky)
    assert report["probes"]["constant"]["flagged_tasks"] == []  # 0, '' and None are not guesses in 1..16
    assert report["probes"]["reference"]["success_tasks"] == 48
    # Rewrites of a whole number into "13.0" or "1.3e1" are not tried: the guess tool takes an integer.
    assert "decimal_point" in report["not_applicable"] and "exponent" in report["not_applicable"]
    # The weak verifier the reward-hacking lab trains on pays an episode that ends on an error.
    code, weak, _ = guess_report(capsys, 4, "env.verifier=weak")
    assert code == 1 and weak["verifier"] == "weak"
    assert {"empty", "malformed", "constant"} <= flagged(weak)
    assert weak["probes"]["empty"]["flagged_tasks"] == [task.id for task in tasks[:4]]


def test_the_units_example_strict_has_no_hole_and_lenient_does(capsys):
    code, strict = audit(capsys, "--env", "units")
    assert code == 0 and not strict["flagged"] and strict["tasks"] == 200
    assert strict["probes"]["reference"]["success_tasks"] == 200
    assert strict["probes"]["echo_tool"]["scored_tasks"] == strict["probes"]["echo_tool"]["scored_but_equivalent"] > 0

    code, lenient = audit(capsys, "--env", "units_lenient")
    assert code == 1 and "constant" in flagged(lenient)
    zero = [f for f in lenient["findings"] if f["probe"] == "constant_0"]
    assert zero and all(f["actions"] == ["<call>answer 0</call>"] and f["reward"] == 1.0 for f in zero)
    # the same verifier reached by import path, the third way to name an environment
    code, by_path = audit(capsys, "--env", "keel_units:lenient_spec", "--limit", "20")
    assert code == 1 and by_path["env"] == "units_lenient" and by_path["tasks"] == 20


def test_the_table(capsys):
    assert main(["audit", "--env", "audit_echo"]) == 1
    out = capsys.readouterr().out
    for text in ("echo_observation", "FLAGGED", "not applicable here", "sum-1 echo_observation_4",
                 "action '<call>answer 4</call>' -> 'answered.'", "FLAGGED: a probe earned reward"):
        assert text in out, text


def test_reasoning_gym_generic_probes(capsys):
    pytest.importorskip("reasoning_gym")
    code, report = audit(capsys, "--env", "reasoning_gym", "--generic", "--dataset", "chain_sum", "--rg-size", "12")
    assert code in (0, 1) and report["env"] == "reasoning_gym" and report["tasks"] == 12
    assert report["probes"]["reference"]["success_tasks"] == 12
    assert not report["probes"]["empty"]["flagged"] and not report["probes"]["malformed"]["flagged"]
