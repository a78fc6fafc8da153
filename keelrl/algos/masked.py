"""Masked reductions over [B, T] tensors.

`mask` is always a boolean tensor of the same shape marking the positions that count
(action tokens). Values at unmasked positions never influence a result, even when they are
inf or NaN: they are replaced before any arithmetic, not multiplied by zero. No reduction
here moves data to the host, so they are safe inside training loops on a GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_fill_zero(values: Tensor, mask: Tensor) -> Tensor:
    """values [B, T] -> [B, T] with every unmasked position set to exactly 0."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` over masked positions, over `dim` or everything."""
    filled = masked_fill_zero(values, mask)
    return filled.sum() if dim is None else filled.sum(dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of masked positions, as a float tensor, over `dim` or everything."""
    counts = mask.sum() if dim is None else mask.sum(dim)
    return counts.to(torch.get_default_dtype())


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked positions; 0 where nothing is masked (not NaN)."""
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: Tensor, mask: Tensor) -> Tensor:
    """Population variance over all masked positions (0 where fewer than one)."""
    mean = masked_mean(values, mask)
    return masked_mean((values - mean) ** 2, mask)


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max over all masked positions; 0 when nothing is masked."""
    lowest = torch.finfo(values.dtype).min
    filled = torch.where(mask, values, torch.full((), lowest, dtype=values.dtype, device=values.device))
    result = filled.max()
    return torch.where(mask.any(), result, torch.zeros_like(result))


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """values [B, T] -> [B, T] shifted to mean 0 and scaled to std 1 over masked positions.

    Unmasked positions come back as 0. Values that are all equal come back as exactly 0:
    a spread below 1e-6 of their magnitude is rounding noise, and scaling it up to std 1
    would invent a signal.
    """
    mean = masked_mean(values, mask)
    centred = masked_fill_zero(values - mean, mask)
    std = masked_mean(centred**2, mask).sqrt()
    noise_floor = 1e-6 * masked_mean(values.abs(), mask)
    scaled = torch.where(std > noise_floor, centred / (std + eps), torch.zeros_like(centred))
    return masked_fill_zero(scaled, mask)
