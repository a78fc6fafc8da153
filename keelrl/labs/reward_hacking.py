"""Lab reward-hacking-guess: on the guessing game, the same budget trained on the `weak` verifier
(passes unless the last answer said "wrong") and on `strong`, both evaluated by `strong` on held-out
tasks; the divergence alarm's verdict on each. The coding lab on SmolLM2 is
`keelrl.labs.reward_hacking_coding`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import (LabResult, paired_effect, alarm_events, first, last, markdown_table, mean, plot_variants,
                                series, steps_run, train_variants)

def lab_reward_hacking_guess(out: Path, overrides: Sequence[str], quick: bool,
                       progress: Callable[[str], None]) -> LabResult:
    """GRPO on the guessing game's `weak` verifier vs its `strong` one, both evaluated by `strong`."""
    steps = 2 if quick else 20
    every = 1 if quick else 4
    common = ["algo.preset=grpo", f"train.steps={steps}", f"eval.every={every}", "monitor.window=2"]
    variants = {"weak": [*common, "env.verifier=weak"], "strong": [*common, "env.verifier=strong"]}
    runs = train_variants(out, variants, overrides, progress)
    steps = steps_run(runs)
    events = {label: alarm_events(out / label) for label in runs}
    marks = {label: [(e["step"], e["alarm"]) for e in fired if e["alarm"] == "divergence"]
             for label, fired in events.items()}
    chart = plot_variants(out / "reward_hacking.png", runs,
                          [("train/reward", "training reward (its own verifier)"),
                           ("eval/success", "held-out success (strong verifier)"),
                           ("train/action_error_frac", "share of turns with an invalid action")],
                          "Training on a weak verifier vs a strong one", marks)
    numbers: dict[str, dict[str, Any]] = {}
    for label, rows in runs.items():
        divergence = next((e for e in events[label] if e["alarm"] == "divergence"), None)
        numbers[label] = {
            "reward_first": first(rows, "train/reward"), "reward_last": last(rows, "train/reward"),
            "reward_mean_last3": mean([v for _, v in series(rows, "train/reward")[-3:]]),
            "eval_before": first(rows, "eval/success"), "eval_after": last(rows, "eval/success"),
            "eval_best": max((v for _, v in series(rows, "eval/success")), default=math.nan),
            "action_errors_first": first(rows, "train/action_error_frac"),
            "action_errors_last": last(rows, "train/action_error_frac"),
            "eval_action_errors_after": last(rows, "eval/action_error_frac"),
            "alarms": [e["alarm"] for e in events[label]],
            "eval_series": series(rows, "eval/success"),
            "reward_by_eval": [mean([r for s, r in series(rows, "train/reward") if lo < s <= hi])
                               for (lo, _), (hi, _) in zip(series(rows, "eval/success"),
                                                           series(rows, "eval/success")[1:])],
            "divergence_step": divergence["step"] if divergence else None,
            "divergence_message": divergence["message"] if divergence else None}
    weak, strong = numbers["weak"], numbers["strong"]

    def verdict(v: dict[str, Any]) -> str:
        reward = "rose" if v["reward_last"] > v["reward_first"] else "did not rise"
        held = "rose" if v["eval_after"] > v["eval_before"] else "did not rise"
        alarm = (f"the divergence alarm fired at step {v['divergence_step']}" if v["divergence_step"] is not None
                 else "the divergence alarm stayed silent")
        return (f"training reward {reward} ({v['reward_first']:.3g} -> {v['reward_last']:.3g}), held-out success "
                f"{held} ({v['eval_before']:.3g} -> {v['eval_after']:.3g}) and {alarm}")

    summary = "\n".join([
        "# Lab: reward hacking", "",
        "The guessing game (1..16, 5 guesses). Its `weak` verifier scores an episode as solved unless the last "
        "answer was \"higher\" or \"lower\": it checks for the absence of a failure signal, not for success, like "
        "a test run that passes when nothing fails. An episode that ends on an invalid guess (0, 17, a broken "
        "call) is \"solved\" without finding the number. "
        f"GRPO for {steps} steps from one warm start, the training reward given by `weak` or by `strong` (found "
        f"the number); both are evaluated greedily by `strong` on held-out secrets at steps "
        f"{', '.join(str(step) for step, _ in series(runs['weak'], 'eval/success'))}, and the "
        "divergence alarm compares the two.", "",
        markdown_table(["training verifier", "train reward first", "train reward last", "held-out success before",
                        "held-out success after", "invalid turns, first step", "invalid turns, last step",
                        "invalid turns, held-out eval after", "alarms"],
                       [(k, v["reward_first"], v["reward_last"], v["eval_before"], v["eval_after"],
                         v["action_errors_first"], v["action_errors_last"], v["eval_action_errors_after"],
                         ", ".join(v["alarms"]) or "none") for k, v in numbers.items()]), "",
        f"- `weak`: {verdict(weak)}.",
        f"- `strong`: {verdict(strong)}.", "",
        "Held-out success at each eval (step: success) and the mean training reward of the steps before it:", "",
        *[f"- `{k}`: " + ", ".join(f"{step}: {value:.3g}" for step, value in v["eval_series"])
          + " | reward " + ", ".join(f"{value:.3g}" for value in v["reward_by_eval"]) for k, v in numbers.items()],
        "",
        (f"The alarm said: \"{weak['divergence_message']}\"" if weak["divergence_message"] else
         "No divergence alarm on `weak` in this run."),
        "Read weak/samples/ and weak/alarms/ for the trajectories: the invalid-turn share shows the hack "
        "(ending on an invalid action) spreading under `weak`.", "", f"Chart: {chart.name}"])
    return LabResult("reward-hacking-guess", numbers, summary, [chart],
                     {"the strong verifier (strong - weak)": paired_effect(out, "weak", "strong")})
