"""Lab distill: when the student almost never succeeds, does a teacher give RL a signal?

Three runs from the same student, with the same seed, tasks and number of student rollouts per
step:

- grpo: plain RL on the strict reward with the default run's algorithm (turn-level RLOO, a group
  baseline: a group that all fails has no advantage to follow; the arm keeps the name `grpo`);
- on-policy: the same plus on-policy distillation from a stronger checkpoint (`distill.mode=on_policy`,
  `distill.form=loss`: the reverse KL to the teacher's next-token distribution at every token
  the student sampled);
- self (OPSD): the same loss with the student itself as teacher, shown the task's reference fix.

The student is SmolLM2-135M-Instruct warm-started on only `STUDENT_DEMOS` of the scripted
teacher's fixes (24 updates): meant to write the tool format yet rarely solve a task. The base
model is no such student: it does not write the format at all, and a reverse KL on tokens of
prose has little to say about the one token where the format begins, so no variant can start
from it (the runs that chose 96 fixes: docs/measurements.md#the-distill-labs-student-and-learning-rate).
A user's `model.path=` is taken as the student as is.

The teacher is `distill.teacher=PATH` when given (e.g. the default run's
`checkpoints/step-N/model`), else the lab makes one first: SmolLM2 warm-started on
`TEACHER_DEMOS` fixes. Student and teacher are cached students (`keelrl.labs.common.cached_student`):
made once per machine and config, reused by every later run of the lab. Held-out strict success (one greedy attempt per task, the strong
verifier) is measured on the same tasks before RL and every `eval.every` steps. The start
is evaluated once, in the first variant's run: the three start from the same weights and greedy
decoding is deterministic, so the other two reuse that figure (`eval.before_rl=false`)
and each variant's change is paired against it. The summary reports each variant's change with
its paired standard error and says plainly when none is distinguishable from the `grpo` arm's.

Every variant makes `train.minibatch_size=4`-trajectory updates (4 optimizer steps per RL step,
one group each) at `optim.lr=5e-5`: four steps of one update each at the default 2e-5 are too
few to move the student (docs/measurements.md#the-distill-labs-student-and-learning-rate).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import (USER_OVERRIDES, LabResult, cached_student, config, first, last, markdown_table, mean,
                                outcome_effect, plot_variants, series, steps_run, train_variant, variant_settings)
from keelrl.runs import SUMMARY

DISTILL = ["model.path=smollm2", "rollout.engine=sync", "rollout.tasks_per_step=4", "rollout.group_size=4",
           "train.steps=4", "eval.every=4", "eval.tasks=32", "train.minibatch_size=4", "optim.lr=5e-5",
           "output.checkpoint_every=1000", "output.sample_trajectories=2", "eval.base=false",
           "warm_start.demos=0", "distill.coef=1.0", "algo.dynamic_sampling=false", "warm_start.own_mistakes=0",
           "rollout.lockstep=true", "eval.probe_tasks=0"]
"""The distill lab's budget on SmolLM2: 4 steps of 4 tasks x 4 attempts per variant, 4 updates a
step, a 32-task held-out evaluation before RL (once) and at each variant's end, with no probe
between (as the other coding labs' `CODING_LAB`; a mid-run evaluation in both arms of a pair
cost about 90 s of a Zen 3's 20-minute budget); the same rollouts for
every variant (no dynamic sampling) and the warm starts' first round only; rollouts in lockstep,
as the other coding labs' (`CODING_LAB`)."""

DISTILL_QUICK = ["model.path=tiny", "env.show_file=false", "env.max_turns=2", "rollout.max_new_tokens=16",
                 "rollout.tasks_per_step=2", "rollout.group_size=2", "train.steps=2", "eval.every=1",
                 "eval.tasks=4", "train.minibatch_size=4", "rollout.temperature=1.0", "eval.dtype=float32"]
"""--quick: the tiny model, for a smoke run of the machinery."""

STUDENT_DEMOS = 96
"""The student's warm start: 24 updates on 96 fixes, the fewest of 48, 64 and 96 after which SmolLM2
wrote the tool format on the lab's held-out tasks
(docs/measurements.md#the-distill-labs-student-and-learning-rate)."""
FORMAT_LIMIT = 0.5
"""A start whose held-out actions are malformed this often (eval/action_error_frac) does not write
the tool format: the summary says its variants' changes cannot be read as distillation's."""
TEACHER_DEMOS = 128
"""The teacher made when none is given: 32 updates on 128 fixes, the default run's warm start."""


def warm_started(name: str, demos: int, overrides: Sequence[str], progress: Callable[[str], None]) -> Path:
    """The lab's model warm-started on `demos` of the scripted teacher's fixes: a cached student
    (`keelrl.labs.common.cached_student`), made once per machine and config."""
    return cached_student([*overrides, f"warm_start.demos={demos}", "distill.mode=none"], progress, name)


def lab_distill(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> LabResult:
    def without_teacher(settings: Sequence[str]) -> list[str]:  # the teacher is the on-policy variant's alone
        return [setting for setting in settings if not setting.startswith("distill.teacher=")]

    def given(key: str) -> str | None:
        values = [o.split("=", 1)[1] for o in [*overrides, *USER_OVERRIDES.get()] if o.startswith(f"{key}=")]
        return values[-1] if values else None

    base = without_teacher(overrides)
    teacher = given("distill.teacher") or warm_started("teacher", 8 if quick else TEACHER_DEMOS, base, progress)
    user_student = any(o.startswith("model.path=") for o in USER_OVERRIDES.get())
    student = given("model.path") if user_student else warm_started("student", 4 if quick else STUDENT_DEMOS, base,
                                                                     progress)
    variants = {"grpo": ["distill.mode=none"],
                "on-policy": ["distill.mode=on_policy", "distill.form=loss", "distill.divergence=reverse_kl",
                              f"distill.teacher={teacher}"],
                "self": ["distill.mode=self", "distill.form=loss", "distill.divergence=reverse_kl"]}
    first_run = True
    for label, extra in variants.items():
        settings = [*base, f"model.path={student}", *extra, *without_teacher(variant_settings()),
                    *([] if first_run else ["eval.before_rl=false"])]
        train_variant(label, config(out / label, settings), progress)  # kept if it finished before
        summary = json.loads((out / label / SUMMARY).read_text())
        if first_run and "warm_start" not in summary.get("heldout", {}):
            raise ValueError("the distill lab evaluates the shared start in its first variant's run: "
                             "leave eval.before_rl true")
        first_run = False
    return distill_summary(out, list(variants), str(teacher), str(student))


def distill_summary(out: Path, labels: Sequence[str], teacher: str, student: str) -> LabResult:
    """The lab's chart, numbers and summary from its run directories out/LABEL (metrics.jsonl and
    summary.json); the first label's run holds the shared start's evaluation."""
    from keelrl.config import load_config
    from keelrl.runs import read_metrics
    from keelrl.train.evaluation import finite_or_none, paired_difference

    summaries = {label: json.loads((out / label / "summary.json").read_text()) for label in labels}
    reference = labels[0]
    preset = load_config(out / reference / "config.yaml").algo.preset  # what the arms ran
    start_report = summaries[reference]["heldout"]["warm_start"]
    start_row = next(row for row in read_metrics(out / reference) if row["step"] == 0)
    runs = {label: read_metrics(out / label) if label == reference else [start_row, *read_metrics(out / label)]
            for label in labels}
    finals = {label: summaries[label]["heldout"]["final"]["task_success"] for label in labels}
    steps = steps_run(runs)
    chart = plot_variants(out / "distill.png", runs,
                          [("eval/success", "held-out strict success"), ("train/action_error_frac", "malformed actions"),
                           ("distill/kl", "reverse KL to the teacher, per token")],
                          "Learning from a teacher: GRPO vs on-policy distillation vs self-distillation")
    start_malformed = start_row.get("eval/action_error_frac")
    numbers: dict[str, Any] = {"teacher": teacher, "student": student, "steps": steps, "start_malformed": start_malformed}
    rows = []
    for label, rows_of in runs.items():
        change, change_se = paired_difference(start_report["task_success"], finals[label])  # final - start
        versus, versus_se = paired_difference(finals[reference], finals[label])  # final - grpo's final
        curve = series(rows_of, "eval/success")
        numbers[label] = {"eval_curve": curve, "change": change, "change_se": finite_or_none(change_se),
                          "versus_grpo": versus, "versus_grpo_se": finite_or_none(versus_se),
                          "reward_mean": mean([v for _, v in series(rows_of, "train/reward")]),
                          "action_error_frac_last": last(rows_of, "train/action_error_frac"),
                          "kl_first": first(rows_of, "distill/kl"), "kl_last": last(rows_of, "distill/kl")}
        rows.append((label, curve[0][1] if curve else math.nan, curve[-1][1] if curve else math.nan,
                     f"{change:+.3f} +- {change_se:.3f}",
                     "-" if label == reference else f"{versus:+.3f} +- {versus_se:.3f}",
                     numbers[label]["reward_mean"], numbers[label]["action_error_frac_last"],
                     f"{numbers[label]['kl_first']:.3g} -> {numbers[label]['kl_last']:.3g}"))

    def beyond(label: str, sign: int) -> bool:  # more than 2 paired standard errors from GRPO's final
        versus, se = numbers[label]["versus_grpo"], numbers[label]["versus_grpo_se"] or 0.0
        return sign * versus > 2 * max(se, 1e-9)

    others = [label for label in labels if label != reference]
    helped, hurt = [lb for lb in others if beyond(lb, 1)], [lb for lb in others if beyond(lb, -1)]
    verdict = [f"Helped, more than 2 paired standard errors above {reference}'s final figure: {', '.join(helped)}."
               if helped else
               f"No variant helped: none ends more than 2 paired standard errors above {reference} at this budget."]
    if hurt:
        verdict.append(f"Hurt, more than 2 paired standard errors below {reference}: {', '.join(hurt)}.")
    if isinstance(start_malformed, (int, float)) and start_malformed >= FORMAT_LIMIT:
        verdict.append(f"The student does not write the tool format: {start_malformed:.0%} of its held-out actions "
                       "before RL were malformed, so no variant's change here says what distillation does; warm-start "
                       "it on more fixes (STUDENT_DEMOS) or give a student that writes the format (model.path=).")
    summary_md = "\n".join([
        "# Lab: learning from a teacher", "",
        f"The same student (`{student}`), seed and tasks; {steps} RL steps of `{preset}` each, plain (`{reference}`), "
        f"with on-policy "
        f"distillation from `{teacher}`, and with self-distillation (the student shown the reference fix). "
        "Held-out strict success on the same tasks before RL (evaluated once) and during it.", "",
        markdown_table(["variant", "held-out before", "held-out after", "change (paired SE)",
                        f"after - {reference}'s after (paired SE)", "training reward (mean)",
                        "malformed actions (last step)", "KL to teacher per token (first -> last step)"], rows), "",
        " ".join(verdict), "", f"Chart: {chart.name}"])
    return LabResult("distill", numbers, summary_md, [chart],
                     {f"{label} - {reference}": outcome_effect(finals[reference], finals[label]) for label in others})
