"""Lab stale-ratios: how large importance weights get as the learner moves away from the policy
that sampled a batch, for each ratio (token, GSPO sequence, cumulative product, CTPO), by staleness
and by trajectory length, and what share of tokens each clip rule then stops."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from keelrl.labs.common import LabResult, config, markdown_table, pyplot, variant_settings

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
    cfg = config(out / "run", [*overrides, *variant_settings()])
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

    plt = pyplot()
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
        f"0..{staleness} updates ahead (each a real GRPO step on that step's batch, lr {cfg.optim.lr:g}). Longest trajectory: "
        f"{longest} action tokens; mean |log pi/mu| per token at staleness {staleness}: "
        f"{results['token_log_ratio_abs_mean_at_max_staleness']:.4f}.", "",
        markdown_table(["ratio", "max weight, fresh", f"max weight, staleness {staleness}",
                        f"max of w and 1/w, staleness {staleness}", f"max weight, {lengths[-1]} tokens", f"share of tokens outside its clip, staleness {staleness}"],
                       rows), "",
        f"At staleness {staleness} the cumulative product strays from 1 by a factor of up to "
        f"{ratios['cumulative']['max_deviation_by_staleness'][-1]:.3g} (max of w and 1/w), the per-token ratio by "
        f"{ratios['token']['max_deviation_by_staleness'][-1]:.3g}: the product multiplies every token's drift, "
        f"as 1.05 ** 100 = 131.5 does (dashed). "
        f"GSPO's length-normalised ratio ({ratios['sequence']['max_weight_by_staleness'][-1]:.3g}) stays nearest 1, "
        f"but with its clip band of 1 +- 3e-4 {ratios['sequence']['clipped_frac_by_staleness'][-1]:.0%} of tokens "
        f"fall outside it. Fresh weights are 1 up to float rounding: sampling suppresses no token and the learner "
        f"scores the batch at the sampling temperature, so before any update pi and mu are the same distribution "
        f"(with top_p below 1, mu is the renormalised nucleus and fresh weights fall below 1; here top_p is "
        f"{cfg.rollout.top_p:g}).",
        "", f"Chart: {chart.name}"])
    return LabResult("stale-ratios", results, summary, [chart])
