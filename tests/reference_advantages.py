"""Slow float64 references for the advantage estimators: plain Python loops over rows.

Written from the definitions in the module docstring of `keelrl.algos.advantages`, not
from its code: each row's action positions are pulled out as a Python list, and every
sum, mean, std and backward recursion is a loop over floats. The tests compare the
vectorised estimators with these on random inputs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

GROUP_ESTIMATORS = ("reinforce", "grpo", "dr_grpo", "rloo")
STEP_ESTIMATORS = ("reward_to_go", "td", "gae")
TURN_ESTIMATORS = ("turn_grpo", "turn_rloo")


def action_positions(mask_row: list[bool]) -> list[int]:
    return [t for t, is_action in enumerate(mask_row) if is_action]


def backward_scan(rewards: list[float], values: list[float], gamma: float,
                  lam: float) -> tuple[list[float], list[float]]:
    """Per-step rewards and values -> (advantages, returns) by GAE's recursion.

    delta_k = r_k + gamma * V_{k+1} - V_k (V after the last step = 0);
    A_k = delta_k + gamma * lam * A_{k+1}; returns_k = A_k + V_k.
    """
    n = len(rewards)
    advantages = [0.0] * n
    next_value = 0.0
    next_advantage = 0.0
    for k in range(n - 1, -1, -1):
        delta = rewards[k] + gamma * next_value - values[k]
        advantages[k] = delta + gamma * lam * next_advantage
        next_value = values[k]
        next_advantage = advantages[k]
    returns = [a + v for a, v in zip(advantages, values)]
    return advantages, returns


def _group_advantages(name: str, scores: list[float], groups: list[int],
                      norm_by_std: bool, std_eps: float) -> list[float]:
    members: dict[int, list[int]] = {}
    for row, gid in enumerate(groups):
        members.setdefault(gid, []).append(row)
    advantages = []
    for row, score in enumerate(scores):
        group = [scores[j] for j in members[groups[row]]]
        n = len(group)
        mean = sum(group) / n
        if name == "reinforce":
            advantages.append(score)
        elif name == "dr_grpo":
            advantages.append(score - mean)
        elif name == "grpo":
            centred = score - mean
            if norm_by_std:
                # Bessel-corrected std; a singleton group has std 0 (and centred 0).
                std = math.sqrt(sum((s - mean) ** 2 for s in group) / (n - 1)) if n > 1 else 0.0
                centred = centred / (std + std_eps)
            advantages.append(centred)
        elif name == "rloo":
            if n == 1:
                advantages.append(0.0)
            else:
                others = (sum(group) - score) / (n - 1)
                advantages.append(score - others)
        else:
            raise KeyError(name)
    return advantages


def reference_advantages(name: str, *, token_rewards: Tensor, mask: Tensor, group_ids: Tensor,
                         values: Tensor | None, turn_ids: Tensor | None, gamma: float,
                         lam: float, level: str, norm_by_std: bool = True,
                         std_eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """The estimator `name` by loops; returns float64 (advantages [B, T], returns [B, T])."""
    rewards = token_rewards.double().tolist()
    masks = mask.tolist()
    vals = values.double().tolist() if values is not None else None
    tids = turn_ids.tolist() if turn_ids is not None else None
    batch, length = mask.shape
    advantages = [[0.0] * length for _ in range(batch)]
    returns = [[0.0] * length for _ in range(batch)]

    if name in TURN_ESTIMATORS:
        return _turn_index_advantages(name, rewards, masks, group_ids.tolist(), tids, gamma, norm_by_std, std_eps)

    if name in GROUP_ESTIMATORS:
        scores = [sum(rewards[b][t] for t in action_positions(masks[b])) for b in range(batch)]
        per_row = _group_advantages(name, scores, group_ids.tolist(), norm_by_std, std_eps)
        for b in range(batch):
            for t in action_positions(masks[b]):
                advantages[b][t] = per_row[b]
        # returns: the discounted reward-to-go at the configured level (no critic behind them)
        _, group_returns = reference_advantages("reward_to_go", token_rewards=token_rewards, mask=mask,
                                                group_ids=group_ids, values=None, turn_ids=turn_ids,
                                                gamma=gamma, lam=1.0, level=level)
        return torch.tensor(advantages, dtype=torch.float64), group_returns

    step_lam = {"reward_to_go": 1.0, "td": 0.0, "gae": lam}[name]
    for b in range(batch):
        positions = action_positions(masks[b])
        row_values = vals[b] if (vals is not None and name != "reward_to_go") else [0.0] * length
        if level == "token":
            adv, ret = backward_scan([rewards[b][t] for t in positions],
                                     [row_values[t] for t in positions], gamma, step_lam)
            for k, t in enumerate(positions):
                advantages[b][t] = adv[k]
                returns[b][t] = ret[k]
        elif level == "turn":
            assert tids is not None
            turns: dict[int, list[int]] = {}
            for t in positions:
                turns.setdefault(tids[b][t], []).append(t)
            order = sorted(turns)  # steps in turn-index order
            turn_rewards = [sum(rewards[b][t] for t in turns[k]) for k in order]
            turn_values = [row_values[min(turns[k])] for k in order]  # value at first action token
            adv, ret = backward_scan(turn_rewards, turn_values, gamma, step_lam)
            for i, k in enumerate(order):
                for t in turns[k]:
                    advantages[b][t] = adv[i]
                    returns[b][t] = ret[i]
        else:
            raise ValueError(level)
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


def _turn_index_advantages(name: str, rewards: list[list[float]], masks: list[list[bool]], groups: list[int],
                           tids: list[list[int]] | None, gamma: float, norm_by_std: bool,
                           std_eps: float) -> tuple[Tensor, Tensor]:
    """turn_grpo / turn_rloo: each turn's reward-to-go over turns, compared per turn index."""
    assert tids is not None
    batch, length = len(masks), len(masks[0]) if masks else 0
    returns_by_turn: list[dict[int, float]] = []  # row -> {turn id: G}
    positions_by_turn: list[dict[int, list[int]]] = []
    for b in range(batch):
        turns: dict[int, list[int]] = {}
        for t in action_positions(masks[b]):
            turns.setdefault(tids[b][t], []).append(t)
        order = sorted(turns)
        g, row = 0.0, {}
        for k in reversed(order):
            g = sum(rewards[b][t] for t in turns[k]) + gamma * g
            row[k] = g
        returns_by_turn.append(row)
        positions_by_turn.append(turns)
    advantages = [[0.0] * length for _ in range(batch)]
    returns = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        group = [j for j in range(batch) if groups[j] == groups[b]]
        for k, positions in positions_by_turn[b].items():
            g = returns_by_turn[b][k]
            reached = [returns_by_turn[j][k] for j in group if k in returns_by_turn[j]]
            if name == "turn_grpo":
                n = len(reached)
                if n < 2:
                    advantage = 0.0
                else:
                    mean = sum(reached) / n
                    advantage = g - mean
                    if norm_by_std:
                        advantage /= math.sqrt(sum((x - mean) ** 2 for x in reached) / (n - 1)) + std_eps
            else:
                others = [returns_by_turn[j][k] for j in group if j != b and k in returns_by_turn[j]]
                whole = [returns_by_turn[j][min(returns_by_turn[j])] if returns_by_turn[j] else 0.0
                         for j in group if j != b]
                if len(group) < 2:
                    advantage = 0.0
                elif others:
                    advantage = g - sum(others) / len(others)
                else:
                    advantage = g - sum(whole) / len(whole)
            for t in positions:
                advantages[b][t], returns[b][t] = advantage, g
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)
