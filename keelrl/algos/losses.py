"""Policy losses (clip rules), loss aggregation, KL estimators, entropy and value loss.

A policy loss has one signature, `(logp, old_logp, advantages, mask, cfg) -> (loss, metrics)`,
all tensors [B, T] and `mask` marking action tokens. It computes the importance ratio named
by `cfg.ratio`, applies its clip rule to get a per-token loss, and reduces it with
`cfg.aggregation`. Metrics are detached 0-dim tensors under namespaced keys (no host sync):

    policy/loss, policy/clip_frac (low + high), policy/clip_frac_low, policy/clip_frac_high,
    policy/is_weight_mean, policy/is_weight_max, policy/is_weight_min (the ratio's spread over the
    action tokens), policy/approx_kl (k3 estimate of KL(mu || pi) from
    token ratios, log-ratios clamped like the weights)

`policy_objective` adds policy/entropy (when per-token entropy is given), policy/kl_ref
(when reference log-probs are given) and loss/total.

Clip rules (r = ratio, A = advantage, sg = stop-gradient):

- ppo:       -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)  (Schulman et al. 2017).
             eps_high > eps_low is DAPO's clip-higher (Yu et al. 2025).
- dual_clip: ppo, and for A < 0 the loss is at most -c A (Ye et al. 2020), so a huge ratio
             on a negative-advantage token cannot dominate the batch.
- cispo:     -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi (MiniMax-M1): every token keeps
             a gradient, scaled by its clipped weight.
- tis:       -sg(min(r, C)) A log pi: truncated importance sampling with cap C.
- none:      -r A: plain importance sampling, no limit.

The loss value of cispo and tis is a surrogate: its gradient is the policy gradient, its
value is not an objective estimate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from keelrl.algos.corrections import correction_weights, truncated_is_weight
from keelrl.algos.masked import masked_fill_zero, masked_max, masked_mean
from keelrl.algos.ratios import compute_dtype, token_log_ratio
from keelrl.algos.registries import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, RATIOS

if TYPE_CHECKING:
    from keelrl.algos.config import AlgoConfig

Metrics = dict[str, Tensor]


# ---------------------------------------------------------------------------- aggregation

@AGGREGATIONS.register("token_mean", summary="mean over all action tokens in the batch")
def token_mean(per_token: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Tensor:
    """per_token [B, T] -> scalar: sum over action tokens / number of action tokens."""
    return masked_mean(per_token, mask)


@AGGREGATIONS.register("seq_mean_token_mean", summary="mean over sequences of token means")
def seq_mean_token_mean(per_token: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Tensor:
    """[B, T] -> scalar: each row's mean over its action tokens, averaged over rows that have any."""
    row_mean = masked_mean(per_token, mask, dim=1)  # [B]
    has_tokens = mask.any(dim=1)
    return masked_mean(row_mean, has_tokens)


@AGGREGATIONS.register("seq_mean_token_sum", summary="mean over sequences of token sums")
def seq_mean_token_sum(per_token: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Tensor:
    """[B, T] -> scalar: each row's sum over action tokens, averaged over all B rows."""
    return masked_fill_zero(per_token, mask).sum(dim=1).mean()


@AGGREGATIONS.register("constant", summary="token sum / (B x constant) (Dr.GRPO)")
def constant(per_token: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Tensor:
    """[B, T] -> scalar: sum over action tokens / (B * cfg.agg_constant).

    A fixed normaliser gives every token the same weight whatever its sequence's length,
    removing GRPO's length bias (Dr.GRPO, Liu et al. 2025). It must not depend on the batch's
    padded length, so the config requires it.
    """
    if cfg.agg_constant is None:
        raise ValueError("aggregation 'constant' needs cfg.agg_constant (the max generated tokens)")
    return masked_fill_zero(per_token, mask).sum() / (mask.shape[0] * cfg.agg_constant)


def aggregate(per_token: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Tensor:
    """Reduce per_token [B, T] to a scalar with the mode `cfg.aggregation`."""
    return AGGREGATIONS.get(cfg.aggregation)(per_token, mask, cfg)


# ---------------------------------------------------------------------------- clip rules

def _ratio_metrics(ratio: Tensor, logp: Tensor, old_logp: Tensor, mask: Tensor,
                   clip_low: Tensor, clip_high: Tensor, cfg: "AlgoConfig") -> Metrics:
    weight = ratio.detach()
    log_ratio = token_log_ratio(logp.detach(), old_logp, mask)
    log_ratio = log_ratio.clamp(-cfg.max_log_ratio, cfg.max_log_ratio)  # finite in float32 too
    # k3 estimate of KL(mu || pi) with samples from mu: (r - 1) - log r, r = pi / mu.
    approx_kl = torch.expm1(log_ratio) - log_ratio
    return {
        "policy/clip_frac": masked_mean((clip_low | clip_high).to(weight.dtype), mask),
        "policy/clip_frac_low": masked_mean(clip_low.to(weight.dtype), mask),
        "policy/clip_frac_high": masked_mean(clip_high.to(weight.dtype), mask),
        "policy/is_weight_mean": masked_mean(weight, mask),
        "policy/is_weight_max": masked_max(weight, mask),
        "policy/is_weight_min": -masked_max(-weight, mask),
        "policy/approx_kl": masked_mean(approx_kl, mask),
    }


def _prepare(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
             cfg: "AlgoConfig") -> tuple[Tensor, Tensor, Tensor]:
    """-> (ratio, advantages, logp) in the ratio's (>= float32) dtype, unmasked positions zeroed."""
    if advantages.shape != mask.shape:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, mask has {tuple(mask.shape)}")
    ratio = RATIOS.get(cfg.ratio)(logp, old_logp, mask, cfg)
    dtype = torch.promote_types(ratio.dtype, compute_dtype(advantages))
    return (ratio.to(dtype), masked_fill_zero(advantages.detach().to(dtype), mask),
            masked_fill_zero(logp.to(dtype), mask))


def _finish(per_token: Tensor, mask: Tensor, cfg: "AlgoConfig", metrics: Metrics) -> tuple[Tensor, Metrics]:
    loss = aggregate(per_token, mask, cfg)
    metrics["policy/loss"] = loss.detach()
    return loss, metrics


def clip_masks(ratio: Tensor, advantages: Tensor, cfg: "AlgoConfig") -> tuple[Tensor, Tensor]:
    """ratio, advantages [B, T] -> (clipped-low, clipped-high) bool masks, as `cfg.clip` limits them.

    ppo and dual_clip: the tokens whose gradient the clip removes (the clipped branch wins the
    min); cispo: the tokens whose weight is clamped (they keep a gradient); tis: the weights
    truncated at the cap; none: no token."""
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    never = torch.zeros(ratio.shape, dtype=torch.bool, device=ratio.device)
    if cfg.clip in ("ppo", "dual_clip"):
        return (ratio < low) & (advantages < 0), (ratio > high) & (advantages > 0)
    if cfg.clip == "cispo":
        return ratio < low, ratio > high
    if cfg.clip == "tis":
        return never, ratio > cfg.tis_cap
    return never, never


def _ppo_terms(ratio: Tensor, advantages: Tensor, cfg: "AlgoConfig") -> tuple[Tensor, Tensor, Tensor]:
    """-> (per-token PPO loss, clipped-low mask, clipped-high mask), each [B, T]."""
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    clipped_ratio = ratio.clamp(low, high)
    per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    # Where the clipped branch wins the min, the gradient is zero.
    clip_low, clip_high = clip_masks(ratio, advantages, cfg)
    return per_token, clip_low, clip_high


@POLICY_LOSSES.register("ppo", summary="PPO clip: min(r A, clip(r, {lo:g}, {hi:g}) A)")
def ppo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """logp, old_logp, advantages, mask [B, T] -> (scalar loss, metrics). PPO clipped surrogate."""
    ratio, advantages, _ = _prepare(logp, old_logp, advantages, mask, cfg)
    per_token, clip_low, clip_high = _ppo_terms(ratio, advantages, cfg)
    return _finish(per_token, mask, cfg, _ratio_metrics(ratio, logp, old_logp, mask, clip_low, clip_high, cfg))


@POLICY_LOSSES.register("dual_clip", summary="PPO clip [{lo:g}, {hi:g}] + dual clip c={c:g} for A<0")
def dual_clip(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
              cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """[B, T] -> (loss, metrics). PPO, with negative-advantage token losses capped at -c A."""
    ratio, advantages, _ = _prepare(logp, old_logp, advantages, mask, cfg)
    per_token, clip_low, clip_high = _ppo_terms(ratio, advantages, cfg)
    cap = -cfg.dual_clip_c * advantages
    negative = advantages < 0
    dual_active = negative & (cap < per_token)
    per_token = torch.where(negative, torch.minimum(per_token, cap), per_token)
    metrics = _ratio_metrics(ratio, logp, old_logp, mask, clip_low, clip_high, cfg)
    metrics["policy/dual_clip_frac"] = masked_mean(dual_active.to(ratio.dtype), mask)
    return _finish(per_token, mask, cfg, metrics)


@POLICY_LOSSES.register("cispo", summary="CISPO: sg(clip(r, {lo:g}, {hi:g})) A log pi")
def cispo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
          cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """[B, T] -> (loss, metrics). Clipped weight as a constant times A times log pi."""
    ratio, advantages, logp_masked = _prepare(logp, old_logp, advantages, mask, cfg)
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    weight = ratio.detach().clamp(low, high)
    per_token = -weight * advantages * logp_masked
    metrics = _ratio_metrics(ratio, logp, old_logp, mask, *clip_masks(ratio, advantages, cfg), cfg)
    return _finish(per_token, mask, cfg, metrics)


@POLICY_LOSSES.register("tis", summary="truncated IS: sg(min(r, {cap:g})) A log pi")
def tis(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
        cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """[B, T] -> (loss, metrics). Importance weight truncated at cfg.tis_cap, as a constant."""
    ratio, advantages, logp_masked = _prepare(logp, old_logp, advantages, mask, cfg)
    weight = ratio.detach().clamp(max=cfg.tis_cap)
    per_token = -weight * advantages * logp_masked
    metrics = _ratio_metrics(ratio, logp, old_logp, mask, *clip_masks(ratio, advantages, cfg), cfg)
    return _finish(per_token, mask, cfg, metrics)


@POLICY_LOSSES.register("none", summary="no limit: r A")
def no_clip(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
            cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """[B, T] -> (loss, metrics). Unclipped importance-weighted policy gradient."""
    ratio, advantages, _ = _prepare(logp, old_logp, advantages, mask, cfg)
    metrics = _ratio_metrics(ratio, logp, old_logp, mask, *clip_masks(ratio, advantages, cfg), cfg)
    return _finish(-ratio * advantages, mask, cfg, metrics)


def describe_clip(cfg: "AlgoConfig") -> str:
    """The clip rule's summary with this config's numbers filled in."""
    return POLICY_LOSSES.entry(cfg.clip).summary.format(
        lo=1.0 - cfg.eps_low, hi=1.0 + cfg.eps_high, c=cfg.dual_clip_c, cap=cfg.tis_cap)


# ---------------------------------------------------------------------------- KL estimators
# Samples come from pi (or from mu close to it); log_ratio = log ref - log pi at the token.
# As values, k1 and k3 are unbiased estimates of KL(pi || ref) and k2 is biased. As loss
# terms differentiated through log pi with the samples held fixed, their expected gradients
# differ (Tang & Munos 2025): k1 gives zero (so it is only allowed as a reward penalty),
# k2 gives the gradient of KL(pi || ref), and k3 (GRPO's choice) that of KL(ref || pi).

@KL_ESTIMATORS.register("k1", summary="log pi - log ref (unbiased, can be negative)")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """logp, ref_logp [B, T] -> [B, T]: -log(ref/pi)."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2", summary="(log ref - log pi)^2 / 2 (biased, low variance)")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """logp, ref_logp [B, T] -> [B, T]: half the squared log ratio; its gradient is KL(pi || ref)'s."""
    return 0.5 * (ref_logp - logp) ** 2


@KL_ESTIMATORS.register("k3", summary="ref/pi - 1 - log(ref/pi) (unbiased, >= 0)")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """logp, ref_logp [B, T] -> [B, T]: (ratio - 1) - log ratio with ratio = ref/pi; never negative.

    As a loss term its expected gradient is that of KL(ref || pi), the reverse direction.
    """
    log_ratio = ref_logp - logp
    return torch.expm1(log_ratio) - log_ratio


def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """logp, ref_logp, mask [B, T] -> per-token KL(pi || ref) estimate [B, T], 0 off the mask."""
    fn = KL_ESTIMATORS.get(estimator)
    # The reference model is a fixed anchor: no gradient ever flows into it.
    return masked_fill_zero(fn(masked_fill_zero(logp, mask), masked_fill_zero(ref_logp.detach(), mask)), mask)


def kl_reward_penalty(token_rewards: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor,
                      coef: float, estimator: str) -> Tensor:
    """token_rewards [B, T] -> token_rewards - coef * KL per action token (no gradient).

    The PPO/RLHF form: the KL is part of the reward the advantage estimator sees.
    """
    penalty = kl_penalty(logp.detach(), ref_logp, mask, estimator)
    return masked_fill_zero(token_rewards, mask) - coef * penalty


# ---------------------------------------------------------------------------- entropy

def _chunk_entropy(chunk: Tensor) -> Tensor:
    """chunk [B, c, V] (any float dtype) -> entropy [B, c] in float32 (float64 stays float64)."""
    chunk = chunk.to(compute_dtype(chunk))
    # A position whose logits are all -inf has no distribution; treat it as uniform rather
    # than let NaN reach a gradient (such positions are padding and get masked later).
    chunk = torch.where(torch.isfinite(chunk).any(dim=-1, keepdim=True), chunk, 0.0)
    log_probs = torch.log_softmax(chunk, dim=-1)
    probs = log_probs.exp()
    # A -inf logit (masked vocabulary entry) has p = 0 and adds 0 log 0 = 0, not NaN;
    # zeroing log p there first keeps the backward pass finite too.
    log_probs = torch.where(probs > 0, log_probs, 0.0)
    return -(probs * log_probs).sum(dim=-1)


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """logits [B, T, V] -> entropy of softmax(logits) [B, T], in float32 (or float64) chunks over T.

    Only one chunk's [B, chunk, V] float32 intermediates exist at a time. When gradients are
    needed, each chunk is checkpointed (recomputed in the backward pass), so autograd keeps
    the logits and the [B, T] result, not a float32 copy of every chunk.
    """
    from torch.utils.checkpoint import checkpoint

    pieces = []
    for start in range(0, logits.shape[1], chunk_size):
        chunk = logits[:, start:start + chunk_size]  # [B, c, V]
        if chunk.requires_grad and torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_entropy, chunk, use_reentrant=False))  # [B, c]
        else:
            pieces.append(_chunk_entropy(chunk))
    if not pieces:
        return logits.new_zeros(logits.shape[:2], dtype=compute_dtype(logits))
    return torch.cat(pieces, dim=1)


def entropy_from_sampled_logprobs(logp: Tensor) -> Tensor:
    """logp [B, T] of sampled tokens -> single-sample entropy surrogate [B, T].

    For when only the sampled token's log-probability exists. The value is -log pi(y), an
    unbiased estimate of the entropy; the gradient is -sg(log pi(y)) * grad log pi(y), an
    unbiased score-function estimate of the entropy's gradient (E[grad log pi] = 0 drops the
    other term).
    """
    sampled = logp.detach()
    return -sampled - sampled * (logp - sampled)


# ---------------------------------------------------------------------------- value loss

def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """values, old_values, returns, mask [B, T] -> (loss, metrics). Clipped critic loss.

    0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) with c = cfg.value_clip,
    or plain 0.5 * (V - R)^2 when it is None; reduced with cfg.aggregation.
    """
    returns = masked_fill_zero(returns.detach(), mask)
    values = masked_fill_zero(values, mask)
    old_values = masked_fill_zero(old_values.detach(), mask)
    squared_error = (values - returns) ** 2
    if cfg.value_clip is None:
        per_token = 0.5 * squared_error
        clipped = torch.zeros_like(mask)
    else:
        clipped_values = old_values + (values - old_values).clamp(-cfg.value_clip, cfg.value_clip)
        clipped_error = (clipped_values - returns) ** 2
        per_token = 0.5 * torch.maximum(squared_error, clipped_error)
        clipped = clipped_error > squared_error
    loss = aggregate(per_token, mask, cfg)
    return loss, {
        "value/loss": loss.detach(),
        "value/mse": masked_mean(squared_error.detach(), mask),
        "value/clip_frac": masked_mean(clipped.to(values.dtype), mask),
        "value/mean": masked_mean(values.detach(), mask),
    }


# ---------------------------------------------------------------------------- full objective

def token_view(*, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: "AlgoConfig",
               prox_logp: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """All [B, T] -> (ratio, clipped), per token, as `policy_objective`'s clip rule sees them.

    The ratio is `cfg.ratio`'s, against the behaviour policy mu, or against the proximal policy
    with `cfg.decoupled` or a rollout correction (whose scaling of the advantages keeps their
    sign, so the masks agree, except at a token a correction gives weight 0: no clip acts there);
    `clipped` is either mask of `clip_masks`. For reading trajectories (the viewer), not a loss:
    both are detached, and 0 / False off the mask."""
    reference = prox_logp if cfg.ratio_to_proximal and prox_logp is not None else old_logp
    ratio = RATIOS.get(cfg.ratio)(logp.detach(), reference, mask, cfg)
    low, high = clip_masks(ratio, advantages.detach().to(ratio.dtype), cfg)
    return masked_fill_zero(ratio.detach(), mask), (low | high) & mask


def policy_objective(*, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                     cfg: "AlgoConfig", ref_logp: Tensor | None = None,
                     entropy: Tensor | None = None, prox_logp: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """All [B, T] -> (loss, metrics): policy loss + beta KL - alpha entropy.

    `old_logp` is the behaviour policy mu's log-probs, recorded at sampling. With
    `cfg.decoupled` (Fu et al. 2025) `prox_logp` must hold the proximal policy's log-probs (the
    learner's weights when the batch arrived): the clip rule then acts on pi / pi_prox, and
    each token's advantage is scaled by the constant w = min(pi_prox / mu, behaviour_weight_cap).
    Every clip rule is positively homogeneous in A (and w >= 0), so this is the per-token loss
    times w. A `cfg.rollout_correction` other than none does the same with its own weight
    (keelrl.algos.corrections): `decoupled` is the correction token_tis at behaviour_weight_cap.
    With neither, the ratio is to mu and the objective does not read `prox_logp`.

    The KL term is added only when `cfg.kl_coef > 0`, `ref_logp` is given and the KL is not
    already in the reward (`cfg.kl_in_reward`). `entropy` (per token, e.g. from
    `entropy_from_logits`) is always logged when given; it is a bonus when cfg.entropy_coef > 0.
    """
    if ref_logp is None and cfg.kl_coef > 0 and not cfg.kl_in_reward:
        raise ValueError(f"cfg.kl_coef={cfg.kl_coef} puts a KL term in the loss, but ref_logp is None; "
                         f"pass the reference model's log-probs or set kl_coef=0")
    weight_metrics: Metrics = {}
    behaviour_logp = old_logp
    if cfg.ratio_to_proximal:
        if prox_logp is None:
            raise ValueError(f"cfg.decoupled={cfg.decoupled} with cfg.rollout_correction={cfg.rollout_correction!r} "
                             f"needs prox_logp: the proximal policy's log-probs of the batch")
        if cfg.decoupled:
            if cfg.rollout_correction != "none":
                raise ValueError(f"cfg.decoupled and cfg.rollout_correction={cfg.rollout_correction!r} would both "
                                 f"weigh the tokens by pi_prox / mu; AlgoConfig refuses this combination")
            raw, weight = truncated_is_weight(prox_logp, old_logp, mask, cfg.behaviour_weight_cap, cfg)
            weight_metrics = {"policy/behaviour_weight_mean": masked_mean(raw, mask),
                              "policy/behaviour_weight_max": masked_max(raw, mask),
                              "policy/behaviour_weight_trunc_frac": masked_mean((raw > weight).to(raw.dtype), mask)}
        else:  # the correction's metrics are the batch's (`keelrl.train.advantage.arrival_stats` logs them)
            weight, _ = correction_weights(prox_logp, old_logp, mask, cfg)
        advantages = advantages.detach().to(weight.dtype) * masked_fill_zero(weight, mask)
        old_logp = prox_logp.detach()
    loss, metrics = POLICY_LOSSES.get(cfg.clip)(logp, old_logp, advantages, mask, cfg)
    metrics.update(weight_metrics)
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, mask, cfg.kl_estimator)
        metrics["policy/kl_ref"] = masked_mean(kl.detach(), mask)
        if cfg.kl_coef and not cfg.kl_in_reward:
            if cfg.kl_is_weight:  # samples came from mu: pi / mu makes each term an estimate under pi
                log_w = token_log_ratio(logp.detach(), behaviour_logp, mask).clamp(-cfg.max_log_ratio,
                                                                                   cfg.max_log_ratio)
                kl = kl * masked_fill_zero(torch.exp(log_w).clamp(max=cfg.behaviour_weight_cap), mask)  # [B, T]
                metrics["policy/kl_ref_weighted"] = masked_mean(kl.detach(), mask)
            loss = loss + cfg.kl_coef * aggregate(kl, mask, cfg)
    if entropy is not None:
        metrics["policy/entropy"] = masked_mean(entropy.detach(), mask)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg)
    metrics["loss/total"] = loss.detach()
    return loss, metrics
