"""Potential-based reward shaping (Ng, Harada and Russell 1999).

Adding F(s, s') = gamma * phi(s') - phi(s) to every transition's reward, with phi of the
absorbing end state taken as 0, leaves every policy's return changed by the same -phi(s0), so
the optimal policies are the unshaped ones; only how soon the credit arrives changes. A bonus
that is not such a difference (a reward for running the tests, say) can change which policy is
best: the lecture's proxy-reward warning. `shaping_reward` is the per-turn term; an environment
reports it as its turn's info["reward"] (`keelrl.envs.coding` with `shaping` > 0).
"""

from __future__ import annotations


def shaping_reward(phi_before: float, phi_after: float, done: bool, gamma: float = 1.0) -> float:
    """gamma * phi(s') - phi(s) for one transition; phi(s') is 0 when the transition ends the episode."""
    return gamma * (0.0 if done else phi_after) - phi_before
