"""The algorithm configuration: which components run and their hyper-parameters.

`AlgoConfig(preset="dapo")` fills every field left as None from the preset, so a resolved
config names every component explicitly; any field set by the user wins over the preset.
Validation runs in `__post_init__` and raises `ConfigError` naming the field and the bad
value; unknown component names list the valid ones, read from the registries.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from keelrl.errors import ConfigError

LEVELS = ("token", "turn")


@dataclass
class AlgoConfig:
    """Credit assignment, importance ratio, clip rule, aggregation, KL and entropy."""

    preset: str = "grpo"
    """Named combination of components (see `keel algos`); fields below override it."""
    advantage: str | None = None
    """Advantage estimator: who gets credit for the outcome."""
    ratio: str | None = None
    """Importance ratio between the learner and the behaviour policy."""
    clip: str | None = None
    """Policy loss, named by its clip rule."""
    aggregation: str | None = None
    """How per-token losses become one scalar."""
    eps_low: float | None = None
    """Lower clip width: ratios below 1 - eps_low are clipped."""
    eps_high: float | None = None
    """Upper clip width: ratios above 1 + eps_high are clipped (DAPO clip-higher: > eps_low)."""
    dual_clip_c: float | None = None
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens (dual_clip rule)."""
    tis_cap: float | None = None
    """Cap C on truncated importance weights min(ratio, C) (tis rule)."""
    norm_by_std: bool | None = None
    """GRPO: divide group-centred rewards by the group's standard deviation."""
    whiten: bool | None = None
    """Whiten advantages over the batch's action tokens after the estimator."""
    gamma: float | None = None
    """Discount per step (token or turn, see `level`)."""
    lam: float | None = None
    """GAE lambda: 0 trusts the critic (TD error), 1 is the Monte Carlo reward-to-go."""
    level: str | None = None
    """Steps for discounting, TD and GAE: each action token, or each turn."""
    kl_coef: float | None = None
    """Weight beta of the KL(pi || ref) term; 0 disables the reference model."""
    kl_estimator: str | None = None
    """Estimator of KL(pi || ref) from sampled tokens."""
    kl_in_reward: bool | None = None
    """Apply KL as a per-token reward penalty (PPO/RLHF) instead of a loss term (GRPO)."""
    entropy_coef: float | None = None
    """Weight alpha of the entropy bonus (0 = off)."""
    value_clip: float | None = None
    """Clip range of the critic's value update around its old prediction (None = unclipped)."""
    value_coef: float | None = None
    """Weight of the value loss when the critic shares the policy body."""
    agg_constant: int | None = None
    """Constant normaliser of the 'constant' aggregation (Dr.GRPO); None = sequence length T."""
    dynamic_sampling: bool | None = None
    """DAPO: keep only groups with mixed rewards and resample until the batch is full."""
    max_log_ratio: float | None = None
    """Log importance weights are clamped to +-this before exp, so weights stay finite."""

    def __post_init__(self) -> None:
        import keelrl.algos  # noqa: F401  (fills the registries)
        from keelrl.algos import registries
        from keelrl.algos.presets import BASE_SETTINGS, PRESETS

        if self.preset not in PRESETS:
            raise ConfigError("preset", f"unknown preset {self.preset!r}; valid names: {', '.join(PRESETS)}")
        preset = PRESETS[self.preset]
        for f in fields(self):
            if f.name != "preset" and getattr(self, f.name) is None:
                value = preset.settings.get(f.name, BASE_SETTINGS.get(f.name))
                setattr(self, f.name, value)
        self._validate(registries)

    def _validate(self, registries) -> None:  # noqa: ANN001 - module passed to avoid cycles
        registries.ADVANTAGES.check(self.advantage, "advantage")
        registries.RATIOS.check(self.ratio, "ratio")
        registries.POLICY_LOSSES.check(self.clip, "clip")
        registries.AGGREGATIONS.check(self.aggregation, "aggregation")
        registries.KL_ESTIMATORS.check(self.kl_estimator, "kl_estimator")
        if self.level not in LEVELS:
            raise ConfigError("level", f"must be one of {', '.join(LEVELS)}, got {self.level!r}")
        _in_range("eps_low", self.eps_low, 0.0, 1.0)
        _in_range("eps_high", self.eps_high, 0.0, None)
        _in_range("gamma", self.gamma, 0.0, 1.0)
        _in_range("lam", self.lam, 0.0, 1.0)
        _in_range("kl_coef", self.kl_coef, 0.0, None)
        _in_range("entropy_coef", self.entropy_coef, 0.0, None)
        _in_range("value_coef", self.value_coef, 0.0, None)
        _in_range("max_log_ratio", self.max_log_ratio, 1e-6, None)
        if not self.dual_clip_c > 1.0:
            raise ConfigError("dual_clip_c", f"must be > 1, got {self.dual_clip_c!r}")
        if not self.tis_cap > 0.0:
            raise ConfigError("tis_cap", f"must be > 0, got {self.tis_cap!r}")
        if self.value_clip is not None:
            _in_range("value_clip", self.value_clip, 1e-12, None)
        if self.agg_constant is not None and not self.agg_constant > 0:
            raise ConfigError("agg_constant", f"must be a positive int or None, got {self.agg_constant!r}")

    @property
    def uses_critic(self) -> bool:
        """True when the advantage estimator needs value predictions."""
        from keelrl.algos.registries import ADVANTAGES

        return "critic" in ADVANTAGES.entry(self.advantage).tags  # type: ignore[arg-type]


def _in_range(name: str, value: float | None, low: float | None, high: float | None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and value == value  # rejects NaN
    if ok and low is not None:
        ok = value >= low  # type: ignore[operator]
    if ok and high is not None:
        ok = value <= high  # type: ignore[operator]
    if not ok:
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise ConfigError(name, f"must be a number in {bounds}, got {value!r}")
