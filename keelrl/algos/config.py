"""The algorithm configuration: which components run and their hyper-parameters.

`AlgoConfig(preset="dapo")` fills every field the user did not set from the preset (and the
preset's gaps from `BASE_SETTINGS`), so a resolved config names every component explicitly
and every field has its annotated type; any field set by the user wins over the preset.
A resolved config (the one saved in a run directory) pins every field, so changing only
its `preset` changes nothing else: start from the preset instead (`keel config
algo.preset=NAME`). Validation runs in `__post_init__` and raises `ConfigError` naming the
field and the bad value; unknown component names list the valid ones, read from the
registries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from keelrl.algos.overlong import OVERLONG_MODES
from keelrl.errors import ConfigError

LEVELS = ("token", "turn")


class _FromPreset:
    """Default of every preset-controlled field until `__post_init__` replaces it."""

    def __repr__(self) -> str:
        return "<from preset>"


FROM_PRESET: Any = _FromPreset()


@dataclass
class AlgoConfig:
    """Credit assignment, importance ratio, clip rule, aggregation, KL and entropy."""

    preset: str = "turn_rloo"
    """Named combination of components (see `keel algos`); fields below override it."""
    advantage: str = FROM_PRESET
    """Advantage estimator: who gets credit for the outcome."""
    ratio: str = FROM_PRESET
    """Importance ratio between the learner and the behaviour policy."""
    clip: str = FROM_PRESET
    """Policy loss, named by its clip rule."""
    aggregation: str = FROM_PRESET
    """How per-token losses become one scalar."""
    eps_low: float = FROM_PRESET
    """Lower clip width: ratios below 1 - eps_low are clipped."""
    eps_high: float = FROM_PRESET
    """Upper clip width: ratios above 1 + eps_high are clipped (DAPO clip-higher: > eps_low)."""
    dual_clip_c: float = FROM_PRESET
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens (dual_clip rule)."""
    tis_cap: float = FROM_PRESET
    """Cap C on truncated importance weights min(ratio, C) (tis rule)."""
    norm_by_std: bool = FROM_PRESET
    """GRPO: divide group-centred rewards by the group's standard deviation."""
    whiten: bool = FROM_PRESET
    """Whiten advantages over the batch's action tokens after the estimator."""
    gamma: float = FROM_PRESET
    """Discount per step (token or turn, see `level`)."""
    lam: float = FROM_PRESET
    """GAE lambda: 0 trusts the critic (TD error), 1 is the Monte Carlo reward-to-go."""
    level: str = FROM_PRESET
    """Steps for discounting, TD and GAE: each action token, or each turn."""
    kl_coef: float = FROM_PRESET
    """Weight beta of the KL(pi || ref) term; 0 disables the reference model."""
    kl_estimator: str = FROM_PRESET
    """Estimator of KL(pi || ref) from sampled tokens."""
    kl_in_reward: bool = FROM_PRESET
    """Apply KL as a per-token reward penalty (PPO/RLHF) instead of a loss term (GRPO)."""
    kl_is_weight: bool = FROM_PRESET
    """Weight each token's KL loss term by pi / mu (detached, truncated at behaviour_weight_cap):
    the estimators assume samples from pi, and on stale samples k3 = ref/pi - 1 - log(ref/pi)
    explodes where the update lowered pi (SmolLM2, async, one step after the weights moved:
    kl_ref 173 against 0.005 in sync, gradient norm 2434 against 1, held-out success 0.30 ->
    0.06). With samples from mu = ref the weighted k3 is at most 1. Fresh data: weight 1."""
    entropy_coef: float = FROM_PRESET
    """Weight alpha of the entropy bonus (0 = off)."""
    value_clip: float | None = FROM_PRESET
    """Clip range of the critic's value update around its old prediction (None = unclipped)."""
    value_coef: float = FROM_PRESET
    """Weight of the value loss when the critic shares the policy body."""
    agg_constant: int | None = FROM_PRESET
    """Constant normaliser of the 'constant' aggregation (Dr.GRPO): the max generated tokens."""
    dynamic_sampling: bool = FROM_PRESET
    """DAPO: keep only groups with mixed rewards and resample until the batch is full."""
    max_log_ratio: float = FROM_PRESET
    """Log importance weights are clamped to +-this before exp, so weights stay finite."""
    decoupled: bool = FROM_PRESET
    """Decoupled objective for stale data: the clip rule's ratio is to the proximal policy (the
    learner's weights when the batch arrives), and each token is weighted by its behaviour ->
    proximal weight pi_prox / mu, truncated at behaviour_weight_cap."""
    behaviour_weight_cap: float = FROM_PRESET
    """Truncation of the decoupled objective's behaviour -> proximal weight."""
    rollout_correction: str = FROM_PRESET
    """Weight for the sampler -> learner mismatch (keelrl.algos.corrections): anything but none makes
    the clip rule's ratio pi / pi_prox and multiplies each token's loss by a weight in pi_prox / mu."""
    correction_cap: float = FROM_PRESET
    """Cap C of token_tis's truncated weight min(pi_prox / mu, C)."""
    seq_mask_low: float = FROM_PRESET
    """seq_mask rejects a row whose product of pi_prox / mu over its action tokens is below this."""
    seq_mask_high: float = FROM_PRESET
    """seq_mask rejects a row whose product of pi_prox / mu over its action tokens is above this."""
    geo_mask_low: float = FROM_PRESET
    """geo_mask rejects a row whose geometric mean of pi_prox / mu is below this."""
    geo_mask_high: float = FROM_PRESET
    """geo_mask rejects a row whose geometric mean of pi_prox / mu is above this."""
    icepop_low: float = FROM_PRESET
    """icepop masks a token whose pi_prox / mu is below this (IcePop's alpha)."""
    icepop_high: float = FROM_PRESET
    """icepop masks a token whose pi_prox / mu is above this (IcePop's beta)."""
    overlong: str = FROM_PRESET
    """What an episode cut by the turn or context limit (termination max_turns or context_limit;
    not one the environment ended with done) does to the update (keelrl.algos.overlong): keep
    (its reward is its grade), mask (DAPO's overlong filtering: its tokens leave the loss, it
    stays in its group's baseline) or penalty (DAPO's soft overlong punishment added to every
    reward: -overlong_penalty for a cut episode, a linear ramp over the last overlong_buffer
    tokens before rollout.max_context_tokens for the others)."""
    overlong_buffer: int = FROM_PRESET
    """penalty: DAPO's L_cache, the tokens before rollout.max_context_tokens over which an episode's
    context length ramps its penalty from 0 to -overlong_penalty (0: only cut episodes pay)."""
    overlong_penalty: float = FROM_PRESET
    """penalty: the reward a cut episode loses (DAPO: 1; verl's penalty_factor)."""

    def __post_init__(self) -> None:
        from keelrl.algos import advantages, corrections, losses, ratios  # noqa: F401  (they fill the registries)
        from keelrl.algos import registries
        from keelrl.algos.presets import BASE_SETTINGS, PRESETS

        if self.preset not in PRESETS:
            raise ConfigError("preset", f"unknown preset {self.preset!r}; valid names: {', '.join(PRESETS)}")
        preset = PRESETS[self.preset]
        filled = []
        for f in fields(self):
            if f.name != "preset" and getattr(self, f.name) is FROM_PRESET:
                value = preset.settings.get(f.name, BASE_SETTINGS.get(f.name))
                setattr(self, f.name, value)
                filled.append(f.name)
        self.from_preset = frozenset(filled)
        """The fields the preset filled (the user set the others): a run may still choose them."""
        self._validate(registries)

    def _validate(self, registries: Any) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), str(f.type))
        registries.ADVANTAGES.check(self.advantage, "advantage")
        registries.RATIOS.check(self.ratio, "ratio")
        registries.POLICY_LOSSES.check(self.clip, "clip")
        registries.AGGREGATIONS.check(self.aggregation, "aggregation")
        registries.KL_ESTIMATORS.check(self.kl_estimator, "kl_estimator")
        registries.ROLLOUT_CORRECTIONS.check(self.rollout_correction, "rollout_correction")
        if self.level not in LEVELS:
            raise ConfigError("level", f"must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.overlong not in OVERLONG_MODES:
            raise ConfigError("overlong", f"must be one of {', '.join(OVERLONG_MODES)}, got {self.overlong!r}")
        if self.overlong_buffer < 0:
            raise ConfigError("overlong_buffer", f"must be >= 0 tokens, got {self.overlong_buffer!r}")
        _in_range("overlong_penalty", self.overlong_penalty, 0.0, None)
        _in_range("eps_low", self.eps_low, 0.0, 1.0)
        _in_range("eps_high", self.eps_high, 0.0, None)
        _in_range("gamma", self.gamma, 0.0, 1.0)
        _in_range("lam", self.lam, 0.0, 1.0)
        _in_range("kl_coef", self.kl_coef, 0.0, None)
        _in_range("entropy_coef", self.entropy_coef, 0.0, None)
        _in_range("value_coef", self.value_coef, 0.0, None)
        _in_range("max_log_ratio", self.max_log_ratio, 1e-6, MAX_LOG_RATIO_LIMIT)
        _in_range("dual_clip_c", self.dual_clip_c, 1.0 + 1e-9, None)
        _in_range("tis_cap", self.tis_cap, 1e-12, None)
        _in_range("behaviour_weight_cap", self.behaviour_weight_cap, 1.0, None)
        _in_range("correction_cap", self.correction_cap, 1.0, None)
        for window in ("seq_mask", "geo_mask", "icepop"):
            _ratio_window(window, getattr(self, f"{window}_low"), getattr(self, f"{window}_high"))
        if self.decoupled and self.rollout_correction != "none":
            raise ConfigError("rollout_correction", f"{self.rollout_correction!r} with decoupled=true: the decoupled "
                              f"objective already weighs each token by min(pi_prox / mu, behaviour_weight_cap) "
                              f"(token_tis), and a second weight in pi_prox / mu would count the mismatch twice; a "
                              f"rollout correction makes the objective decoupled by itself: set decoupled=false")
        if self.value_clip is not None:
            _in_range("value_clip", self.value_clip, 1e-12, None)
        if self.agg_constant is not None and not self.agg_constant > 0:
            raise ConfigError("agg_constant", f"must be a positive int or None, got {self.agg_constant!r}")
        if self.aggregation == "constant" and self.agg_constant is None:
            raise ConfigError("agg_constant", "aggregation 'constant' needs a fixed normaliser "
                              "(the max number of generated tokens); got None")
        if self.kl_estimator == "k1" and not self.kl_in_reward and self.kl_coef > 0:
            raise ConfigError("kl_estimator", "k1 as a loss term has zero expected gradient; "
                              "use k2 or k3 in the loss, or k1 with kl_in_reward=true")

    @property
    def ratio_to_proximal(self) -> bool:
        """True when the clip rule's ratio is pi / pi_prox (decoupled, or a rollout correction), not pi / mu."""
        return bool(self.decoupled) or self.rollout_correction != "none"

    @property
    def uses_critic(self) -> bool:
        """True when the advantage estimator needs value predictions."""
        from keelrl.algos.registries import ADVANTAGES

        return "critic" in ADVANTAGES.entry(self.advantage).tags


MAX_LOG_RATIO_LIMIT = 80.0
"""exp(80) ~ 5.5e34 is finite in float32 (which overflows near exp(88.7))."""

_TYPES = {"float": (int, float), "int": (int,), "bool": (bool,), "str": (str,)}


def _check_type(name: str, value: object, annotation: str) -> None:
    """Raise ConfigError unless `value` fits an annotation such as 'float' or 'int | None'."""
    options = [option.strip() for option in annotation.split("|")]
    if value is None and "None" in options:
        return
    for option in options:
        allowed = _TYPES.get(option)
        if allowed and isinstance(value, allowed) and (option == "bool" or not isinstance(value, bool)):
            return
    raise ConfigError(name, f"expected {annotation}, got {value!r}")


def _in_range(name: str, value: object, low: float | None, high: float | None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and math.isfinite(float(value))  # type: ignore[arg-type]
    if ok and low is not None:
        ok = float(value) >= low  # type: ignore[arg-type]
    if ok and high is not None:
        ok = float(value) <= high  # type: ignore[arg-type]
    if not ok:
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise ConfigError(name, f"must be a number in {bounds}, got {value!r}")


def _ratio_window(name: str, low: object, high: object) -> None:
    """Raise ConfigError unless 0 < low < 1 < high (finite): a window of ratios pi_prox / mu around 1.

    It must contain 1, where the sampler and the learner agree: a window without it would reject
    every token of a batch without mismatch."""
    for field, value, bounds in ((f"{name}_low", low, "(0, 1)"), (f"{name}_high", high, "(1, inf)")):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
        ok = ok and (0.0 < float(value) < 1.0 if field.endswith("_low") else float(value) > 1.0)  # type: ignore[arg-type]
        if not ok:
            raise ConfigError(field, f"must be a number in {bounds} (the window of pi_prox / mu must hold 1, "
                                     f"where sampler and learner agree), got {value!r}")
