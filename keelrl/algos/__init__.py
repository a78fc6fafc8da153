"""The algorithm core: pure tensor functions, registered by name, no I/O and no model.

Importing this package registers every component; see `keelrl.algos.registries` for the
one signature of each kind and `keelrl.algos.presets` for the named combinations.
"""

from keelrl.algos import advantages, corrections, losses, ratios  # noqa: F401  (fills the registries)
from keelrl.algos.advantages import AdvantageOutput, compute_advantages, outcome_to_token_rewards, td_errors
from keelrl.algos.config import AlgoConfig
from keelrl.algos.corrections import correction_weights, mismatch_metrics
from keelrl.algos.losses import (
    entropy_from_logits,
    entropy_from_sampled_logprobs,
    kl_penalty,
    kl_reward_penalty,
    policy_objective,
    value_loss,
)
from keelrl.algos.catalogue import comparison_table
from keelrl.algos.presets import PRESETS
from keelrl.algos.registries import (
    ADVANTAGES,
    AGGREGATIONS,
    ALL,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    RATIOS,
    ROLLOUT_CORRECTIONS,
)
from keelrl.registry import UnknownNameError

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "ALL", "KL_ESTIMATORS", "POLICY_LOSSES", "PRESETS", "RATIOS",
    "ROLLOUT_CORRECTIONS", "AdvantageOutput", "AlgoConfig", "UnknownNameError", "comparison_table",
    "compute_advantages", "correction_weights", "entropy_from_logits", "entropy_from_sampled_logprobs",
    "kl_penalty", "kl_reward_penalty", "mismatch_metrics", "outcome_to_token_rewards", "policy_objective",
    "td_errors", "value_loss",
]
