"""Lab distill: when the student almost never succeeds, does a teacher give RL a signal?

Three runs from the same student (SmolLM2-135M-Instruct as it comes: 0 of 209 held-out tasks
strictly solved), with the same seed, tasks and number of student rollouts per step:

- grpo: plain GRPO on the strict reward (a group that all fails has no advantage to follow);
- on-policy: GRPO plus on-policy distillation from a stronger checkpoint (`distill.mode=on_policy`,
  `distill.form=loss`: the reverse KL to the teacher's next-token distribution at every token
  the student sampled);
- self (OPSD): the same loss with the student itself as teacher, shown the task's reference fix.

The teacher is `distill.teacher=PATH` when given (e.g. the default run's
`checkpoints/step-N/model`), else the lab makes one first: the student warm-started on the
scripted teacher's fixes. Held-out strict success (one greedy attempt per task, the strong
verifier) is measured on the same tasks before RL and every `train.eval_every` steps. The start
is evaluated once, in the first variant's run: the three start from the same weights and greedy
decoding is deterministic, so the other two reuse that figure (`train.eval_before_rl=false`)
and each variant's change is paired against it. The summary reports each variant's change with
its paired standard error and says plainly when none is distinguishable from GRPO's.

Every variant makes `train.minibatch_size=4`-trajectory updates (4 optimizer steps per RL step)
at `train.lr=5e-5`: with one update per step at the default 2e-5, four steps moved nothing in
the first SmolLM2 run of this lab (all variants 0/40, 100% malformed actions).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import (USER_OVERRIDES, LabResult, config, first, last, markdown_table, mean, plot_variants,
                                series, steps_run)

DISTILL = ["model.path=smollm2", "rollout.engine=sync", "rollout.tasks_per_step=4", "rollout.group_size=4",
           "train.steps=4", "train.eval_every=2", "train.eval_tasks=32", "train.minibatch_size=4", "train.lr=5e-5",
           "train.checkpoint_every=1000", "train.sample_trajectories=2", "train.eval_base=false",
           "warm_start.demos=0", "distill.coef=1.0"]
"""The distill lab's budget on SmolLM2: 4 steps of 4 tasks x 4 attempts per variant, 4 updates a
step, a 32-task held-out evaluation before RL (once) and every 2 steps."""

DISTILL_QUICK = ["model.path=tiny", "env.show_file=false", "env.max_turns=2", "rollout.max_new_tokens=16",
                 "rollout.tasks_per_step=2", "rollout.group_size=2", "train.steps=2", "train.eval_every=1",
                 "train.eval_tasks=4", "train.minibatch_size=4", "rollout.temperature=1.0", "train.eval_dtype=float32"]
"""--quick: the tiny model, for a smoke run of the machinery."""

TEACHER_DEMOS = 64


def make_teacher(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> Path:
    """The student warm-started on the scripted teacher's fixes, saved in out/teacher/model
    (reused when already there)."""
    from keelrl.train.trainer import Trainer

    target = out / "teacher" / "model"
    if (target / "config.json").exists():
        return target
    progress("making the teacher: the student warm-started on the scripted teacher's fixes")
    demos = 8 if quick else TEACHER_DEMOS
    trainer = Trainer(config(out / "teacher", [*overrides, f"warm_start.demos={demos}", "distill.mode=none"]))
    trainer.warm_start()
    trainer.model.save_pretrained(target)
    trainer.tokenizer.save_pretrained(target)
    return target


def lab_distill(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> LabResult:
    from keelrl.monitor import read_metrics
    from keelrl.train.evaluation import finite_or_none, paired_difference
    from keelrl.train.trainer import Trainer

    def without_teacher(settings: Sequence[str]) -> list[str]:  # the teacher is the on-policy variant's alone
        return [setting for setting in settings if not setting.startswith("distill.teacher=")]

    given = [o.split("=", 1)[1] for o in [*overrides, *USER_OVERRIDES.get()] if o.startswith("distill.teacher=")]
    teacher = Path(given[-1]) if given else make_teacher(out, without_teacher(overrides), quick, progress)
    variants = {"grpo": ["distill.mode=none"],
                "on-policy": ["distill.mode=on_policy", "distill.form=loss", "distill.divergence=reverse_kl",
                              f"distill.teacher={teacher}"],
                "self": ["distill.mode=self", "distill.form=loss", "distill.divergence=reverse_kl"]}
    runs: dict[str, list[dict[str, Any]]] = {}
    lifts: dict[str, dict[str, Any]] = {}
    start: tuple[dict[str, Any], dict[str, Any]] | None = None  # the shared start's step-0 row and report
    for label, extra in variants.items():
        progress(f"training variant {label!r}")
        settings = [*without_teacher(overrides), *extra, *without_teacher(USER_OVERRIDES.get()),
                    *([] if start is None else ["train.eval_before_rl=false"])]
        summary = Trainer(config(out / label, settings)).run()
        rows = read_metrics(out / label)
        if start is None:
            if "warm_start" not in summary.get("heldout", {}):
                raise ValueError("the distill lab evaluates the shared start in its first variant's run: "
                                 "leave train.eval_before_rl true")
            start = next(row for row in rows if row["step"] == 0), summary["heldout"]["warm_start"]
        else:
            rows = [start[0], *rows]
        runs[label] = rows
        final = summary.get("heldout", {}).get("final")
        if final:  # final - the shared start, paired over the same tasks
            change, change_se = paired_difference(start[1]["task_success"], final["task_success"])
            lifts[label] = {"success": change, "success_se": finite_or_none(change_se)}
    steps = steps_run(runs)
    chart = plot_variants(out / "distill.png", runs,
                          [("eval/success", "held-out strict success"), ("train/action_error_frac", "malformed actions"),
                           ("distill/kl", "reverse KL to the teacher, per token")],
                          "Learning from a teacher: GRPO vs on-policy distillation vs self-distillation")
    numbers: dict[str, Any] = {"teacher": str(teacher), "steps": steps}
    rows = []
    for label, rows_of in runs.items():
        change = lifts[label].get("success", math.nan)
        se = lifts[label].get("success_se") or 0.0
        curve = series(rows_of, "eval/success")
        numbers[label] = {"eval_curve": curve, "change": change, "change_se": se,
                          "reward_mean": mean([v for _, v in series(rows_of, "train/reward")]),
                          "action_error_frac_last": last(rows_of, "train/action_error_frac"),
                          "kl_first": first(rows_of, "distill/kl"), "kl_last": last(rows_of, "distill/kl")}
        rows.append((label, curve[0][1] if curve else math.nan, curve[-1][1] if curve else math.nan,
                     f"{change:+.3f} +- {se:.3f}", numbers[label]["reward_mean"],
                     numbers[label]["action_error_frac_last"],
                     f"{numbers[label]['kl_first']:.3g} -> {numbers[label]['kl_last']:.3g}"))
    helped = [label for label in ("on-policy", "self")
              if numbers[label]["change"] - numbers["grpo"]["change"] > 2 * max(numbers[label]["change_se"],
                                                                                numbers["grpo"]["change_se"], 1e-9)]
    verdict = (f"Distinguishable from GRPO (more than 2 standard errors): {', '.join(helped)}." if helped else
               "Nothing here is distinguishable from plain GRPO: no variant's held-out change exceeds GRPO's by "
               "more than 2 standard errors at this budget.")
    summary_md = "\n".join([
        "# Lab: learning from a teacher", "",
        f"The same student, seed and tasks; {steps} RL steps of GRPO each, plain, with on-policy distillation "
        f"from `{teacher}`, and with self-distillation (the student shown the reference fix). Held-out strict "
        "success on the same tasks before RL and during it.", "",
        markdown_table(["variant", "held-out before", "held-out after", "change (paired SE)", "training reward (mean)",
                        "malformed actions (last step)", "KL to teacher per token (first -> last step)"], rows), "",
        verdict, "", f"Chart: {chart.name}"])
    return LabResult("distill", numbers, summary_md, [chart])
