"""Named presets: each algorithm of the comparison table is a combination of registered parts.

A preset is data, a mapping from `AlgoConfig` fields to values; anything it does not set comes
from `BASE_SETTINGS`. `comparison_table()` derives the three columns of the lecture's table
(credit assignment, token weighting, update limit) from the registries' summaries and the
preset's numbers, so `keel algos` and the docs cannot drift from the code.

Where a paper leaves a number open or our setting departs from it, the preset's `note` says so.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

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
    Preset("rloo", "Kool et al. 2019; Ahmadian et al. 2024",
           {"advantage": "rloo", "aggregation": "seq_mean_token_mean"},
           note="PPO clip for multi-epoch reuse; Ahmadian et al. use on-policy REINFORCE with KL in the reward"),
    Preset("dapo", "Yu et al. 2025 (DAPO)",
           {"advantage": "grpo", "eps_low": 0.2, "eps_high": 0.28, "aggregation": "token_mean",
            "dynamic_sampling": True},
           note="overlong reward shaping is a reward setting, not part of this preset"),
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

PRESETS: Mapping[str, Preset] = MappingProxyType({})


def _build(presets: list[Preset]) -> Mapping[str, Preset]:
    table: dict[str, Preset] = {}
    for preset in presets:
        if preset.name in table:
            raise ValueError(f"duplicate preset name {preset.name!r}")
        unknown = set(preset.settings) - set(BASE_SETTINGS)
        if unknown:
            raise ValueError(f"preset {preset.name!r} sets unknown fields: {sorted(unknown)}")
        table[preset.name] = preset
    return MappingProxyType(table)


PRESETS = _build(_PRESET_LIST)


def comparison_table() -> list[dict[str, Any]]:
    """One row per preset: its resolved components and the lecture's three columns."""
    from keelrl.algos.config import AlgoConfig
    from keelrl.algos.losses import describe_clip
    from keelrl.algos.registries import ADVANTAGES, AGGREGATIONS, RATIOS

    rows = []
    for name, preset in PRESETS.items():
        cfg = AlgoConfig(preset=name)
        estimator = ADVANTAGES.entry(cfg.advantage)
        credit = estimator.summary
        if "uses_std" in estimator.tags and not cfg.norm_by_std:
            credit += " (std division off)"
        if "critic" in estimator.tags:
            credit += f", {cfg.level}-level, lambda={cfg.lam:g}"
        if cfg.whiten:
            credit += ", whitened"
        kl = "none"
        if cfg.kl_coef:
            kl = f"{cfg.kl_estimator} x {cfg.kl_coef:g} in {'reward' if cfg.kl_in_reward else 'loss'}"
        rows.append({
            "preset": name,
            "credit": credit,
            "token_weighting": f"{RATIOS.entry(cfg.ratio).summary}; "
                               f"{AGGREGATIONS.entry(cfg.aggregation).summary}",
            "update_limit": describe_clip(cfg) + (
                f"; decoupled: ratio to the proximal policy, behaviour weight <= {cfg.behaviour_weight_cap:g}"
                if cfg.decoupled else ""),
            "kl": kl,
            "dynamic_sampling": bool(cfg.dynamic_sampling),
            "critic": cfg.uses_critic,
            "paper": preset.paper,
            "note": preset.note,
            "components": {"advantage": cfg.advantage, "ratio": cfg.ratio, "clip": cfg.clip,
                           "aggregation": cfg.aggregation},
        })
    return rows


SUMMARY_SYMBOLS = {"lo": "1 - eps_low", "hi": "1 + eps_high", "c": "dual_clip_c", "cap": "tis_cap"}
"""The config fields behind the placeholders of the clip rules' summaries (`describe_clip` fills
them with numbers; a listing of every component names the fields instead)."""


def symbolic_summary(summary: str) -> str:
    """A registered summary with its `{lo:g}`-style placeholders written as the fields they read."""
    return re.sub(r"\{(\w+)(?::[^}]*)?\}", lambda match: SUMMARY_SYMBOLS.get(match.group(1), match.group(0)), summary)


def comparison_markdown() -> str:
    """The comparison table and every registered component, as Markdown (docs/algorithms.md is this,
    written by `keel algos --format markdown`; a test fails when the committed file drifts)."""
    import keelrl.algos  # noqa: F401  (fills the registries)
    from keelrl.algos.registries import ALL

    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["# Algorithms", "",
             "Generated from keelrl's registries by `keel algos --format markdown > docs/algorithms.md`; "
             "do not edit by hand. Pick one with `algo.preset=NAME`; any field of `AlgoConfig` overrides "
             "its preset (`keel config --explain` lists them).", "",
             "| preset | credit assignment | token weighting | update limit | KL to reference | dynamic sampling "
             "| critic | source |",
             "|---|---|---|---|---|---|---|---|"]
    for row in comparison_table():
        note = f" ({row['note']})" if row["note"] else ""
        lines.append(f"| `{row['preset']}` | {cell(row['credit'])} | {cell(row['token_weighting'])} "
                     f"| {cell(row['update_limit'])} | {cell(row['kl'])} | {'yes' if row['dynamic_sampling'] else 'no'} "
                     f"| {'yes' if row['critic'] else 'no'} | {cell(row['paper'] + note)} |")
    for kind, registry in ALL.items():
        lines += ["", f"## `algo.{kind}`", "", "| name | what it is |", "|---|---|"]
        lines += [f"| `{entry.name}` | {cell(symbolic_summary(entry.summary))} |" for entry in registry]
    return "\n".join(lines) + "\n"


def choices_for(field: str) -> list[str]:
    """The valid values of `AlgoConfig.<field>` when it names a component, else []."""
    import keelrl.algos  # noqa: F401  (fills the registries)
    from keelrl.algos.config import LEVELS
    from keelrl.algos.registries import ALL

    if field == "preset":
        return list(PRESETS)
    if field == "level":
        return list(LEVELS)
    if field in ALL:
        return ALL[field].names()
    return []
