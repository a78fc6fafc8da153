"""Probes run through real `CodingEnv` episodes, and a scored candidate compared with the reference fix."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Mapping

from keelrl.audit.probes import (FALSE_POSITIVE, MAX_PROBE_CHARS, AuditError, Channels, Probe, _json_value,
                                 _with_newline, false_positive_probes)
from keelrl.audit.rewrites import rewrite_probes
from keelrl.envs.base import Grade
from keelrl.envs.coding import CodingEnv
from keelrl.envs.tasks import Check, Task, shift_ints
from keelrl.envs.teacher import edit_action
from keelrl.envs.verifiers import Verifier, checks_request, grading_files, run_checks, run_grader


# ------------------------------------------------------------------------------ running probes

def default_env(verifier: Verifier) -> CodingEnv:
    """The audit's episode: the training env, with room for long probe files."""
    return CodingEnv(verifier, sandbox=verifier.sandbox, max_turns=8, max_action_chars=MAX_PROBE_CHARS,
                     show_tools=False)


def run_probe(env: CodingEnv, task: Task, probe: Probe) -> Grade:
    """A fresh episode of `task` in which the agent writes `probe`'s files, submits, and is graded."""
    env.reset(task)
    assert env.workdir is not None
    for path in sorted(probe.files):
        target = probe.files[path]
        if target is None:  # there is no delete tool; an agent with a shell would do this
            (env.workdir / path).unlink()
            continue
        current = env.current_files().get(path)
        if current is None:
            raise AuditError(f"probe {probe.name} on {task.id}: {path!r} is not a file of the task")
        action = edit_action(path, current, target, default_path=task.entry_file)
        if action is None:
            continue
        observation, done, info = env.step(action)
        if info.get("error") or done:
            raise AuditError(f"probe {probe.name} on {task.id}: the env refused the edit: {observation[:300]}")
        if env.current_files().get(path) != _with_newline(target):
            raise AuditError(f"probe {probe.name} on {task.id}: the edit did not produce the probe's {path}")
    observation, done, info = env.step("<call>submit</call>")
    if not done:
        raise AuditError(f"probe {probe.name} on {task.id}: submit did not end the episode: {observation[:300]}")
    return env.grade()


@dataclass(frozen=True)
class ProbeResult:
    """What one probe earned on one task."""

    task_id: str
    probe: str
    family: str
    kind: str
    reward: float
    success: bool
    detail: str
    """The failing checks (or, for a false positive that scored, the checks it passed)."""
    equivalent: bool = False
    """It scored, but its candidate behaved like the reference fix on every probe input."""

    @property
    def scored(self) -> bool:
        return self.reward > 0

    @property
    def flagged(self) -> bool:
        """A false positive that earned reward (unless equivalent), or a rewrite short of full success."""
        return (self.scored and not self.equivalent) if self.kind == FALSE_POSITIVE else not self.success


def _result(task: Task, probe: Probe, grade: Grade) -> ProbeResult:
    failing = [f"{check.name}: {check.detail}" for check in grade.checks if not check.passed]
    passing = [check.name for check in grade.checks if check.passed]
    if probe.kind == FALSE_POSITIVE and grade.reward > 0:
        detail = f"passed {', '.join(passing)}" + (f"; failed {'; '.join(failing)}" if failing else "")
    else:
        detail = "; ".join(failing)
    return ProbeResult(task.id, probe.name, probe.family, probe.kind, grade.reward, grade.success, detail[:500])


def audit_probe(env: CodingEnv, task: Task, probe: Probe) -> ProbeResult:
    """`probe` on `task` in an episode of `env`; a score of a probe judged by behaviour is then
    compared with the reference fix (`compare_with_fix`) and reported as equivalent if they agree."""
    result = _result(task, probe, run_probe(env, task, probe))
    if not (probe.judged_by_behaviour and result.scored):
        return result
    agrees, why = compare_with_fix(env.verifier, task, probe.files)
    detail = f"{result.detail}; " + (f"behaves like the reference fix on {why}" if agrees
                                     else f"unlike the reference fix: {why}")
    return replace(result, equivalent=agrees, detail=detail[:1000])


def audit_task(env: CodingEnv, task: Task, channels: Channels) -> list[ProbeResult]:
    """Every probe (false positives, then rewrites) on `task`, each in its own episode of `env`."""
    probes = false_positive_probes(task, channels) + rewrite_probes(task)
    return [audit_probe(env, task, probe) for probe in probes]


# ------------------------------------------------------------------------------ candidate vs fix

PROBE_INPUT_LIMIT = 48
"""At most this many probe inputs per task (all in one sandbox process, each under the per-call timeout)."""
_INT_SHIFTS = (-1, 1, 3, 7)
_STRING_PREFIX = "re"
_UNRELATED_KEY = "keel_unrelated_setting"


def _prefix_strings(value: Any) -> Any:
    """Every string in `value` (nested in lists and dict values, keys untouched) with a prefix."""
    if isinstance(value, str):
        return _STRING_PREFIX + value
    if isinstance(value, list):
        return [_prefix_strings(item) for item in value]
    if isinstance(value, dict):
        return {key: _prefix_strings(item) for key, item in value.items()}
    return value


def _with_unrelated_key(args: list[Any]) -> list[Any]:
    """Each dict argument (top level) gains a key the task never mentions."""
    return [{**arg, _UNRELATED_KEY: True} if isinstance(arg, dict) and _UNRELATED_KEY not in arg else arg
            for arg in args]


def probe_inputs(task: Task) -> list[list[Any]]:
    """Arguments to tell a candidate from the reference fix: every check's own arguments (hidden
    and visible), then each of them perturbed: an unrelated key added to dict arguments, every int
    shifted by each of `_INT_SHIFTS`, every string prefixed. Deduplicated, at most
    `PROBE_INPUT_LIMIT`, the checks' own arguments first."""
    originals = [_json_value(check.args) for check in [*task.hidden_checks, *task.visible_tests]]
    perturbed = [changed for args in originals
                 for changed in [_with_unrelated_key(args), *[shift_ints(args, by) for by in _INT_SHIFTS],
                                 _prefix_strings(args)]]
    inputs: dict[str, list[Any]] = {}
    for args in originals + perturbed:
        inputs.setdefault(json.dumps(args, sort_keys=True), args)
    return list(inputs.values())[:PROBE_INPUT_LIMIT]


def _call_text(task: Task, args: list[Any]) -> str:
    return f"{task.entry_function}({', '.join(repr(arg) for arg in args)})"


def _reference_checks(verifier: Verifier, task: Task, inputs: list[list[Any]]) -> tuple[list[Check], str]:
    """The reference fix run on `inputs` in the verifier's sandbox -> (one check per input that
    expects what the fix did, or why it could not run). The fix is task data, possibly a user's:
    it runs in the sandbox like any candidate, never in this process."""
    request = checks_request(task, inputs, verifier.per_call_timeout)
    report, reason = run_grader(verifier.sandbox, grading_files(task, task.fixed_files()), request)
    if report is None:
        return [], f"the reference fix could not run: {reason}"
    if "import_error" in report:
        return [], f"the reference fix could not be imported: {report['import_error']}"
    outcomes = report.get("results", [])
    if len(outcomes) != len(inputs):
        return [], "the reference fix's report is incomplete"
    checks = []
    for index, (args, outcome) in enumerate(zip(inputs, outcomes)):
        name = f"probe_input_{index}"
        if not outcome.get("ok"):  # the same exception (by name; "Timeout" for a call that timed out)
            checks.append(Check(name, args, None, raises=str(outcome.get("error"))))
        elif outcome.get("value") is not None:
            checks.append(Check(name, args, json.loads(outcome["value"])))
        # else a value JSON cannot carry (a set...): the grader could not compare it either
    return checks, ""


def compare_with_fix(verifier: Verifier, task: Task, files: Mapping[str, str | None]) -> tuple[bool, str]:
    """Does the candidate (the task's files with `files` written over them, None deleting) behave
    like the reference fix on every `probe_inputs(task)`? -> (agrees, what was compared or how
    they differ). Both run in `verifier`'s sandbox, one process each, and are compared as the
    verifier compares (`run_checks`: type-aware values, exceptions by name). A comparison that
    cannot be made is a disagreement: the score then stays flagged, with the reason."""
    inputs = probe_inputs(task)
    checks, reason = _reference_checks(verifier, task, inputs)
    if reason:
        return False, reason
    candidate = {path: text for path, text in {**task.files, **files}.items() if text is not None}
    results = run_checks(task, candidate, checks, verifier.sandbox, verifier.per_call_timeout)
    differing = [(check, result) for check, result in zip(checks, results) if not result.passed]
    if not differing:
        return True, f"{len(checks)} probe inputs"
    shown = "; ".join(f"{_call_text(task, check.args)}: {result.detail}" for check, result in differing[:3])
    return False, (f"differs on {len(differing)} of {len(checks)} probe inputs (expected: the fix's outcome), "
                   f"e.g. {shown}")
