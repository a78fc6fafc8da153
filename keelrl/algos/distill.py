"""Teacher-student divergences per token, for distillation (pure functions, no model).

Inputs are logits over the vocabulary, [B, T, V] (or any [..., V]); outputs are per-token
divergences [B, T] (or [...]), reduced by the caller with the trainer's aggregation over the
tokens it trains on. Softmaxes run in float32 at least (float64 inputs stay float64).

- `forward_kl`: KL(teacher || student), the classic distillation loss (Hinton et al. 2015)
  when the histories come from the teacher: the student covers every token the teacher puts
  mass on. With `top_k`, only the teacher's k most likely tokens are kept and the rest of the
  vocabulary is one bucket on each side: the result is the KL between those coarsened
  distributions, which is never above the full KL, and the gap is exactly the teacher's
  remaining mass times the KL between the two distributions renormalised over the remaining
  tokens (the chain rule of KL; `top_k_gap` computes it, the tests check the identity).
- `reverse_kl`: KL(student || teacher), mode-seeking; on the student's own samples it is the
  on-policy distillation loss (Agarwal et al. 2024). `sampled_reverse_kl` is its one-sample
  estimate at the sampled token, log pi_S(a) - log pi_T(a), the per-token term that serves as
  a dense (negative) reward or advantage.
- `generalized_jsd`: GKD's interpolation, beta * KL(T || M) + (1 - beta) * KL(S || M) with
  M = beta * T + (1 - beta) * S; beta = 0 is forward KL and beta = 1 reverse KL exactly (the
  endpoints are computed as those KLs, since the mixture degenerates there).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _log_probs(logits: Tensor, temperature: float) -> Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits / temperature, dim=-1)


def _check(student_logits: Tensor, teacher_logits: Tensor) -> None:
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: distillation needs one vocabulary")


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) over the last dimension, with 0 log 0 = 0."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros((), dtype=p.dtype, device=p.device)).sum(-1)


def forward_kl(student_logits: Tensor, teacher_logits: Tensor, *, temperature: float = 1.0,
               top_k: int | None = None) -> Tensor:
    """KL(teacher || student) per position; with `top_k`, over the teacher's top k tokens and
    one bucket for the rest of the vocabulary (see the module docstring)."""
    _check(student_logits, teacher_logits)
    log_s, log_t = _log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature)
    if top_k is None or top_k >= log_t.shape[-1]:
        return _kl(log_t, log_s)
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    kept_t, index = log_t.topk(top_k, dim=-1)
    kept_s = log_s.gather(-1, index)
    rest_t = _log_rest(kept_t)
    rest_s = _log_rest(kept_s)
    return _kl(torch.cat([kept_t, rest_t.unsqueeze(-1)], -1), torch.cat([kept_s, rest_s.unsqueeze(-1)], -1))


def _log_rest(kept: Tensor) -> Tensor:
    """log(1 - sum(exp(kept))) over the last dimension, accurately when the kept mass is near 1."""
    total = torch.logsumexp(kept, dim=-1)
    return torch.log(-torch.expm1(total.clamp(max=0.0)))


def top_k_gap(student_logits: Tensor, teacher_logits: Tensor, *, top_k: int, temperature: float = 1.0) -> Tensor:
    """forward_kl - forward_kl(top_k) per position: the teacher's mass outside its top k times
    KL between teacher and student renormalised over those remaining tokens (>= 0)."""
    _check(student_logits, teacher_logits)
    log_s, log_t = _log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature)
    index = log_t.topk(top_k, dim=-1).indices
    outside = torch.ones_like(log_t, dtype=torch.bool).scatter(-1, index, False)
    minus_inf = torch.tensor(-math.inf, dtype=log_t.dtype, device=log_t.device)
    rest_t, rest_s = log_t.where(outside, minus_inf), log_s.where(outside, minus_inf)
    mass_t = torch.logsumexp(rest_t, -1, keepdim=True)
    mass_s = torch.logsumexp(rest_s, -1, keepdim=True)
    return mass_t.squeeze(-1).exp() * _kl(rest_t - mass_t, rest_s - mass_s)


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """KL(student || teacher) per position, over the whole vocabulary."""
    _check(student_logits, teacher_logits)
    return _kl(_log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature))


def sampled_reverse_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """The one-sample estimate of KL(student || teacher) at each sampled token [B, T]:
    log pi_S(a_t) - log pi_T(a_t). Its expectation under the student is the reverse KL."""
    if student_logp.shape != teacher_logp.shape:
        raise ValueError(f"log-prob shapes differ: {tuple(student_logp.shape)} vs {tuple(teacher_logp.shape)}")
    return student_logp - teacher_logp


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, *, beta: float, temperature: float = 1.0) -> Tensor:
    """GKD's generalised Jensen-Shannon divergence per position, beta in [0, 1]:
    beta KL(T || M) + (1 - beta) KL(S || M), M = beta T + (1 - beta) S. Its limits are
    forward KL (beta -> 0, after dividing by beta) and reverse KL (beta -> 1, after dividing
    by 1 - beta); at exactly 0 and 1 it returns forward and reverse KL themselves."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    _check(student_logits, teacher_logits)
    log_s, log_t = _log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature)
    if beta == 0.0:
        return _kl(log_t, log_s)
    if beta == 1.0:
        return _kl(log_s, log_t)
    log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))
    return beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)


def top_token_disagreement(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """1.0 where the teacher's most likely token differs from the student's, else 0.0 (per position)."""
    _check(student_logits, teacher_logits)
    return (student_logits.argmax(-1) != teacher_logits.argmax(-1)).to(torch.float32)
