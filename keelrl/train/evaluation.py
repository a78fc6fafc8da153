"""Held-out evaluation reports: success and partial credit with standard errors, per bug kind.

An evaluation runs one attempt per held-out task (greedy, or at a fixed seed), so each task
contributes one Bernoulli outcome (strict success) and one number in [0, 1] (partial credit).
The standard error of a mean over n tasks is the sample standard deviation over sqrt(n) (for
success that is sqrt(p (1 - p) / (n - 1)) with the unbiased variance). Comparing two
evaluations on the same tasks, the paired standard error of the difference is smaller than
either alone; `paired_difference` gives it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Sequence

from keelrl.rollout.trajectory import Trajectory


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean); the error is nan for fewer than two values."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN: an undefined error (one task) is written as null."""
    return value if math.isfinite(value) else None


def heldout_report(trajectories: Sequence[Trajectory], kinds: Sequence[str]) -> dict[str, Any]:
    """Success and partial credit (mean, se) overall and per kind; `kinds[i]` is trajectory i's kind."""
    if len(kinds) != len(trajectories):
        raise ValueError(f"{len(kinds)} kinds for {len(trajectories)} trajectories")

    def block(rows: Sequence[Trajectory]) -> dict[str, float | None]:
        # An episode whose environment failed (ungraded, reward NaN) counts as a failed task with
        # no partial credit, and is counted: the figure is never inflated by dropping it.
        success, success_se = mean_and_se([float(t.success) for t in rows])
        partial, partial_se = mean_and_se([0.0 if t.termination == "env_error" else float(t.partial) for t in rows])
        return {"tasks": len(rows), "success": success, "success_se": finite_or_none(success_se),
                "partial": partial, "partial_se": finite_or_none(partial_se),
                "env_errors": sum(t.termination == "env_error" for t in rows)}

    by_kind: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory, kind in zip(trajectories, kinds):
        by_kind[kind].append(trajectory)
    report: dict[str, Any] = block(trajectories)
    report["by_kind"] = {kind: block(rows) for kind, rows in sorted(by_kind.items())}
    report["task_success"] = {t.task_id: bool(t.success) for t in trajectories}
    return report


def paired_difference(before: dict[str, bool], after: dict[str, bool]) -> tuple[float, float]:
    """(after - before success rate, its paired standard error) over the tasks both evaluated."""
    common = sorted(set(before) & set(after))
    return mean_and_se([float(after[task]) - float(before[task]) for task in common])
