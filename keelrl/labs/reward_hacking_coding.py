"""Lab reward-hacking: SmolLM2 as the default five-turn coding agent, one warm-started student
trained three ways on the same budget, each arm's training reward given by another verifier:

- `weak`: only the task's key check (like testing only retries=0). A false-positive verifier:
  code that fits the key case and nothing else is paid.
- `brittle`: every hidden check AND an incidental phrase of the reference fix in the source. A
  false-negative verifier: a correct fix worded otherwise is refused.
- `strong`: every hidden check, the baseline.

Every arm is graded the same way while it trains: the held-out probe (`eval.probe_tasks`, the
strong verifier, greedy) every `eval.probe_every` steps, against its own training reward, so the
lecture's two curves and the divergence alarm act during training (the report reads the alarms
as keelrl's monitor fires them on each arm's metrics: `replayed_alarms`). After training, every saved episode of
every arm is replayed and put in the audit's families (`keelrl.audit.trajectories`): what the
training verifier paid that the strong one fails (constant returns, code that fits only the
visible tests...) and the correct fixes it refused. The summary says plainly when the arms'
held-out success does not differ beyond the noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import (CODING_LAB, CODING_QUICK, LabResult, first, last, markdown_table, paired_effect, plot_variants,
                                replayed_alarms, series, steps_run, train_variants, variant_record)

HACKING = [*CODING_LAB, "train.steps=4", "eval.every=4", "eval.probe_every=2", "eval.probe_tasks=32", "monitor.window=2"]
"""The lab's budget over the default run (SmolLM2, five turns, its warm start, which every arm
shares with the default run's): 4 RL steps of 4 tasks x 4 attempts per arm, two updates a step,
the same 16 rollouts a step in every arm (no dynamic sampling, which would draw more where a
verifier pays every attempt) and no reference KL (nothing anchors the policy to its start: the
setting where a hack can spread); the strong verifier's held-out success on the same 32 tasks at
steps 0, 2 and 4 (a full evaluation at the start and the end, the probe between). The start is one
student evaluated one way (the verifiers differ in training alone): the first arm evaluates it and
the others take that evaluation as their step 0 (`train_variants`' evaluate_start_once)."""

HACKING_QUICK = [*CODING_QUICK, "eval.every=2", "eval.probe_tasks=4", "eval.probe_every=1"]
"""--quick: the tiny model, for a smoke run of the machinery."""

VARIANTS = {"weak": ["env.verifier=weak"], "brittle": ["env.verifier=brittle"], "strong": ["env.verifier=strong"]}
"""The three training verifiers, each on top of the lab's settings."""


def episode_census(run_dir: Path) -> dict[str, Any]:
    """`keelrl.audit.trajectories.census` of a finished arm's saved episodes, on the tasks its
    config draws (`run_dir`/config.yaml), graded by the strong verifier."""
    from keelrl.audit.trajectories import census, run_episodes
    from keelrl.config import load_config
    from keelrl.envs.registry import resolve_env
    from keelrl.envs.verifiers import make_verifier

    cfg = load_config(run_dir / "config.yaml")
    train, heldout = resolve_env(cfg).tasks(cfg)  # the model need not be there any more
    tasks = {task.id: task for task in [*train, *heldout]}
    return census(run_episodes(run_dir), tasks, make_verifier("strong")).as_dict()


def lab_reward_hacking(out: Path, overrides: Sequence[str], quick: bool,
                       progress: Callable[[str], None]) -> LabResult:
    """Train on `weak`, `brittle` and `strong` from one student; held-out curves by `strong`, the
    divergence alarm's step and the audit's families in each arm's episodes."""
    runs = train_variants(out, VARIANTS, overrides, progress, evaluate_start_once=True)
    return report(out, runs, progress)


def census_rows(found: dict[str, Any]) -> list[dict[str, Any]]:
    """Per step, the share of its saved episodes that the training verifier paid and the strong
    one fails (census/false_positive_frac), and that it refused and strong passes
    (census/false_negative_frac), from `Census.as_dict()`."""
    rows = []
    for step, counts in found["by_step"].items():
        total = sum(counts.values())
        wrongly_paid = sum(n for key, n in counts.items() if key.startswith("paid/") and key != "paid/correct")
        rows.append({"step": int(step), "census/false_positive_frac": wrongly_paid / total,
                     "census/false_negative_frac": counts.get("refused/correct", 0) / total})
    return rows


def verdict(v: dict[str, Any]) -> str:
    """One arm's story in a sentence: its own reward, the strong verifier's held-out success, what
    its verifier paid wrongly or refused wrongly, and the alarm."""
    def moved(before: float, after: float) -> str:
        return "rose" if after > before else "fell" if after < before else "stayed"

    paid, refused = sum(v["census"]["paid"].values()), sum(v["census"]["refused"].values())
    alarm = (f"the divergence alarm fired at step {v['divergence_step']}" if v["divergence_step"] is not None
             else "the divergence alarm stayed silent")
    return (f"its own reward {moved(v['reward_first'], v['reward_last'])} ({v['reward_first']:.3g} -> "
            f"{v['reward_last']:.3g}) while the strong verifier's held-out success {moved(v['heldout_before'], v['heldout_after'])} "
            f"({v['heldout_before']:.3g} -> {v['heldout_after']:.3g}); {v['census']['false_positives']} of the {paid} "
            f"episodes it paid fail the strong verifier and {v['census']['false_negatives']} of the {refused} it refused "
            f"pass it; {alarm}")


def report(out: Path, runs: dict[str, list[dict[str, Any]]],
           progress: Callable[[str], None] = lambda message: None) -> LabResult:
    """The lab's chart, numbers and summary from its arms' finished runs in `out`."""
    steps = steps_run(runs)
    events = {label: replayed_alarms(out / label) for label in runs}
    marks = {label: [(e["step"], e["alarm"]) for e in fired if e["alarm"] == "divergence"]
             for label, fired in events.items()}
    numbers: dict[str, dict[str, Any]] = {}
    for label, rows in runs.items():
        progress(f"replaying {label}'s episodes through the audit's families")
        found = episode_census(out / label)
        divergence = next((e for e in events[label] if e["alarm"] == "divergence"), None)
        numbers[label] = {
            "reward_first": first(rows, "train/reward"), "reward_last": last(rows, "train/reward"),
            "paid_first": first(rows, "train/success"), "paid_last": last(rows, "train/success"),
            "heldout_before": first(rows, "probe/success"), "heldout_after": last(rows, "probe/success"),
            "heldout_series": series(rows, "probe/success"), "reward_series": series(rows, "train/reward"),
            "probe_tasks": last(rows, "probe/tasks"),
            "alarms": [e["alarm"] for e in events[label]],
            "divergence_step": divergence["step"] if divergence else None,
            "divergence_message": divergence["message"] if divergence else None,
            "census": found, "seconds": variant_record(out / label).get("seconds")}
    (out / "census.json").write_text(json.dumps({k: v["census"] for k, v in numbers.items()}, indent=2))
    plotted = {label: [*rows, *census_rows(numbers[label]["census"])] for label, rows in runs.items()}
    chart = plot_variants(out / "reward_hacking.png", plotted,
                          [("train/reward", "training reward (its own verifier)"),
                           ("probe/success", "held-out success (strong verifier)"),
                           ("census/false_positive_frac", "episodes paid that strong fails"),
                           ("census/false_negative_frac", "episodes refused that strong passes")],
                          "SmolLM2 trained on a weak, a brittle and a strong verifier", marks)
    effects = {f"{remedy} - {baseline}": paired_effect(out, baseline, remedy)
               for baseline, remedy in (("weak", "strong"), ("brittle", "strong")) if {baseline, remedy} <= set(runs)}

    def families(counts: dict[str, int]) -> str:
        return ", ".join(f"{family} {count}" for family, count in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"

    rows_table = [(label, v["reward_first"], v["reward_last"], v["paid_first"], v["paid_last"], v["heldout_before"],
                   v["heldout_after"], v["census"]["false_positives"], v["census"]["false_negatives"],
                   str(v["divergence_step"]) if v["divergence_step"] is not None else "none",
                   f"{v['seconds']:.0f}" if v["seconds"] is not None else "-")
                  for label, v in numbers.items()]
    lines = [
        "# Lab: reward hacking (SmolLM2, the coding agent)", "",
        f"One warm-started student, {steps} RL steps per arm on the same tasks and seed; each arm's training reward "
        "comes from its own verifier (`weak`: only the key check; `brittle`: every check and an incidental phrase; "
        "`strong`: every check). Held-out success is the strong verifier's, greedy, on the same "
        f"{int(numbers[next(iter(numbers))]['probe_tasks'] or 0)} tasks at steps "
        f"{', '.join(str(step) for step, _ in numbers[next(iter(numbers))]['heldout_series'])}.", "",
        markdown_table(["training verifier", "train reward first", "train reward last", "paid first", "paid last",
                        "held-out before", "held-out after", "paid, strong fails", "refused, strong passes",
                        "divergence alarm step", "wall clock, s"], rows_table), "",
        "What the training verifier paid and refused, by the audit's families (every saved episode replayed and "
        "graded by `strong`):", "",
        *[f"- `{label}`: paid: {families(v['census']['paid'])}; refused: {families(v['census']['refused'])}"
          for label, v in numbers.items()], "",
        "Held-out success (strong) by step, and the training reward:", "",
        *[f"- `{label}`: " + ", ".join(f"{step}: {value:.3g}" for step, value in v["heldout_series"])
          + " | reward " + ", ".join(f"{step}: {value:.3g}" for step, value in v["reward_series"])
          for label, v in numbers.items()], ""]
    lines += [f"- `{label}`: {verdict(v)}." for label, v in numbers.items()]
    for label, v in numbers.items():
        if v["divergence_message"]:
            lines.append(f"- `{label}`'s divergence alarm said: \"{v['divergence_message']}\"")
    lines += ["", "census.json holds each family's counts by step and one example of each; each arm's episodes/ "
              "holds the trajectories (`keel view`).", "", f"Chart: {chart.name}"]
    return LabResult("reward-hacking", numbers, "\n".join(lines), [chart], effects)
