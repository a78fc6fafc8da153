"""The comparison table of the presets, and every registered component, as `keel algos` and
docs/algorithms.md show them.

`comparison_table()` derives the three columns of the lecture's table (credit assignment, token
weighting, update limit) from the registries' summaries and each preset's resolved numbers, so
`keel algos` and the docs cannot drift from the code.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from keelrl.algos.config import LEVELS, AlgoConfig
from keelrl.algos.corrections import describe_correction
from keelrl.algos.losses import describe_clip
from keelrl.algos.overlong import OVERLONG_MODES
from keelrl.algos.presets import PRESETS
from keelrl.algos.registries import ADVANTAGES, AGGREGATIONS, ALL, RATIOS


def comparison_table() -> list[dict[str, Any]]:
    """One row per preset: its resolved components and the lecture's three columns."""
    rows = []
    for name, preset in ((entry.name, entry.obj) for entry in PRESETS.entries()):
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
                if cfg.decoupled else "") + (
                f"; ratio to the proximal policy, rollout correction: {describe_correction(cfg)}"
                if cfg.rollout_correction != "none" else ""),
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
them with numbers; a listing of every component names the fields instead). A placeholder that is
an `AlgoConfig` field's own name (the rollout corrections': `{icepop_low:g}`) is written as it."""

_FIELDS = {f.name for f in fields(AlgoConfig)}


def symbolic_summary(summary: str) -> str:
    """A registered summary with its `{lo:g}`-style placeholders written as the fields they read."""
    def symbol(match: re.Match[str]) -> str:
        name = match.group(1)
        return SUMMARY_SYMBOLS.get(name, name if name in _FIELDS else match.group(0))

    return re.sub(r"\{(\w+)(?::[^}]*)?\}", symbol, summary)


def comparison_markdown() -> str:
    """The comparison table and every registered component, as Markdown (docs/algorithms.md is this,
    written by `keel algos --format markdown`; a test fails when the committed file drifts)."""
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
        lines += [f"| `{entry.name}` | {cell(symbolic_summary(entry.summary))} |" for entry in registry.entries()]
    return "\n".join(lines) + "\n"


def choices_for(field: str) -> list[str]:
    """The valid values of `AlgoConfig.<field>` when it names a component, else []."""
    if field == "preset":
        return list(PRESETS)
    if field == "level":
        return list(LEVELS)
    if field == "overlong":
        return list(OVERLONG_MODES)
    if field in ALL:
        return ALL[field].names()
    return []
