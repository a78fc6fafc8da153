"""Lab curriculum: SmolLM2 as the default five-turn coding agent, one warm-started student trained
twice on the same budget: drawing each step's tasks uniformly over the training set, and from the
success-rate curriculum (`keelrl.train.curriculum`): the bug kinds the student already sometimes
fixes first (level 0), the rest admitted once level 0's measured success reaches
`curriculum.advance_at`, every admitted task weighted up while its success rate is in the band
and never weighted down. Both are graded on the same fixed held-out tasks, over every kind; the
summary gives the held-out success of each kind level too, the share of training episodes each
arm spent on each level, the curriculum's level over the steps, and says plainly when the arms
do not differ beyond the noise. `--quick` runs the tiny model.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import (CODING_LAB, CODING_QUICK, LabResult, config, effect_sentence, first, last, markdown_table, mean,
                                paired_effect, plot_variants, series, share_start, steps_run, train_variants,
                                variant_record)

EASY_KINDS = ("off_by_one", "flipped_comparison", "falsy_or_default", "missing_none_guard", "swapped_arguments")
"""Level 0: the kinds the cached SmolLM2 student fixed at least half of in its 32-task held-out
evaluation after the warm start (the reward-hacking lab's step 0, docs/measurements.md)."""

HARD_KINDS = ("missing_empty_guard", "wrong_default", "inverted_condition", "missing_validation", "wrong_operator")
"""Level 1: the coding environment's other five kinds."""

CURRICULUM = [*CODING_LAB, "curriculum.levels=" + ",".join([*(f"{kind}:0" for kind in EASY_KINDS),
                                                             *(f"{kind}:1" for kind in HARD_KINDS)])]
"""The SmolLM2 coding labs' budget (`CODING_LAB`: 3 RL steps of 4 tasks x 4 attempts per arm, the
same 16 episodes a step in every arm, 32 held-out tasks at the start, shared, and at each arm's
end) and the kind levels, which apply only where the curriculum is enabled."""

CURRICULUM_QUICK = CODING_QUICK
"""--quick: the tiny model, for a smoke run of the machinery."""

VARIANTS = {"uniform": ["curriculum.enabled=false"], "curriculum": ["curriculum.enabled=true", "eval.before_rl=false"]}
"""Uniform draws (evaluating the shared start), then the curriculum."""


def level_of(kind: str, cfg: Any) -> int:
    """`kind`'s curriculum level under `cfg`, as the trainer reads it (a kind `curriculum.levels`
    does not name is level 0)."""
    return cfg.curriculum.level_of().get(kind, 0)


def level_shares(run_dir: Path, cfg: Any) -> dict[int, float]:
    """The share of a finished arm's training episodes on each kind level."""
    from keelrl.audit.trajectories import run_episodes

    counts = Counter(level_of(str(row.get("kind", "")), cfg) for row in run_episodes(run_dir))
    total = sum(counts.values())
    return {level: count / total for level, count in sorted(counts.items())} if total else {}


def heldout_by_level(run_dir: Path, cfg: Any, which: str) -> dict[int, float]:
    """Held-out strict success per kind level of the run's `which` evaluation ("warm_start" for
    before RL, "final" for the last), pooled over its kinds by task count."""
    import json

    report = json.loads((run_dir / "summary.json").read_text())["heldout"].get(which, {})
    tasks: Counter[int] = Counter()
    solved: Counter[int] = Counter()
    for kind, block in report.get("by_kind", {}).items():
        level = level_of(kind, cfg)
        tasks[level] += block["tasks"]
        solved[level] += block["success"] * block["tasks"]
    return {level: solved[level] / tasks[level] for level in sorted(tasks)}


def lab_curriculum(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> LabResult:
    """Uniform task draws against the success-rate curriculum over the kinds, from one student."""
    runs = train_variants(out, VARIANTS, overrides, progress)
    runs = share_start(runs, "uniform")
    steps = steps_run(runs)
    cfg = config(out, overrides)
    chart = plot_variants(out / "curriculum.png", runs,
                          [("eval/success", "held-out strict success (greedy)"),
                           ("train/success", "training success (sampled)"),
                           ("curriculum/level", "curriculum level")],
                          "Success-rate curriculum vs uniform task draws")
    before = heldout_by_level(out / "uniform", cfg, "warm_start")
    numbers: dict[str, Any] = {}
    for label, rows in runs.items():
        numbers[label] = {"eval_before": first(rows, "eval/success"), "eval_after": last(rows, "eval/success"),
                          "train_success": mean([v for _, v in series(rows, "train/success")]),
                          "level_last": last(rows, "curriculum/level"),
                          "episode_share_by_level": level_shares(out / label, cfg),
                          "heldout_by_level_before": before,
                          "heldout_by_level_after": heldout_by_level(out / label, cfg, "final"),
                          "seconds": variant_record(out / label).get("seconds")}
    levels = sorted({level for v in numbers.values() for level in v["heldout_by_level_after"]})
    effect = paired_effect(out, "uniform", "curriculum")
    table = markdown_table(
        ["arm", "held-out before", "held-out after", *[f"held-out after, level {n}" for n in levels],
         "training success (mean)", *[f"episodes on level {n}" for n in levels], "wall clock (s)"],
        [(k, v["eval_before"], v["eval_after"], *[v["heldout_by_level_after"].get(n, float("nan")) for n in levels],
          v["train_success"], *[v["episode_share_by_level"].get(n, 0.0) for n in levels], v["seconds"])
         for k, v in numbers.items()])
    summary = "\n".join([
        "# Lab: curriculum", "",
        f"One warm-started student, then {steps} RL steps drawing tasks uniformly, and {steps} drawing them "
        f"from the success-rate curriculum (level 0: {', '.join(EASY_KINDS)}; level 1: {', '.join(HARD_KINDS)}, admitted "
        f"when level 0's measured success reaches {cfg.curriculum.advance_at:g}). Held-out: {cfg.eval.tasks} "
        f"fixed tasks over every kind, greedy, strict success; before RL, by level: "
        + ", ".join(f"level {n} {rate:.3g}" for n, rate in before.items()) + ".", "",
        table, "",
        effect_sentence("Held-out, curriculum minus uniform", effect, cfg.eval.tasks, "the curriculum"), "",
        f"Chart: {chart.name}"])
    return LabResult("curriculum", numbers, summary, [chart], {"curriculum - uniform": effect})
