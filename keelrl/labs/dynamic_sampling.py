"""Lab dynamic-sampling: DAPO with and without dynamic sampling on the guessing game (where many
groups all fail or all succeed): zero-advantage fraction, extra draws, success."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from keelrl.labs.common import (LabResult, paired_effect, first, last, markdown_table, mean, plot_variants, series,
                                steps_run, train_variants)

def lab_dynamic_sampling(out: Path, overrides: Sequence[str], quick: bool,
                         progress: Callable[[str], None]) -> LabResult:
    """On the guessing game, where a fair share of groups all fail (or all succeed)."""
    steps = 2 if quick else 12
    common = ["algo.preset=dapo", f"train.steps={steps}", f"eval.every={max(1, steps // 3)}",
              "rollout.dynamic_max_extra_groups=16"]
    variants = {"dapo": common, "dapo-no-dynamic": [*common, "algo.dynamic_sampling=false"]}
    runs = train_variants(out, variants, overrides, progress)
    steps = steps_run(runs)
    chart = plot_variants(out / "dynamic_sampling.png", runs,
                          [("train/zero_advantage_frac", "zero-advantage fraction (trained batch)"),
                           ("train/reward", "training reward")], "DAPO dynamic sampling")
    numbers = {label: {"zero_adv_frac_trained_mean": mean([v for _, v in series(rows, "train/zero_advantage_frac")]),
                       "zero_adv_frac_before_filter_mean": mean([v for _, v in series(rows, "dynamic/zero_adv_frac_before")]),
                       "draws_per_kept_group_mean": mean([v for _, v in series(rows, "dynamic/draws_per_kept_group")]),
                       "reward_first": first(rows, "train/reward"), "reward_last": last(rows, "train/reward"),
                       "eval_before": first(rows, "eval/success"), "eval_after": last(rows, "eval/success"),
                       "eval_partial_after": last(rows, "eval/partial"),
                       "step_s_mean": mean([v for _, v in series(rows, "time/step_s")])}
               for label, rows in runs.items()}
    summary = "\n".join(["# Lab: dynamic sampling", "",
                         f"DAPO for {steps} steps on the guessing game (1..16, 5 guesses) from one warm start, "
                         f"with and without dynamic sampling (at most 16 extra groups a step).", "",
                         markdown_table(["variant", "zero-adv frac (trained)", "zero-adv frac (before filter)",
                                         "draws per kept group", "reward first", "reward last", "held-out success after",
                                         "held-out partial after", "s/step"],
                                        [(k, v["zero_adv_frac_trained_mean"], v["zero_adv_frac_before_filter_mean"],
                                          v["draws_per_kept_group_mean"], v["reward_first"], v["reward_last"],
                                          v["eval_after"], v["eval_partial_after"], v["step_s_mean"])
                                         for k, v in numbers.items()]), "",
                         "With dynamic sampling every trained group has mixed rewards (zero-advantage fraction 0); "
                         "the price is the extra groups drawn per kept group.", "", f"Chart: {chart.name}"])
    return LabResult("dynamic-sampling", numbers, summary, [chart],
                     {"dynamic sampling (dapo - dapo-no-dynamic)": paired_effect(out, "dapo-no-dynamic", "dapo")})
