"""Lab entropy: on the guessing game, GRPO with no KL anchor, without and with an entropy bonus:
entropy over training, distinct guess sequences per group, success."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import (LabResult, paired_effect, alarms, config, first, last, markdown_table, mean, plot_variants,
                                series, steps_run, train_variants, warm_tokenizer)

def lab_entropy(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> LabResult:
    """GRPO without a KL anchor, with and without an entropy bonus, on the guessing game."""
    steps = 2 if quick else 16
    common = ["algo.preset=grpo", f"train.steps={steps}", f"eval.every={max(1, steps // 2)}",
              "algo.kl_coef=0"]
    variants = {"no-bonus": [*common, "algo.entropy_coef=0"], "bonus-0.005": [*common, "algo.entropy_coef=0.005"],
                "bonus-0.05": [*common, "algo.entropy_coef=0.05"]}
    runs = train_variants(out, variants, overrides, progress)
    steps = steps_run(runs)
    chart = plot_variants(out / "entropy.png", runs,
                          [("policy/entropy", "mean token entropy"),
                           ("train/distinct_patches", "distinct guess sequences per group"),
                           ("train/reward", "training success")], "Entropy bonus")
    numbers: dict[str, dict[str, Any]] = {}
    for label, rows in runs.items():
        entropy = [v for _, v in series(rows, "policy/entropy")]
        numbers[label] = {"entropy_first": first(rows, "policy/entropy"), "entropy_last": last(rows, "policy/entropy"),
                          "entropy_min": min(entropy, default=math.nan),
                          "distinct_answers_first": first(rows, "train/distinct_patches"),
                          "distinct_answers_last": last(rows, "train/distinct_patches"),
                          "reward_first3": mean([v for _, v in series(rows, "train/reward")[:3]]),
                          "reward_last3": mean([v for _, v in series(rows, "train/reward")[-3:]]),
                          "eval_before": first(rows, "eval/success"), "eval_after": last(rows, "eval/success"),
                          "alarms": alarms(out / label)}
    lr = config(out, overrides).optim.lr
    plain = numbers["no-bonus"]
    fell = plain["entropy_min"] < 0.5 * plain["entropy_first"]
    uniform = math.log(len(warm_tokenizer(out)))

    def bonus_line(label: str) -> str:
        v = numbers[label]
        state = ("near the uniform distribution's " + f"{uniform:.3g}: the bonus overpowered the reward and the "
                 "policy stopped making valid guesses" if v["entropy_last"] > 0.5 * uniform else
                 "held" if v["entropy_last"] >= 0.9 * v["entropy_first"] else "fell")
        return (f"- `{label}`: entropy {v['entropy_first']:.3g} -> {v['entropy_last']:.3g} ({state}); distinct answers "
                f"{v['distinct_answers_last']:.3g}; success in the last 3 steps {v['reward_last3']:.3g}; held-out "
                f"{v['eval_before']:.3g} -> {v['eval_after']:.3g}.")

    summary = "\n".join([
        "# Lab: entropy", "",
        f"The guessing game (1..16, 5 guesses), GRPO at lr {lr:g} with no KL anchor for {steps} steps from one "
        "warm start, without an entropy bonus and with two coefficients. Distinct answers: distinct guess "
        "sequences among a group's attempts (1 = the group explores nothing).", "",
        markdown_table(["variant", "entropy first", "entropy last", "entropy min", "distinct answers first",
                        "distinct answers last", "success, first 3 steps", "success, last 3 steps", "held-out before",
                        "held-out after", "alarms"],
                       [(k, v["entropy_first"], v["entropy_last"], v["entropy_min"], v["distinct_answers_first"],
                         v["distinct_answers_last"], v["reward_first3"], v["reward_last3"], v["eval_before"],
                         v["eval_after"], ", ".join(v["alarms"]) or "none") for k, v in numbers.items()]), "",
        (f"- `no-bonus`: entropy fell to {plain['entropy_min']:.3g} (from {plain['entropy_first']:.3g}): a collapse."
         if fell else
         f"- `no-bonus`: entropy did not collapse in this budget (lowest {plain['entropy_min']:.3g}, from "
         f"{plain['entropy_first']:.3g}); the collapse the lecture describes needs longer training than this lab's."),
        *[bonus_line(label) for label in numbers if label != "no-bonus"],
        "", f"Chart: {chart.name}"])
    return LabResult("entropy", numbers, summary, [chart],
                     {f"{label} - no-bonus": paired_effect(out, "no-bonus", label) for label in ("bonus-0.005", "bonus-0.05")})
