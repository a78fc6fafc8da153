"""Lab entropy: GRPO with no KL anchor at a learning rate five times the default's, without and with
an entropy bonus, on SmolLM2 as the default five-turn coding agent (the default run's cached warm
start; `--quick`: the tiny model): mean token entropy per step, distinct patches per group (how
many different final files a task's attempts wrote), the entropy-collapse alarm, held-out success.
`entropy-guess` runs the guessing game's version (three arms)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import (CODING_LAB, CODING_QUICK, LabResult, alarms, config, effect_sentence, first, last, markdown_table,
                                mean, paired_effect, plot_variants, replayed_alarms, series, share_start, steps_run,
                                train_variants, variant_record, warm_tokenizer)

ENTROPY_CODING = [*CODING_LAB, "optim.lr=1e-4", "monitor.window=2"]
"""The SmolLM2 coding labs' budget (`CODING_LAB`: 3 RL steps of 4 tasks x 4 attempts per arm, no
reference KL, 32 held-out tasks at the start, shared, and at each arm's end) at the learning rate
1e-4 (the default's five times)."""

ENTROPY_QUICK = CODING_QUICK
"""--quick: the tiny model, for a smoke run of the machinery."""

BONUS = 0.01
"""The entropy bonus's coefficient in the `bonus` arm."""


def entropy_figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """A run's mean token entropy (`policy/entropy`): at its first and last step, and its lowest."""
    entropy = [v for _, v in series(rows, "policy/entropy")]
    return {"entropy_first": first(rows, "policy/entropy"), "entropy_last": last(rows, "policy/entropy"),
            "entropy_min": min(entropy, default=math.nan)}


def lab_entropy(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> LabResult:
    """GRPO at a high learning rate without a KL anchor, without and with an entropy bonus, from one student."""
    variants = {"no-bonus": ["algo.entropy_coef=0"], "bonus": [f"algo.entropy_coef={BONUS:g}", "eval.before_rl=false"]}
    runs = train_variants(out, variants, overrides, progress)
    runs = share_start(runs, "no-bonus")
    steps = steps_run(runs)
    fired = {label: [(int(event["step"]), event["alarm"]) for event in replayed_alarms(out / label)
                     if event["alarm"] == "entropy_collapse"] for label in runs}
    chart = plot_variants(out / "entropy.png", runs,
                          [("policy/entropy", "mean token entropy (sampled actions)"),
                           ("train/distinct_patches", "distinct final files per group"),
                           ("eval/success", "held-out strict success (greedy)")],
                          "Entropy bonus at a high learning rate, no KL anchor", marks=fired)
    numbers: dict[str, dict[str, Any]] = {}
    for label, rows in runs.items():
        numbers[label] = {**entropy_figures(rows), "distinct_patches_first": first(rows, "train/distinct_patches"),
                          "distinct_patches_last": last(rows, "train/distinct_patches"),
                          "train_success": mean([v for _, v in series(rows, "train/success")]),
                          "eval_before": first(rows, "eval/success"), "eval_after": last(rows, "eval/success"),
                          "collapse_alarm_steps": [step for step, _ in fired[label]],
                          "seconds": variant_record(out / label).get("seconds")}
    cfg = config(out, overrides)
    plain, bonus = numbers["no-bonus"], numbers["bonus"]
    effect = paired_effect(out, "no-bonus", "bonus")
    group = cfg.rollout.group_size
    summary = "\n".join([
        "# Lab: entropy", "",
        f"One warm-started student, then {steps} steps of GRPO with no KL anchor at lr {cfg.optim.lr:g}, without an "
        f"entropy bonus and with one (coefficient {BONUS:g}). Distinct patches: how many different final files "
        f"the {group} attempts at a task wrote ({group}: every attempt differs; 1: the group explores nothing). "
        f"Held-out: {cfg.eval.tasks} tasks, greedy, strict success.", "",
        markdown_table(["arm", "entropy first", "entropy last", "entropy min", "distinct patches first",
                        "distinct patches last", "training success (mean)", "held-out before", "held-out after",
                        "entropy-collapse alarm at steps", "wall clock (s)"],
                       [(k, v["entropy_first"], v["entropy_last"], v["entropy_min"], v["distinct_patches_first"],
                         v["distinct_patches_last"], v["train_success"], v["eval_before"], v["eval_after"],
                         ", ".join(map(str, v["collapse_alarm_steps"])) or "none", v["seconds"])
                        for k, v in numbers.items()]), "",
        (f"- `no-bonus`: entropy fell to {plain['entropy_min']:.3g} (from {plain['entropy_first']:.3g}): a collapse."
         if plain["entropy_min"] < 0.5 * plain["entropy_first"] else
         f"- `no-bonus`: entropy did not halve in this budget (lowest {plain['entropy_min']:.3g}, from "
         f"{plain['entropy_first']:.3g})."),
        f"- `bonus`: entropy {bonus['entropy_first']:.3g} -> {bonus['entropy_last']:.3g}; distinct patches "
        f"{bonus['distinct_patches_first']:.3g} -> {bonus['distinct_patches_last']:.3g}.",
        effect_sentence("- Held-out, bonus minus no-bonus", effect, cfg.eval.tasks, "the bonus"), "",
        f"Chart: {chart.name}"])
    return LabResult("entropy", numbers, summary, [chart], {"bonus - no-bonus": effect})


def lab_entropy_guess(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> LabResult:
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
        numbers[label] = {**entropy_figures(rows), "distinct_answers_first": first(rows, "train/distinct_patches"),
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
        "# Lab: entropy (guessing game)", "",
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
    return LabResult("entropy-guess", numbers, summary, [chart],
                     {f"{label} - no-bonus": paired_effect(out, "no-bonus", label) for label in ("bonus-0.005", "bonus-0.05")})
