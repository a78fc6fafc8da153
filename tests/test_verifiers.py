"""Verifiers: behavioural grading in the sandbox, and the lecture's false positive / negative."""

import json

import pytest

from keelrl.envs.base import VerifierError
from keelrl.envs.tasks import Check, Task, render_test_file
from keelrl.sandbox import Sandbox
from keelrl.envs.verifiers import VERIFIERS, check_tasks, make_verifier, run_checks, run_visible_tests
from task_fixtures import BUGGY, CONSTANT_ZERO, FIXED, REWRITE, WRONG, retry_task

TASK = retry_task()


def with_source(source: str) -> dict:
    return {**TASK.files, "retry.py": source}


@pytest.fixture(scope="module")
def verifiers():
    sandbox = Sandbox()
    return {name: make_verifier(name, sandbox) for name in VERIFIERS}


# Rewards each verifier gives each candidate: the lecture's table.
#                    strong weak brittle
EXPECTED = {
    "buggy":         (0.0, 0.0, 0.0),   # `or 3` turns 0 into 3: fails the key check
    "fixed":         (1.0, 1.0, 1.0),
    "wrong":         (0.0, 1.0, 0.0),   # get(..., 3): fixes 0, breaks None
    "constant_zero": (0.0, 1.0, 0.0),   # the lecture's false positive: weak pays for `return 0`
    "rewrite":       (1.0, 1.0, 0.0),   # the lecture's false negative: brittle rejects `== None`
}
SOURCES = {"buggy": BUGGY, "fixed": FIXED, "wrong": WRONG, "constant_zero": CONSTANT_ZERO, "rewrite": REWRITE}


@pytest.mark.parametrize("candidate", list(EXPECTED))
def test_variants_reproduce_the_lectures_false_positive_and_negative(verifiers, candidate):
    for name, expected in zip(("strong", "weak", "brittle"), EXPECTED[candidate]):
        grade = verifiers[name].grade(TASK, with_source(SOURCES[candidate]))
        assert grade.reward == expected, (name, candidate, grade.summary())
        assert grade.verifier == name


def test_failing_checks_say_expected_and_got(verifiers):
    grade = verifiers["strong"].grade(TASK, with_source(WRONG))
    failed = {check.name: check.detail for check in grade.checks if not check.passed}
    assert failed == {"none": "expected 3, got None"}
    brittle = verifiers["brittle"].grade(TASK, with_source(REWRITE))
    assert [c.detail for c in brittle.checks if not c.passed] == ["retry.py does not contain 'is None'"]


def test_partial_credit_is_the_fraction_of_checks(verifiers):
    partial = make_verifier("strong", verifiers["strong"].sandbox, partial_credit=True)
    # constant zero passes only retries=0: 1 of 4.
    assert partial.grade(TASK, with_source(CONSTANT_ZERO)).reward == 0.25
    assert partial.grade(TASK, with_source(BUGGY)).reward == 0.75
    assert partial.grade(TASK, with_source(FIXED)).reward == 1.0
    strict = verifiers["strong"].grade(TASK, with_source(BUGGY))
    assert strict.reward == 0.0 and strict.partial == 0.75


def test_weighted_partial_credit_counts_the_key_check_more(verifiers):
    import dataclasses

    weighted = make_verifier("strong", verifiers["strong"].sandbox, partial_credit=True, key_weight=3.0)
    # The key check (retries=0) weighs 3 of 6: constant zero passes only it, the bug all but it.
    assert weighted.grade(TASK, with_source(CONSTANT_ZERO)).reward == pytest.approx(3 / 6)
    assert weighted.grade(TASK, with_source(BUGGY)).reward == pytest.approx(3 / 6)
    # Task-level weights apply too (here: the 'none' check weighs 2).
    task = dataclasses.replace(TASK, hidden_checks=[dataclasses.replace(c, weight=2.0) if c.name == "none" else c
                                                    for c in TASK.hidden_checks])
    assert weighted.grade(task, with_source(BUGGY)).reward == pytest.approx(4 / 7)
    grade = weighted.grade(task, with_source(FIXED))
    assert grade.reward == 1.0 and grade.success
    with pytest.raises(Exception, match="key_weight"):
        make_verifier("strong", verifiers["strong"].sandbox, key_weight=0.0)


@pytest.mark.parametrize("source, detail", [
    ("def retry_count(config):\n    return True\n", "expected 3, got True"),          # bool is not int
    ("def retry_count(config):\n    return 3.0\n", "expected 3, got 3.0"),           # float is not int
    ("def retry_count(config):\n    return '3'\n", "expected 3, got '3'"),
    ("def retry_count(config):\n    raise KeyError('retries')\n", "raised KeyError: 'retries'"),
    ("def retry_count(config)\n    return 3\n", "could not import retry.py: SyntaxError"),
    ("import sys\nsys.exit(0)\n", "could not import retry.py: SystemExit: 0"),
    ("import os\nos._exit(0)\n", "exited before the grader could report"),
    ("def retry_count(config):\n    return object()\n", "got an unserialisable object"),
])
def test_type_aware_comparison_and_failures_are_explained(verifiers, source, detail):
    grade = verifiers["strong"].grade(TASK, with_source(source))
    assert grade.reward == 0.0
    assert any(detail in check.detail for check in grade.checks if check.name == "missing"), grade.summary()


def test_an_endless_call_times_out_alone_and_other_checks_still_count(verifiers):
    source = ("def retry_count(config):\n    if config.get('retries') == 2:\n        while True:\n            pass\n"
              "    value = config.get('retries')\n    return 3 if value is None else value\n")
    grade = make_verifier("strong", verifiers["strong"].sandbox, per_call_timeout=0.5).grade(TASK, with_source(source))
    details = {check.name: (check.passed, check.detail) for check in grade.checks}
    assert details["two"] == (False, "raised Timeout: call timed out")
    assert all(details[name][0] for name in ("missing", "none", "zero"))


def test_forged_reports_earn_nothing(verifiers):
    # The candidate writes a fake "all pass" report to the result channel and exits at import.
    forged = json.dumps({"nonce": "guess", "results": [{"ok": True, "value": "3", "type": "int"}] * 4})
    source = ("import os\nos.write(int(os.environ['KEEL_RESULT_FD']), " + repr(forged.encode()) + ")\nos._exit(0)\n")
    grade = verifiers["strong"].grade(TASK, with_source(source))
    assert grade.reward == 0.0
    assert all("forged" in check.detail for check in grade.checks)


def test_expected_values_never_enter_the_sandbox(verifiers):
    # A candidate that searches its directory for the expected outputs finds only args.
    source = ("import os\nFOUND = sorted(os.listdir('.'))\nTEXT = ''.join(open(n).read() for n in FOUND if n.endswith('.json'))\n"
              "def retry_count(config):\n    raise RuntimeError(repr(FOUND) + TEXT)\n")
    grade = verifiers["strong"].grade(TASK, with_source(source))
    detail = grade.checks[0].detail
    assert "RuntimeError" in detail and "expected" not in detail.split(":", 1)[1]


def test_grading_restores_the_test_file_and_ignores_git(verifiers):
    tampered = {**with_source(CONSTANT_ZERO), "test_retry.py": "def test_ok():\n    pass\n", ".git/HEAD": "x"}
    tests, error = run_visible_tests(TASK, tampered, verifiers["strong"].sandbox)
    assert not error and [t["name"] for t in tests] == ["test_ok"] and tests[0]["passed"]
    assert verifiers["strong"].grade(TASK, tampered).reward == 0.0
    deleted = {k: v for k, v in with_source(FIXED).items() if k != "test_retry.py"}
    assert verifiers["strong"].grade(TASK, deleted).reward == 1.0  # restored before grading
    assert run_visible_tests(TASK, deleted, verifiers["strong"].sandbox)[1].startswith("no test file")


def test_visible_tests_report_the_failing_value(verifiers):
    tests, error = run_visible_tests(TASK, TASK.files, verifiers["strong"].sandbox)
    assert error == ""
    outcome = {t["name"]: (t["passed"], t["message"]) for t in tests}
    assert outcome["test_zero"] == (False, "retry_count({'retries': 0}): expected 0, got 3")
    assert all(outcome[name][0] for name in ("test_missing", "test_none", "test_two"))


def test_raises_checks():
    task = Task(id="div", kind="k", prompt="p",
                files={"m.py": "def f(x):\n    return 1 / x\n",
                       "test_m.py": render_test_file("m", "f", [Check("zero", [0], raises="ZeroDivisionError")])},
                entry_file="m.py", entry_function="f", test_file="test_m.py",
                visible_tests=[Check("zero", [0], raises="ZeroDivisionError")],
                hidden_checks=[Check("zero", [0], raises="ZeroDivisionError"), Check("two", [2], 0.5)],
                reference_fix={"m.py": "def f(x):\n    return 1 / x\n"})
    sandbox = Sandbox()
    assert [c.passed for c in run_checks(task, task.files, task.hidden_checks, sandbox)] == [True, True]
    other = run_checks(task, {**task.files, "m.py": "def f(x):\n    return 0.5\n"}, task.hidden_checks, sandbox)
    assert [c.passed for c in other] == [False, True]
    assert other[0].detail == "expected ZeroDivisionError to be raised, returned 0.5"


def test_verifier_errors_are_loud_not_zero_rewards():
    no_key = Task(**{**TASK.__dict__, "hidden_checks": [Check("missing", [{}], 3)], "brittle_phrase": ""})
    with pytest.raises(VerifierError, match="no key check"):
        make_verifier("weak").grade(no_key, no_key.files)
    with pytest.raises(VerifierError, match="no brittle_phrase"):
        make_verifier("brittle").grade(no_key, no_key.files)
    with pytest.raises(VerifierError, match="unknown verifier 'strict'.*strong, weak, brittle"):
        make_verifier("strict")


def test_check_tasks_accepts_the_fixture_and_flags_broken_tasks():
    assert check_tasks([TASK]) == []
    not_a_fix = Task(**{**TASK.__dict__, "id": "not_a_fix", "reference_fix": {"retry.py": WRONG}, "wrong_fix": {}})
    no_bug = Task(**{**TASK.__dict__, "id": "no_bug", "files": with_source(FIXED)})
    problems = check_tasks([not_a_fix, no_bug])
    assert any(line.startswith("not_a_fix: the reference fix fails") for line in problems)
    assert any(line.startswith("no_bug: the buggy original passes every check") for line in problems)


def test_check_weights_round_trip_through_jsonl_and_bad_weights_are_named():
    import json

    from keelrl.envs.tasks import TaskError, task_from_dict

    data = json.loads(TASK.to_json())
    data["hidden_checks"][0]["weight"] = 2.5
    assert task_from_dict(data).hidden_checks[0].weight == 2.5
    data["hidden_checks"][0]["weight"] = 0
    with pytest.raises(TaskError, match=r"hidden_checks\[0\]\.weight"):
        task_from_dict(data)
