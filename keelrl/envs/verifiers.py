"""Verifiers: grade a candidate repository by its behaviour, in the sandbox.

A grading copies the candidate's files (never .git) into a fresh sandbox, restores the task's
test file from the base commit (so editing or deleting tests earns nothing), and runs all of
the task's checks in ONE sandboxed process: the candidate's function is called on each
check's inputs, and the values come back to the host, which compares them with the expected
values. The expected values never enter the sandbox. Equality is type-aware: True is not 1
and 3.0 is not 3 (tuples and lists are the same, since JSON cannot tell them apart).

Named variants, for the lecture's lessons:

- strong:  every hidden check (the default, and the independent eval's verifier).
- weak:    only the task's key check (like testing only retries=0): a constant-returning
           patch can score, a false positive.
- brittle: every hidden check AND an incidental source phrase (like demanding the text
           "is None"): a correct rewrite without it is rejected, a false negative.

Reward is strict (1 when every check passes, else 0) or, with `partial_credit=True`, the
weighted fraction of checks passed (each check's `weight` from the task, the key check's also
multiplied by `key_weight`; all 1 by default, so the plain fraction of checks). A check that cannot run (import error, timeout, crash, killed
sandbox) fails with the reason in its detail. A verifier that cannot work at all (the sandbox
cannot start) raises `VerifierError`: it never returns a default reward.

NOT guaranteed: the candidate runs in the same process as the small grader script, so code
written to inspect the grader's frames could find the per-run nonce and forge a report. The
shortcuts an RL policy is known to find (constant returns, test tampering, git history,
network, secrets) are closed; see `keel audit`.
"""

from __future__ import annotations

import dataclasses

import json
import secrets
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from keelrl.envs.base import CheckResult, Grade, VerifierError
from keelrl.envs.tasks import Check, Task
from keelrl.registry import Registry
from keelrl.sandbox import Sandbox, SandboxLimits

GRADER_SOURCE = (Path(__file__).parent / "_grader.py").read_text()
GRADER_FILE = "_keel_grader.py"
DEFAULT_LIMITS = SandboxLimits(wall_time_s=15.0, cpu_time_s=10, memory_mb=512)


def grading_files(task: Task, files: Mapping[str, str]) -> dict[str, str]:
    """The files a grading run sees: the candidate's without git metadata, the test file restored
    from the task, and the grader. Public so that other code (the audit running a reference fix)
    grades exactly as a verifier does."""
    clean = {path: text for path, text in files.items() if not Path(path).parts[0] == ".git"}
    clean[task.test_file] = task.files[task.test_file]
    clean[GRADER_FILE] = GRADER_SOURCE
    return clean


def run_grader(sandbox: Sandbox, files: dict[str, str], request: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """Run the grader over `files` (see `grading_files`) in the sandbox -> (its report or None,
    why there is none). A report is accepted only with this run's nonce, from the result channel."""
    nonce = secrets.token_hex(16)
    try:
        result = sandbox.run(files, [GRADER_FILE], stdin=json.dumps({**request, "nonce": nonce}).encode())
    except OSError as error:
        raise VerifierError(f"the sandbox could not run the grader: {error}") from error
    if not result.result_data:
        if result.ok:
            return None, "the program exited before the grader could report (os._exit or sys.exit in import?)"
        return None, f"sandbox {result.verdict()}"
    try:
        report = json.loads(result.result_data)
    except json.JSONDecodeError:
        return None, "the grader's report was corrupted (tampered result channel)"
    if not isinstance(report, dict) or report.get("nonce") != nonce:
        return None, "the grader's report was forged (nonce mismatch)"
    if not result.ok and "results" not in report and "tests" not in report:
        return None, f"sandbox {result.verdict()}"
    return report, ""


_FAMILY = {"bool": "bool", "int": "int", "float": "float", "str": "str", "NoneType": "null",
           "list": "list", "tuple": "list", "dict": "dict"}


def _matches(outcome: Mapping[str, Any], check: Check) -> tuple[bool, str]:
    if check.raises:
        if not outcome.get("ok") and outcome.get("error") == check.raises:
            return True, ""
        got = (f"raised {outcome.get('error')}: {outcome.get('message', '')}" if not outcome.get("ok")
               else f"returned {_shown(outcome)}")
        return False, f"expected {check.raises} to be raised, {got}"
    if not outcome.get("ok"):
        return False, f"raised {outcome.get('error')}: {outcome.get('message', '')}"
    if outcome.get("value") is None:
        return False, f"expected {check.expected!r}, got an unserialisable {outcome.get('type')}"
    value = json.loads(outcome["value"])
    expected_family = _FAMILY.get(type(check.expected).__name__)
    if _FAMILY.get(str(outcome.get("type"))) != expected_family or value != check.expected:
        return False, f"expected {check.expected!r}, got {_shown(outcome)}"
    return True, ""


def _shown(outcome: Mapping[str, Any]) -> str:
    if outcome.get("value") is None:
        return str(outcome.get("repr", "?"))
    value = json.loads(outcome["value"])
    return repr(value) if outcome.get("type") != "tuple" else repr(tuple(value))


def checks_request(task: Task, calls: Sequence[list[Any]], per_call_timeout: float) -> dict[str, Any]:
    """The grader's request to call `task`'s entry function on each argument list of `calls`
    (its "checks" mode), with the task's off-limits functions fenced. Public so that other code
    (the audit running a reference fix) asks exactly as a verifier does."""
    return {"mode": "checks", "module": task.module, "function": task.entry_function, "calls": list(calls),
            "per_call_timeout": per_call_timeout, "off_limits": list(task.off_limits)}


def run_checks(task: Task, files: Mapping[str, str], checks: Sequence[Check], sandbox: Sandbox,
               per_call_timeout: float = 2.0) -> list[CheckResult]:
    """Run `checks` against the candidate `files` in one sandboxed process."""
    request = checks_request(task, [check.args for check in checks], per_call_timeout)
    report, reason = run_grader(sandbox, grading_files(task, files), request)
    if report is None:
        return [CheckResult(check.name, False, reason) for check in checks]
    if "import_error" in report:
        return [CheckResult(check.name, False, f"could not import {task.entry_file}: {report['import_error']}")
                for check in checks]
    outcomes = report.get("results", [])
    if len(outcomes) != len(checks):
        return [CheckResult(check.name, False, "the grader's report is incomplete") for check in checks]
    return [CheckResult(check.name, *_matches(outcome, check)) for outcome, check in zip(outcomes, checks)]


def run_visible_tests(task: Task, files: Mapping[str, str], sandbox: Sandbox,
                      per_call_timeout: float = 2.0) -> tuple[list[dict[str, Any]], str]:
    """Run the candidate's own visible test file as it is now -> (per-test results, error).

    This is what the agent's `test` tool shows; unlike grading, it uses the test file in the
    candidate's files, edits included.
    """
    runnable = {path: text for path, text in files.items() if Path(path).parts[0] != ".git"}
    runnable[GRADER_FILE] = GRADER_SOURCE
    if task.test_file not in runnable:
        return [], f"no test file {task.test_file!r} (it was deleted)"
    request = {"mode": "tests", "test_module": task.test_module, "per_call_timeout": per_call_timeout,
               "off_limits": list(task.off_limits)}
    report, reason = run_grader(sandbox, runnable, request)
    if report is None:
        return [], reason
    if "import_error" in report:
        return [], f"the tests could not be imported: {report['import_error']}"
    return list(report.get("tests", [])), ""


class Verifier:
    """Grades a candidate for a task. Subclasses choose the checks and extra conditions."""

    name = "strong"

    def __init__(self, sandbox: Sandbox | None = None, *, partial_credit: bool = False,
                 per_call_timeout: float = 2.0, key_weight: float = 1.0) -> None:
        if not key_weight > 0:
            raise VerifierError(f"key_weight must be > 0, got {key_weight}")
        self.sandbox = sandbox or Sandbox(DEFAULT_LIMITS)
        self.partial_credit = partial_credit
        self.per_call_timeout = per_call_timeout
        self.key_weight = key_weight

    def checks_for(self, task: Task) -> list[Check]:
        return list(task.hidden_checks)

    def extra_results(self, task: Task, files: Mapping[str, str]) -> list[CheckResult]:
        return []

    def grade(self, task: Task, files: Mapping[str, str]) -> Grade:
        checks = self.checks_for(task)
        results = [dataclasses.replace(result, weight=check.weight * (self.key_weight if check.key else 1.0))
                   for result, check in zip(run_checks(task, files, checks, self.sandbox, self.per_call_timeout),
                                            checks)]
        results += self.extra_results(task, files)
        grade = Grade(reward=0.0, checks=tuple(results), verifier=self.name)
        reward = grade.partial if self.partial_credit else float(grade.success)
        return dataclasses.replace(grade, reward=reward)


class WeakVerifier(Verifier):
    """Only the key check: the lecture's false-positive example."""

    name = "weak"

    def checks_for(self, task: Task) -> list[Check]:
        keys = [check for check in task.hidden_checks if check.key]
        if not keys:
            raise VerifierError(f"task {task.id!r} has no key check; the weak verifier needs one")
        return keys


class BrittleVerifier(Verifier):
    """Every check plus an incidental source phrase: the lecture's false-negative example."""

    name = "brittle"

    def extra_results(self, task: Task, files: Mapping[str, str]) -> list[CheckResult]:
        if not task.brittle_phrase:
            raise VerifierError(f"task {task.id!r} has no brittle_phrase; the brittle verifier needs one")
        source = files.get(task.entry_file, "")
        present = task.brittle_phrase in source
        return [CheckResult("source_phrase", present,
                            "" if present else f"{task.entry_file} does not contain {task.brittle_phrase!r}")]


VERIFIERS: Registry[type[Verifier]] = Registry("verifier")
"""Verifier name -> class (`env.verifier` choices of the coding environment), in registration order."""
VERIFIERS.add(Verifier.name, Verifier, summary="every hidden check")
VERIFIERS.add(WeakVerifier.name, WeakVerifier, summary="only the key check (the lecture's false positive)")
VERIFIERS.add(BrittleVerifier.name, BrittleVerifier,
              summary="every check plus an incidental source phrase (the lecture's false negative)")


def make_verifier(name: str, sandbox: Sandbox | None = None, **kwargs: Any) -> Verifier:
    """Build the verifier `name`; an unknown name lists the valid ones."""
    if name not in VERIFIERS:
        raise VerifierError(f"unknown verifier {name!r}; valid names: {', '.join(VERIFIERS)}")
    return VERIFIERS[name](sandbox, **kwargs)


def check_tasks(tasks: Sequence[Task], sandbox: Sandbox | None = None, workers: int = 2,
                progress: Callable[[int], None] | None = None) -> list[str]:
    """Behavioural validation of tasks, each in the sandbox -> one line per problem.

    Every task's reference fix must pass every hidden check and every visible test; its buggy
    original must fail its key check (or, without one, some hidden check) and at least one
    visible test; its wrong_fix, if any, must fail some hidden check.
    """
    from concurrent.futures import ThreadPoolExecutor

    verifier = Verifier(sandbox)

    def problems_of(task: Task) -> list[str]:
        found = []
        fixed = verifier.grade(task, task.fixed_files())
        if not fixed.success:
            found.append(f"{task.id}: the reference fix fails: {fixed.summary()}")
        tests, error = run_visible_tests(task, task.fixed_files(), verifier.sandbox)
        if error or not all(test["passed"] for test in tests):
            found.append(f"{task.id}: the reference fix fails visible tests: {error or tests}")
        buggy = verifier.grade(task, task.files)
        key_names = {check.name for check in task.hidden_checks if check.key}
        failed = {check.name for check in buggy.checks if not check.passed}
        if not failed or (key_names and not key_names <= failed):
            found.append(f"{task.id}: the buggy original passes {'its key check' if failed else 'every check'}")
        tests, error = run_visible_tests(task, task.files, verifier.sandbox)
        if not error and all(test["passed"] for test in tests):
            found.append(f"{task.id}: the buggy original passes every visible test")
        if task.wrong_fix and verifier.grade(task, {**task.files, **task.wrong_fix}).success:
            found.append(f"{task.id}: the wrong_fix passes every hidden check")
        return found

    problems: list[str] = []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for done, found in enumerate(pool.map(problems_of, tasks), start=1):
            problems.extend(found)
            if progress is not None:
                progress(done)
    return problems
