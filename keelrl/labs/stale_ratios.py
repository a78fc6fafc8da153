"""Lab stale-ratios: how large importance weights get as the learner moves away from the policy
that sampled a batch, by staleness and by trajectory length, on SmolLM2 as the default five-turn
coding agent (the default run's cached warm start; `--quick`: the tiny model).

One behaviour batch is scored by learners 0..4 real updates ahead. Two views of it:

- each ratio (token, GSPO's sequence, the cumulative product, CTPO's prefix) with its max weight
  by staleness and length and the share of tokens outside its preset's clip band;
- each objective a stale batch can be trained with (token PPO, GSPO, CISPO, the decoupled
  objective, truncated IS): the weight it puts on each token at the first update of the stale
  batch, the share of tokens it limits (clips, truncates or cuts), and how evenly the weight is
  spread: the effective sample size (sum w)^2 / (n sum w^2) and the share of the total weight
  carried by the heaviest 1% of tokens. The same two figures for the exact trajectory weight
  (the product over a trajectory's tokens) measure the lecture's "a few samples dominate".

Then it trains (`stale_training`): the student samples `TRAIN_UPDATES` batches before any update,
and each objective, from the student, makes one learner update on each of them in turn, so update
k trains on data k - 1 updates stale. Reported per objective: its clip fraction and largest
importance weight at each update, the alarms its updates raised (`keelrl.alarms`, as a run with
the same `monitor` settings raises them), and its held-out success after, paired against token PPO's on
the same batches and against `fresh`, the lab's algorithm trained as many steps on batches its
own current policy samples (on-policy).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.config import TINY_RUN
from keelrl.labs.common import (LAB_FAST, QUICK, Effect, LabResult, config, final_outcomes, last, markdown_table,
                                outcome_effect, pyplot, release_memory, variant_settings, warm_model)

STALE = ["model.path=smollm2", "rollout.tasks_per_step=4", "train.minibatch_size=8", "algo.dynamic_sampling=false",
         "output.checkpoint_every=1000", "eval.tasks=32", "eval.every=1000", "eval.probe_tasks=0"]
"""The lab's settings over the default run (SmolLM2, five turns, its cached warm start): batches
of 4 tasks x 4 attempts, each learner update the default algorithm's step on the next batch (two
optimizer steps), no dynamic sampling (every batch the same 16 episodes); the training part's
held-out success on 32 tasks (strong verifier, greedy)."""

TRAIN_UPDATES = 5
"""Learner updates of the training part: update k trains on a batch the student sampled, k - 1
updates stale (0 .. 4, the measurement's range)."""

STALE_QUICK = [*TINY_RUN, *LAB_FAST, *QUICK, "algo.preset=reinforce"]
"""--quick: the tiny model's recipe at the labs' quick budget, two learner updates, for a smoke run of
the machinery. Its updates are REINFORCE's (the reward itself as the advantage): the tiny student
answers alike within a group so often that a group baseline would leave nothing to learn from."""

RATIO_CLIPS = {"token": ("ppo", 0.2, 0.2), "sequence": ("gspo", 3e-4, 4e-4), "cumulative": ("ppo", 0.2, 0.2),
               "ctpo": ("ctpo", 0.2, 0.28)}
"""Each ratio with the preset whose clip widths it is judged with (eps_low, eps_high)."""

OBJECTIVES: dict[str, dict[str, Any]] = {"token PPO": {"preset": "ppo"}, "GSPO": {"preset": "gspo"}, "CISPO": {"preset": "cispo"},
              "decoupled": {"preset": "decoupled"}, "truncated IS": {"preset": "grpo", "clip": "tis"}}
"""The objectives whose weights the lab measures, each as the algorithm settings that select it
(their clip widths and caps come from keelrl's presets)."""


LIMIT_FIELDS = ("ratio", "clip", "eps_low", "eps_high", "tis_cap", "decoupled", "behaviour_weight_cap")
"""The algorithm fields that make an objective: its ratio and update limit."""


def objective_overrides(name: str) -> list[str]:
    """The `algo.*` overrides that give the lab's algorithm objective `name`'s ratio, clip rule,
    widths and caps (from its preset, as `OBJECTIVES` selects it); credit assignment, aggregation
    and KL stay the lab's."""
    from keelrl.algos import AlgoConfig

    algo = AlgoConfig(**OBJECTIVES[name])
    values = {field: getattr(algo, field) for field in LIMIT_FIELDS}
    return [f"algo.{field}={str(value).lower() if isinstance(value, bool) else value}" for field, value in values.items()]


def objective_weights(name: str, logp: Any, behaviour_logp: Any, mask: Any) -> tuple[Any, Any]:
    """logp (the learner's), behaviour_logp (the sampler's), mask [B, T] -> (the weight objective
    `name` puts on each action token at the first update of the batch, float64 [B, T], 0 off the
    mask; which tokens it limits, bool [B, T]).

    - token PPO: clip(r, 1 - eps_low, 1 + eps_high), r = pi / mu per token; limited: r outside.
    - GSPO: the sequence ratio exp(mean log r) clipped to its narrow band; limited: rows outside.
    - CISPO: the detached weight clip(r, 1 - eps_low, 1 + eps_high) (eps_low 1: no lower bound);
      limited: r outside (their gradient still flows, scaled down).
    - decoupled: pi_prox is the learner itself at a batch's first update, so the clip ratio
      pi / pi_prox is 1 and the weight is the behaviour weight min(pi_prox / mu, behaviour_weight_cap);
      limited: truncated.
    - truncated IS: min(r, tis_cap); limited: truncated.
    """
    import torch

    from keelrl.algos import AlgoConfig
    from keelrl.algos.registries import RATIOS

    settings = OBJECTIVES[name]
    algo = AlgoConfig(**settings, max_log_ratio=80.0)
    token = RATIOS.get("token")(logp, behaviour_logp, mask, algo).double()
    if name == "GSPO":
        ratio = RATIOS.get("sequence")(logp, behaviour_logp, mask, algo).double()
    else:
        ratio = token
    low, high = 1.0 - algo.eps_low, 1.0 + algo.eps_high
    if name in ("token PPO", "GSPO", "CISPO"):
        weight, limited = ratio.clamp(low, high), (ratio < low) | (ratio > high)
    else:
        cap = algo.behaviour_weight_cap if name == "decoupled" else algo.tis_cap
        weight, limited = ratio.clamp(max=cap), ratio > cap
    return torch.where(mask, weight, torch.zeros_like(weight)), limited & mask


def dominance(weights: Sequence[float]) -> dict[str, float]:
    """How evenly a set of non-negative importance weights spreads: `ess_frac`, the effective
    sample size (sum w)^2 / sum w^2 over n (1: all equal; 1/n: one weight carries everything),
    and `top1pct_share`, the share of sum w carried by the heaviest ceil(n / 100) weights."""
    values = sorted((float(w) for w in weights), reverse=True)
    total, squares = math.fsum(values), math.fsum(w * w for w in values)
    if not values or total <= 0:
        return {"ess_frac": math.nan, "top1pct_share": math.nan}
    top = max(1, math.ceil(len(values) / 100))
    return {"ess_frac": total * total / squares / len(values), "top1pct_share": math.fsum(values[:top]) / total}


def learner_logprobs(trainer: Any, batch: Any) -> Any:
    """log pi of every token of `batch` [B, T] under `trainer`'s current weights, at the rollouts'
    temperature, scored in the learner's micro-batches (perf.micro_batch_tokens), without gradient."""
    import torch

    from keelrl.policy.model import row_lengths, split_rows, token_logprobs

    logp = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    lengths = row_lengths(batch.attention_mask).tolist()
    trainer.model.eval()
    with torch.no_grad():
        for group in split_rows(lengths, trainer.cfg.perf.micro_batch_tokens):
            rows = torch.tensor(group, device=batch.input_ids.device)
            width = max(lengths[r] for r in group)
            scored = token_logprobs(trainer.model, batch.input_ids[rows, :width], batch.attention_mask[rows, :width],
                                    positions=batch.action_mask[rows, :width],
                                    temperature=trainer.cfg.rollout.temperature)["logp"]
            logp[rows, :width] = scored.float()
    return logp


def update_figures(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Each learner update's staleness, clip fraction and largest importance weight, from its metrics rows."""
    return {"staleness": [row.get("rollout/staleness_mean") for row in rows],
            "clip_frac": [row.get("policy/clip_frac") for row in rows],
            "is_weight_max": [row.get("policy/is_weight_max") for row in rows]}


def stale_training(out: Path, overrides: Sequence[str], model: Path, progress: Callable[[str], None],
                   updates: int = TRAIN_UPDATES) -> dict[str, Any]:
    """Train each objective of `OBJECTIVES` from the student (`model`) on `updates` batches the
    student sampled before any update (update k on batch k: k - 1 updates stale), and `fresh`, the
    lab's algorithm for as many steps on batches its current policy samples; each evaluated on
    the held-out tasks after. Runs go to out/train-*/ and out/fresh/, each with a run's
    metrics.jsonl (an objective arm's held-out success on its last update's row) and alarms.jsonl,
    which `keel view` reads; an alarm does not stop an objective arm (`monitor.stop_on` is not
    read there). Returns, per arm: held-out success, the staleness, clip fraction and largest
    importance weight of each update, the alarms its updates raised (`keelrl.alarms`, with the
    run's `monitor` settings; `AlarmEvent.as_dict` each), and the paired effects against token PPO
    (with each task's difference) and against fresh; and the start's held-out success."""
    from keelrl.alarms import AlarmMonitor
    from keelrl.config import dump_config, to_dict
    from keelrl.labs.common import train_variants
    from keelrl.metrics import MetricsLogger
    from keelrl.runs import CONFIG, atomic_write_text, clear_outputs, read_alarms
    from keelrl.train.trainer import Trainer

    base = [*overrides, *variant_settings(), f"model.path={model}", "warm_start.demos=0"]
    sampler = Trainer(config(out / "train-batches", [*base, "rollout.engine=async", f"rollout.max_staleness={updates - 1}"]))
    engine = sampler.make_engine(last_step=updates)
    engine.start(0)
    progress(f"sampling {updates} batches with the student (version 0)")
    batches = [engine.batch(step) for step in range(1, updates + 1)]
    engine.close()
    progress("evaluating the student")
    start = sampler.evaluate()["eval/success"]
    start_outcomes = dict(sampler.last_eval_report["task_success"]) if sampler.last_eval_report else {}
    del sampler, engine
    release_memory()
    arms: dict[str, dict[str, Any]] = {}
    outcomes: dict[str, dict[str, bool]] = {}
    for name in OBJECTIVES:
        progress(f"training {name} on the stale batches")
        run_dir = out / f"train-{name.lower().replace(' ', '-')}"
        cfg = config(run_dir, [*base, *objective_overrides(name)])
        run_dir.mkdir(parents=True, exist_ok=True)
        clear_outputs(run_dir)  # an earlier lab's logs in the same place are not this arm's
        atomic_write_text(run_dir / CONFIG, dump_config(cfg))  # what the arm ran
        trainer = Trainer(cfg)
        monitor = AlarmMonitor(cfg.monitor)  # the run's alarms, as `keel train` would raise them
        rows = []
        with MetricsLogger(run_dir, cfg.log, config=to_dict(cfg)) as logger:  # the arm's curves, as a run's
            for step, batch in enumerate(batches, start=1):
                trainer.model.train()
                rows.append(trainer.rl_step(step, batch))
                if step == len(batches):
                    rows[-1].update(trainer.evaluate())
                events = monitor.update(step, rows[-1])
                logger.log(step, {**rows[-1], **{f"alarm/{event.name}": 1.0 for event in events}})
                trainer.outputs.raise_alarms(events, batch.trajectories)  # alarms.jsonl, and samples around each
        outcomes[name] = dict(trainer.last_eval_report["task_success"]) if trainer.last_eval_report else {}
        arms[name] = {"heldout": rows[-1]["eval/success"], **update_figures(rows), "alarms": read_alarms(run_dir)}
        del trainer
        release_memory()
    fresh = [f"train.steps={updates}", "eval.before_rl=false", "rollout.max_staleness=0"]  # on-policy
    fresh_rows = train_variants(out, {"fresh": fresh}, overrides, progress)["fresh"]  # from the same student
    outcomes["fresh"] = final_outcomes(out / "fresh")
    arms["fresh"] = {"heldout": last(fresh_rows, "eval/success"),
                     **update_figures([row for row in fresh_rows if "train/updates" in row]),
                     "alarms": read_alarms(out / "fresh")}
    for name, arm in arms.items():
        for baseline in ("token PPO", "fresh"):
            if name != baseline:
                effect = outcome_effect(outcomes[baseline], outcomes[name])
                arm[f"effect_vs_{baseline.replace(' ', '_')}"] = list(effect)
                if baseline == "token PPO":  # each task's difference, for the verdict over seeds ([task, d]
                    # pairs: a list, so the numbers over seeds leave them out)
                    arm["tasks_vs_token_PPO"] = [list(pair) for pair in effect.tasks.items()]
        arm["lift"] = list(outcome_effect(start_outcomes, outcomes[name]))
    return {"start": start, "updates": updates, "arms": arms}


def lab_stale_ratios(out: Path, overrides: Sequence[str], quick: bool,
                     progress: Callable[[str], None]) -> LabResult:
    """Weights of a fixed batch under learners 0..K updates ahead, per ratio, objective and length."""
    import torch

    from keelrl.algos import AlgoConfig
    from keelrl.algos.registries import RATIOS
    from keelrl.rollout.trajectory import collate
    from keelrl.train.trainer import Trainer

    staleness = 2 if quick else 4
    model = warm_model(out, overrides, progress)
    cfg = config(out / "run", [*overrides, *variant_settings(), f"model.path={model}", "warm_start.demos=0"])
    trainer = Trainer(cfg)
    engine = trainer.make_engine()
    engine.start(0)
    progress("sampling the behaviour batch (version 0)")
    first = engine.batch(1)
    behaviour = first.trajectories
    batch = collate(behaviour, trainer.pad_id).to(trainer.device)
    learner_logp = []
    for k in range(staleness + 1):
        learner_logp.append(learner_logprobs(trainer, batch))
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
    results["objectives"] = {}
    for name in OBJECTIVES:
        figures: dict[str, list[float]] = {"max_weight_by_staleness": [], "limited_frac_by_staleness": [],
                                           "ess_frac_by_staleness": [], "top1pct_share_by_staleness": []}
        for logp in learner_logp:
            weight, limited = objective_weights(name, logp, batch.behaviour_logprobs, mask)
            spread = dominance(weight[mask].tolist())
            figures["max_weight_by_staleness"].append(float(weight[mask].max()))
            figures["limited_frac_by_staleness"].append(float(limited.sum() / mask.sum()))
            figures["ess_frac_by_staleness"].append(spread["ess_frac"])
            figures["top1pct_share_by_staleness"].append(spread["top1pct_share"])
        results["objectives"][name] = figures
    unlimited: dict[str, list[float]] = {"token_ess_frac": [], "token_top1pct_share": [], "trajectory_ess_frac": [],
                                         "trajectory_top_share": [], "trajectory_max_weight": []}
    exact = AlgoConfig(preset="ppo", ratio="cumulative", max_log_ratio=80.0)
    rows_with_actions = mask.any(dim=1)
    for logp in learner_logp:  # plain importance sampling: per token, and the exact trajectory weight
        token_spread = dominance(RATIOS.get("token")(logp, batch.behaviour_logprobs, mask, exact).double()[mask].tolist())
        trajectory = RATIOS.get("cumulative")(logp, batch.behaviour_logprobs, mask, exact).double()
        per_row = [float(trajectory[row][mask[row]][0]) for row in range(len(behaviour)) if rows_with_actions[row]]
        trajectory_spread = dominance(per_row)
        unlimited["token_ess_frac"].append(token_spread["ess_frac"])
        unlimited["token_top1pct_share"].append(token_spread["top1pct_share"])
        unlimited["trajectory_ess_frac"].append(trajectory_spread["ess_frac"])
        unlimited["trajectory_top_share"].append(max(per_row) / math.fsum(per_row))
        unlimited["trajectory_max_weight"].append(max(per_row))
    results["unlimited"] = unlimited
    token_log = (learner_logp[-1] - batch.behaviour_logprobs)[mask].double()
    results["token_log_ratio_abs_mean_at_max_staleness"] = float(token_log.abs().mean())
    results["lecture_1.05^100"] = 1.05 ** 100

    episodes = len(behaviour)
    # The engine holds the trainer (its model and request source), and its batches the episodes:
    # all go before the training part makes its own trainers (4-5 GB more at its peak on SmolLM2).
    del trainer, engine, first, behaviour
    release_memory()
    training = stale_training(out, overrides, model, progress, updates=2 if quick else TRAIN_UPDATES)
    results["training"] = training

    plt = pyplot()
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.2))
    for name, data in results["ratios"].items():
        left.plot(results["staleness"], data["max_weight_by_staleness"], marker="o", label=name)
        middle.plot(lengths, data["max_weight_by_length"], marker="o", label=name)
    middle.plot(lengths, [1.05 ** n for n in lengths], linestyle="--", color="grey", label="1.05 ** length")
    for ax, xlabel in ((left, "staleness (learner updates since sampling)"), (middle, "action tokens per trajectory")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("max importance weight")
        ax.legend(fontsize=8)
    left.set_title("max weight vs staleness (full trajectories)")
    middle.set_title(f"max weight vs length (staleness {staleness})")
    if len(lengths) > 1:
        middle.set_xscale("log", base=2)
    for name, data in results["objectives"].items():
        right.plot(results["staleness"], data["ess_frac_by_staleness"], marker="o", label=f"{name} (tokens)")
    right.plot(results["staleness"], unlimited["token_ess_frac"], marker="x", linestyle=":", color="black",
               label="plain IS (tokens)")
    right.plot(results["staleness"], unlimited["trajectory_ess_frac"], marker="s", linestyle="--", color="grey",
               label="trajectory IS (episodes)")
    right.set_ylim(0, 1.05)
    right.set_xlabel("staleness (learner updates since sampling)")
    right.set_ylabel("effective sample size / n")
    right.set_title("how evenly each objective weighs the batch")
    right.legend(fontsize=7)
    figure.tight_layout()
    chart = figure_path = out / "stale_ratios.png"
    figure.savefig(figure_path, dpi=100)
    plt.close(figure)

    ratios = results["ratios"]
    rows = [(name, *[d["max_weight_by_staleness"][k] for k in (0, staleness)],
             d["max_deviation_by_staleness"][staleness], d["max_weight_by_length"][-1],
             d["clipped_frac_by_staleness"][staleness]) for name, d in results["ratios"].items()]
    objective_rows = [(name, *[d[key][k] for k in (1, staleness) for key in ("max_weight_by_staleness",
                                                                              "limited_frac_by_staleness",
                                                                              "ess_frac_by_staleness",
                                                                              "top1pct_share_by_staleness")])
                      for name, d in results["objectives"].items()]
    objective_rows += [("plain IS (no limit)", *[value for k in (1, staleness) for value in (
        max(1.0, ratios["token"]["max_weight_by_staleness"][k]), 0.0, unlimited["token_ess_frac"][k],
        unlimited["token_top1pct_share"][k])])]
    header = ["objective"] + [f"{what}, staleness {k}" for k in (1, staleness)
                              for what in ("max weight", "share limited", "ESS / n", "top 1% share")]
    model_name = "the tiny model" if quick else "SmolLM2-135M-Instruct"
    summary = "\n".join([
        "# Lab: stale ratios", "",
        f"One batch of {episodes} real rollouts ({model_name} as the {cfg.env.name} agent, "
        f"from its cached warm start) is scored by learners 0..{staleness} updates ahead (each the run's "
        f"{cfg.algo.preset} step on that step's batch, lr {cfg.optim.lr:g}). Longest trajectory: {longest} action "
        f"tokens; mean |log pi/mu| per token at staleness {staleness}: "
        f"{results['token_log_ratio_abs_mean_at_max_staleness']:.4f}.", "",
        "## Ratios", "",
        markdown_table(["ratio", "max weight, fresh", f"max weight, staleness {staleness}",
                        f"max of w and 1/w, staleness {staleness}", f"max weight, {lengths[-1]} tokens",
                        f"share of tokens outside its clip, staleness {staleness}"], rows), "",
        f"At staleness {staleness} the cumulative product strays from 1 by a factor of up to "
        f"{ratios['cumulative']['max_deviation_by_staleness'][-1]:.3g} (max of w and 1/w), the per-token ratio by "
        f"{ratios['token']['max_deviation_by_staleness'][-1]:.3g}: the product multiplies every token's drift, "
        f"as 1.05 ** 100 = 131.5 does (dashed). "
        f"GSPO's length-normalised ratio ({ratios['sequence']['max_weight_by_staleness'][-1]:.3g}) stays nearest 1, "
        f"but with its clip band of 1 +- 3e-4 {ratios['sequence']['clipped_frac_by_staleness'][-1]:.0%} of tokens "
        f"fall outside it. Fresh weights are 1 up to float rounding: sampling suppresses no token and the learner "
        f"scores the batch at the sampling temperature, so before any update pi and mu are the same distribution "
        f"(with top_p below 1, mu is the renormalised nucleus and fresh weights fall below 1; here top_p is "
        f"{cfg.rollout.top_p:g}).", "",
        "## Objectives", "",
        "The weight each objective puts on each action token at the first update of the stale batch "
        "(`objective_weights`): the largest, the share of tokens it limits (clips, truncates), the effective "
        "sample size over n (1: every token weighs the same) and the share of the total weight on the heaviest "
        "1% of tokens.", "",
        markdown_table(header, objective_rows), "",
        f"A few samples dominate: with the exact trajectory weight (the product over each episode's tokens, "
        f"no limit), the heaviest of the {episodes} episodes carries "
        f"{unlimited['trajectory_top_share'][1]:.0%} of the batch's weight at staleness 1 and "
        f"{unlimited['trajectory_top_share'][staleness]:.0%} at staleness {staleness} (effective sample size "
        f"{unlimited['trajectory_ess_frac'][1] * episodes:.1f} and "
        f"{unlimited['trajectory_ess_frac'][staleness] * episodes:.1f} episodes of {episodes}). "
        "", *training_section(training, int(cfg.eval.tasks)), "", f"Chart: {chart.name}"])
    effects: dict[str, Effect] = {}
    for name, arm in training["arms"].items():
        if name != "token PPO":
            difference, se = arm["effect_vs_token_PPO"]
            effects[f"{name} - token PPO"] = Effect(difference, se, dict(arm["tasks_vs_token_PPO"]))
    return LabResult("stale-ratios", results, summary, [chart], effects)


def training_section(training: dict[str, Any], tasks: int) -> list[str]:
    """The summary's lines on `stale_training`'s results."""
    from keelrl.labs.common import effect_sentence

    arms, updates = training["arms"], training["updates"]

    def per_update(values: list[Any]) -> str:
        return " / ".join("-" if value is None else f"{value:.3g}" for value in values)

    rows = [(name, arm["heldout"], f"{arm['lift'][0]:+.3f}",
             "-" if name == "token PPO" else f"{arm['effect_vs_token_PPO'][0]:+.3f}",
             "-" if name == "fresh" else f"{arm['effect_vs_fresh'][0]:+.3f}",
             per_update(arm["staleness"]), per_update(arm["clip_frac"]), per_update(arm["is_weight_max"]))
            for name, arm in arms.items()]
    return [
        "## Training on stale batches", "",
        f"The student sampled {updates} batches before any update; each objective, from the student, made one "
        f"learner update on each in turn (update k on data k - 1 updates stale). `fresh`: the lab's algorithm for "
        f"{updates} steps on batches its own current policy sampled. Held-out: {tasks} tasks, greedy, strict "
        f"success; the student scored {training['start']:.3g}.", "",
        markdown_table(["arm", "held-out after", "minus the student", "minus token PPO", "minus fresh",
                        "staleness, each update", "clip fraction, each update", "max importance weight, each update"],
                       rows), "",
        *[effect_sentence(f"- Held-out, {name} minus token PPO on the same stale batches", tuple(arm["effect_vs_token_PPO"]),
                          tasks, name) for name, arm in arms.items() if name != "token PPO"],
        "", *alarm_lines(arms)]


def alarm_lines(arms: dict[str, dict[str, Any]]) -> list[str]:
    """The summary's lines on the alarms each arm's updates raised (none: said so)."""
    fired = [f"- {name}, update {event['step']}: `{event['alarm']}`, {event['message']}"
             for name, arm in arms.items() for event in arm.get("alarms", [])]
    quiet = [name for name, arm in arms.items() if not arm.get("alarms")]
    lines = ["Alarms raised while training (the run's `monitor` settings, as `keel train` raises them):"]
    lines += fired or ["- none"]
    if fired and quiet:
        lines.append(f"- none in: {', '.join(quiet)}")
    return lines
