"""Lab entropy: exploration collapse on SmolLM2 as the default five-turn coding agent (the default
run's cached warm start; `--quick`: the tiny model). Three arms of the default run's algorithm
(turn-level RLOO, a group baseline) with no KL anchor from one student: `cold` samples its
rollouts at a temperature low enough that a group's attempts stop differing (entropy under the
collapse alarm's floor, groups writing the same file, most groups all-equal so the group baseline
has nothing to compare), `bonus` adds an entropy bonus at that temperature (the lecture's
remedy), `warm` samples at the labs' own temperature (the default run's). Reported: mean
token entropy per step, distinct patches per group (how many different final files a task's
attempts wrote), the zero-advantage share, the entropy-collapse alarm's steps, held-out success.
`entropy-guess` runs the guessing game's version (three arms)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import (CODING_LAB, CODING_QUICK, LabResult, alarms, config, effect_sentence, first, kl_anchor, last,
                                markdown_table, mean, paired_effect, plot_variants, replayed_alarms, series, share_start, steps_run,
                                train_variants, variant_record, warm_tokenizer)

ENTROPY_CODING = [*CODING_LAB, "train.steps=4", "monitor.window=2"]
"""The SmolLM2 coding labs' budget (`CODING_LAB`: RL steps of 4 tasks x 4 attempts, no reference KL,
32 held-out tasks at the start, shared, and at each arm's end) for 4 steps an arm, at the default
learning rate."""

ENTROPY_QUICK = CODING_QUICK
"""--quick: the tiny model, for a smoke run of the machinery."""

COLD = 0.3
"""The rollout temperature of the `cold` and `bonus` arms: at it the default run's student samples
tokens with a mean entropy under the collapse alarm's floor (0.05 nats) from the first step."""

BONUS = 0.05
"""The entropy bonus's coefficient in the `bonus` arm."""


def entropy_figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """A run's mean token entropy (`policy/entropy`): at its first and last step, and its lowest."""
    entropy = [v for _, v in series(rows, "policy/entropy")]
    return {"entropy_first": first(rows, "policy/entropy"), "entropy_last": last(rows, "policy/entropy"),
            "entropy_min": min(entropy, default=math.nan)}


def lab_entropy(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> LabResult:
    """The default run's algorithm without a KL anchor from one student: sampling at a collapsing
    temperature, the same with an entropy bonus, and sampling at the labs' own temperature."""
    cold = f"rollout.temperature={COLD:g}"
    variants = {"cold": [cold, "algo.entropy_coef=0"],
                "bonus": [cold, f"algo.entropy_coef={BONUS:g}", "eval.before_rl=false"],
                "warm": ["algo.entropy_coef=0", "eval.before_rl=false"]}
    runs = train_variants(out, variants, overrides, progress)
    runs = share_start(runs, "cold")
    steps = steps_run(runs)
    fired = {label: [(int(event["step"]), event["alarm"]) for event in replayed_alarms(out / label)
                     if event["alarm"] == "entropy_collapse"] for label in runs}
    chart = plot_variants(out / "entropy.png", runs,
                          [("policy/entropy", "mean token entropy (sampled actions)"),
                           ("train/distinct_patches", "distinct final files per group"),
                           ("train/zero_advantage_frac", "zero-advantage share of groups"),
                           ("eval/success", "held-out strict success (greedy)")],
                          "Exploration at a cold sampling temperature, with and without an entropy bonus", marks=fired)
    from keelrl.config import load_config

    numbers: dict[str, dict[str, Any]] = {}
    for label, rows in runs.items():
        cfg = load_config(out / label / "config.yaml")  # what the arm ran, the user's overrides included
        patches = [v for _, v in series(rows, "train/distinct_patches")]
        numbers[label] = {**entropy_figures(rows), "temperature": cfg.rollout.temperature,
                          "entropy_coef": cfg.algo.entropy_coef,
                          "distinct_patches_first": first(rows, "train/distinct_patches"),
                          "distinct_patches_last": last(rows, "train/distinct_patches"),
                          "distinct_patches_mean": mean(patches),
                          "zero_advantage_frac": mean([v for _, v in series(rows, "train/zero_advantage_frac")]),
                          "train_success": mean([v for _, v in series(rows, "train/success")]),
                          "eval_before": first(rows, "eval/success"), "eval_after": last(rows, "eval/success"),
                          "malformed_after": last(rows, "eval/action_error_frac"),
                          "collapse_alarm_steps": [step for step, _ in fired[label]],
                          "seconds": variant_record(out / label).get("seconds")}
    cfg = config(out, overrides)
    floor, group = cfg.monitor.entropy_floor, cfg.rollout.group_size
    effects = {"bonus - cold": paired_effect(out, "cold", "bonus"), "warm - cold": paired_effect(out, "cold", "warm")}

    def exploration(label: str) -> str:
        v = numbers[label]
        steps_fired = v["collapse_alarm_steps"]
        alarm = (f"the collapse alarm fired at step{'s' if len(steps_fired) > 1 else ''} {', '.join(map(str, steps_fired))}"
                 if v["collapse_alarm_steps"] else "the collapse alarm stayed silent")
        return (f"- `{label}` (temperature {v['temperature']:g}, bonus {v['entropy_coef']:g}): entropy "
                f"{v['entropy_first']:.3g} -> {v['entropy_last']:.3g} (floor {floor:g}), {alarm}; "
                f"{v['distinct_patches_mean']:.3g} distinct final files per group of {group} on average; "
                f"{v['zero_advantage_frac']:.0%} of groups all-equal (nothing for the group baseline to compare); held-out "
                f"{v['eval_before']:.3g} -> {v['eval_after']:.3g}, {v['malformed_after']:.0%} of its actions malformed.")

    plain, bonus = numbers["cold"], numbers["bonus"]
    raised = bonus["entropy_last"] > 1.25 * plain["entropy_last"]
    summary = "\n".join([
        "# Lab: entropy", "",
        f"One warm-started student, then {steps} steps of `{cfg.algo.preset}` with {kl_anchor(cfg)} at lr "
        f"{cfg.optim.lr:g}: `cold` samples "
        f"its rollouts at temperature {COLD:g}, `bonus` the same with an entropy bonus (coefficient {BONUS:g}), `warm` at "
        f"the labs' own temperature. Entropy is the sampled actions' mean token entropy at each arm's temperature (the "
        f"learner scores at it); distinct patches: how many different final files the {group} attempts at a task "
        f"wrote ({group}: every attempt differs; 1: the group explores nothing). Held-out: {cfg.eval.tasks} tasks, "
        "greedy, strict success.", "",
        markdown_table(["arm", "temperature", "bonus", "entropy first", "entropy last", "entropy min",
                        "distinct patches first", "distinct patches last", "zero-advantage share",
                        "training success (mean)", "held-out before", "held-out after",
                        "malformed actions, held-out after", "entropy-collapse alarm at steps", "wall clock (s)"],
                       [(k, v["temperature"], v["entropy_coef"], v["entropy_first"], v["entropy_last"], v["entropy_min"],
                         v["distinct_patches_first"], v["distinct_patches_last"], v["zero_advantage_frac"],
                         v["train_success"], v["eval_before"], v["eval_after"], v["malformed_after"],
                         ", ".join(map(str, v["collapse_alarm_steps"])) or "none", v["seconds"])
                        for k, v in numbers.items()]), "",
        *[exploration(label) for label in numbers],
        (f"- The bonus raised the cold arm's entropy (last step {bonus['entropy_last']:.3g} against "
         f"{plain['entropy_last']:.3g} without it)." if raised else
         f"- The bonus did not raise the cold arm's entropy in {steps} steps (last step {bonus['entropy_last']:.3g} "
         f"against {plain['entropy_last']:.3g} without it)."),
        effect_sentence("- Held-out, bonus minus cold", effects["bonus - cold"], cfg.eval.tasks, "the bonus"),
        effect_sentence("- Held-out, warm minus cold", effects["warm - cold"], cfg.eval.tasks, "the warmer temperature"),
        "", f"Chart: {chart.name}"])
    return LabResult("entropy", numbers, summary, [chart], effects)


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
    from keelrl.config import load_config

    guess_cfg = load_config(out / "no-bonus" / "config.yaml")  # what the arms ran: the variants set the KL
    lr = guess_cfg.optim.lr
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
        f"The guessing game (1..16, 5 guesses), GRPO at lr {lr:g} with {kl_anchor(guess_cfg)} for {steps} steps from one "
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
