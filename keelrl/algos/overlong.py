"""Overlong episodes: what an episode cut by a limit does to the update (`algo.overlong`).

An episode is *cut* when a limit ended it, not the agent: the turn limit or the context limit
(`keelrl.rollout.trajectory.CUT_TERMINATIONS`). Its grade judges an unfinished attempt, so its
reward says little about its actions; DAPO (Yu et al. 2025, section 3.4) calls such samples
truncated and offers two remedies, both here, beside leaving them alone:

- keep:    nothing changes; a cut episode's reward is its grade.
- mask:    DAPO's Overlong Filtering, "masks the loss of truncated samples": a cut episode's
           action tokens leave the update's mask and its advantages become 0, so it adds no
           term to the loss (policy, KL, entropy, value or distillation: every term the learner
           sums over action tokens) nor a token to any aggregation's count. It still counts in
           its group's baseline with its graded reward, as the truncated samples stay among
           DAPO's G outputs whose rewards give the advantages: the other episodes' advantages
           are exactly those of keep. The teacher's samples (GKD) are not filtered: they are
           distilled on, not reinforced.
- penalty: DAPO's Soft Overlong Punishment (eq. 13) added to each episode's reward before the
           advantages: `soft_overlong_penalty` of the episode's context length |y| (prompt,
           actions and observations: what the context limit measures) against
           L_max = rollout.max_context_tokens with buffer L_cache = algo.overlong_buffer, times
           algo.overlong_penalty. A cut episode gets the full penalty -overlong_penalty whatever
           its length, as a truncated response in DAPO has |y| = L_max: where DAPO's only limit
           is the length, ours are the context and the turn count, and the scheduler stops an
           episode before a turn that might not fit, so a context-cut episode can be shorter
           than L_max. Uncut episodes inside the buffer are penalised too (the "soft" part, as
           in DAPO): the penalty warns before the limit is reached. Dynamic sampling
           (keelrl.train.dynamic) judges a group by its graded rewards, before the penalty, as
           DAPO's filter judges accuracy: a group whose attempts all failed is dropped even when
           some of them were cut.

Departures from the paper: here the remedies are one setting, so they cannot be combined (the
paper's best run shapes the reward without the filter, as verl's DAPO recipe notes). The
penalty's scale (`overlong_penalty`, 1 in the paper) is verl's `penalty_factor`. The multi-turn
reading of |y| and L_max, and the full penalty for a turn-limit cut, are ours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from keelrl.algos.config import AlgoConfig

OVERLONG_MODES = ("keep", "mask", "penalty")
"""The values of `algo.overlong` (module docstring)."""

Metrics = dict[str, Tensor]


def soft_overlong_penalty(lengths: Tensor, max_len: int, buffer: int) -> Tensor:
    """lengths [B] -> penalties [B] (float64) in [-1, 0]: DAPO's soft overlong punishment (eq. 13).

        R_length(y) = 0                                  |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache L_max - L_cache < |y| <= L_max
                    = -1                                 |y| > L_max

    with L_max = `max_len` and L_cache = `buffer`. A buffer of 0 leaves the step alone: 0 up
    to L_max, -1 past it.
    """
    if buffer < 0 or buffer > max_len:
        raise ValueError(f"buffer must be in [0, max_len={max_len}], got {buffer}")
    lengths = lengths.to(torch.float64)
    expected = max_len - buffer  # the longest |y| without penalty
    excess = (lengths - expected).clamp(min=0.0)  # [B]
    if buffer == 0:
        return -(excess > 0).to(torch.float64)
    return -(excess / buffer).clamp(max=1.0)


def overlong_shaping(rewards: Tensor, lengths: Tensor, cut: Tensor, max_len: int,
                     cfg: "AlgoConfig") -> tuple[Tensor, Metrics]:
    """rewards, lengths, cut [B] -> (rewards [B], metrics): in penalty mode, each reward plus
    overlong_penalty x (-1 where `cut`, else `soft_overlong_penalty` of its length); in any
    other mode `rewards` itself and no metrics.

    Metrics (penalty mode): train/overlong_penalty_mean (the mean added reward, <= 0) and
    train/overlong_penalised_frac (the share of episodes whose reward it lowered)."""
    if cfg.overlong != "penalty":
        return rewards, {}
    soft = soft_overlong_penalty(lengths, max_len, cfg.overlong_buffer)  # [B]
    penalty = torch.where(cut.bool(), torch.full_like(soft, -1.0), soft) * cfg.overlong_penalty  # [B]
    metrics = {"train/overlong_penalty_mean": penalty.mean(),
               "train/overlong_penalised_frac": (penalty < 0).to(torch.float64).mean()}
    return rewards + penalty.to(rewards.dtype), metrics


def overlong_filter(advantages: Tensor, mask: Tensor, cut: Tensor,
                    cfg: "AlgoConfig") -> tuple[Tensor, Tensor, Metrics]:
    """advantages [B, T], mask [B, T], cut [B] -> (advantages, mask, metrics): in mask mode the
    rows that are `cut` lose their action tokens (mask False) and their advantages (0); in any
    other mode the inputs themselves and no metrics.

    Metrics (mask mode): train/overlong_masked_token_frac, the share of the batch's action
    tokens left out of the loss."""
    if cfg.overlong != "mask":
        return advantages, mask, {}
    kept = ~cut.bool().unsqueeze(1)  # [B, 1]
    loss_mask = mask & kept  # [B, T]
    filtered = torch.where(kept, advantages, torch.zeros((), dtype=advantages.dtype, device=advantages.device))
    dropped = (mask & ~kept).sum().to(torch.float64) / mask.sum().clamp(min=1).to(torch.float64)
    return filtered, loss_mask, {"train/overlong_masked_token_frac": dropped}

