"""Labs: small, reproducible experiments that show a failure mode and its remedy side by side.

`keel lab NAME [--out DIR] [--quick] [key=value ...]` runs one lab on CPU within a small budget
and writes, into its directory (runs/lab-NAME by default): `summary.md` (what was run and the
headline numbers), `results.json` (every number behind them) and one or more PNG charts.
`--quick` shrinks everything for a smoke run; overrides apply to every training run of the
lab (e.g. `device=cuda`).

Labs that compare training variants share one warm start: it runs once, is saved under
warm/model, and every variant starts RL from it with the same seed, so the variants differ in
the one setting the lab is about.

- stale-ratios: how large importance weights get as the learner moves away from the policy
  that sampled a batch, for each ratio (token, GSPO sequence, cumulative product, CTPO), by
  staleness and by trajectory length, and what share of tokens each clip rule then stops.
- dynamic-sampling: DAPO with and without dynamic sampling on the guessing game (where many
  groups all fail or all succeed): zero-advantage fraction, extra draws, success.
- entropy: on the guessing game, GRPO with no KL anchor, without and with an entropy bonus:
  entropy over training, distinct guess sequences per group, success.
- reward-hacking: on the guessing game, the same budget trained on the `weak` verifier (passes
  unless the last answer said "wrong") and on `strong`, both evaluated by `strong` on held-out
  tasks; the divergence alarm's verdict on each.
- credit: on the guessing game, critic + turn-level GAE vs GRPO group credit: learning speed,
  and the per-turn advantages of a failed episode that had a good turn.
"""

from __future__ import annotations

import json
import math
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

LAB_FAST = ["rollout.tasks_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=64", "env.max_turns=4",
            "train.eval_tasks=40", "train.sample_trajectories=2", "train.checkpoint_every=1000",
            "warm_start.demos=128", "warm_start.epochs=3", "rollout.engine=sync"]
"""Budget shared by the labs' training runs (one warm start, short RL, a 40-task held-out eval)."""

GUESS = ["env.name=guess", "env.max_turns=5", "rollout.max_new_tokens=24", "rollout.tasks_per_step=8",
         "warm_start.demos=256", "warm_start.mistake_rate=0.6", "train.eval_tasks=100"]
"""The guessing-game labs (credit, dynamic-sampling): find 1..16 in 5 guesses, after a warm start
on a teacher that errs."""


HACK = [*GUESS, "warm_start.mistake_rate=0.3", "rollout.tasks_per_step=16", "train.eval_tasks=200"]
"""The reward-hacking lab: a steadier teacher than the other guessing-game labs' (so the policy starts
out mostly well-formed), 64 episodes a step and a 200-task held-out eval."""

ENTROPY = [*GUESS, "warm_start.mistake_rate=0.3", "rollout.tasks_per_step=16", "train.lr=5e-4"]
"""The entropy lab: the reward-hacking lab's warm start and batch, and a faster learning rate."""

QUICK = ["rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "env.max_turns=2",
         "train.eval_tasks=4", "warm_start.demos=8", "warm_start.epochs=1", "train.minibatch_size=4"]

QUICK_GUESS = ["rollout.tasks_per_step=2", "rollout.group_size=2", "train.eval_tasks=4", "warm_start.demos=16",
               "warm_start.epochs=1", "train.minibatch_size=4"]
"""--quick on a guessing-game lab (5 turns kept: the teacher's demonstrations must still succeed)."""


@dataclass
class LabResult:
    """What a lab reports: headline numbers, the markdown summary and the files it wrote."""

    name: str
    numbers: dict[str, Any]
    summary: str
    files: list[Path] = field(default_factory=list)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _config(out: Path, overrides: Sequence[str]) -> Any:
    from keelrl.config import load_config

    return load_config(overrides=[f"run_dir={out}", *overrides])


def _warm_model(out: Path, overrides: Sequence[str]) -> Path:
    """Warm-start once into out/warm/model (reused when already there); returns the model dir."""
    from keelrl.train.trainer import Trainer

    target = out / "warm" / "model"
    if (target / "config.json").exists():
        return target
    trainer = Trainer(_config(out / "warm", overrides))
    trainer.warm_start()
    trainer.model.save_pretrained(target)
    trainer.tokenizer.save_pretrained(target)
    return target


def _warm_tokenizer(out: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out / "warm" / "model")


_USER_OVERRIDES: ContextVar[tuple[str, ...]] = ContextVar("keel_lab_user_overrides", default=())
"""The overrides the user gave `run_lab`: they win over every setting a lab makes, its variants' too."""


def _train_variants(out: Path, variants: dict[str, list[str]], overrides: Sequence[str],
                    progress: Callable[[str], None], trainers: dict[str, Any] | None = None
                    ) -> dict[str, list[dict[str, Any]]]:
    """Run each variant from the shared warm start; returns each variant's metrics rows.

    Pass `trainers` to get each variant's trained `Trainer` back in it. The user's overrides
    (`run_lab`'s) are applied again after each variant's own settings, so they win there too.
    """
    from keelrl.monitor import read_metrics
    from keelrl.train.trainer import Trainer

    model = _warm_model(out, overrides)
    runs = {}
    for label, extra in variants.items():
        progress(f"training variant {label!r}")
        run_dir = out / label
        trainer = Trainer(_config(run_dir, [*overrides, *extra, *_USER_OVERRIDES.get(),
                                            f"model.path={model}", "warm_start.demos=0"]))
        trainer.run()
        runs[label] = read_metrics(run_dir)
        if trainers is not None:
            trainers[label] = trainer
    return runs


def _steps_run(runs: dict[str, list[dict[str, Any]]]) -> int:
    """RL steps the variants ran (what a summary reports, whatever the overrides set)."""
    return max((int(row["step"]) for rows in runs.values() for row in rows), default=0)


def _series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _last(rows: list[dict[str, Any]], key: str) -> float:
    points = _series(rows, key)
    return points[-1][1] if points else math.nan


def _first(rows: list[dict[str, Any]], key: str) -> float:
    points = _series(rows, key)
    return points[0][1] if points else math.nan


def _alarm_events(out: Path) -> list[dict[str, Any]]:
    """The alarms a run fired (alarms.jsonl), in order."""
    path = out / "alarms.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _alarms(out: Path) -> list[str]:
    return [event["alarm"] for event in _alarm_events(out)]


def _plot_variants(path: Path, runs: dict[str, list[dict[str, Any]]], panels: list[tuple[str, str]],
                   title: str, marks: dict[str, list[tuple[int, str]]] | None = None) -> Path:
    """One panel per metric, one line per variant; `marks` draws each variant's (step, label) events
    (alarms) as dashed vertical lines in the variant's colour."""
    plt = _plt()
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    axes = list(axes) if len(panels) > 1 else [axes]
    for ax, (key, label) in zip(axes, panels):
        for variant, rows in runs.items():
            points = _series(rows, key)
            if points:
                steps, values = zip(*points)
                line = ax.plot(steps, values, marker="o", label=variant)[0]
                for step, name in (marks or {}).get(variant, []):
                    ax.axvline(step, color=line.get_color(), linestyle="--", linewidth=1,
                               label=f"{variant}: {name} alarm")
        ax.set_title(label)
        ax.set_xlabel("RL step")
        ax.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- stale-ratios

RATIO_CLIPS = {"token": ("ppo", 0.2, 0.2), "sequence": ("gspo", 3e-4, 4e-4), "cumulative": ("ppo", 0.2, 0.2),
               "ctpo": ("ctpo", 0.2, 0.28)}
"""Each ratio with the preset whose clip widths it is judged with (eps_low, eps_high)."""


def lab_stale_ratios(out: Path, overrides: Sequence[str], quick: bool,
                     progress: Callable[[str], None]) -> LabResult:
    """Weights of a fixed batch under learners 0..K updates ahead, per ratio and trajectory length."""
    import torch

    from keelrl.algos import AlgoConfig
    from keelrl.algos.registries import RATIOS
    from keelrl.policy.model import token_logprobs
    from keelrl.rollout.trajectory import collate
    from keelrl.train.trainer import Trainer

    staleness = 2 if quick else 4
    cfg = _config(out / "run", list(overrides))
    trainer = Trainer(cfg)
    progress("warm start")
    trainer.warm_start()
    engine = trainer.make_engine()
    engine.start(0)
    progress("sampling the behaviour batch (version 0)")
    first = engine.batch(1)
    behaviour = first.trajectories
    batch = collate(behaviour, trainer.pad_id).to(trainer.device)
    learner_logp = []
    for k in range(staleness + 1):
        with torch.no_grad():
            learner_logp.append(token_logprobs(trainer.model, batch.input_ids, batch.attention_mask,
                                               temperature=cfg.rollout.temperature)["logp"])
        if k < staleness:
            progress(f"learner update {k + 1}/{staleness}")
            # Update k+1 trains on step k+1's batch (the behaviour batch first), as synchronous RL would.
            rollouts = first if k == 0 else engine.batch(k + 1)
            trainer.model.train()
            trainer.rl_step(k + 1, rollouts)
            engine.publish({}, k + 1)
    engine.close()
    mask = batch.action_mask
    positions = mask.long().cumsum(dim=1)  # 1-based index among each row's action tokens
    longest = int(positions.max())
    lengths = [n for n in (8, 16, 32, 64, 128, 256, 512) if n <= longest] or [longest]
    results: dict[str, Any] = {"lengths": lengths, "staleness": list(range(staleness + 1)), "ratios": {},
                               "episodes": len(behaviour), "action_tokens_max": longest}
    for name, (preset, eps_low, eps_high) in RATIO_CLIPS.items():
        algo = AlgoConfig(preset=preset, ratio=name, max_log_ratio=80.0)
        by_k, clipped_by_k, by_length, spread_by_k = [], [], [], []
        for k, logp in enumerate(learner_logp):
            ratio = RATIOS.get(name)(logp, batch.behaviour_logprobs, mask, algo).double()
            by_k.append(float(ratio[mask].max()))
            spread_by_k.append(float(torch.maximum(ratio[mask], 1 / ratio[mask]).max()))
            outside = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)) & mask
            clipped_by_k.append(float(outside.sum() / mask.sum()))
        for n in lengths:  # the same ratio on each row's first n action tokens, at max staleness
            prefix = mask & (positions <= n)
            ratio = RATIOS.get(name)(learner_logp[-1], batch.behaviour_logprobs, prefix, algo).double()
            by_length.append(float(ratio[prefix].max()))
        results["ratios"][name] = {"max_weight_by_staleness": by_k, "clipped_frac_by_staleness": clipped_by_k,
                                   "max_deviation_by_staleness": spread_by_k,
                                   "max_weight_by_length": by_length, "clip": [eps_low, eps_high]}
    token_log = (learner_logp[-1] - batch.behaviour_logprobs)[mask].double()
    results["token_log_ratio_abs_mean_at_max_staleness"] = float(token_log.abs().mean())
    results["lecture_1.05^100"] = 1.05 ** 100

    plt = _plt()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, data in results["ratios"].items():
        left.plot(results["staleness"], data["max_weight_by_staleness"], marker="o", label=name)
        right.plot(lengths, data["max_weight_by_length"], marker="o", label=name)
    right.plot(lengths, [1.05 ** n for n in lengths], linestyle="--", color="grey", label="1.05 ** length")
    for ax, xlabel in ((left, "staleness (learner updates since sampling)"), (right, "action tokens per trajectory")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("max importance weight")
        ax.legend(fontsize=8)
    left.set_title("max weight vs staleness (full trajectories)")
    right.set_title(f"max weight vs length (staleness {staleness})")
    if len(lengths) > 1:
        right.set_xscale("log", base=2)
    figure.tight_layout()
    chart = figure_path = out / "stale_ratios.png"
    figure.savefig(figure_path, dpi=100)
    plt.close(figure)

    ratios = results["ratios"]
    rows = [(name, *[d["max_weight_by_staleness"][k] for k in (0, staleness)],
             d["max_deviation_by_staleness"][staleness], d["max_weight_by_length"][-1],
             d["clipped_frac_by_staleness"][staleness]) for name, d in results["ratios"].items()]
    summary = "\n".join([
        "# Lab: stale ratios", "",
        f"One batch of {len(behaviour)} real rollouts (tiny model after a short warm start) is scored by learners "
        f"0..{staleness} updates ahead (each a real GRPO step on that step's batch, lr {cfg.train.lr:g}). Longest trajectory: "
        f"{longest} action tokens; mean |log pi/mu| per token at staleness {staleness}: "
        f"{results['token_log_ratio_abs_mean_at_max_staleness']:.4f}.", "",
        _table(["ratio", "max weight, fresh", f"max weight, staleness {staleness}",
                f"max of w and 1/w, staleness {staleness}", f"max weight, {lengths[-1]} tokens", f"share of tokens outside its clip, staleness {staleness}"],
               rows), "",
        f"At staleness {staleness} the cumulative product strays from 1 by a factor of up to "
        f"{ratios['cumulative']['max_deviation_by_staleness'][-1]:.3g} (max of w and 1/w), the per-token ratio by "
        f"{ratios['token']['max_deviation_by_staleness'][-1]:.3g}: the product multiplies every token's drift, "
        f"as 1.05 ** 100 = 131.5 does (dashed). "
        f"GSPO's length-normalised ratio ({ratios['sequence']['max_weight_by_staleness'][-1]:.3g}) stays nearest 1, "
        f"but with its clip band of 1 +- 3e-4 {ratios['sequence']['clipped_frac_by_staleness'][-1]:.0%} of tokens "
        f"fall outside it. Fresh weights sit slightly below 1 because sampling never draws the pad token, whose "
        f"probability the learner's distribution still holds.",
        "", f"Chart: {chart.name}"])
    return LabResult("stale-ratios", results, summary, [chart])


# ---------------------------------------------------------------------------- training comparisons

def lab_dynamic_sampling(out: Path, overrides: Sequence[str], quick: bool,
                         progress: Callable[[str], None]) -> LabResult:
    """On the guessing game, where a fair share of groups all fail (or all succeed)."""
    steps = 2 if quick else 12
    common = ["algo.preset=dapo", f"train.steps={steps}", f"train.eval_every={max(1, steps // 3)}",
              "rollout.dynamic_max_extra_groups=16"]
    variants = {"dapo": common, "dapo-no-dynamic": [*common, "algo.dynamic_sampling=false"]}
    runs = _train_variants(out, variants, overrides, progress)
    steps = _steps_run(runs)
    chart = _plot_variants(out / "dynamic_sampling.png", runs,
                           [("train/zero_advantage_frac", "zero-advantage fraction (trained batch)"),
                            ("train/reward", "training reward")], "DAPO dynamic sampling")
    numbers = {label: {"zero_adv_frac_trained_mean": _mean([v for _, v in _series(rows, "train/zero_advantage_frac")]),
                       "zero_adv_frac_before_filter_mean": _mean([v for _, v in _series(rows, "dynamic/zero_adv_frac_before")]),
                       "draws_per_kept_group_mean": _mean([v for _, v in _series(rows, "dynamic/draws_per_kept_group")]),
                       "reward_first": _first(rows, "train/reward"), "reward_last": _last(rows, "train/reward"),
                       "eval_before": _first(rows, "eval/success"), "eval_after": _last(rows, "eval/success"),
                       "eval_partial_after": _last(rows, "eval/partial"),
                       "step_s_mean": _mean([v for _, v in _series(rows, "time/step_s")])}
               for label, rows in runs.items()}
    summary = "\n".join(["# Lab: dynamic sampling", "",
                         f"DAPO for {steps} steps on the guessing game (1..16, 5 guesses) from one warm start, "
                         f"with and without dynamic sampling (at most 16 extra groups a step).", "",
                         _table(["variant", "zero-adv frac (trained)", "zero-adv frac (before filter)",
                                 "draws per kept group", "reward first", "reward last", "held-out success after",
                                 "held-out partial after", "s/step"],
                                [(k, v["zero_adv_frac_trained_mean"], v["zero_adv_frac_before_filter_mean"],
                                  v["draws_per_kept_group_mean"], v["reward_first"], v["reward_last"],
                                  v["eval_after"], v["eval_partial_after"], v["step_s_mean"])
                                 for k, v in numbers.items()]), "",
                         "With dynamic sampling every trained group has mixed rewards (zero-advantage fraction 0); "
                         "the price is the extra groups drawn per kept group.", "", f"Chart: {chart.name}"])
    return LabResult("dynamic-sampling", numbers, summary, [chart])


def lab_entropy(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> LabResult:
    """GRPO without a KL anchor, with and without an entropy bonus, on the guessing game."""
    steps = 2 if quick else 16
    common = ["algo.preset=grpo", f"train.steps={steps}", f"train.eval_every={max(1, steps // 2)}",
              "algo.kl_coef=0"]
    variants = {"no-bonus": [*common, "algo.entropy_coef=0"], "bonus-0.005": [*common, "algo.entropy_coef=0.005"],
                "bonus-0.05": [*common, "algo.entropy_coef=0.05"]}
    runs = _train_variants(out, variants, overrides, progress)
    steps = _steps_run(runs)
    chart = _plot_variants(out / "entropy.png", runs,
                           [("policy/entropy", "mean token entropy"),
                            ("train/distinct_patches", "distinct guess sequences per group"),
                            ("train/reward", "training success")], "Entropy bonus")
    numbers: dict[str, dict[str, Any]] = {}
    for label, rows in runs.items():
        entropy = [v for _, v in _series(rows, "policy/entropy")]
        numbers[label] = {"entropy_first": _first(rows, "policy/entropy"), "entropy_last": _last(rows, "policy/entropy"),
                          "entropy_min": min(entropy, default=math.nan),
                          "distinct_answers_first": _first(rows, "train/distinct_patches"),
                          "distinct_answers_last": _last(rows, "train/distinct_patches"),
                          "reward_first3": _mean([v for _, v in _series(rows, "train/reward")[:3]]),
                          "reward_last3": _mean([v for _, v in _series(rows, "train/reward")[-3:]]),
                          "eval_before": _first(rows, "eval/success"), "eval_after": _last(rows, "eval/success"),
                          "alarms": _alarms(out / label)}
    lr = _config(out, overrides).train.lr
    plain = numbers["no-bonus"]
    fell = plain["entropy_min"] < 0.5 * plain["entropy_first"]
    uniform = math.log(len(_warm_tokenizer(out)))

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
        _table(["variant", "entropy first", "entropy last", "entropy min", "distinct answers first",
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
    return LabResult("entropy", numbers, summary, [chart])


def lab_reward_hacking(out: Path, overrides: Sequence[str], quick: bool,
                       progress: Callable[[str], None]) -> LabResult:
    """GRPO on the guessing game's `weak` verifier vs its `strong` one, both evaluated by `strong`."""
    steps = 2 if quick else 20
    every = 1 if quick else 4
    common = ["algo.preset=grpo", f"train.steps={steps}", f"train.eval_every={every}", "monitor.window=2"]
    variants = {"weak": [*common, "env.verifier=weak"], "strong": [*common, "env.verifier=strong"]}
    runs = _train_variants(out, variants, overrides, progress)
    steps = _steps_run(runs)
    events = {label: _alarm_events(out / label) for label in runs}
    marks = {label: [(e["step"], e["alarm"]) for e in fired if e["alarm"] == "divergence"]
             for label, fired in events.items()}
    chart = _plot_variants(out / "reward_hacking.png", runs,
                           [("train/reward", "training reward (its own verifier)"),
                            ("eval/success", "held-out success (strong verifier)"),
                            ("train/action_error_frac", "share of turns with an invalid action")],
                           "Training on a weak verifier vs a strong one", marks)
    numbers: dict[str, dict[str, Any]] = {}
    for label, rows in runs.items():
        divergence = next((e for e in events[label] if e["alarm"] == "divergence"), None)
        numbers[label] = {
            "reward_first": _first(rows, "train/reward"), "reward_last": _last(rows, "train/reward"),
            "reward_mean_last3": _mean([v for _, v in _series(rows, "train/reward")[-3:]]),
            "eval_before": _first(rows, "eval/success"), "eval_after": _last(rows, "eval/success"),
            "eval_best": max((v for _, v in _series(rows, "eval/success")), default=math.nan),
            "action_errors_first": _first(rows, "train/action_error_frac"),
            "action_errors_last": _last(rows, "train/action_error_frac"),
            "eval_action_errors_after": _last(rows, "eval/action_error_frac"),
            "alarms": [e["alarm"] for e in events[label]],
            "eval_series": _series(rows, "eval/success"),
            "reward_by_eval": [_mean([r for s, r in _series(rows, "train/reward") if lo < s <= hi])
                               for (lo, _), (hi, _) in zip(_series(rows, "eval/success"),
                                                           _series(rows, "eval/success")[1:])],
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
        f"{', '.join(str(step) for step, _ in _series(runs['weak'], 'eval/success'))}, and the "
        "divergence alarm compares the two.", "",
        _table(["training verifier", "train reward first", "train reward last", "held-out success before",
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
    return LabResult("reward-hacking", numbers, summary, [chart])


def _turn_table(trajectory: Any, advantages: dict[str, Any]) -> list[dict[str, Any]]:
    """Per turn of one trajectory: its guess, whether it was the midpoint, each method's mean advantage."""
    import torch

    from keelrl.envs.guess import interval_after

    turn_ids = torch.tensor(trajectory.turn_ids)
    action = torch.tensor(trajectory.action_mask)
    rows: list[dict[str, Any]] = []
    history: list[tuple[int, str]] = []
    for turn, (text, observation) in enumerate(zip(trajectory.actions, trajectory.observations)):
        low, high = interval_after(16, history)
        try:
            guess = int(text.strip().removeprefix("<call>guess ").removesuffix("</call>"))
        except ValueError:
            guess = None
        where = action & (turn_ids == turn)
        row = {"turn": turn, "action": text.strip()[:40], "answer": observation[:20],
               "midpoint_guess": guess == (low + high) // 2 if guess is not None else False}
        for name, adv in advantages.items():
            row[name] = float(adv[where].mean()) if bool(where.any()) else float("nan")
        rows.append(row)
        if guess is not None:
            history.append((guess, observation))
    return rows


def lab_credit(out: Path, overrides: Sequence[str], quick: bool, progress: Callable[[str], None]) -> LabResult:
    """Critic + turn-level GAE vs GRPO group credit on the guessing game."""
    import torch

    from keelrl.algos import AlgoConfig, compute_advantages, outcome_to_token_rewards
    from keelrl.rollout.trajectory import collate

    steps = 2 if quick else 15
    settings = list(overrides)
    common = [f"train.steps={steps}", f"train.eval_every={max(1, steps // 3)}"]
    variants = {"grpo": ["algo.preset=grpo", *common],
                "critic-turn-gae": ["algo.preset=ppo", "algo.level=turn", "algo.lam=0.9", "model.critic=head",
                                    *common]}
    trainers: dict[str, Any] = {}
    runs = _train_variants(out, variants, settings, progress, trainers)
    steps = _steps_run(runs)
    chart = _plot_variants(out / "credit.png", runs, [("train/reward", "training success rate"),
                                                      ("eval/success", "held-out success (greedy)")],
                           "Credit assignment on the guessing game")
    progress("looking for a failed episode with a good turn")
    critic = trainers["critic-turn-gae"]
    engine = critic.make_engine()
    engine.start(critic.step)
    example: list[dict[str, Any]] = []
    for attempt in range(6):
        if attempt:  # the same weights under the next version, so the next step's requests may start
            critic.publish(engine, critic.step + attempt)
        trajectories = engine.batch(critic.step + 1 + attempt).trajectories
        batch = collate(trajectories, critic.pad_id).to(critic.device)
        critic_adv = critic._advantages(batch)[0].cpu()
        grpo = compute_advantages(token_rewards=outcome_to_token_rewards(batch.rewards, batch.action_mask),
                                  mask=batch.action_mask, group_ids=batch.group_ids,
                                  cfg=AlgoConfig(preset="grpo")).advantages.cpu()
        for row, t in enumerate(trajectories):
            if t.success:
                continue
            n = len(t.token_ids)
            table = _turn_table(t, {"grpo": grpo[row, :n], "critic_turn_gae": critic_adv[row, :n]})
            if any(r["midpoint_guess"] for r in table[:-1]) or (any(r["midpoint_guess"] for r in table) and not example):
                example = table
                group_rewards = [u.reward for u in trajectories if u.group_id == t.group_id]
                if any(r["midpoint_guess"] for r in table[:-1]) and max(group_rewards) > 0:
                    break
        else:
            continue
        break
    engine.close()
    numbers: dict[str, Any] = {label: {"reward_first": _first(rows, "train/reward"),
                                       "reward_last3": _mean([v for _, v in _series(rows, "train/reward")[-3:]]),
                                       "eval_before": _first(rows, "eval/success"),
                                       "eval_after": _last(rows, "eval/success")}
                               for label, rows in runs.items()}
    numbers["failed_episode_turns"] = example
    signs = ""
    if example:
        signs = _table(["turn", "action", "answer", "midpoint guess", "GRPO advantage", "critic + turn GAE"],
                       [(r["turn"], r["action"], r["answer"], r["midpoint_guess"], r["grpo"], r["critic_turn_gae"])
                        for r in example])
    summary = "\n".join([
        "# Lab: credit assignment", "",
        f"The guessing game (1..16, 5 guesses), warm-started on a teacher that guesses at random 60% of the time, "
        f"then {steps} RL steps of GRPO (group credit: every token of an episode shares its outcome's advantage) "
        f"or PPO with a value head and turn-level GAE (lambda 0.9: each turn is credited by how the critic's "
        f"estimate moved).", "",
        _table(["variant", "train success first", "train success (last 3)", "held-out before", "held-out after"],
               [(k, v["reward_first"], v["reward_last3"], v["eval_before"], v["eval_after"])
                for k, v in numbers.items() if k != "failed_episode_turns"]), "",
        "A failed episode from the trained critic policy, per turn (mean advantage over the turn's tokens); "
        "a midpoint guess is the binary-search move:", "",
        signs or "(no failed episode found in the sampled batches)", "",
        "GRPO gives every turn of a failed episode the same sign; turn-level GAE can credit a good turn "
        "inside a failed episode when the critic's value rose after it.", "", f"Chart: {chart.name}"])
    return LabResult("credit", numbers, summary, [chart])


LabFn = Callable[[Path, Sequence[str], bool, Callable[[str], None]], LabResult]

LABS: dict[str, tuple[str, LabFn, list[str]]] = {
    "stale-ratios": ("importance weights by ratio type, staleness and length", lab_stale_ratios, []),
    "dynamic-sampling": ("DAPO with and without dynamic sampling (guessing game)", lab_dynamic_sampling, GUESS),
    "entropy": ("entropy collapse without a bonus vs with one (guessing game)", lab_entropy, ENTROPY),
    "reward-hacking": ("training on the weak verifier vs the strong one (guessing game)", lab_reward_hacking, HACK),
    "credit": ("critic + turn-level GAE vs GRPO group credit (guessing game)", lab_credit, GUESS),
}
"""name -> (description, function, the settings it runs on over LAB_FAST)."""


def lab_settings(name: str, overrides: Sequence[str] = (), quick: bool = False) -> list[str]:
    """The overrides every training run of lab `name` starts from; the user's come last and win."""
    base = LABS[name][2]
    quick_settings = (QUICK_GUESS if "env.name=guess" in base else QUICK) if quick else []
    from keelrl.config import TINY_RUN

    return [*TINY_RUN, *LAB_FAST, *base, *quick_settings, *overrides]


def run_lab(name: str, out: str | Path | None = None, overrides: Sequence[str] = (), quick: bool = False,
            progress: Callable[[str], None] | None = None) -> LabResult:
    """Run lab `name` into `out` (default runs/lab-NAME); writes summary.md and results.json."""
    if name not in LABS:
        raise KeyError(f"unknown lab {name!r}; valid names: {', '.join(LABS)}")
    directory = Path(out or f"runs/lab-{name}")
    directory.mkdir(parents=True, exist_ok=True)
    function = LABS[name][1]
    settings = lab_settings(name, overrides, quick)
    _config(directory, settings)  # a bad override fails here, before any work
    started = time.monotonic()
    token = _USER_OVERRIDES.set(tuple(overrides))
    try:
        result = function(directory, settings, quick, progress or (lambda message: None))
    finally:
        _USER_OVERRIDES.reset(token)
    seconds = time.monotonic() - started
    result.numbers = {**result.numbers, "lab_seconds": round(seconds, 1)}
    result.summary += f"\n\nLab wall time: {seconds:.0f} s."
    (directory / "summary.md").write_text(result.summary + "\n")
    (directory / "results.json").write_text(json.dumps(result.numbers, indent=2, default=str))
    result.files += [directory / "summary.md", directory / "results.json"]
    return result
