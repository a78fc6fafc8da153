"""The real-code task family: size, determinism, split, provenance, and the behaviour of every task.

Behaviour is checked in-process for EVERY task (exec the task file in a fresh namespace, call
on deep-copied args, compare type-aware, as tests/test_coding_tasks.py does: the sources are
trusted standard-library text or one change to it), and for a small sample through the real
sandbox (`check_tasks`, and one `CodingEnv` episode that applies the reference fix).
"""

from __future__ import annotations

import collections
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from keelrl.envs import real_tasks as real
from keelrl.envs.real_tasks import KINDS, SOURCES, real_split, real_tasks, source_of
from keelrl.envs.tasks import Task
from test_coding_tasks import assert_valid_and_round_trips, failing, load_function, passes, run_visible_file  # the trusted harness

TASKS = real_tasks()


# ------------------------------------------------------------------------------ size, kinds, determinism

def test_at_least_150_distinct_tasks_from_at_least_30_functions():
    assert len(TASKS) >= 150
    assert len({task.id for task in TASKS}) == len(TASKS)
    assert len({task.files[task.entry_file] for task in TASKS}) == len(TASKS)
    counts = collections.Counter(task.kind for task in TASKS)
    assert set(counts) == {real.KIND_PREFIX + kind for kind in KINDS} and min(counts.values()) >= 10, counts
    per_source = collections.Counter(source_of(task).slug for task in TASKS)
    assert len(per_source) >= 30 and max(per_source.values()) <= real.TASKS_PER_SOURCE
    # a source whose function or helper another Python version lacks is left out (3.10: 3, 3.13: 2)
    assert len(per_source) == len(SOURCES) if sys.version_info[:2] == (3, 11) else len(per_source) >= len(SOURCES) - 3
    for task in TASKS:
        prefix, name, number = task.id.split("-")
        assert prefix == "real" and name == source_of(task).slug and number.isdigit(), task.id


def _digest(tasks: list[Task]) -> str:
    return hashlib.sha256("\n".join(task.to_json() for task in tasks).encode()).hexdigest()


def test_generation_is_deterministic_across_processes_and_hash_seeds():
    assert real_tasks() == TASKS  # cached analyses; the subprocess below starts from nothing
    code = ("import hashlib; from keelrl.envs.real_tasks import real_tasks; "
            "print(hashlib.sha256('\\n'.join(t.to_json() for t in real_tasks()).encode()).hexdigest())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == _digest(TASKS)


def test_seeds_draw_different_mutants_of_the_same_functions():
    other = real_tasks(seed=1)
    assert real_tasks(seed=1) == other
    assert {source_of(task).slug for task in other} == {source_of(task).slug for task in TASKS}
    differing = len({task.files[task.entry_file] for task in other} - {task.files[task.entry_file] for task in TASKS})
    assert differing > len(TASKS) // 4


def test_the_split_holds_out_whole_functions():
    train, heldout = real_tasks(split="train"), real_tasks(split="heldout")
    assert len(heldout) >= 40 and len(train) >= 100
    assert len(train) + len(heldout) == len(TASKS)
    assert {task.id for task in train}.isdisjoint({task.id for task in heldout})
    held_functions = {source_of(task).slug for task in heldout}
    assert held_functions.isdisjoint({source_of(task).slug for task in train})
    assert 0.15 < len(held_functions) / len(SOURCES) < 0.35
    assert all(real_split(task) == "heldout" and real_split(task.id) == "heldout" for task in heldout)
    for seed in (1, 2):
        assert len(real_tasks(seed=seed, split="heldout")) >= 40
    with pytest.raises(ValueError, match="split"):
        real_tasks(split="test")
    with pytest.raises(ValueError, match="real-code family"):
        real_split("off_by_one-0001")


# ------------------------------------------------------------------------------ schema, shape, provenance

def test_every_task_is_valid_and_round_trips_through_jsonl(tmp_path):
    assert_valid_and_round_trips(TASKS, tmp_path / "real.jsonl")


def test_every_task_has_the_documented_shape():
    for task in TASKS:
        keys = [check for check in task.hidden_checks if check.key]
        assert len(keys) == 1 and keys[0] in task.visible_tests, task.id
        assert len(task.hidden_checks) >= 4 and 3 <= len(task.visible_tests) < len(task.hidden_checks), task.id
        assert all(check in task.hidden_checks for check in task.visible_tests), task.id
        assert set(task.files) == {task.entry_file, task.test_file} and task.test_file == f"test_{task.entry_file}"
        assert task.module not in sys.stdlib_module_names, task.id
        assert set(task.reference_fix) == {task.entry_file} and set(task.wrong_fix) <= {task.entry_file}, task.id
        assert task.entry_function in task.prompt and task.test_file in task.prompt, task.id
        assert task.brittle_phrase and task.brittle_phrase in task.reference_fix[task.entry_file], task.id
        buggy, fixed = task.files[task.entry_file], task.reference_fix[task.entry_file]
        assert buggy.startswith("# From CPython ") and "Python Software Foundation License" in buggy.split("\n")[0]
        # a small edit inside the function: provenance, imports and helpers are left as they are
        start = next(i for i, line in enumerate(fixed.splitlines()) if line.startswith(f"def {task.entry_function}("))
        edits = [op for op in difflib.SequenceMatcher(None, buggy.splitlines(), fixed.splitlines()).get_opcodes()
                 if op[0] != "equal"]
        assert edits and all(op[1] >= start for op in edits), task.id
        assert sum(max(i2 - i1, j2 - j1) for _, i1, i2, j1, j2 in edits) <= 4, task.id


def pure_module(name: str) -> Any:
    """A fresh copy of a standard module run from its file, its C accelerators blocked (as
    test.support.import_fresh_module does), so private pure-Python functions stay defined."""
    spec = importlib.util.spec_from_file_location(f"_pure_{name.replace('.', '_')}", real.stdlib_path(name))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    blocked = ("_datetime", "_bisect", "_heapq")
    saved = {key: sys.modules.get(key) for key in blocked}
    sys.modules.update(dict.fromkeys(blocked))  # None in sys.modules makes the import fail
    try:
        spec.loader.exec_module(module)
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
    return module


def test_the_reference_is_the_standard_library_text_and_agrees_with_the_library():
    """Provenance: the task's function is inspect.getsource's text of the module's own function,
    and that function (and the imported one, C or Python, where the module still exposes it)
    gives every expected value."""
    first_tasks = {source_of(task).slug: task for task in reversed(TASKS)}
    pure: dict[str, Any] = {}
    for source in SOURCES:
        assert source.licence == real.PSF
        if source.slug not in first_tasks:  # absent from this Python's library
            continue
        task = first_tasks[source.slug]
        fixed = task.reference_fix[task.entry_file]
        module = real._prepared(source.slug).module
        if module not in pure:
            pure[module] = pure_module(module)
        original = getattr(pure[module], source.function)
        assert fixed.endswith(textwrap.dedent(inspect.getsource(original))), source.function
        assert fixed.startswith(f"# From CPython {sys.version_info.major}.{sys.version_info.minor}, Lib/")
        live = getattr(importlib.import_module(module), source.function, None)
        for check in task.hidden_checks:
            assert passes(original, check), (source.function, check)
            assert live is None or passes(live, check), (source.function, check)


# ------------------------------------------------------------------------------ behaviour, every task

@pytest.mark.parametrize("kind", KINDS)
def test_reference_bug_and_wrong_fix_behave_as_documented(kind):
    for task in [task for task in TASKS if task.kind == real.KIND_PREFIX + kind]:
        buggy, fixed = task.files[task.entry_file], task.reference_fix[task.entry_file]
        key = next(check.name for check in task.hidden_checks if check.key)
        assert failing(task, fixed, task.hidden_checks) == set(), task.id
        bug_fails = failing(task, buggy, task.hidden_checks)
        assert key in bug_fails, (task.id, bug_fails)
        visible = {check.name for check in task.visible_tests}
        assert bug_fails & visible, task.id
        # a check the bug breaks stays hidden, unless the bug breaks only the key check
        assert bug_fails - visible or bug_fails == {key}, (task.id, bug_fails)
        if task.wrong_fix:
            wrong = task.wrong_fix[task.entry_file]
            assert wrong not in (buggy, fixed) and failing(task, wrong, task.hidden_checks), task.id


@pytest.mark.parametrize("kind", KINDS)
def test_the_visible_test_file_agrees_with_visible_tests(kind):
    for task in [task for task in TASKS if task.kind == real.KIND_PREFIX + kind]:
        buggy, fixed = task.files[task.entry_file], task.reference_fix[task.entry_file]
        key = next(check.name for check in task.visible_tests if check.key)
        assert run_visible_file(task, fixed) == set(), task.id
        assert key in run_visible_file(task, buggy), task.id


def test_most_tasks_ship_a_near_miss_wrong_fix():
    with_wrong = [task for task in TASKS if task.wrong_fix]
    assert len(with_wrong) >= 0.5 * len(TASKS)
    near = 0
    for task in with_wrong:
        key = next(check for check in task.hidden_checks if check.key)
        near += passes(load_function(task.wrong_fix[task.entry_file], task.entry_function), key)
    assert near >= 0.5 * len(with_wrong)


# ------------------------------------------------------------------------------ the machinery

def test_the_step_budget_stops_an_endless_loop_and_restores_the_trace():
    def spin(n):
        while n >= 0:
            n += 1

    before = sys.gettrace()
    outcome = real._call(spin, [0])
    assert outcome.hung and outcome.error is None
    assert sys.gettrace() is before
    assert real._call(len, [[1, 2]]).value == 2
    assert isinstance(real._call(int, ["x"], traced=False).error, ValueError)


def test_variants_change_one_token_and_keep_comments():
    text = ("def f(a, b):\n    # keep me\n    if not a:  # and me\n        return 0\n"
            "    return (a + b) if a < b else max(a, b - 1)\n")
    variants = real._variants(text.rstrip("\n"))
    kinds = collections.Counter(variant.kind for variant in variants)
    assert kinds["off_by_one"] >= 3 and kinds["flipped_comparison"] >= 2 and kinds["wrong_operator"] >= 2
    assert kinds["inverted_condition"] >= 2 and kinds["missing_guard"] == 1
    for variant in variants:
        assert variant.kind is None or variant.kind in KINDS
        if variant.kind != "missing_guard":
            assert "# keep me" in variant.text and "# and me" in variant.text
            assert len(variant.text.splitlines()) == len(text.splitlines())
    assert "    return (a + b) if a <= b else max(a, b - 1)" in {line for v in variants for line in v.text.split("\n")}
    assert any("min(a, b - 1)" in variant.text for variant in variants)


# ------------------------------------------------------------------------------ through the real sandbox

def _sample() -> list[Task]:
    """One task of every kind (held-out ones first), one more held-out task, and one task of every
    source module (the grader fences each module's original: tests/test_audit.py)."""
    ordered = sorted(TASKS, key=lambda task: real_split(task) != "heldout")
    sample = {task.kind: task for task in reversed(ordered)}
    chosen = [*sample.values(), next(task for task in ordered if task not in sample.values())]
    by_module = {source_of(task).module: task for task in reversed(ordered)}
    return [*chosen, *(task for task in by_module.values() if task not in chosen)]


def test_a_sample_passes_sandboxed_behavioural_validation():
    from keelrl.envs.verifiers import check_tasks

    assert check_tasks(_sample(), workers=2) == []


def test_a_coding_episode_fixes_a_real_task():
    from keelrl.envs.coding import CodingEnv
    from keelrl.envs.teacher import edit_action

    task = _sample()[0]
    env = CodingEnv("strong", use_git=False, max_turns=4)
    try:
        env.reset(task)
        before = env.grade()
        key = next(check.name for check in task.hidden_checks if check.key)
        assert not before.success and key in {check.name for check in before.checks if not check.passed}
        action = edit_action(task.entry_file, task.files[task.entry_file], task.reference_fix[task.entry_file],
                             default_path=task.entry_file)
        assert action is not None
        env.step(action)
        assert env.grade().success
    finally:
        env.close()


def test_each_task_puts_its_original_off_limits_and_a_bad_entry_is_named():
    """The standard library in the sandbox still holds the unmutated function: each task names it
    in `off_limits` for the grader to fence (tests/test_audit.py runs the fence)."""
    import dataclasses

    from keelrl.envs.tasks import TaskError, task_from_dict, validate_task

    tasks = TASKS
    for task in tasks:
        source = source_of(task)
        assert task.off_limits == [f"{source.module}.{source.function}"], task.id
    for bad in (["join"], ["posixpath.join()"], "posixpath.join", [3]):
        with pytest.raises(TaskError, match="off_limits"):
            validate_task(dataclasses.replace(tasks[0], off_limits=bad))  # type: ignore[arg-type]
    data = json.loads(tasks[0].to_json())
    assert task_from_dict(data).off_limits == tasks[0].off_limits
    del data["off_limits"]
    assert task_from_dict(data).off_limits == []  # optional: a task file without it loads
