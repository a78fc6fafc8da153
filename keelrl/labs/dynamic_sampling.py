"""Lab dynamic-sampling: GRPO with and without DAPO's dynamic sampling on the same number of sampled
rollouts, on SmolLM2 as the default five-turn coding agent (the default run's cached warm start;
`--quick`: the tiny model); `dynamic-sampling-guess` runs DAPO on the guessing game.

A group whose attempts all earn the same outcome has zero group-relative advantage: the learner
pays its forward and backward passes and learns nothing from it. With dynamic sampling the
rollouts go on until the batch holds enough groups with mixed outcomes, so each step costs more
rollouts but trains on none that teach nothing. The `dynamic` arm runs first for its steps; the
`no-dynamic` arm then runs as many steps as make the same number of sampled rollouts (the dynamic
arm's count over its batch size, rounded to the nearest step). Both start from one held-out
evaluation and end with one on the same tasks: the summary gives each arm's zero-advantage share,
its rollouts, its held-out lift per thousand rollouts and its wall clock.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import (CODING_QUICK, LabResult, config, effect_sentence, first, kl_anchor, last, markdown_table,
                                mean, paired_effect, plot_variants, pooled_share, series, share_start, steps_run,
                                train_variants, variant_record)

DYNAMIC = ["model.path=smollm2", "algo.preset=grpo", "algo.kl_coef=0", "rollout.tasks_per_step=2",
           "rollout.group_size=4", "train.minibatch_size=8", "rollout.dynamic_max_extra_groups=6", "train.steps=3",
           "eval.tasks=32", "eval.every=1000", "eval.probe_tasks=0", "output.checkpoint_every=1000",
           "output.sample_trajectories=2", "rollout.lockstep=true"]
"""The lab's budget over the default run (SmolLM2, five turns, its warm start, which every arm
shares with the default run's): GRPO without a reference KL, batches of 2 tasks x 4 attempts
(one update a step); the dynamic arm 3 steps, drawing at most 6 extra groups a step; a 32-task
held-out evaluation at the start and the end of each arm (no probe between); rollouts in
lockstep, as the other coding labs' (`CODING_LAB`)."""

DYNAMIC_QUICK = [*CODING_QUICK, "train.minibatch_size=4", "rollout.dynamic_max_extra_groups=2"]
"""--quick: the tiny model, for a smoke run of the machinery."""


def rl_steps(rows: list[dict[str, Any]]) -> list[int]:
    """The RL steps an arm ran: those that trained (`train/reward`) and, with dynamic sampling,
    those whose draws kept no group to train on (`dynamic/groups_drawn` alone)."""
    return sorted({step for key in ("train/reward", "dynamic/groups_drawn") for step, _ in series(rows, key)} - {0})


def rollouts_sampled(rows: list[dict[str, Any]], cfg: Any) -> int:
    """Episodes an arm sampled for training over its steps: with dynamic sampling, every group it
    drew (`dynamic/groups_drawn`) times the group size; without, its batch each step."""
    drawn = series(rows, "dynamic/groups_drawn")
    if drawn:
        return int(round(sum(value for _, value in drawn))) * cfg.rollout.group_size
    return len(rl_steps(rows)) * cfg.rollout.tasks_per_step * cfg.rollout.group_size


def groups_with_signal(rows: list[dict[str, Any]], cfg: Any) -> float:
    """Groups an arm's updates learned from, over its steps: each trained step's groups (with
    dynamic sampling those it kept, `dynamic/kept_groups`; without, its batch's tasks) times the
    share of them whose advantage was not zero."""
    total = 0.0
    for row in rows:
        if "train/zero_advantage_frac" in row:
            groups = row.get("dynamic/kept_groups", cfg.rollout.tasks_per_step)
            total += groups * (1 - row["train/zero_advantage_frac"])
    return total


BROKEN_FORMAT = 0.3
"""An arm whose held-out actions are malformed this often after training (eval/action_error_frac),
from a start below it, has broken the tool-call format; the summary says so (and, of a start at
or above it, that the start does not write the format)."""


def format_sentences(numbers: dict[str, dict[str, Any]]) -> list[str]:
    """What the summary says of the tool-call format, from each arm's `malformed_before` (the shared
    start's) and `malformed_after`: that the start does not write it, or which arms broke it."""
    start = next(iter(numbers.values()))["malformed_before"]
    if start >= BROKEN_FORMAT:
        return [f"The start itself does not write the tool-call format ({start:.0%} of its held-out actions malformed)."]
    return [f"`{label}`'s tool-call format broke: {v['malformed_after']:.0%} of its held-out actions were "
            f"malformed after training ({start:.0%} at the start)."
            for label, v in numbers.items() if v["malformed_after"] >= BROKEN_FORMAT]


def matching_steps(rollouts: int, per_step: int) -> int:
    """The steps (at least 1) of `per_step` rollouts that come nearest `rollouts`."""
    return max(1, math.floor(rollouts / per_step + 0.5))


def lab_dynamic_sampling(out: Path, overrides: Sequence[str], quick: bool,
                         progress: Callable[[str], None]) -> LabResult:
    """GRPO with dynamic sampling, then without it on the same number of sampled rollouts, from one student."""
    runs = train_variants(out, {"dynamic": ["algo.dynamic_sampling=true"]}, overrides, progress)
    dynamic_cfg = config(out / "dynamic", overrides)
    budget = rollouts_sampled(runs["dynamic"], dynamic_cfg)
    per_step = dynamic_cfg.rollout.tasks_per_step * dynamic_cfg.rollout.group_size
    steps = matching_steps(budget, per_step)
    progress(f"the dynamic arm sampled {budget} rollouts: the no-dynamic arm runs {steps} steps of {per_step}")
    runs.update(train_variants(out, {"no-dynamic": ["algo.dynamic_sampling=false", f"train.steps={steps}",
                                                    "eval.before_rl=false"]}, overrides, progress))
    runs = share_start(runs, "dynamic")
    chart = plot_variants(out / "dynamic_sampling.png", runs,
                          [("train/zero_advantage_frac", "zero-advantage share of the trained batch"),
                           ("train/reward", "training reward (kept groups)"),
                           ("eval/success", "held-out strict success (greedy)")],
                          "GRPO with and without dynamic sampling, same sampled rollouts")
    numbers: dict[str, Any] = {}
    for label, rows in runs.items():
        cfg = config(out / label, [*overrides, *(["algo.dynamic_sampling=false"] if label == "no-dynamic" else [])])
        sampled = rollouts_sampled(rows, cfg if label == "no-dynamic" else dynamic_cfg)
        before, after = first(rows, "eval/success"), last(rows, "eval/success")
        rejected, rejected_positive = pooled_share(rows, "credit/rejected_turns", "credit/rejected_turn_positive_frac")
        zero_before = [v for _, v in series(rows, "dynamic/zero_adv_frac_before")] or \
            [v for _, v in series(rows, "train/zero_advantage_frac")]
        numbers[label] = {"steps": len(rl_steps(rows)), "trained_steps": len(series(rows, "train/reward")),
                          "rollouts_sampled": sampled,
                          "zero_adv_frac_sampled": mean(zero_before),
                          "zero_adv_frac_trained": mean([v for _, v in series(rows, "train/zero_advantage_frac")]),
                          "eval_before": before, "eval_after": after,
                          "lift_per_1000_rollouts": (after - before) / sampled * 1000 if sampled else math.nan,
                          "reward_mean": mean([v for _, v in series(rows, "train/reward")]),
                          "groups_with_signal": groups_with_signal(rows, cfg),
                          "grad_norm_mean": mean([v for _, v in series(rows, "train/grad_norm")]),
                          "malformed_before": first(rows, "eval/action_error_frac"),
                          "malformed_after": last(rows, "eval/action_error_frac"),
                          "rejected_turns": rejected, "rejected_turns_credited": round(rejected * rejected_positive)
                          if rejected else 0,
                          "seconds": variant_record(out / label).get("seconds", math.nan),
                          "step_s_mean": mean([v for _, v in series(rows, "time/step_s")])}
    dyn, plain = numbers["dynamic"], numbers["no-dynamic"]
    effect = paired_effect(out, "no-dynamic", "dynamic")
    tasks = config(out, overrides).eval.tasks
    broke = format_sentences(numbers)
    summary = "\n".join([
        "# Lab: dynamic sampling", "",
        f"GRPO ({kl_anchor(dynamic_cfg)}) from one warm-started student: `dynamic` for {dyn['steps']} steps with DAPO's "
        f"dynamic sampling, then `no-dynamic` for {plain['steps']} steps without it, the steps that make the same "
        f"number of sampled rollouts ({dyn['rollouts_sampled']} and {plain['rollouts_sampled']}). Held-out: "
        f"{tasks} tasks, greedy, strict success, evaluated once at the start and at each arm's end.", "",
        markdown_table(["arm", "steps", "rollouts sampled", "zero-advantage share, sampled",
                        "zero-advantage share, trained", "held-out before", "held-out after",
                        "held-out lift per 1000 rollouts", "training reward (mean)", "groups trained with signal",
                        "gradient norm (mean)", "malformed turns trained on, credited > 0",
                        "malformed actions, held-out after", "wall clock (s)"],
                       [(k, v["steps"], v["rollouts_sampled"], v["zero_adv_frac_sampled"], v["zero_adv_frac_trained"],
                         v["eval_before"], v["eval_after"], v["lift_per_1000_rollouts"], v["reward_mean"],
                         v["groups_with_signal"], v["grad_norm_mean"],
                         f"{v['rejected_turns_credited']} of {v['rejected_turns']}", v["malformed_after"], v["seconds"])
                        for k, v in numbers.items()]), "",
        f"Without dynamic sampling {plain['zero_adv_frac_trained']:.0%} of the trained groups had zero advantage: "
        f"rollouts and learner passes that teach nothing. With it the trained share is "
        f"{dyn['zero_adv_frac_trained']:.0%}, and {dyn['zero_adv_frac_sampled']:.0%} of what it sampled was dropped: "
        f"its updates learned from {dyn['groups_with_signal']:g} groups with signal against "
        f"{plain['groups_with_signal']:g}. A malformed turn (an action the environment rejected) in a solved "
        f"episode takes the episode's positive advantage under GRPO: the updates credited "
        f"{dyn['rejected_turns_credited']} of the {dyn['rejected_turns']} malformed turns they trained on with "
        f"dynamic sampling, {plain['rejected_turns_credited']} of {plain['rejected_turns']} without. "
        + " ".join(broke) + (" " if broke else "")
        + effect_sentence("Held-out, dynamic minus no-dynamic", effect, tasks, "dynamic sampling"), "",
        f"Chart: {chart.name}"])
    return LabResult("dynamic-sampling", numbers, summary, [chart],
                     {"dynamic sampling (dynamic - no-dynamic)": effect})


def lab_dynamic_sampling_guess(out: Path, overrides: Sequence[str], quick: bool,
                               progress: Callable[[str], None]) -> LabResult:
    """DAPO with and without dynamic sampling on the guessing game, where a fair share of groups all
    fail (or all succeed)."""
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
    summary = "\n".join(["# Lab: dynamic sampling (guessing game)", "",
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
    return LabResult("dynamic-sampling-guess", numbers, summary, [chart],
                     {"dynamic sampling (dapo - dapo-no-dynamic)": paired_effect(out, "dapo-no-dynamic", "dapo")})
