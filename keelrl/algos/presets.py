"""Named presets: each algorithm of the comparison table is a combination of registered parts.

A preset is data, a mapping from `AlgoConfig` fields to values; anything it does not set comes
from `BASE_SETTINGS`. This module is that data alone (`AlgoConfig` reads it);
keelrl.algos.catalogue derives the lecture's comparison table from it and the registries.

Where a paper leaves a number open or our setting departs from it, the preset's `note` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from keelrl.registry import Registry

BASE_SETTINGS: Mapping[str, Any] = MappingProxyType({
    "advantage": "grpo",
    "ratio": "token",
    "clip": "ppo",
    "aggregation": "token_mean",
    "eps_low": 0.2,
    "eps_high": 0.2,
    "dual_clip_c": 3.0,
    "tis_cap": 2.0,
    "norm_by_std": True,
    "whiten": False,
    "gamma": 1.0,
    "lam": 1.0,
    "level": "token",
    "kl_coef": 0.0,
    "kl_estimator": "k3",
    "kl_in_reward": False,
    "kl_is_weight": False,
    "entropy_coef": 0.0,
    "value_clip": 0.2,
    "value_coef": 0.5,
    "agg_constant": None,
    "dynamic_sampling": False,
    "max_log_ratio": 20.0,
    "decoupled": False,
    "behaviour_weight_cap": 2.0,
    "rollout_correction": "none",
    "correction_cap": 2.0,
    "seq_mask_low": 0.5,
    "seq_mask_high": 2.0,
    "geo_mask_low": 0.99,
    "geo_mask_high": 1.01,
    "icepop_low": 0.5,
    "icepop_high": 5.0,
    "overlong": "keep",
    "overlong_buffer": 512,
    "overlong_penalty": 1.0,
})


@dataclass(frozen=True)
class Preset:
    """A named algorithm: settings for `AlgoConfig` fields, its source and any caveat."""

    name: str
    paper: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""


_PRESET_LIST = [
    Preset("reinforce", "Williams 1992; lecture 9",
           {"advantage": "reinforce", "clip": "none", "aggregation": "seq_mean_token_mean"},
           note="on-policy: the ratio is 1 on the first pass, so 'none' adds no limit"),
    Preset("ppo", "Schulman et al. 2017; InstructGPT (Ouyang et al. 2022)",
           {"advantage": "gae", "lam": 0.95, "kl_coef": 0.05, "kl_estimator": "k1",
            "kl_in_reward": True, "whiten": True},
           note="critic + GAE; KL to the reference as a per-token reward penalty"),
    Preset("grpo", "Shao et al. 2024 (DeepSeekMath)",
           {"advantage": "grpo", "aggregation": "seq_mean_token_mean", "kl_coef": 0.04,
            "kl_estimator": "k3"},
           note="k3 in the loss as in the paper: its gradient pulls on KL(ref || pi)"),
    Preset("dr_grpo", "Liu et al. 2025 (Understanding R1-Zero-like training)",
           {"advantage": "dr_grpo", "aggregation": "constant", "norm_by_std": False, "agg_constant": 1024},
           note="no std division; loss normalised by B x agg_constant: set it to your max generated tokens"),
    Preset("turn_rloo", "Kool et al. 2019's leave-one-out baseline, per turn index; GRPO's KL; DAPO's "
           "dynamic sampling (Yu et al. 2025)",
           {"advantage": "turn_rloo", "aggregation": "seq_mean_token_mean", "kl_coef": 0.04,
            "kl_estimator": "k3", "dynamic_sampling": True},
           note="the default: each turn's reward-to-go against the group's other episodes at that turn; "
                "without per-turn rewards (env.shaping) each turn's reward-to-go is the outcome; DAPO's "
                "dynamic sampling refills groups whose rewards are all equal"),
    Preset("rloo", "Kool et al. 2019; Ahmadian et al. 2024",
           {"advantage": "rloo", "aggregation": "seq_mean_token_mean"},
           note="PPO clip for multi-epoch reuse; Ahmadian et al. use on-policy REINFORCE with KL in the reward"),
    Preset("dapo", "Yu et al. 2025 (DAPO)",
           {"advantage": "grpo", "eps_low": 0.2, "eps_high": 0.28, "aggregation": "token_mean",
            "dynamic_sampling": True},
           note="overlong reward shaping is a separate setting, off here: algo.overlong=penalty"),
    Preset("cispo", "MiniMax 2025 (MiniMax-M1)",
           {"advantage": "grpo", "clip": "cispo", "eps_low": 1.0, "eps_high": 0.28,
            "aggregation": "token_mean"},
           note="eps_low=1: no lower bound on the weight, as in the paper; eps_high is ours"),
    Preset("gspo", "Zheng et al. 2025 (GSPO)",
           {"advantage": "grpo", "ratio": "sequence", "eps_low": 3e-4, "eps_high": 4e-4,
            "aggregation": "seq_mean_token_mean"}),
    Preset("ctpo", "Zhang et al. 2026 (CTPO)",
           {"advantage": "grpo", "ratio": "ctpo", "eps_low": 0.2, "eps_high": 0.28,
            "aggregation": "token_mean"},
           note="prefix ratio with PPO clip-higher; clip widths are ours"),
    Preset("decoupled", "Fu et al. 2025 (AReaL)",
           {"advantage": "grpo", "aggregation": "seq_mean_token_mean", "decoupled": True},
           note="for asynchronous rollouts: PPO clip of pi / pi_prox, times pi_prox / mu truncated at 2 (ours)"),
]

def _build(presets: list[Preset]) -> Registry[Preset]:
    table: Registry[Preset] = Registry("preset")
    for preset in presets:
        unknown = set(preset.settings) - set(BASE_SETTINGS)
        if unknown:
            raise ValueError(f"preset {preset.name!r} sets unknown fields: {sorted(unknown)}")
        table.add(preset.name, preset, summary=preset.paper)  # a duplicate name raises ValueError
    return table


PRESETS: Registry[Preset] = _build(_PRESET_LIST)
"""The presets by name (`algo.preset`), in the comparison table's order."""
