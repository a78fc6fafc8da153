"""The opt-in agent kinds (`AGENT_KINDS`): the default tasks do not change, every task keeps the
module's guarantees, and each kind has its own property, seen the way the agent sees it.

Behaviour is checked for every task with the trusted in-process harness of test_coding_tasks.py;
a few tasks of each kind also go through the environment's real `test` tool (sandboxed, ~70 ms a
run), so what is asserted about test output is what the agent reads.
"""

from __future__ import annotations

import ast
import collections
import hashlib
import re
from typing import Any

import pytest

from keelrl.envs.coding_tasks import AGENT_KINDS, KINDS, bundled_tasks, generate_tasks
from keelrl.envs.tasks import Check, Task, validate_task
from test_coding_tasks import assert_documented_shape, assert_valid_and_round_trips, failing, load_function, run_visible_file

DEFAULT_SHA256 = "8b310069cda3e028e69c5512d4ea5829f0da54de9b3343819aec39a6196682c3"
"""sha256 of the concatenated `to_json()` of `generate_tasks(0)`: 851 tasks, the fixture and 85 of
each of `KINDS`. The default training run, its held-out split and the golden runs depend on them;
change this only together with a deliberate change of the default tasks."""

AGENT = generate_tasks(0, kinds=AGENT_KINDS)
AGENT_OTHER_SEED = generate_tasks(1, kinds=AGENT_KINDS)
BY_SEED = {0: AGENT, 1: AGENT_OTHER_SEED}


def key_of(task: Task) -> Check:
    (key,) = [check for check in task.hidden_checks if check.key]
    return key


def visible_messages(task: Task, source: str) -> dict[str, str]:
    """Run the rendered visible test file against `source`: failing check name -> the message the
    `test` tool shows (an assertion's text, or "ErrorName: text" for any other exception)."""
    header, _, body = task.files[task.test_file].partition("\n")
    assert header == f"from {task.module} import {task.entry_function}"
    namespace: dict[str, Any] = {task.entry_function: load_function(source, task.entry_function)}
    exec(compile(body, task.test_file, "exec"), namespace)
    messages = {}
    for name, test in namespace.items():
        if name.startswith("test_"):
            try:
                test()
            except AssertionError as error:
                messages[name[len("test_"):]] = str(error)
            except Exception as error:  # noqa: BLE001 - as the grader reports it
                messages[name[len("test_"):]] = f"{type(error).__name__}: {error}"
    return messages


def states(text: str, value: Any) -> bool:
    """Whether `text` states `value`: a string anywhere, a number as a whole token (4 is not in 48)."""
    if isinstance(value, str):
        return value in text
    return re.search(rf"(?<![\w.]){re.escape(repr(value))}(?![\w.])", text) is not None


def is_wrong_value(task: Task, message: str) -> bool:
    """A failed assertion of the visible test file ("f(args): expected X, got Y"), not a crash."""
    return message.startswith(f"{task.entry_function}(") and ": expected " in message


# ------------------------------------------------------------------------------ the default tasks

def test_the_default_tasks_are_unchanged():
    default = generate_tasks(0)
    digest = hashlib.sha256("".join(task.to_json() for task in default).encode()).hexdigest()
    assert digest == DEFAULT_SHA256
    assert len(default) == 851 and default[0].id == "retry_count"
    assert collections.Counter(task.kind for task in default[1:]) == {kind: 85 for kind in KINDS}
    assert generate_tasks(0, kinds=KINDS) == default and bundled_tasks() == default
    assert len(bundled_tasks("heldout")) == 209  # the held-out split the module docstring promises
    assert not set(AGENT_KINDS) & set(KINDS)


def test_appending_kinds_leaves_the_earlier_kinds_alone():
    everything = generate_tasks(0, kinds=KINDS + AGENT_KINDS)
    assert [task for task in everything if task.kind not in AGENT_KINDS] == generate_tasks(0)
    assert [task for task in everything if task.kind in AGENT_KINDS] == AGENT
    assert len({task.id for task in everything}) == len(everything)
    assert len({task.files[task.entry_file] for task in everything}) == len(everything)
    # A task's split depends on its id alone, so the old kinds keep their held-out tasks too.
    heldout = bundled_tasks("heldout", kinds=KINDS + AGENT_KINDS)
    assert [task for task in heldout if task.kind not in AGENT_KINDS] == bundled_tasks("heldout")
    agent_heldout = [task for task in heldout if task.kind in AGENT_KINDS]
    assert agent_heldout == bundled_tasks("heldout", kinds=AGENT_KINDS) and 0 < len(agent_heldout) < len(AGENT)


def test_kinds_are_checked_and_errors_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown task kinds \\['two_defect'\\]; valid kinds: falsy_or_default, "):
        generate_tasks(0, kinds=("two_defect",))
    with pytest.raises(ValueError, match="more than once"):
        generate_tasks(0, kinds=("two_defects", "two_defects"))
    with pytest.raises(ValueError, match="at least one kind"):
        generate_tasks(0, kinds=())
    with pytest.raises(ValueError, match="got the string 'two_defects'"):
        generate_tasks(0, kinds="two_defects")
    with pytest.raises(ValueError, match="unknown task kinds"):
        bundled_tasks("train", kinds=("nope",))


def test_agent_kinds_alone_have_no_fixture_and_are_seeded_and_prefix_stable():
    assert [task.id for task in AGENT[:3]] == [f"{kind}-0000" for kind in AGENT_KINDS]
    counts = collections.Counter(task.kind for task in AGENT)
    assert counts == {kind: 85 for kind in AGENT_KINDS}
    assert generate_tasks(0, kinds=AGENT_KINDS) == AGENT
    assert generate_tasks(0, count=20, kinds=AGENT_KINDS) == AGENT[:20]
    bigger = generate_tasks(0, count=len(AGENT) + 6, kinds=AGENT_KINDS)
    assert bigger[:len(AGENT)] == AGENT and len(bigger) == len(AGENT) + 6
    assert sum(a != b for a, b in zip(AGENT, AGENT_OTHER_SEED)) > len(AGENT) // 2
    assert generate_tasks(0, kinds=("two_defects",)) == [task for task in AGENT if task.kind == "two_defects"]


def test_every_kind_draws_from_all_of_its_templates():
    # Each template has its own function names: many names means no template was left out.
    for kind in AGENT_KINDS:
        functions = collections.Counter(task.entry_function for task in AGENT if task.kind == kind)
        assert len(functions) >= 12, (kind, functions)


# ------------------------------------------------------------------------------ the module's guarantees

def test_every_task_is_valid_and_round_trips_through_jsonl(tmp_path):
    for task in AGENT_OTHER_SEED:
        validate_task(task)
    assert_valid_and_round_trips(AGENT, tmp_path / "tasks.jsonl")


@pytest.mark.parametrize("seed", [0, 1])
def test_every_task_has_the_documented_shape(seed):
    for task in BY_SEED[seed]:
        assert_documented_shape(task)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", AGENT_KINDS)
def test_reference_bug_and_wrong_fix_behave_as_documented(kind, seed):
    for task in [task for task in BY_SEED[seed] if task.kind == kind]:
        buggy = task.files[task.entry_file]
        fixed, wrong = task.reference_fix[task.entry_file], task.wrong_fix[task.entry_file]
        key = key_of(task).name
        visible = {check.name for check in task.visible_tests}
        assert failing(task, fixed, task.hidden_checks) == set(), task.id
        bug_fails = failing(task, buggy, task.hidden_checks)
        assert key in bug_fails and bug_fails & visible, (task.id, bug_fails)
        assert bug_fails - visible, (task.id, bug_fails)  # memorising the visible answers does not pass
        assert failing(task, wrong, task.hidden_checks), task.id
        assert wrong != fixed and wrong != buggy, task.id
        assert task.brittle_phrase and task.brittle_phrase in fixed, task.id
        assert run_visible_file(task, buggy) == failing(task, buggy, task.visible_tests), task.id
        assert run_visible_file(task, fixed) == set(), task.id


# ------------------------------------------------------------------------------ each kind's own property

@pytest.mark.parametrize("seed", [0, 1])
def test_hidden_edge_value_is_stated_only_by_a_failing_visible_test(seed):
    for task in [task for task in BY_SEED[seed] if task.kind == "hidden_edge_value"]:
        key = key_of(task)
        edge, source = key.expected, task.files[task.entry_file]
        messages = visible_messages(task, source)
        # e.g. "font_size({'size': 70}): expected 48, got 70"
        assert key.name in messages and f": expected {edge!r}, got " in messages[key.name], (task.id, messages)
        assert is_wrong_value(task, messages[key.name]), task.id  # a crash would not show the value
        assert not states(task.prompt, edge) and not states(source, edge), (task.id, edge)


@pytest.mark.parametrize("seed", [0, 1])
def test_two_defects_fixing_the_crash_exposes_a_different_failing_test(seed):
    for task in [task for task in BY_SEED[seed] if task.kind == "two_defects"]:
        key = key_of(task).name
        before = visible_messages(task, task.files[task.entry_file])
        after = visible_messages(task, task.wrong_fix[task.entry_file])
        # The buggy code only ever shows the crash ...
        assert key in before, (task.id, before)
        assert not any(is_wrong_value(task, message) for message in before.values()), (task.id, before)
        # ... the crash fix alone passes the key test, and a test that crashed now shows a wrong value.
        assert after and key not in after and set(after) < set(before), (task.id, before, after)
        assert all(is_wrong_value(task, message) for message in after.values()), (task.id, after)
        assert visible_messages(task, task.reference_fix[task.entry_file]) == {}, task.id


@pytest.mark.parametrize("seed", [0, 1])
def test_tests_only_behaviour_prompts_name_files_and_nothing_else(seed):
    tasks = [task for task in BY_SEED[seed] if task.kind == "tests_only_behaviour"]
    templates = {task.prompt.replace(task.test_file, "TESTS").replace(task.entry_file, "FILE")
                 .replace(f"`{task.entry_function}`", "FUNCTION") for task in tasks}
    assert templates == {"Make the visible tests in TESTS pass by fixing FUNCTION (FILE). "
                         "Hidden checks try more cases of the behaviour those tests show."}
    for task in tasks:
        (function,) = [node for node in ast.parse(task.files[task.entry_file]).body
                       if isinstance(node, ast.FunctionDef)]
        assert ast.get_docstring(function) is None, task.id
        # The visible tests alone tell the buggy code and the wrong fix from the reference fix.
        assert failing(task, task.files[task.entry_file], task.visible_tests), task.id
        assert failing(task, task.wrong_fix[task.entry_file], task.visible_tests), task.id


# ------------------------------------------------------------------------------ through the real tools

def sample(kind: str, count: int = 2) -> list[Task]:
    return [task for task in AGENT if task.kind == kind][:count]


def whole_file_edit(path: str, old_text: str, new_text: str) -> str:
    return f"<call>edit {path}\n{old_text.rstrip(chr(10))}\n>>>\n{new_text.rstrip(chr(10))}</call>"


def failed_lines(observation: str) -> dict[str, str]:
    """The `test` tool's "FAIL test_NAME: MESSAGE" lines -> {NAME: MESSAGE}."""
    found = {}
    for line in observation.splitlines()[1:]:
        name, _, message = line.removeprefix("FAIL test_").partition(": ")
        found[name] = message
    return found


@pytest.fixture(scope="module")
def env():
    from keelrl.envs.coding import CodingEnv

    coding = CodingEnv(use_git=False)
    yield coding
    coding.close()


def test_the_test_tool_shows_the_hidden_edge_value(env):
    for task in sample("hidden_edge_value", 3):
        key = key_of(task)
        opening = env.reset(task)
        assert not states(opening, key.expected), task.id
        observation, done, info = env.step("<call>test</call>")
        shown = failed_lines(observation)
        assert not done and info["tests_failed"] == len(shown) >= 1, (task.id, observation)
        assert f": expected {key.expected!r}, got " in shown[key.name], (task.id, observation)
        assert shown == visible_messages(task, task.files[task.entry_file])  # the harness reads what the agent reads


def test_the_test_tool_shows_the_second_defect_only_after_the_crash_fix(env):
    for task in sample("two_defects", 2):
        key = key_of(task).name
        env.reset(task)
        before = failed_lines(env.step("<call>test</call>")[0])
        _, _, info = env.step(whole_file_edit(task.entry_file, task.files[task.entry_file],
                                              task.wrong_fix[task.entry_file]))
        assert "error" not in info, info
        after = failed_lines(env.step("<call>test</call>")[0])
        assert key in before and not any(is_wrong_value(task, message) for message in before.values()), before
        assert after and key not in after and set(after) < set(before), (before, after)
        assert all(is_wrong_value(task, message) for message in after.values()), after
        assert before == visible_messages(task, task.files[task.entry_file])
        assert after == visible_messages(task, task.wrong_fix[task.entry_file])
        assert not env.grade().success  # the hidden checks still catch the half fix


def test_the_test_tool_rejects_the_wrong_fix_of_a_tests_only_task(env):
    (task,) = sample("tests_only_behaviour", 1)
    env.reset(task)
    assert failed_lines(env.step("<call>test</call>")[0])
    env.step(whole_file_edit(task.entry_file, task.files[task.entry_file], task.wrong_fix[task.entry_file]))
    assert failed_lines(env.step("<call>test</call>")[0])
    env.step(whole_file_edit(task.entry_file, task.wrong_fix[task.entry_file], task.reference_fix[task.entry_file]))
    observation = env.step("<call>test</call>")[0]
    assert failed_lines(observation) == {} and observation.startswith("tests: ")
    assert env.grade().success


def test_one_task_of_every_agent_kind_passes_sandboxed_behavioural_validation():
    from keelrl.envs.verifiers import check_tasks

    assert check_tasks([sample(kind, 1)[0] for kind in AGENT_KINDS], workers=1) == []
