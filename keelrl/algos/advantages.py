"""Advantage estimators: who gets credit for the outcome.

All estimators share one keyword-only signature and return `AdvantageOutput`:

    fn(*, token_rewards [B, T], mask [B, T], group_ids [B], values [B, T] | None,
       turn_ids [B, T] | None, cfg) -> AdvantageOutput(advantages [B, T], returns [B, T])

`token_rewards` holds every reward at the token where it was earned: an outcome reward sits
on the last action token (`outcome_to_token_rewards`), a KL penalty on every action token, a
process reward on the last token of its step. `mask` marks action tokens; observation and
prompt positions are ignored on input (even NaN there changes nothing) and come back as 0.

Group estimators score a trajectory by the sum of its action-token rewards and compare it
with the other trajectories of its group (`group_ids`, any integers; equal id = same task):

- reinforce: the raw score, no baseline (REINFORCE / Williams 1992, outcome reward).
- grpo: score minus group mean, divided by the group's std (Bessel-corrected) when
  `cfg.norm_by_std` (DeepSeekMath). A single-trajectory group has std 0 and advantage 0.
- dr_grpo: score minus group mean, never divided (Dr.GRPO, Liu et al. 2025).
- rloo: score minus the mean of the *other* members of its group (Kool et al. 2019).
- turn_grpo, turn_rloo: per turn index k over turns (always turn level): each turn's
  reward-to-go G_k against the group's episodes that reached turn k; turn_grpo normalises per
  index (as multi-turn GRPO variants do, biased when episodes differ in length), turn_rloo
  takes a leave-one-out baseline per index (unbiased; docs/credit-assignment.md).

Their `returns` are the discounted reward-to-go at `cfg.level`, as `reward_to_go` computes it,
so a critic can be trained beside a group estimator. A row without action tokens still counts
as a member of its group, with score 0.

Step estimators run a backward scan over steps, where a step is an action token
(`cfg.level == "token"`) or a whole turn (`"turn"`: the turn's reward is the sum of its
tokens' rewards, its value is the critic's value at the turn's first action token, and the
turn's advantage is given to every action token of the turn). Observation tokens are not
steps: the scan jumps over them, so they never change an advantage (the environment's reply
is part of the transition, not an action).

- reward_to_go: discounted sum of future rewards, G_t = r_t + gamma * G_{t+1}.
- td: one-step TD error, delta_t = r_t + gamma * V_{t+1} - V_t (V after the last step = 0).
- gae: generalised advantage estimation (Schulman et al. 2016),
  A_t = delta_t + gamma * lam * A_{t+1}; returns = A_t + V_t (the critic's target).

`values[b, t]` is the critic's estimate V(history before action token t).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from keelrl.algos.masked import masked_fill_zero, masked_whiten
from keelrl.algos.registries import ADVANTAGES

if TYPE_CHECKING:
    from keelrl.algos.config import AlgoConfig

GROUP_STD_EPS = 1e-6
"""Added to a group's std before dividing, so all-equal groups give 0, not NaN."""


class AdvantageOutput(NamedTuple):
    """advantages [B, T] for the policy loss; returns [B, T] a critic can regress on."""

    advantages: Tensor
    returns: Tensor


def outcome_to_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """rewards [B], mask [B, T] -> [B, T] with each reward on the row's last action token.

    Rows without any action token get no reward anywhere. Floating rewards keep their dtype
    (float64 stays float64); bool and integer rewards become the default float dtype.
    """
    batch, length = mask.shape
    if rewards.shape != (batch,):
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}, expected ({batch},) for mask "
                         f"{tuple(mask.shape)}: one outcome reward per row")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    positions = torch.arange(length, device=mask.device).expand(batch, length)
    last = torch.where(mask, positions, -1).max(dim=1).values  # [B]
    onehot = positions == last.unsqueeze(1)  # [B, T]; never true for rows with last = -1
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    return torch.where(onehot, rewards.unsqueeze(1), zero)


def trajectory_scores(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """token_rewards [B, T] -> [B]: total reward over each row's action tokens."""
    return masked_fill_zero(token_rewards, mask).sum(dim=1)


def _same_group(group_ids: Tensor, batch: int) -> Tensor:
    """group_ids [B] -> same [B, B], true where rows i and j share a group.

    A [B, B] matrix: no host sync and no assumption that ids are dense.
    """
    if group_ids.shape != (batch,):
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected ({batch},): "
                         f"one group id per row")
    return group_ids.unsqueeze(0) == group_ids.unsqueeze(1)  # [B, B]


def _group_sum(per_row: Tensor, same: Tensor) -> Tensor:
    """per_row [B], same [B, B] -> [B]: sum of per_row over each row's group.

    A select, not a matmul: 0 * inf would let one group's inf or NaN leak into every group.
    """
    zero = torch.zeros((), dtype=per_row.dtype, device=per_row.device)
    return torch.where(same, per_row.unsqueeze(0), zero).sum(dim=1)


def group_offsets(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """scores [B], group_ids [B] -> (same [B, B], group size [B], offsets [B]).

    offsets = score minus the best score of its group. Group means are taken over offsets,
    not raw scores: equal scores have offsets of exactly 0, so an all-equal group gets exactly
    0 advantage. A mean of raw scores rounds: six equal float32 scores of about 539 gave a
    GRPO advantage of 1.5 once divided by the group's rounding-noise std.
    """
    same = _same_group(group_ids, scores.shape[0])
    size = same.sum(dim=1).to(scores.dtype)
    if scores.shape[0] == 0:  # amax cannot reduce an empty dim; nothing to centre
        return same, size, scores
    lowest = torch.full((), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = torch.where(same, scores.unsqueeze(0), lowest).amax(dim=1)  # [B]
    return same, size, scores - best


def _group_centred(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """scores [B], group_ids [B] -> (same [B, B], group size [B], score - group mean [B])."""
    same, size, offsets = group_offsets(scores, group_ids)
    return same, size, offsets - _group_sum(offsets, same) / size


def _broadcast(per_row: Tensor, mask: Tensor) -> Tensor:
    """per_row [B] -> [B, T], the row's value at action tokens and 0 elsewhere."""
    return masked_fill_zero(per_row.unsqueeze(1).expand(mask.shape), mask)


def _group_output(per_row_adv: Tensor, token_rewards: Tensor, mask: Tensor,
                  turn_ids: Tensor | None, cfg: "AlgoConfig") -> "AdvantageOutput":
    """Broadcast per-row advantages; returns are the discounted reward-to-go at cfg.level."""
    if cfg.gamma == 1.0 and cfg.level == "token":  # no discount: a reversed cumsum, no scan
        rewards = masked_fill_zero(token_rewards, mask)
        returns = masked_fill_zero(rewards.flip(1).cumsum(1).flip(1), mask)  # [B, T]
    else:
        returns = _step_estimator(token_rewards, mask, None, turn_ids, cfg, lam=1.0).returns
    return AdvantageOutput(_broadcast(per_row_adv, mask), returns)


def _sanitize(token_rewards: Tensor, mask: Tensor) -> Tensor:
    if token_rewards.shape != mask.shape:
        raise ValueError(f"token_rewards has shape {tuple(token_rewards.shape)}, "
                         f"mask has {tuple(mask.shape)}; they must match ([B, T])")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
    if not token_rewards.is_floating_point():
        token_rewards = token_rewards.to(torch.get_default_dtype())
    return masked_fill_zero(token_rewards, mask)


@ADVANTAGES.register("reinforce", summary="raw outcome reward, no baseline (REINFORCE)",
                     tags=("group", "outcome",))
def reinforce(*, token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
              values: Tensor | None, turn_ids: Tensor | None, cfg: "AlgoConfig") -> AdvantageOutput:
    """token_rewards [B, T] -> advantages [B, T]: each row's total reward at every action token."""
    token_rewards = _sanitize(token_rewards, mask)
    return _group_output(trajectory_scores(token_rewards, mask), token_rewards, mask, turn_ids, cfg)


@ADVANTAGES.register("grpo", summary="group comparison: (r - group mean) / group std",
                     tags=("group", "outcome", "uses_std"))
def grpo(*, token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
         values: Tensor | None, turn_ids: Tensor | None, cfg: "AlgoConfig") -> AdvantageOutput:
    """token_rewards [B, T] -> [B, T]: (score - group mean), / group std if cfg.norm_by_std."""
    token_rewards = _sanitize(token_rewards, mask)
    scores = trajectory_scores(token_rewards, mask)  # [B]
    same, size, centred = _group_centred(scores, group_ids)
    if cfg.norm_by_std:
        sq_dev = _group_sum(centred**2, same)  # [B], sum of squared deviations in the row's group
        var = sq_dev / (size - 1).clamp(min=1)
        std = torch.where(size > 1, var.sqrt(), torch.zeros_like(var))
        centred = centred / (std + GROUP_STD_EPS)
    return _group_output(centred, token_rewards, mask, turn_ids, cfg)


@ADVANTAGES.register("dr_grpo", summary="group comparison: r - group mean (no std)",
                     tags=("group", "outcome",))
def dr_grpo(*, token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
            values: Tensor | None, turn_ids: Tensor | None, cfg: "AlgoConfig") -> AdvantageOutput:
    """token_rewards [B, T] -> [B, T]: score minus its group's mean."""
    token_rewards = _sanitize(token_rewards, mask)
    scores = trajectory_scores(token_rewards, mask)
    _, _, centred = _group_centred(scores, group_ids)
    return _group_output(centred, token_rewards, mask, turn_ids, cfg)


@ADVANTAGES.register("rloo", summary="leave-one-out: r - mean of the group's others (RLOO)",
                     tags=("group", "outcome",))
def rloo(*, token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
         values: Tensor | None, turn_ids: Tensor | None, cfg: "AlgoConfig") -> AdvantageOutput:
    """token_rewards [B, T] -> [B, T]: score minus the mean of the other group members.

    A single-member group has no others and gets advantage 0.
    """
    token_rewards = _sanitize(token_rewards, mask)
    scores = trajectory_scores(token_rewards, mask)
    same, size, offsets = group_offsets(scores, group_ids)
    others_mean = (_group_sum(offsets, same) - offsets) / (size - 1).clamp(min=1)  # as offsets
    advantage = torch.where(size > 1, offsets - others_mean, torch.zeros_like(scores))
    return _group_output(advantage, token_rewards, mask, turn_ids, cfg)


def _turn_returns(token_rewards: Tensor, mask: Tensor, turn_ids: Tensor | None,
                  gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    """-> (G [B, K] each turn's discounted reward-to-go over turns, is-turn [B, K], ids [B, T])."""
    token_rewards = _sanitize(token_rewards, mask)
    turn_rewards, turn_values, is_turn, ids = _to_turns(token_rewards, torch.zeros_like(token_rewards), mask,
                                                        turn_ids)
    _, returns = _scan(turn_rewards, turn_values, is_turn, gamma, 1.0)
    return returns, is_turn, ids


def _per_index(returns: Tensor, is_turn: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For each row i and turn index k, over the rows j of i's group that have a turn k:
    (count [B, K], sum of G [B, K], sum of G^2 [B, K]); i itself included where it has one."""
    same = _same_group(group_ids, returns.shape[0]).unsqueeze(2)  # [B, B, 1]
    member = same & is_turn.unsqueeze(0)  # [B, B, K]: j (dim 1) in i's group with a turn k
    zero = torch.zeros((), dtype=returns.dtype, device=returns.device)
    values = torch.where(member, returns.unsqueeze(0), zero)
    return member.sum(dim=1).to(returns.dtype), values.sum(dim=1), (values * values).sum(dim=1)


@ADVANTAGES.register("turn_grpo", summary="per turn index: (G_k - mean) / std over the group's turns k",
                     tags=("group", "uses_std"))
def turn_grpo(*, token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
              values: Tensor | None, turn_ids: Tensor | None, cfg: "AlgoConfig") -> AdvantageOutput:
    """Per-turn-index normalisation, as multi-turn GRPO variants do it: turn k's advantage is its
    reward-to-go G_k (over turns, `cfg.gamma`) minus the mean of G_k over the group's episodes
    that have a turn k, divided by their std (Bessel) when `cfg.norm_by_std`; 0 where only one
    episode reached turn k. Kept to show its bias (docs/credit-assignment.md): when episodes end
    at different turns, the comparison set at turn k is the episodes long enough to reach it,
    each episode is in its own baseline, and a late turn that only one episode reached gets
    nothing, so long and short episodes are weighted differently. `turn_rloo` removes it."""
    returns, is_turn, ids = _turn_returns(token_rewards, mask, turn_ids, cfg.gamma)
    count, total, squares = _per_index(returns, is_turn, group_ids)
    mean = total / count.clamp(min=1)
    advantage = returns - mean
    if cfg.norm_by_std:
        variance = (squares - count * mean * mean).clamp(min=0) / (count - 1).clamp(min=1)
        advantage = advantage / (variance.sqrt() + GROUP_STD_EPS)
    advantage = torch.where(is_turn & (count > 1), advantage, torch.zeros_like(advantage))
    return AdvantageOutput(masked_fill_zero(advantage.gather(1, ids), mask),
                           masked_fill_zero(returns.gather(1, ids), mask))


@ADVANTAGES.register("turn_rloo", summary="per turn index: G_k - mean G_k of the group's other episodes",
                     tags=("group",))
def turn_rloo(*, token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
              values: Tensor | None, turn_ids: Tensor | None, cfg: "AlgoConfig") -> AdvantageOutput:
    """Turn credit that is unbiased whatever lengths the episodes take: turn k's advantage is its
    reward-to-go G_k (over turns, `cfg.gamma`) minus the mean G_k of the *other* episodes of its
    group that reached turn k; where none did, minus the mean whole-episode return G_0 of the
    group's others. Each baseline is made of other episodes only, which the turn's action cannot
    change, so E[advantage x grad log pi(turn)] is the policy gradient exactly (no std division,
    no self-inclusion, no length-dependent weight); a single-episode group gets 0."""
    returns, is_turn, ids = _turn_returns(token_rewards, mask, turn_ids, cfg.gamma)
    count, total, _ = _per_index(returns, is_turn, group_ids)
    own = torch.where(is_turn, returns, torch.zeros_like(returns))
    others = count - is_turn.to(returns.dtype)
    index_baseline = (total - own) / others.clamp(min=1)
    same = _same_group(group_ids, returns.shape[0])
    first = is_turn.to(torch.int8).argmax(dim=1, keepdim=True)  # the row's first turn (0 for a row without)
    episode_returns = returns.gather(1, first).squeeze(1)  # [B]: G from the first turn, the whole return
    size = same.sum(dim=1).to(returns.dtype)
    episode_baseline = (_group_sum(episode_returns, same) - episode_returns) / (size - 1).clamp(min=1)  # [B]
    baseline = torch.where(others > 0, index_baseline, episode_baseline.unsqueeze(1))
    advantage = torch.where(is_turn & (size > 1).unsqueeze(1), returns - baseline, torch.zeros_like(returns))
    return AdvantageOutput(masked_fill_zero(advantage.gather(1, ids), mask),
                           masked_fill_zero(returns.gather(1, ids), mask))


def _scan(rewards: Tensor, values: Tensor, steps: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """rewards, values, steps [B, S] -> (advantages [B, S], returns [B, S]) by a backward scan.

    Only positions where `steps` is true are steps; the scan skips the others, which come
    back as 0. The value after the last step is 0 (the episode ended).
    """
    batch, length = steps.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    next_advantage = torch.zeros_like(next_value)
    for t in range(length - 1, -1, -1):
        is_step = steps[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(is_step, advantage, 0.0)
        next_value = torch.where(is_step, values[:, t], next_value)
        next_advantage = torch.where(is_step, advantage, next_advantage)
    returns = masked_fill_zero(advantages + values, steps)
    return advantages, returns


def _to_turns(token_rewards: Tensor, values: Tensor, mask: Tensor,
              turn_ids: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Token tensors [B, T] -> turn tensors [B, K] (rewards, values, is-turn) and ids [B, T].

    A turn exists in a row when it has at least one action token. Its value is the value at
    its first action token.
    """
    if turn_ids is None:
        raise ValueError("level='turn' needs turn_ids [B, T] (turn index of every token)")
    if turn_ids.shape != mask.shape:
        raise ValueError(f"turn_ids has shape {tuple(turn_ids.shape)}, mask has {tuple(mask.shape)}")
    ids = torch.where(mask, turn_ids.long(), 0)
    if bool((ids < 0).any()):
        raise ValueError("turn_ids must be >= 0 at action tokens")
    num_turns = int(ids.max()) + 1 if ids.numel() else 1  # two syncs per batch, none per token
    batch, length = mask.shape
    turn_rewards = torch.zeros(batch, num_turns, dtype=token_rewards.dtype, device=mask.device)
    turn_rewards.scatter_add_(1, ids, masked_fill_zero(token_rewards, mask))
    positions = torch.arange(length, device=mask.device).expand(batch, length)
    first = torch.full((batch, num_turns), length, dtype=torch.long, device=mask.device)
    first.scatter_reduce_(1, ids, torch.where(mask, positions, length), reduce="amin")
    is_turn = first < length  # [B, K]
    turn_values = values.gather(1, first.clamp(max=length - 1))
    return turn_rewards, masked_fill_zero(turn_values, is_turn), is_turn, ids


def _check_values(values: Tensor, mask: Tensor) -> Tensor:
    # torch.where would broadcast a [B, 1] or [T] tensor silently; values are per token.
    if values.shape != mask.shape:
        raise ValueError(f"values has shape {tuple(values.shape)}, mask has {tuple(mask.shape)}; "
                         f"they must match ([B, T])")
    return masked_fill_zero(values, mask)


def _step_estimator(token_rewards: Tensor, mask: Tensor, values: Tensor | None,
                    turn_ids: Tensor | None, cfg: "AlgoConfig", lam: float) -> AdvantageOutput:
    token_rewards = _sanitize(token_rewards, mask)
    values = torch.zeros_like(token_rewards) if values is None else _check_values(values, mask)
    if cfg.level == "token":
        return AdvantageOutput(*_scan(token_rewards, values, mask, cfg.gamma, lam))
    turn_rewards, turn_values, is_turn, ids = _to_turns(token_rewards, values, mask, turn_ids)  # [B, K]
    turn_adv, turn_ret = _scan(turn_rewards, turn_values, is_turn, cfg.gamma, lam)
    advantages = masked_fill_zero(turn_adv.gather(1, ids), mask)  # [B, T]
    returns = masked_fill_zero(turn_ret.gather(1, ids), mask)  # [B, T]
    return AdvantageOutput(advantages, returns)


def _require_values(values: Tensor | None, name: str) -> Tensor:
    if values is None:
        raise ValueError(f"advantage estimator {name!r} needs critic values [B, T]; got None")
    return values


@ADVANTAGES.register("reward_to_go", summary="discounted reward-to-go per step")
def reward_to_go(*, token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
                 values: Tensor | None, turn_ids: Tensor | None, cfg: "AlgoConfig") -> AdvantageOutput:
    """token_rewards [B, T] -> [B, T]: G_t = r_t + gamma * G_{t+1} over steps (no baseline)."""
    return _step_estimator(token_rewards, mask, None, turn_ids, cfg, lam=1.0)


@ADVANTAGES.register("td", summary="critic: one-step TD error r + gamma V' - V",
                     tags=("critic",))
def td(*, token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
       values: Tensor | None, turn_ids: Tensor | None, cfg: "AlgoConfig") -> AdvantageOutput:
    """token_rewards, values [B, T] -> [B, T]: delta_t = r_t + gamma * V_{t+1} - V_t."""
    return _step_estimator(token_rewards, mask, _require_values(values, "td"), turn_ids, cfg, lam=0.0)


@ADVANTAGES.register("gae", summary="critic + GAE(gamma, lambda) per step",
                     tags=("critic",))
def gae(*, token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
        values: Tensor | None, turn_ids: Tensor | None, cfg: "AlgoConfig") -> AdvantageOutput:
    """token_rewards, values [B, T] -> [B, T]: A_t = delta_t + gamma * lam * A_{t+1}."""
    return _step_estimator(token_rewards, mask, _require_values(values, "gae"), turn_ids, cfg, lam=cfg.lam)


def td_errors(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """token_rewards, values, mask [B, T] -> delta [B, T] over action tokens (observations skipped)."""
    token_rewards = _sanitize(token_rewards, mask)
    return _scan(token_rewards, _check_values(values, mask), mask, gamma, 0.0)[0]


def compute_advantages(*, token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
                       cfg: "AlgoConfig", values: Tensor | None = None,
                       turn_ids: Tensor | None = None) -> AdvantageOutput:
    """Run the estimator `cfg.advantage`, then whiten over action tokens if `cfg.whiten`.

    Returns are never whitened: they are the critic's regression target.
    """
    estimator = ADVANTAGES.get(cfg.advantage)
    out = estimator(token_rewards=token_rewards, mask=mask, group_ids=group_ids,
                    values=values, turn_ids=turn_ids, cfg=cfg)
    if cfg.whiten:
        return AdvantageOutput(masked_whiten(out.advantages, mask), out.returns)
    return out
