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
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.config import TINY_RUN
from keelrl.labs.common import (LAB_FAST, QUICK, LabResult, config, markdown_table, pyplot, variant_settings,
                                warm_model)

STALE = ["model.path=smollm2", "rollout.tasks_per_step=4", "train.minibatch_size=8", "algo.dynamic_sampling=false",
         "output.checkpoint_every=1000"]
"""The lab's settings over the default run (SmolLM2, five turns, its cached warm start): batches
of 4 tasks x 4 attempts, each learner update the default algorithm's step on the next batch (two
optimizer steps), no dynamic sampling (every batch the same 16 episodes)."""

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
        f"One batch of {len(behaviour)} real rollouts ({model_name} as the {cfg.env.name} agent, "
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
        f"no limit), the heaviest of the {len(behaviour)} episodes carries "
        f"{unlimited['trajectory_top_share'][1]:.0%} of the batch's weight at staleness 1 and "
        f"{unlimited['trajectory_top_share'][staleness]:.0%} at staleness {staleness} (effective sample size "
        f"{unlimited['trajectory_ess_frac'][1] * len(behaviour):.1f} and "
        f"{unlimited['trajectory_ess_frac'][staleness] * len(behaviour):.1f} episodes of {len(behaviour)}). "
        "Held-out success after training at each staleness with each objective is not measured by this lab.",
        "", f"Chart: {chart.name}"])
    return LabResult("stale-ratios", results, summary, [chart])
