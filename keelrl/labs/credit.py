"""Lab credit: on SmolLM2 as a multi-turn coding agent, one warm-started student trained three
ways on the same rollout budget: GRPO (one advantage broadcast to every turn), PPO with a value
head and turn-level GAE, and GRPO with the process reward model as a surrogate value. Held-out
curves, and the lecture's trajectory-B measurement: among the turns of failed episodes that
raised the hidden-check pass count, the share each method gave a positive advantage."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import (CODING_LAB, CODING_QUICK, LabResult, config, effect_sentence, first, last, markdown_table, mean,
                                paired_effect, plot_variants, pooled_share, series, share_start, steps_run,
                                train_variants, variant_record)

CREDIT = [*CODING_LAB, "prm.enabled=true"]
"""The SmolLM2 coding labs' budget (`CODING_LAB`: 3 RL steps of 4 tasks x 4 attempts per variant,
the same sampled rollouts' count for every variant, 32 held-out tasks at the start, shared, and at
each variant's end). Every variant labels its turns by hidden-check progress (`prm.enabled`) for
the trajectory-B measurement; only grpo-prm trains the scorer (the others set `prm.scorer=false`,
so a one-update budget drops their separate proximal pass) and adds it to its advantages."""

CREDIT_QUICK = [*CODING_QUICK, "eval.every=1"]
"""--quick: the tiny model, for a smoke run of the machinery."""

VARIANTS = {"grpo": ["algo.preset=grpo", "prm.scorer=false"],
            "ppo-turn-gae": ["algo.preset=ppo", "algo.level=turn", "algo.lam=0.9", "model.critic=head", "prm.scorer=false"],
            "grpo-prm": ["algo.preset=grpo", "prm.weight=1.0"]}
"""The three credit assignments, each on top of the lab's settings."""


def good_turn_share(rows: list[dict[str, Any]]) -> tuple[int, float]:
    """(good turns of failed episodes over the run's steps, the share with a positive advantage),
    pooled over steps by count (`credit/good_turns`, `credit/good_turn_positive_frac`)."""
    return pooled_share(rows, "credit/good_turns", "credit/good_turn_positive_frac")


def lab_credit(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> LabResult:
    """GRPO vs PPO + value head with turn-level GAE vs GRPO + process reward model, from one warm start."""
    first_variant = next(iter(VARIANTS))
    variants = {label: [*extra, *([] if label == first_variant else ["eval.before_rl=false"])]
                for label, extra in VARIANTS.items()}  # one start, evaluated once
    runs = train_variants(out, variants, overrides, progress)
    runs = share_start(runs, first_variant)
    steps = steps_run(runs)
    chart = plot_variants(out / "credit.png", runs, [("eval/success", "held-out strict success (greedy)"),
                                                     ("train/success", "training success (sampled)"),
                                                     ("credit/good_turn_positive_frac",
                                                      "good turns of failed episodes credited > 0")],
                          "Credit assignment on the multi-turn coding agent")
    numbers: dict[str, Any] = {}
    for label, rows in runs.items():
        good, share = good_turn_share(rows)
        numbers[label] = {"eval_before": first(rows, "eval/success"), "eval_after": last(rows, "eval/success"),
                          "train_success": mean([v for _, v in series(rows, "train/success")]),
                          "recovery_after": last(rows, "eval/recovery_rate"),
                          "good_turns": good, "good_turn_positive_share": share,
                          "seconds": variant_record(out / label).get("seconds")}
    table = markdown_table(
        ["variant", "held-out before", "held-out after", "training success (mean)", "recovery after",
         "good turns of failed episodes", "share credited > 0", "wall clock (s)"],
        [(k, v["eval_before"], v["eval_after"], v["train_success"], v["recovery_after"], v["good_turns"],
          v["good_turn_positive_share"], v["seconds"]) for k, v in numbers.items()])
    tasks = config(out, overrides).eval.tasks
    effects = {f"{label} - {first_variant}": paired_effect(out, first_variant, label)
               for label in runs if label != first_variant}
    summary = "\n".join([
        "# Lab: credit assignment", "",
        f"One warm-started student, then {steps} RL steps of each credit assignment on the same rollout "
        "budget: GRPO (every token of an episode shares its outcome's advantage), PPO with a value head "
        "and turn-level GAE (lambda 0.9: a turn is credited by how the critic's estimate moved), and GRPO "
        "with the process reward model as a surrogate value (its score of each code-changing turn, "
        "centred in the group, added to the turn's advantage). Every variant labels each code-changing "
        f"turn by whether it raised the hidden-check pass count. Held-out: {tasks} tasks, greedy, strict "
        "success, the start evaluated once.", "",
        table, "",
        "Good turns: turns of failed training episodes that raised the hidden-check pass count (the "
        "lecture's trajectory B), pooled over the steps; the share is those whose mean advantage over "
        "the turn's tokens was positive. GRPO gives them their episode's sign; per-turn credit can "
        "reward them.", "",
        *[effect_sentence(f"- Held-out, {name}", effect, tasks, name.split(" - ")[0]) for name, effect in effects.items()],
        "", f"Chart: {chart.name}"])
    return LabResult("credit", numbers, summary, [chart], effects)
