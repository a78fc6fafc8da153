"""A lab over seeds: each number's mean and spread, and each effect's verdict against the noise.

`keel lab NAME --seeds K` runs the lab K times (seeds seed, seed+1, ...: `keelrl.labs.run_lab`),
from the same cached student; this module combines the K results.

- Every number a lab reports (`LabResult.numbers`, nested) gets its mean, standard deviation
  over seeds (n - 1), minimum, maximum and the K values (`over_seeds`).
- Every effect a lab names (`LabResult.effects`: a remedy arm's held-out success minus its
  baseline arm's, on the same tasks, with the paired standard error over tasks) gets a verdict.
  Its noise is sqrt(s.d.^2 / K + SE^2): s.d. the spread of the effect over seeds, shrunk by
  averaging K runs; SE the standard error over tasks of each task's difference averaged over the
  K seeds (with one seed, the paired standard error itself). Why both: write a task's difference
  at a seed as d(t, s) = mu + a(t) + b(s) + e(t, s), with a the task's own effect (the tasks are
  a sample), b a seed's shift of every task, e a task's outcome flipping with the seed. The mean
  over T tasks and K seeds has variance var(a) / T + var(b) / K + var(e) / (T K); s.d.^2 / K
  estimates var(b) / K + var(e) / (T K) and SE^2 estimates var(a) / T + var(e) / (T K), so the
  noise counts the flips twice: in expectation its square is the mean's variance plus
  var(e) / (T K), up to twice the variance where flips are all of it (any one estimate can still
  fall below). More seeds shrink it, except for the tasks' own spread, which only more tasks
  shrink. Effects
  from labs that do not keep each task's difference (an `Effect` without `tasks`) fall back to
  the mean paired standard error, which counts the flips at K = 1. An effect whose mean is
  within 2 x noise of zero is called within the noise; with one seed the spread over seeds is
  unknown and the verdict rests on the tasks alone, and says so.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from keelrl.labs.common import LabResult, markdown_table


def spread(values: Sequence[float]) -> dict[str, Any]:
    """mean, sd (sample standard deviation over the values; None for fewer than two), min, max, values."""
    n = len(values)
    centre = sum(values) / n
    sd = math.sqrt(sum((v - centre) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"mean": centre, "sd": sd, "min": min(values), "max": max(values), "values": list(values)}


def numeric_leaves(numbers: Any, prefix: str = "") -> dict[str, float]:
    """Every finite number in a nested dict, by its dotted path (lists and strings left out)."""
    out: dict[str, float] = {}
    if isinstance(numbers, dict):
        for key, value in numbers.items():
            out.update(numeric_leaves(value, f"{prefix}{key}."))
    elif isinstance(numbers, (int, float)) and not isinstance(numbers, bool) and math.isfinite(numbers):
        out[prefix[:-1]] = float(numbers)
    return out


def over_seeds(results: Sequence[LabResult]) -> dict[str, dict[str, Any]]:
    """Each number every seed reported (dotted path) -> its `spread` over the seeds."""
    leaves = [numeric_leaves(result.numbers) for result in results]
    common = [path for path in leaves[0] if all(path in other for other in leaves[1:])]
    return {path: spread([values[path] for values in leaves]) for path in common}


def task_mean_se(per_seed: Sequence[Mapping[str, float]]) -> float | None:
    """The standard error over tasks of each task's difference averaged over the seeds, over the
    tasks every seed has (sample s.d. / sqrt(T)); None when a seed kept no task's difference or
    fewer than two tasks are common."""
    from keelrl.train.evaluation import mean_and_se  # torch: not at import

    if not per_seed or not all(per_seed):
        return None
    tasks = sorted(set.intersection(*(set(differences) for differences in per_seed)))
    if len(tasks) < 2:
        return None
    averaged = [sum(differences[task] for differences in per_seed) / len(per_seed) for task in tasks]
    return mean_and_se(averaged)[1]


def verdicts(results: Sequence[LabResult]) -> dict[str, dict[str, Any]]:
    """Each effect every seed reported -> its mean, spread, SE over tasks (`task_mean_se`, else
    the mean paired SE), noise and verdict."""
    out = {}
    for name in results[0].effects:
        if not all(name in result.effects for result in results):
            continue
        values = [result.effects[name][0] for result in results]
        errors = [result.effects[name][1] for result in results]
        known = [error for error in errors if error is not None and math.isfinite(error)]
        se = task_mean_se([getattr(result.effects[name], "tasks", {}) for result in results])
        if se is None:  # no task's difference kept: each seed's paired SE, averaged
            se = sum(known) / len(known) if known else 0.0
        summary = spread(values)
        k = len(values)
        noise = math.sqrt((summary["sd"] or 0.0) ** 2 / k + se ** 2)
        beyond = abs(summary["mean"]) > 2 * noise and noise > 0
        if beyond:
            verdict = "helped" if summary["mean"] > 0 else "hurt"
        else:
            verdict = "within the noise"
        out[name] = {**summary, "se_over_tasks": se, "noise": noise, "verdict": verdict, "seeds": k}
    return out


def effects_section(results: Sequence[LabResult]) -> str:
    """The summary's section on the lab's effects: one row each, with its verdict in words."""
    found = verdicts(results)
    if not found:
        return ""
    k = len(results)
    rows = []
    for name, v in found.items():
        sd = "-" if v["sd"] is None else f"{v['sd']:.3f}"
        rows.append((name, f"{v['mean']:+.3f}", sd, " ".join(f"{x:+.3f}" for x in v["values"]),
                     f"{v['se_over_tasks']:.3f}", f"{v['noise']:.3f}", v["verdict"]))
    lines = ["## Effects" + (f" over {k} seeds" if k > 1 else ""), "",
             markdown_table(["effect (held-out strict success, same tasks)", "mean", "s.d. over seeds", "each seed",
                             "SE over tasks", "noise", "verdict"], rows), "",
             "Noise is sqrt(s.d.^2 / seeds + SE^2), SE the standard error over tasks of each task's difference "
             "averaged over the seeds; an effect within 2 x noise of zero is within the noise."]
    if k == 1:
        lines.append("One seed: the spread over seeds is unknown, so the noise here is the tasks' alone and "
                     "understates it; run `--seeds 3` or more before believing a small effect.")
    plain = [name for name, v in found.items() if v["verdict"] == "within the noise"]
    if plain:
        lines.append(f"Within the noise, so not shown to help or hurt at this budget: {', '.join(plain)}.")
    return "\n".join(lines)


def combine(name: str, seeds: Sequence[int], results: Sequence[LabResult]) -> LabResult:
    """The lab's result over seeds: numbers per seed and over seeds, effects' verdicts, one summary."""
    table = over_seeds(results)
    shown = [(path, f"{v['mean']:.3g}", "-" if v["sd"] is None else f"{v['sd']:.3g}",
              f"{v['min']:.3g} .. {v['max']:.3g}") for path, v in table.items() if not path.endswith("_seconds")]
    summary = "\n".join([
        f"# Lab {name}: {len(seeds)} seeds", "",
        f"Seeds {', '.join(map(str, seeds))}, each in seed-N/ with its own summary.md and chart; every seed starts "
        "from the same warm-started student, so the seeds differ in RL's sampling alone.", "",
        effects_section(results), "",
        "## Every number over seeds", "",
        markdown_table(["number", "mean", "s.d.", "min .. max"], shown)])
    files = [path for result in results for path in result.files]
    numbers: dict[str, Any] = {"seeds": list(seeds), "per_seed": {str(seed): result.numbers for seed, result in zip(seeds, results)},
               "over_seeds": table, "effects": verdicts(results)}
    effects = {effect: (v["mean"], v["noise"]) for effect, v in numbers["effects"].items()}
    return LabResult(name, numbers, summary, files, effects)
