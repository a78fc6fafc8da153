"""The bundled task family: the lecture's fixture, size and determinism, schema, and behaviour.

Behaviour is checked for EVERY generated task with a small in-process harness (exec the module
in a fresh namespace, call on deep-copied args, compare type-aware). That is fine here because
these sources are trusted bundled data; candidate code from an agent goes through the sandbox.
"""

from __future__ import annotations

import collections
import copy
import difflib
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from keelrl.envs.coding_tasks import KINDS, bundled_tasks, generate_tasks, retry_count_task
from keelrl.envs.tasks import Check, Task, load_tasks, save_tasks, split_of, validate_task

TASKS = generate_tasks()
OTHER_SEED = generate_tasks(seed=1)  # behaviour is checked for a second seed too: templates, not luck
GENERATED = [task for task in TASKS if task.id != "retry_count"]


# ------------------------------------------------------------------------------ trusted harness

def load_function(source: str, name: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {"__name__": "bundled_task_module"}
    exec(compile(source, "<task>", "exec"), namespace)
    return namespace[name]


def same(got: Any, expected: Any) -> bool:
    """Equal values of the same JSON type: True is not 1, 3.0 is not 3."""
    if type(got) is not type(expected):
        return False
    if isinstance(expected, list):
        return len(got) == len(expected) and all(same(g, e) for g, e in zip(got, expected))
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(same(got[k], expected[k]) for k in expected)
    return got == expected


def passes(function: Callable[..., Any], check: Check) -> bool:
    try:
        got = function(*copy.deepcopy(check.args))
    except Exception as error:  # noqa: BLE001 - a check that raises is a failed check unless it names the error
        return check.raises is not None and type(error).__name__ == check.raises
    return check.raises is None and same(got, check.expected)


def failing(task: Task, source: str, checks: list[Check]) -> set[str]:
    function = load_function(source, task.entry_function)
    return {check.name for check in checks if not passes(function, check)}


def run_visible_file(task: Task, source: str) -> set[str]:
    """Exec the rendered visible test file against `source`; the names of the checks whose test fails."""
    header, _, body = task.files[task.test_file].partition("\n")
    assert header == f"from {task.module} import {task.entry_function}"
    namespace: dict[str, Any] = {task.entry_function: load_function(source, task.entry_function)}
    exec(compile(body, task.test_file, "exec"), namespace)
    failed = set()
    for name, test in namespace.items():
        if name.startswith("test_"):
            try:
                test()
            except Exception:  # noqa: BLE001 - any error fails the test, as under pytest
                failed.add(name[len("test_"):])
    return failed


def test_the_harness_is_type_aware_and_checks_raises():
    int_three = load_function("def f(x):\n    return 3\n", "f")
    assert passes(int_three, Check("a", [0], 3))
    assert not passes(load_function("def f(x):\n    return 3.0\n", "f"), Check("a", [0], 3))
    assert not passes(load_function("def f(x):\n    return True\n", "f"), Check("a", [0], 1))
    assert not passes(int_three, Check("a", [0], None, raises="ValueError"))
    raiser = load_function("def f(x):\n    raise ValueError(x)\n", "f")
    assert passes(raiser, Check("a", [0], None, raises="ValueError"))
    assert not passes(raiser, Check("a", [0], None, raises="TypeError"))
    assert not passes(raiser, Check("a", [0], 0))


# ------------------------------------------------------------------------------ the lecture's fixture

def test_the_fixture_is_the_lectures_retry_count():
    task = retry_count_task()
    assert (task.id, task.kind, task.entry_file, task.entry_function, task.test_file) == (
        "retry_count", "falsy_or_default", "retry.py", "retry_count", "test_retry.py")
    assert task.files["retry.py"] == 'def retry_count(config):\n    return config.get("retries") or 3\n'
    assert task.wrong_fix == {"retry.py": 'def retry_count(config):\n    return config.get("retries", 3)\n'}
    assert task.reference_fix == {"retry.py": 'def retry_count(config):\n    value = config.get("retries")\n'
                                              '    if value is None:\n        return 3\n    return value\n'}
    assert task.brittle_phrase == "is None"
    # missing -> 3, None -> 3, 0 -> 0 (the key check), 2 -> 2, all visible; hidden also holds
    # the key case beside an unrelated setting, so memorising the four answers does not pass.
    assert [(c.name, c.args, c.expected, c.key) for c in task.hidden_checks] == [
        ("missing", [{}], 3, False), ("none", [{"retries": None}], 3, False),
        ("zero", [{"retries": 0}], 0, True), ("two", [{"retries": 2}], 2, False),
        ("zero_variant", [{"retries": 0, "verbose": True}], 0, False)]
    assert task.visible_tests == task.hidden_checks[:4]
    assert "retries=0 must disable retries" in task.prompt
    assert TASKS[0] == task
    # the lecture's trajectory: the first fix repairs 0 and breaks None; handling None passes all four
    assert failing(task, task.files["retry.py"], task.hidden_checks) == {"zero", "zero_variant"}
    assert failing(task, task.wrong_fix["retry.py"], task.hidden_checks) == {"none"}
    assert failing(task, task.reference_fix["retry.py"], task.hidden_checks) == set()


# ------------------------------------------------------------------------------ size, kinds, determinism

def test_at_least_500_distinct_tasks_over_all_kinds():
    assert len(TASKS) >= 500
    assert len({task.id for task in TASKS}) == len(TASKS)
    assert len({task.files[task.entry_file] for task in TASKS}) == len(TASKS)
    counts = collections.Counter(task.kind for task in TASKS)
    assert set(counts) == set(KINDS) and len(KINDS) >= 7
    assert min(counts.values()) >= 30, counts
    for task in GENERATED:
        kind, _, index = task.id.rpartition("-")
        assert kind == task.kind and len(index) == 4 and index.isdigit()


def test_generation_is_deterministic_and_seeded():
    assert generate_tasks() == TASKS
    assert generate_tasks(seed=0, count=37) == TASKS[:37]
    assert generate_tasks(seed=1) == OTHER_SEED
    assert [task.id for task in OTHER_SEED] == [task.id for task in TASKS]
    differing = sum(a != b for a, b in zip(OTHER_SEED, TASKS))
    assert differing > len(TASKS) // 2
    assert OTHER_SEED[0] == TASKS[0]  # the fixture does not depend on the seed
    bigger = generate_tasks(seed=0, count=len(TASKS) + 20)
    assert bigger[:len(TASKS)] == TASKS and len(bigger) == len(TASKS) + 20
    with pytest.raises(ValueError, match="count"):
        generate_tasks(count=-1)


def test_splits_are_disjoint_deterministic_and_large_enough():
    train, heldout = bundled_tasks("train"), bundled_tasks("heldout")
    assert len(train) >= 300 and len(heldout) >= 100
    assert {t.id for t in train}.isdisjoint({t.id for t in heldout})
    assert len(train) + len(heldout) == len(bundled_tasks()) == len(TASKS)
    assert all(split_of(t.id, 0) == "heldout" for t in heldout)
    assert bundled_tasks("heldout") == heldout
    for seed in (1, 2):
        assert len(bundled_tasks("heldout", seed=seed)) >= 100 and len(bundled_tasks("train", seed=seed)) >= 300
    with pytest.raises(ValueError, match="split"):
        bundled_tasks("test")


# ------------------------------------------------------------------------------ schema and shape

def assert_valid_and_round_trips(tasks: list[Task], path: Path) -> None:
    """Every task passes `validate_task`, and the list survives `save_tasks` then `load_tasks` at `path`."""
    for task in tasks:
        validate_task(task)
    assert save_tasks(tasks, path) == len(tasks)
    assert load_tasks(path) == tasks


def test_every_task_is_valid_and_round_trips_through_jsonl(tmp_path):
    assert_valid_and_round_trips(TASKS, tmp_path / "tasks.jsonl")


def assert_documented_shape(task: Task) -> None:
    """The shape every generated task has (the module docstring's), the key check visible."""
    keys = [check for check in task.hidden_checks if check.key]
    assert len(keys) == 1, task.id
    assert 4 <= len(task.hidden_checks) <= 7, task.id
    assert 2 <= len(task.visible_tests) <= 4 and len(task.visible_tests) < len(task.hidden_checks), task.id
    assert all(check in task.hidden_checks for check in task.visible_tests), task.id
    assert keys[0] in task.visible_tests, task.id
    assert set(task.files) == {task.entry_file, task.test_file}, task.id
    assert task.test_file == f"test_{task.entry_file}", task.id
    assert set(task.reference_fix) == set(task.wrong_fix) == {task.entry_file}, task.id
    assert task.module not in sys.stdlib_module_names and not task.module.startswith(("test", "conftest")), task.id
    assert task.entry_function in task.prompt and task.test_file in task.prompt, task.id
    source = task.files[task.entry_file]
    assert len(source.splitlines()) <= 16, (task.id, source)
    assert "import" not in source and "import" not in task.reference_fix[task.entry_file], task.id
    # a small edit: at most two lines replaced, at most four written
    diff = difflib.SequenceMatcher(None, source.splitlines(), task.reference_fix[task.entry_file].splitlines())
    edits = [op for op in diff.get_opcodes() if op[0] != "equal"]
    assert sum(i2 - i1 for _, i1, i2, _, _ in edits) <= 2, task.id
    assert sum(j2 - j1 for _, _, _, j1, j2 in edits) <= 4, task.id


def test_every_task_has_the_documented_shape():
    for task in GENERATED:
        assert_documented_shape(task)


# ------------------------------------------------------------------------------ behaviour, every task

@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_reference_bug_and_wrong_fix_behave_as_documented(kind, seed):
    for task in [task for task in (OTHER_SEED if seed else TASKS) if task.kind == kind]:
        buggy = task.files[task.entry_file]
        fixed, wrong = task.reference_fix[task.entry_file], task.wrong_fix[task.entry_file]
        key = next(check.name for check in task.hidden_checks if check.key)
        assert failing(task, fixed, task.hidden_checks) == set(), task.id
        bug_fails = failing(task, buggy, task.hidden_checks)
        assert key in bug_fails, (task.id, bug_fails)
        assert bug_fails & {check.name for check in task.visible_tests}, task.id
        # Some check the bug breaks is hidden, unless the bug breaks only the key input itself
        # (then answering the visible inputs right is the fix).
        hidden_only = bug_fails - {check.name for check in task.visible_tests}
        assert hidden_only or bug_fails == {key}, (task.id, bug_fails)
        assert failing(task, wrong, task.hidden_checks), task.id
        assert wrong != fixed and wrong != buggy, task.id
        assert task.brittle_phrase and task.brittle_phrase in fixed, task.id


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_the_visible_test_file_agrees_with_visible_tests(kind, seed):
    for task in [task for task in (OTHER_SEED if seed else TASKS) if task.kind == kind]:
        buggy, fixed = task.files[task.entry_file], task.reference_fix[task.entry_file]
        assert run_visible_file(task, buggy) == failing(task, buggy, task.visible_tests), task.id
        assert run_visible_file(task, fixed) == set(), task.id


def test_most_wrong_fixes_pass_the_key_check():
    """The wrong fix is a near miss (like the lecture's get(k, 3)) wherever the bug allows it."""
    passing = 0
    for task in GENERATED:
        key = next(check for check in task.hidden_checks if check.key)
        passing += passes(load_function(task.wrong_fix[task.entry_file], task.entry_function), key)
    assert passing >= 0.8 * len(GENERATED)


def test_a_sample_of_every_kind_passes_sandboxed_behavioural_validation():
    # The in-process harness above is trusted; this cross-checks through the real sandboxed
    # verifier: two tasks of every kind plus the lecture's fixture.
    from keelrl.envs.verifiers import check_tasks

    tasks = generate_tasks()
    sample, per_kind = [tasks[0]], {}
    for task in tasks[1:]:
        if per_kind.get(task.kind, 0) < 2:
            sample.append(task)
            per_kind[task.kind] = per_kind.get(task.kind, 0) + 1
    assert check_tasks(sample, workers=2) == []


def test_the_generated_fixture_matches_the_hand_written_one():
    from task_fixtures import retry_task

    generated, by_hand = retry_count_task(), retry_task()
    for field in ("id", "files", "entry_file", "entry_function", "test_file", "visible_tests",
                  "reference_fix", "wrong_fix", "brittle_phrase"):
        assert getattr(generated, field) == getattr(by_hand, field), field
    assert generated.hidden_checks[:4] == by_hand.hidden_checks  # plus the hidden-only variant
