"""The coding audit end to end (`run_audit`), its report and its table."""

from __future__ import annotations

import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.table import Table

from keelrl.audit.episodes import ProbeResult, audit_task, default_env
from keelrl.audit.exposure import Exposure, check_exposure, _mechanisms
from keelrl.audit.probes import CANARY_VAR, Channels, FALSE_POSITIVE, FALSE_POSITIVE_PROBES, answer_server
from keelrl.audit.rewrites import REWRITES
from keelrl.envs.coding import CodingEnv
from keelrl.envs.tasks import Task
from keelrl.envs.verifiers import Verifier, make_verifier


# ------------------------------------------------------------------------------ the audit

@dataclass(frozen=True)
class FamilySummary:
    """One row of the report: a probe family over every task it applies to."""

    family: str
    kind: str
    tasks: int
    """Tasks the family applies to."""
    probes: int
    """Probe runs (a task has one per distinct constant, else one)."""
    scored_tasks: int
    """Tasks where some probe of the family earned reward > 0."""
    success_tasks: int
    """Tasks where some probe of the family earned full success."""
    mean_reward: float
    """Over the probe runs."""
    flagged_tasks: list[str] = field(default_factory=list)
    equivalent_tasks: list[str] = field(default_factory=list)
    """Tasks where a probe scored but behaved like the reference fix (not flagged)."""

    @property
    def flagged(self) -> bool:
        return bool(self.flagged_tasks)

    @classmethod
    def of(cls, family: str, results: Sequence[Any]) -> "FamilySummary":
        """The row of `family` from its probe results (non-empty; each with task_id, kind, scored,
        success, reward, flagged, equivalent)."""
        return cls(family=family, kind=results[0].kind, tasks=len({r.task_id for r in results}),
                   probes=len(results), scored_tasks=len({r.task_id for r in results if r.scored}),
                   success_tasks=len({r.task_id for r in results if r.success}),
                   mean_reward=sum(r.reward for r in results) / len(results),
                   flagged_tasks=list(dict.fromkeys(r.task_id for r in results if r.flagged)),
                   equivalent_tasks=list(dict.fromkeys(r.task_id for r in results if r.scored and r.equivalent)))


@dataclass
class AuditReport:
    """Everything `run_audit` found; `flagged` decides the exit status of `keel audit`."""

    verifier: str
    task_ids: list[str]
    results: list[ProbeResult]
    exposure: list[Exposure]
    isolation: list[str]
    seconds: float
    workers: int

    def families(self) -> list[FamilySummary]:
        order = list(FALSE_POSITIVE_PROBES) + list(REWRITES)
        rows = []
        for family in order:
            mine = [result for result in self.results if result.family == family]
            if not mine:
                continue
            rows.append(FamilySummary.of(family, mine))
        return rows

    @property
    def flagged(self) -> bool:
        return any(result.flagged for result in self.results)

    def to_dict(self) -> dict[str, Any]:
        families = self.families()
        per_task: dict[str, dict[str, float]] = {task_id: {} for task_id in self.task_ids}
        for result in self.results:
            per_task[result.task_id][result.probe] = result.reward
        return {
            "verifier": self.verifier, "tasks": len(self.task_ids), "flagged": self.flagged,
            "seconds": round(self.seconds, 2), "workers": self.workers, "isolation": self.isolation,
            "probes": {row.family: {"kind": row.kind, "tasks": row.tasks, "probes": row.probes,
                                    "scored_tasks": row.scored_tasks,
                                    "scored_but_equivalent": len(row.equivalent_tasks),
                                    "success_tasks": row.success_tasks,
                                    "mean_reward": round(row.mean_reward, 4), "flagged": row.flagged,
                                    "flagged_tasks": row.flagged_tasks, "equivalent_tasks": row.equivalent_tasks}
                       for row in families},
            "exposure": [asdict(item) for item in self.exposure],
            "findings": [asdict(result) for result in self.results if result.flagged],
            "rewards": per_task,
        }


def default_workers() -> int:
    """Parallel episodes: a grading mostly waits on its sandbox process, so several per core."""
    return min(64, 8 * (os.cpu_count() or 1))


def run_audit(tasks: Sequence[Task], verifier: str | Verifier = "strong", *, workers: int | None = None,
              make_env: Callable[[Verifier], CodingEnv] = default_env,
              progress: Callable[[int], None] | None = None) -> AuditReport:
    """Run every probe on every task through `make_env(verifier)` episodes, then check exposure.

    Each worker thread audits whole tasks with its own env (episodes are not thread-safe; the
    verifier and its sandbox are). The network probe's answer server runs for the audit's
    duration; secret_env is armed only when `CANARY_VAR` is set (see `planted_secret`).
    Errors of the verifier or the sandbox propagate: an audit never reports a default.
    """
    if not tasks:
        raise ValueError("no tasks to audit")
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    started = time.monotonic()
    grader = make_verifier(verifier) if isinstance(verifier, str) else verifier
    canary = os.environ.get(CANARY_VAR)
    network_key, token = secrets.token_hex(16), secrets.token_hex(16)
    with answer_server(network_key, token) as port:
        channels = Channels(network_key=network_key, network_port=port, network_token=token,
                            secret_key=canary or f"not-planted-{secrets.token_hex(16)}")

        def audit_one(task: Task) -> list[ProbeResult]:
            env = make_env(grader)
            try:
                return audit_task(env, task, channels)
            finally:
                env.close()

        results: list[ProbeResult] = []
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for done, found in enumerate(pool.map(audit_one, tasks), start=1):
                results.extend(found)
                if progress is not None:
                    progress(done)
        env = make_env(grader)
        try:
            exposure = check_exposure(env, tasks[0], results, port, canary)
        finally:
            env.close()
    return AuditReport(verifier=grader.name, task_ids=[task.id for task in tasks], results=results,
                       exposure=exposure, isolation=list(_mechanisms(grader)), seconds=time.monotonic() - started,
                       workers=workers)


# ------------------------------------------------------------------------------ the table

def print_report(report: AuditReport, console: Console, examples: int = 3) -> None:
    """The report as rich tables: probes, exposure, then a few findings per flagged family."""
    probes = Table(title=f"keel audit: {len(report.task_ids)} tasks, verifier {report.verifier!r} "
                         f"({report.seconds:.0f} s, {report.workers} workers)")
    for column in ("probe", "must", "tasks", "runs", "scores (reward > 0)", "of which like the fix", "full success",
                   "mean reward", "verdict"):
        probes.add_column(column, overflow="fold")
    for row in report.families():
        must = "earn nothing" if row.kind == FALSE_POSITIVE else "pass in full"
        bad = (f"scores on {len(row.flagged_tasks)}" if row.kind == FALSE_POSITIVE
               else f"rejected on {len(row.flagged_tasks)}")
        verdict = f"[bold red]FLAGGED[/]: {bad}" if row.flagged else "[green]ok[/]"
        if row.equivalent_tasks:
            verdict += f" ({len(row.equivalent_tasks)} indistinguishable from the fix)"
        probes.add_row(row.family, must, str(row.tasks), str(row.probes), str(row.scored_tasks),
                       str(len(row.equivalent_tasks)) if row.kind == FALSE_POSITIVE else "",
                       str(row.success_tasks), f"{row.mean_reward:.3f}", verdict)
    console.print(probes)
    exposure = Table(title=f"sandbox exposure (in force: {', '.join(report.isolation) or 'unknown'})", show_lines=True)
    for column in ("check", "status", "finding", "mitigation"):
        exposure.add_column(column, overflow="fold")
    for item in report.exposure:
        exposure.add_row(item.check, "[bold red]EXPOSED[/]" if item.exposed else "[green]closed[/]",
                         item.finding, item.mitigation)
    console.print(exposure)
    for row in report.families():
        if not row.flagged:
            continue
        console.print(f"[bold]{row.family}[/]: {len(row.flagged_tasks)} tasks, e.g.")
        shown = [r for r in report.results if r.family == row.family and r.flagged][:examples]
        for result in shown:
            console.print(f"  {result.task_id} {result.probe}: reward {result.reward:g}; {result.detail}",
                          highlight=False, markup=False)
    verdict = "FLAGGED: a probe scored or a rewrite was rejected" if report.flagged else "nothing flagged"
    console.print(f"{verdict}", highlight=False)
