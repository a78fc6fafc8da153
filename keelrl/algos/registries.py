"""The algorithm core's registries (`keelrl.registry.Registry` each). Importing `keelrl.algos` fills them.

Each kind has exactly one call signature:

- ADVANTAGES:    fn(*, token_rewards, mask, group_ids, values, turn_ids, cfg) -> AdvantageOutput
- RATIOS:        fn(logp, old_logp, mask, cfg) -> ratio [B, T]
- POLICY_LOSSES: fn(logp, old_logp, advantages, mask, cfg) -> (loss, metrics)
- AGGREGATIONS:  fn(per_token [B, T], mask, cfg) -> scalar
- KL_ESTIMATORS: fn(logp, ref_logp) -> per-token KL(pi || ref) estimate [B, T]
- ROLLOUT_CORRECTIONS: fn(prox_logp, behaviour_logp, mask, cfg) -> (weights [B, T], metrics)
"""

from __future__ import annotations

from typing import Callable

from keelrl.registry import Registry

ADVANTAGES: Registry[Callable] = Registry(
    "advantage estimator", ("token_rewards", "mask", "group_ids", "values", "turn_ids", "cfg"))
RATIOS: Registry[Callable] = Registry("importance ratio", ("logp", "old_logp", "mask", "cfg"))
POLICY_LOSSES: Registry[Callable] = Registry(
    "policy loss (clip rule)", ("logp", "old_logp", "advantages", "mask", "cfg"))
AGGREGATIONS: Registry[Callable] = Registry("loss aggregation", ("per_token", "mask", "cfg"))
KL_ESTIMATORS: Registry[Callable] = Registry("KL estimator", ("logp", "ref_logp"))
ROLLOUT_CORRECTIONS: Registry[Callable] = Registry(
    "rollout correction", ("prox_logp", "behaviour_logp", "mask", "cfg"))

ALL = {
    "advantage": ADVANTAGES,
    "ratio": RATIOS,
    "clip": POLICY_LOSSES,
    "aggregation": AGGREGATIONS,
    "kl_estimator": KL_ESTIMATORS,
    "rollout_correction": ROLLOUT_CORRECTIONS,
}
