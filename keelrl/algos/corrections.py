"""Rollout corrections: weights for the step from the sampler's policy mu to the learner's pi_prox.

The sampler's log-probs mu (`batch.behaviour_logprobs`) and the learner's log-probs of the same
tokens under the same weights are not equal: a bf16 sampler (vLLM's default, keelrl's with
`rollout.dtype=bfloat16`) against a float32 learner, other kernels, another batch layout. On
fresh data the RL step is then off-policy by that mismatch (Yao, Liu et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"; Liu, Li et al. 2025, "When
speed kills stability"). A rollout correction weighs each action token by a function of
rho_t = pi_prox(y_t) / mu(y_t), where pi_prox is the learner's policy when the batch arrives.

One signature for every component:

    fn(prox_logp [B, T], behaviour_logp [B, T], mask [B, T] bool, cfg) -> (weights [B, T], metrics)

`weights` are detached, in >= float32, 0 off the mask. `metrics` are detached 0-dim tensors (no
host sync): `mismatch_metrics` (the same for every component) and

    correction/weight_mean, correction/weight_max     over action tokens
    correction/masked_token_frac                      action tokens the rule gives weight 0
    correction/masked_seq_frac                        rows (with action tokens) wholly masked
    correction/truncated_frac                         token_tis: weights cut to the cap

Components (log rho_t = log pi_prox - log mu; the windows are tested in log space on the exact
log-ratios, the weights exponentiate log-ratios clamped to +-cfg.max_log_ratio):

- none:      weight 1; the objective is exactly the one without this module.
- token_tis: min(rho_t, correction_cap): truncated importance sampling (Yao et al., C = 2).
             The decoupled objective's weight is this one: `decoupled=true` is token_tis with
             correction_cap = behaviour_weight_cap, and both come from `truncated_is_weight`.
- seq_mask:  sequence masked IS ("Seq-MIS"; verl's sequence IS + sequence rejection with one
             threshold): rho_seq = prod_t rho_t = exp(sum_t log rho_t) over the row's action
             tokens; the weight is rho_seq at every action token when seq_mask_low <= rho_seq <=
             seq_mask_high, else 0 (the whole row is rejected). Inside the window the weight
             keeps its importance value: a weight of 1 would leave the accepted rows'
             mismatch uncorrected under the three-policy objective below.
- geo_mask:  geometric-mean rejection (verl's geometric RS): g = exp(mean_t log rho_t); the
             weight is 1 at every action token when geo_mask_low <= g <= geo_mask_high, else 0.
             g is a length-normalised diagnostic, not an importance weight, so it only rejects.
- icepop:    IcePop's double-sided token mask (Ring-1T, 2025: M(k) = k inside [alpha, beta],
             0 outside, alpha = 0.5, beta = 5): weight rho_t inside [icepop_low, icepop_high],
             0 outside.

Where the weights act (`keelrl.algos.losses.policy_objective`). Any component but `none` makes
the objective three-policy, like the decoupled objective (Fu et al. 2025; verl's "decoupled
mode"): the clip rule acts on pi / pi_prox, and each token's advantage is multiplied by its
weight (every clip rule is positively homogeneous in A, so this multiplies its loss). With
`none` the clip rule acts on pi / mu, which already importance-weights from mu (verl's "bypass
mode"); a weight in pi_prox / mu on top of it would weigh the mismatch twice. For the same
reason the config refuses a correction together with `decoupled=true`, which has its own.

Defaults and why: correction_cap 2 (Yao et al.; verl's rollout_is_threshold); seq_mask
[0.5, 2] (verl's sequence rejection default, reciprocal bounds); icepop [0.5, 5] (the Ring-1T
report's alpha and beta); geo_mask [0.99, 1.01], wider than verl's geometric preset [0.999,
1.001], which presumes a far smaller mismatch than a bf16 sampler's on a small model: there it
rejects most rows of a batch, not the outliers (measured: docs/measurements.md#rollout-correction-windows).
Under a mismatch E_mu[log rho] = -KL(mu || pi_prox) < 0, so a row's product drifts below 1 as
exp(-length x KL): seq_mask's window suits short completions, not long agent trajectories.

What this does NOT do: it cannot tell a precision mismatch from staleness (rho carries both);
it does not renormalise the loss over the tokens it keeps (a masked token still counts in its
aggregation's denominator, as a clipped token does); and a window only bounds what it tests:
icepop's rho_t, seq_mask's product, geo_mask's mean.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from keelrl.algos.masked import masked_fill_zero, masked_max, masked_mean, masked_sum
from keelrl.algos.ratios import token_log_ratio
from keelrl.algos.registries import ROLLOUT_CORRECTIONS

if TYPE_CHECKING:
    from keelrl.algos.config import AlgoConfig

Metrics = dict[str, Tensor]


# ---------------------------------------------------------------------------- shared pieces

def behaviour_log_ratio(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> Tensor:
    """prox_logp, behaviour_logp, mask [B, T] -> log rho_t = log pi_prox - log mu [B, T], detached, 0 off the mask."""
    return token_log_ratio(prox_logp.detach(), behaviour_logp, mask)


def truncated_is_weight(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cap: float,
                        cfg: "AlgoConfig") -> tuple[Tensor, Tensor]:
    """[B, T] -> (rho, min(rho, cap)) [B, T]: the truncated importance weight, 1 off the mask.

    log rho is clamped to +-cfg.max_log_ratio before exp. The decoupled objective
    (`policy_objective` with cfg.decoupled, cap = behaviour_weight_cap) and token_tis
    (cap = correction_cap) both weigh tokens with this function."""
    log_rho = behaviour_log_ratio(prox_logp, behaviour_logp, mask).clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
    rho = torch.exp(log_rho)
    return rho, rho.clamp(max=cap)


def mismatch_metrics(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Metrics:
    """[B, T] -> how far the learner's pi_prox is from the sampler's mu on the action tokens.

    mismatch/kl:  mean of log mu - log pi_prox, the sampled (k1) estimate of KL(mu || pi_prox)
                  with samples from mu (unbiased; can come out negative on a small batch)
    mismatch/k3:  mean of (rho - 1) - log rho, rho = pi_prox / mu: the same KL, never negative
                  (log rho clamped like the weights)
    mismatch/log_ratio_abs_max: the largest |log pi_prox - log mu|
    All 0 when pi_prox == mu, and when there are no action tokens."""
    log_rho = behaviour_log_ratio(prox_logp, behaviour_logp, mask)  # [B, T]
    clamped = log_rho.clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
    return {
        "mismatch/kl": masked_mean(-log_rho, mask),
        "mismatch/k3": masked_mean(torch.expm1(clamped) - clamped, mask),
        "mismatch/log_ratio_abs_max": masked_max(log_rho.abs(), mask),
    }


def _finish(weights: Tensor, rejected: Tensor, mask: Tensor, metrics: Metrics) -> tuple[Tensor, Metrics]:
    """weights [B, T] (0 off the mask) and rejected [B, T] (the rule's zeros) -> (weights, metrics)."""
    rows = mask.any(dim=1)  # [B]
    wholly_rejected = (rejected | ~mask).all(dim=1)  # [B]
    metrics.update({
        "correction/weight_mean": masked_mean(weights, mask),
        "correction/weight_max": masked_max(weights, mask),
        "correction/masked_token_frac": masked_mean(rejected.to(weights.dtype), mask),
        "correction/masked_seq_frac": masked_mean(wholly_rejected.to(weights.dtype), rows),
    })
    return weights.detach(), metrics


def _row_window(row_log_value: Tensor, low: float, high: float) -> Tensor:
    """row_log_value [B] (a log-ratio) -> [B] bool: low <= exp(row_log_value) <= high, tested in log space."""
    return (row_log_value >= math.log(low)) & (row_log_value <= math.log(high))


# ---------------------------------------------------------------------------- components

@ROLLOUT_CORRECTIONS.register("none", summary="no correction: the clip rule's ratio is pi / mu")
def no_correction(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor,
                  cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """prox_logp, behaviour_logp, mask [B, T] -> (weights 1 on action tokens [B, T], metrics)."""
    log_rho = behaviour_log_ratio(prox_logp, behaviour_logp, mask)
    weights = mask.to(log_rho.dtype)  # [B, T]
    return _finish(weights, torch.zeros_like(mask), mask, mismatch_metrics(prox_logp, behaviour_logp, mask, cfg))


@ROLLOUT_CORRECTIONS.register("token_tis", summary="truncated IS per token: min(pi_prox / mu, {correction_cap:g})")
def token_tis(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor,
              cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """[B, T] -> (min(rho_t, cfg.correction_cap) [B, T], metrics). Truncated IS (Yao et al. 2025)."""
    rho, weights = truncated_is_weight(prox_logp, behaviour_logp, mask, cfg.correction_cap, cfg)
    metrics = mismatch_metrics(prox_logp, behaviour_logp, mask, cfg)
    metrics["correction/truncated_frac"] = masked_mean((rho > weights).to(rho.dtype), mask)
    return _finish(masked_fill_zero(weights, mask), torch.zeros_like(mask), mask, metrics)


@ROLLOUT_CORRECTIONS.register(
    "seq_mask", summary="sequence masked IS: prod pi_prox / mu if in [{seq_mask_low:g}, {seq_mask_high:g}], else 0")
def seq_mask(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor,
             cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """[B, T] -> (rho_seq at a row's action tokens if it is in the window, else 0 [B, T], metrics)."""
    log_rho = behaviour_log_ratio(prox_logp, behaviour_logp, mask)
    row_log_ratio = masked_sum(log_rho, mask, dim=1)  # [B]: log prod_t rho_t
    accepted = _row_window(row_log_ratio, cfg.seq_mask_low, cfg.seq_mask_high)  # [B]
    # Inside the window the product is at most seq_mask_high: the clamp only keeps rejected rows finite.
    row_weight = torch.exp(row_log_ratio.clamp(math.log(cfg.seq_mask_low), math.log(cfg.seq_mask_high)))
    row_weight = torch.where(accepted, row_weight, torch.zeros_like(row_weight))  # [B]
    weights = masked_fill_zero(row_weight.unsqueeze(1).expand_as(log_rho), mask)  # [B, T]
    rejected = (~accepted).unsqueeze(1) & mask  # [B, T]
    return _finish(weights, rejected, mask, mismatch_metrics(prox_logp, behaviour_logp, mask, cfg))


@ROLLOUT_CORRECTIONS.register(
    "geo_mask", summary="geometric-mean mask: 1 if exp(mean log pi_prox / mu) in "
                        "[{geo_mask_low:g}, {geo_mask_high:g}], else 0")
def geo_mask(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor,
             cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """[B, T] -> (1 at a row's action tokens if its geometric-mean ratio is in the window, else 0 [B, T], metrics)."""
    log_rho = behaviour_log_ratio(prox_logp, behaviour_logp, mask)
    row_mean_log_ratio = masked_mean(log_rho, mask, dim=1)  # [B]: log of the geometric mean
    accepted = _row_window(row_mean_log_ratio, cfg.geo_mask_low, cfg.geo_mask_high)  # [B]
    weights = masked_fill_zero(accepted.unsqueeze(1).expand_as(log_rho).to(log_rho.dtype), mask)  # [B, T]
    rejected = (~accepted).unsqueeze(1) & mask  # [B, T]
    return _finish(weights, rejected, mask, mismatch_metrics(prox_logp, behaviour_logp, mask, cfg))


@ROLLOUT_CORRECTIONS.register(
    "icepop", summary="IcePop token mask: pi_prox / mu if in [{icepop_low:g}, {icepop_high:g}], else 0")
def icepop(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor,
           cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """[B, T] -> (rho_t inside [icepop_low, icepop_high], 0 outside [B, T], metrics). IcePop (Ring-1T 2025)."""
    log_rho = behaviour_log_ratio(prox_logp, behaviour_logp, mask)
    low, high = math.log(cfg.icepop_low), math.log(cfg.icepop_high)
    inside = (log_rho >= low) & (log_rho <= high)  # [B, T]
    weights = masked_fill_zero(torch.where(inside, torch.exp(log_rho.clamp(low, high)), 0.0), mask)  # [B, T]
    return _finish(weights, ~inside & mask, mask, mismatch_metrics(prox_logp, behaviour_logp, mask, cfg))


def correction_weights(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor,
                       cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """[B, T] -> (weights [B, T], metrics) of the component `cfg.rollout_correction`."""
    return ROLLOUT_CORRECTIONS.get(cfg.rollout_correction)(prox_logp, behaviour_logp, mask, cfg)


def describe_correction(cfg: "AlgoConfig") -> str:
    """The rollout correction's summary with this config's numbers filled in."""
    return ROLLOUT_CORRECTIONS.entry(cfg.rollout_correction).summary.format(**vars(cfg))
