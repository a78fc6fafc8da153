"""Importance ratios between the learner's policy pi and the behaviour policy mu.

All share one signature: `fn(logp [B, T], old_logp [B, T], mask [B, T], cfg) -> ratio [B, T]`,
where `logp` is log pi(token) (with gradient), `old_logp` is log mu(token) recorded at
sampling time (no gradient), and `mask` marks action tokens. Observation tokens are not
actions: they are skipped in sums, products and lengths, and get ratio exactly 1 with no
gradient. Log-weights are clamped to +-cfg.max_log_ratio before exp so a ratio is never inf;
a token whose log-weight is past the clamp gets no gradient through the ratio, as if clipped
(with the default 20, that is a weight above 4.8e8: only an exact trajectory ratio or a
CTPO prefix over a long, stale trajectory gets there).

- token:      r_t = pi(y_t) / mu(y_t)                                     (PPO, GRPO, DAPO)
- sequence:   s = exp(mean_t log r_t), the same at every token; gradient through the mean
              (GSPO, Zheng et al. 2025: the length-normalised sequence ratio)
- sequence_token: value s at every token, gradient sg(s) * grad log pi(y_t) (GSPO-token:
              equal to `sequence` when a row's advantages are equal, but allows per-token ones)
- cumulative: R = prod_t r_t over all of a row's action tokens, the exact trajectory ratio,
              the same at every token, gradient through every factor
- ctpo:       P_t = prod_{s <= t} r_s, the prefix ratio at each token, gradient through the
              current token's factor only (CTPO, Zhang et al. 2026: corrects for how often pi
              reaches the prefix without the variance of the full product)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from keelrl.algos.masked import masked_fill_zero
from keelrl.algos.registries import RATIOS

if TYPE_CHECKING:
    from keelrl.algos.config import AlgoConfig


def compute_dtype(tensor: Tensor) -> torch.dtype:
    """float32 for half-precision inputs, else the input's own float dtype.

    Ratios near 1 and clip bounds like GSPO's 1 +- 3e-4 are below bf16's resolution (0.0078
    at 1.0), so losses are never computed in half precision. Log-probabilities should come
    from a float32 log-softmax too: this cannot undo rounding that already happened.
    """
    return torch.promote_types(tensor.dtype, torch.float32)


def token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """logp, old_logp [B, T] -> log r_t [B, T] in >= float32, exactly 0 at observation tokens."""
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
                         f"{tuple(mask.shape)} must all be [B, T]")
    dtype = torch.promote_types(compute_dtype(logp), compute_dtype(old_logp))
    return masked_fill_zero(logp.to(dtype), mask) - masked_fill_zero(old_logp.detach().to(dtype), mask)


def _exp(log_weight: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Tensor:
    limit = cfg.max_log_ratio
    ratio = torch.exp(log_weight.clamp(-limit, limit))
    return torch.where(mask, ratio, torch.ones((), dtype=ratio.dtype, device=ratio.device))


@RATIOS.register("token", summary="per-token ratio pi/mu")
def token(logp: Tensor, old_logp: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Tensor:
    """logp, old_logp, mask [B, T] -> r_t = exp(logp - old_logp) [B, T]."""
    return _exp(token_log_ratio(logp, old_logp, mask), mask, cfg)


def _sequence_mean_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """-> [B, 1]: mean of log r_t over each row's action tokens (0 for rows without any)."""
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    return token_log_ratio(logp, old_logp, mask).sum(dim=1, keepdim=True) / lengths


@RATIOS.register("sequence", summary="sequence ratio exp(mean log pi/mu) (GSPO)")
def sequence(logp: Tensor, old_logp: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Tensor:
    """logp, old_logp, mask [B, T] -> s = exp(mean_t log r_t) at every action token [B, T]."""
    mean_log_ratio = _sequence_mean_log_ratio(logp, old_logp, mask)  # [B, 1]
    return _exp(mean_log_ratio.expand(mask.shape), mask, cfg)


@RATIOS.register("sequence_token", summary="GSPO value, per-token gradient (GSPO-token)")
def sequence_token(logp: Tensor, old_logp: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Tensor:
    """[B, T] -> value s (as `sequence`) with gradient sg(s) * d log pi(y_t) at token t."""
    mean_log_ratio = _sequence_mean_log_ratio(logp, old_logp, mask).detach()  # [B, 1]
    own = masked_fill_zero(logp.to(mean_log_ratio.dtype), mask)
    log_weight = mean_log_ratio + own - own.detach()  # [B, T]
    return _exp(log_weight, mask, cfg)


@RATIOS.register("cumulative", summary="trajectory ratio: product of all pi/mu")
def cumulative(logp: Tensor, old_logp: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Tensor:
    """[B, T] -> prod over the row's action tokens of r_s, at every action token [B, T]."""
    total = token_log_ratio(logp, old_logp, mask).sum(dim=1, keepdim=True)  # [B, 1]
    return _exp(total.expand(mask.shape), mask, cfg)


@RATIOS.register("ctpo", summary="prefix ratio prod_{s<=t} pi/mu, grad via token t (CTPO)")
def ctpo(logp: Tensor, old_logp: Tensor, mask: Tensor, cfg: "AlgoConfig") -> Tensor:
    """[B, T] -> P_t = prod_{s <= t} r_s [B, T]; gradient only through r_t's own log pi."""
    log_ratio = token_log_ratio(logp, old_logp, mask)
    prefix = torch.cumsum(log_ratio, dim=1)  # [B, T]; observation tokens add 0
    log_weight = prefix.detach() - log_ratio.detach() + log_ratio
    return _exp(log_weight, mask, cfg)
