"""Importance ratios, clip rules, aggregation, KL, entropy and value loss.

Fast paths are checked against the float64 plain-loop references in `reference_losses.py`
(values, metrics and hand-derived gradients) over seeds, shapes and ragged masks; the
lecture's worked numbers (DESIGN.md) are fixtures with the arithmetic in comments; gradient
claims of each clip rule and ratio are checked with autograd; hypothesis checks the clip
bounds and that observation tokens never change anything.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference_losses as ref
from keelrl.algos import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    RATIOS,
    AlgoConfig,
    entropy_from_logits,
    entropy_from_sampled_logprobs,
    kl_penalty,
    kl_reward_penalty,
    policy_objective,
    value_loss,
)
from keelrl.algos.losses import aggregate
from keelrl.errors import ConfigError

F64 = torch.float64
RATIO_NAMES = ["token", "sequence", "sequence_token", "cumulative", "ctpo"]
CLIP_NAMES = ["ppo", "dual_clip", "cispo", "tis", "none"]
AGG_MODES = [("token_mean", None), ("seq_mean_token_mean", None), ("seq_mean_token_sum", None),
             ("constant", 4), ("constant", 16)]
COMBOS = [(r, c, a, k) for r in RATIO_NAMES for c in CLIP_NAMES for (a, k) in AGG_MODES]
SHAPES = [(1, 1), (2, 3), (3, 6), (4, 9), (6, 4), (5, 12)]
RATIO_METRICS = {"policy/loss", "policy/clip_frac", "policy/clip_frac_low", "policy/clip_frac_high",
                 "policy/is_weight_mean", "policy/is_weight_max", "policy/approx_kl"}
TIGHT = dict(rtol=1e-10, atol=1e-12)


def make_cfg(**overrides: object) -> AlgoConfig:
    settings_ = dict(preset="grpo", ratio="token", clip="ppo", aggregation="token_mean",
                     eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, tis_cap=2.0,
                     max_log_ratio=20.0, kl_coef=0.0, entropy_coef=0.0)
    settings_.update(overrides)
    return AlgoConfig(**settings_)  # type: ignore[arg-type]


def t64(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def run_loss(clip: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, cfg: AlgoConfig) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """-> (loss, metrics, d loss / d logp) with autograd."""
    leaf = logp.detach().clone().requires_grad_(True)
    loss, metrics = POLICY_LOSSES.get(clip)(leaf, old_logp, advantages, mask, cfg)
    loss.backward()
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    return loss.detach(), metrics, grad


def random_batch(seed: int, batch: int, length: int, *, garbage: bool = True):
    """logp, old_logp, advantages [B, T] float64 and a ragged mask with an empty row.

    Observation positions hold NaN / inf when `garbage`: the library must never read them.
    """
    g = torch.Generator().manual_seed(seed)
    old_logp = -4.0 * torch.rand(batch, length, generator=g, dtype=F64) - 0.05
    logp = old_logp + 0.4 * torch.randn(batch, length, generator=g, dtype=F64)
    advantages = torch.randn(batch, length, generator=g, dtype=F64)
    mask = torch.rand(batch, length, generator=g) < 0.7
    if batch >= 3:
        mask[seed % batch] = False  # a row without action tokens (e.g. a truncated prompt)
    if not mask.any():
        mask[0, length - 1] = True
    if garbage:
        logp = logp.masked_fill(~mask, float("nan"))
        old_logp = old_logp.masked_fill(~mask, float("-inf"))
        advantages = advantages.masked_fill(~mask, float("inf"))
    return logp, old_logp, advantages, mask


def grad_of(fn, x: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().clone().requires_grad_(True)
    fn(leaf).backward()
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def jacobian(fn, x: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T] function: d out[b, t] / d x[c, s] as [B, T, B, T]."""
    return torch.autograd.functional.jacobian(fn, x.detach().clone())


def test_registries_hold_exactly_the_tested_components():
    # A new component must get a reference and join these tests.
    assert sorted(RATIOS.names()) == sorted(RATIO_NAMES)
    assert sorted(POLICY_LOSSES.names()) == sorted(CLIP_NAMES)
    assert sorted(AGGREGATIONS.names()) == sorted({a for a, _ in AGG_MODES})
    assert sorted(KL_ESTIMATORS.names()) == ["k1", "k2", "k3"]


# ============================================================== 1. worked numbers (DESIGN.md)

def test_worked_ratio_learner_07_rollout_04_is_175():
    # pi = 0.7, mu = 0.4: r = 0.7 / 0.4 = 1.75, the same for every ratio on a one-token row.
    logp, old_logp = t64([[math.log(0.7)]]), t64([[math.log(0.4)]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    for name in RATIO_NAMES:
        r = RATIOS.get(name)(logp, old_logp, mask, make_cfg(ratio=name))
        torch.testing.assert_close(r, t64([[1.75]]), **TIGHT)


def test_worked_ratios_compound_105_over_100_tokens_to_about_132():
    # 100 action tokens, each r_t = 1.05. cumulative: 1.05 ** 100 = 131.5012578...;
    # token stays 1.05; GSPO's length-normalised exp(mean log r) stays 1.05;
    # ctpo's prefix at token t (0-based) is 1.05 ** (t + 1).
    length = 100
    old_logp = torch.full((1, length), math.log(0.5), dtype=F64)
    logp = old_logp + math.log(1.05)
    mask = torch.ones(1, length, dtype=torch.bool)
    cfg = make_cfg()
    cumulative = RATIOS.get("cumulative")(logp, old_logp, mask, cfg)
    assert 131.5 < cumulative[0, 0].item() < 131.51  # "about 132"
    torch.testing.assert_close(cumulative, torch.full((1, length), 1.05 ** 100, dtype=F64), **TIGHT)
    for name in ("token", "sequence", "sequence_token"):
        torch.testing.assert_close(RATIOS.get(name)(logp, old_logp, mask, cfg),
                                   torch.full((1, length), 1.05, dtype=F64), **TIGHT)
    prefix = RATIOS.get("ctpo")(logp, old_logp, mask, cfg)
    torch.testing.assert_close(prefix, t64([[1.05 ** (t + 1) for t in range(length)]]), **TIGHT)
    # The metrics report the weight the loss used, unclipped: max 131.5 (the last prefix),
    # mean sum_{t=1..100} 1.05^t / 100 = 1.05 (1.05^100 - 1) / 0.05 / 100 = 27.5103.
    _, metrics, _ = run_loss("ppo", logp, old_logp, torch.ones(1, length, dtype=F64), mask,
                             make_cfg(ratio="ctpo"))
    assert metrics["policy/is_weight_max"].item() == pytest.approx(1.05 ** 100, rel=1e-12)
    assert metrics["policy/is_weight_mean"].item() == pytest.approx(1.05 * (1.05 ** 100 - 1) / 5, rel=1e-12)
    assert metrics["policy/clip_frac_high"].item() == pytest.approx(95 / 100, abs=1e-15)  # 1.05^t > 1.28 from t = 6


def test_worked_none_check_prefix_ratio_is_025_even_when_next_ratio_is_1():
    # Token 0: mu adds the None check w.p. 0.4, pi w.p. 0.1 -> r_0 = 0.25.
    # An observation token (the tool's reply) sits between, then the next action has
    # probability 0.5 under both -> r_2 = 1. The token ratio at the second action is 1,
    # but pi reaches that history 0.25 times as often: ctpo P_2 = 0.25 * 1 = 0.25, and the
    # cumulative ratio of the row is 0.25 at every action token. The reply gets ratio 1.
    logp = t64([[math.log(0.1), -7.0, math.log(0.5)]])
    old_logp = t64([[math.log(0.4), -2.0, math.log(0.5)]])
    mask = torch.tensor([[True, False, True]])
    cfg = make_cfg()
    torch.testing.assert_close(RATIOS.get("token")(logp, old_logp, mask, cfg), t64([[0.25, 1.0, 1.0]]), **TIGHT)
    torch.testing.assert_close(RATIOS.get("ctpo")(logp, old_logp, mask, cfg), t64([[0.25, 1.0, 0.25]]), **TIGHT)
    torch.testing.assert_close(RATIOS.get("cumulative")(logp, old_logp, mask, cfg),
                               t64([[0.25, 1.0, 0.25]]), **TIGHT)
    # GSPO: exp(mean(log 0.25, log 1)) = sqrt(0.25) = 0.5
    torch.testing.assert_close(RATIOS.get("sequence")(logp, old_logp, mask, cfg), t64([[0.5, 1.0, 0.5]]), **TIGHT)


def test_worked_clip_range_08_12_for_eps_02():
    # eps 0.2: clip range [0.8, 1.2]. Ratios 0.7, 1.0, 1.3.
    # A = +1: per-token -min(rA, clip(r)A) = -min(0.7, 0.8), -1.0, -min(1.3, 1.2)
    #         = -0.7, -1.0, -1.2; only 1.3 is clipped (high); loss = -2.9 / 3.
    #         d/d logp = -A r / 3 where unclipped: -0.7/3, -1/3, 0.
    # A = -1: -min(-0.7, -0.8) = 0.8 (clipped low), 1.0, -min(-1.3, -1.2) = 1.3 (not clipped:
    #         the pessimistic branch is the unclipped one); loss = 3.1 / 3;
    #         d/d logp = 0, +1/3, +1.3/3.
    cfg = make_cfg(eps_low=0.2, eps_high=0.2)
    old_logp = torch.full((1, 3), math.log(0.5), dtype=F64)
    logp = old_logp + torch.log(t64([[0.7, 1.0, 1.3]]))
    mask = torch.ones(1, 3, dtype=torch.bool)

    loss, metrics, grad = run_loss("ppo", logp, old_logp, torch.ones(1, 3, dtype=F64), mask, cfg)
    torch.testing.assert_close(loss, torch.tensor(-2.9 / 3, dtype=F64), **TIGHT)
    torch.testing.assert_close(grad, t64([[-0.7 / 3, -1.0 / 3, 0.0]]), **TIGHT)
    assert metrics["policy/clip_frac_high"].item() == pytest.approx(1 / 3, abs=1e-15)
    assert metrics["policy/clip_frac_low"].item() == 0.0

    loss, metrics, grad = run_loss("ppo", logp, old_logp, -torch.ones(1, 3, dtype=F64), mask, cfg)
    torch.testing.assert_close(loss, torch.tensor(3.1 / 3, dtype=F64), **TIGHT)
    torch.testing.assert_close(grad, t64([[0.0, 1.0 / 3, 1.3 / 3]]), **TIGHT)
    assert metrics["policy/clip_frac_low"].item() == pytest.approx(1 / 3, abs=1e-15)
    assert metrics["policy/clip_frac_high"].item() == 0.0
    # is_weight mean (0.7 + 1 + 1.3) / 3 = 1, max 1.3
    assert metrics["policy/is_weight_mean"].item() == pytest.approx(1.0, abs=1e-14)
    assert metrics["policy/is_weight_max"].item() == pytest.approx(1.3, abs=1e-14)


def test_worked_critic_ten_outcomes_three_successes():
    # Returns: three 1s, seven 0s; the best constant prediction is V = 0.3.
    # Predict 0.6: MSE = (3 * 0.4**2 + 7 * 0.6**2) / 10 = (0.48 + 2.52) / 10 = 0.30
    # Predict 0.3: MSE = (3 * 0.7**2 + 7 * 0.3**2) / 10 = (1.47 + 0.63) / 10 = 0.21
    # value_loss = 0.5 * MSE with token_mean: 0.15 and 0.105.
    returns = t64([[1.0] * 3 + [0.0] * 7])
    mask = torch.ones(1, 10, dtype=torch.bool)
    cfg = make_cfg(value_clip=None, aggregation="token_mean")
    expected = {0.6: 0.30, 0.3: 0.21}
    for prediction, mse in expected.items():
        values = torch.full((1, 10), prediction, dtype=F64)
        loss, metrics = value_loss(values, values, returns, mask, cfg)
        assert loss.item() == pytest.approx(0.5 * mse, abs=1e-14)
        assert metrics["value/mse"].item() == pytest.approx(mse, abs=1e-14)
        assert metrics["value/mean"].item() == pytest.approx(prediction, abs=1e-14)
        assert metrics["value/clip_frac"].item() == 0.0
    # The mean return minimises the loss: a shared scalar prediction has zero gradient at 0.3
    # (sum (V - R) / 10 = 0.3 - 0.3) and positive gradient 0.3 at 0.6.
    for prediction, slope in ((0.3, 0.0), (0.6, 0.3)):
        v = torch.tensor(prediction, dtype=F64, requires_grad=True)
        loss, _ = value_loss(v.expand(1, 10), returns, returns, mask, cfg)
        loss.backward()
        assert v.grad.item() == pytest.approx(slope, abs=1e-14)


def test_worked_clipped_value_loss():
    # V_old = 0.5, c = 0.2, so the clipped prediction lies in [0.3, 0.7].
    # token 0: V = 0.9, R = 0: (0.9)^2 = 0.81 vs clipped (0.7)^2 = 0.49 -> 0.5 * 0.81, grad 0.9
    # token 1: V = 0.9, R = 1: (0.1)^2 = 0.01 vs clipped (0.3)^2 = 0.09 -> 0.5 * 0.09, clipped,
    #          and the clipped branch is flat in V -> grad 0
    # token 2: V = 0.6, R = 1 (inside the range): 0.5 * 0.16, grad -0.4
    # token_mean: loss = (0.405 + 0.045 + 0.08) / 3; clip_frac = 1/3; mse = (0.81+0.01+0.16)/3
    cfg = make_cfg(value_clip=0.2, aggregation="token_mean")
    values = t64([[0.9, 0.9, 0.6]])
    old_values = t64([[0.5, 0.5, 0.5]])
    returns = t64([[0.0, 1.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    leaf = values.clone().requires_grad_(True)
    loss, metrics = value_loss(leaf, old_values, returns, mask, cfg)
    loss.backward()
    assert loss.item() == pytest.approx((0.405 + 0.045 + 0.08) / 3, abs=1e-14)
    assert metrics["value/clip_frac"].item() == pytest.approx(1 / 3, abs=1e-15)
    assert metrics["value/mse"].item() == pytest.approx((0.81 + 0.01 + 0.16) / 3, abs=1e-14)
    torch.testing.assert_close(leaf.grad, t64([[0.9 / 3, 0.0, -0.4 / 3]]), **TIGHT)


# ============================================================== 2. plain-loop references

@pytest.mark.parametrize("name", RATIO_NAMES)
def test_ratio_values_and_jacobian_match_reference(name):
    for seed, (batch, length) in enumerate(SHAPES):
        for limit in (20.0, 0.6):  # 0.6 exercises the clamp of the log weight
            logp, old_logp, _, mask = random_batch(seed, batch, length)
            cfg = make_cfg(ratio=name, max_log_ratio=limit)
            fn = RATIOS.get(name)
            got = fn(logp, old_logp, mask, cfg)
            expected = t64(ref.ratio(name, logp.tolist(), old_logp.tolist(), mask.tolist(), limit))
            assert got.dtype == F64
            torch.testing.assert_close(got, expected, **TIGHT)
            assert torch.equal(got[~mask], torch.ones_like(got[~mask]))  # observation: exactly 1

            jac = jacobian(lambda x: fn(x, old_logp, mask, cfg), logp)
            expected_jac = torch.zeros(batch, length, batch, length, dtype=F64)
            for (b, t, s), value in ref.ratio_jacobian(name, logp.tolist(), old_logp.tolist(),
                                                       mask.tolist(), limit).items():
                expected_jac[b, t, b, s] = value
            torch.testing.assert_close(jac, expected_jac, **TIGHT)


@pytest.mark.parametrize("ratio_name,clip,aggregation,agg_constant", COMBOS)
def test_policy_loss_matches_reference(ratio_name, clip, aggregation, agg_constant):
    for seed, (batch, length) in enumerate(SHAPES):
        for limit in (20.0, 0.6):
            logp, old_logp, advantages, mask = random_batch(100 + seed, batch, length)
            # c and C small enough that the dual clip and the truncation both happen
            knobs = dict(eps_low=0.2, eps_high=0.28, dual_clip_c=1.5, tis_cap=1.3)
            cfg = make_cfg(ratio=ratio_name, clip=clip, aggregation=aggregation,
                           agg_constant=agg_constant, max_log_ratio=limit, **knobs)
            loss, metrics, grad = run_loss(clip, logp, old_logp, advantages, mask, cfg)
            ref_loss, ref_metrics, ref_grad = ref.policy_loss(
                clip, ratio_name, logp.tolist(), old_logp.tolist(), advantages.tolist(),
                mask.tolist(), aggregation=aggregation, agg_constant=agg_constant,
                max_log_ratio=limit, **knobs)
            torch.testing.assert_close(loss, torch.tensor(ref_loss, dtype=F64), **TIGHT)
            torch.testing.assert_close(grad, t64(ref_grad), **TIGHT)
            assert set(metrics) == set(ref_metrics)
            for key, value in ref_metrics.items():
                assert metrics[key].dim() == 0 and not metrics[key].requires_grad, key
                torch.testing.assert_close(metrics[key], torch.tensor(value, dtype=F64), **TIGHT,
                                           msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("mode,agg_constant", AGG_MODES)
def test_aggregation_matches_reference(mode, agg_constant):
    cfg = make_cfg(aggregation=mode, agg_constant=agg_constant)
    for seed, (batch, length) in enumerate(SHAPES):
        _, _, per_token, mask = random_batch(200 + seed, batch, length, garbage=False)
        per_token = per_token.masked_fill(~mask, float("nan"))
        got = aggregate(per_token, mask, cfg)
        torch.testing.assert_close(AGGREGATIONS.get(mode)(per_token, mask, cfg), got, rtol=0, atol=0)
        expected = ref.aggregate(mode, per_token.tolist(), mask.tolist(), agg_constant)
        torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), **TIGHT)
        grad = grad_of(lambda x: aggregate(x, mask, cfg), per_token)
        torch.testing.assert_close(grad, t64(ref.aggregation_weights(mode, mask.tolist(), agg_constant)),
                                   **TIGHT)


def test_aggregation_worked_example():
    # Row 0: tokens 1, 3 (length 2); row 1: 5, 7, 9 (length 3); row 2: no action tokens. T = 4.
    # token_mean = 25 / 5 = 5; seq_mean_token_mean = (2 + 7) / 2 = 4.5 (empty row skipped);
    # seq_mean_token_sum = (4 + 21 + 0) / 3 = 25 / 3; constant = 25 / (3 * 4), or 25 / (3 * 10).
    # ('constant' must be given its normaliser: None is a config error, tested below.)
    per_token = t64([[1, 3, 99, 99], [5, 7, 9, 99], [99, 99, 99, 99]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    expected = {("token_mean", None): 5.0, ("seq_mean_token_mean", None): 4.5,
                ("seq_mean_token_sum", None): 25 / 3, ("constant", 4): 25 / 12,
                ("constant", 10): 25 / 30}
    for (mode, constant), value in expected.items():
        got = aggregate(per_token, mask, make_cfg(aggregation=mode, agg_constant=constant))
        assert got.item() == pytest.approx(value, abs=1e-14), mode


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_reference(estimator):
    for seed, (batch, length) in enumerate(SHAPES):
        logp, ref_logp, _, mask = random_batch(300 + seed, batch, length)
        got = kl_penalty(logp, ref_logp, mask, estimator)
        expected = torch.zeros(batch, length, dtype=F64)
        expected_grad = torch.zeros(batch, length, dtype=F64)
        for b, t in itertools.product(range(batch), range(length)):
            if mask[b, t]:
                value, slope = ref.kl_estimate(estimator, logp[b, t].item(), ref_logp[b, t].item())
                expected[b, t], expected_grad[b, t] = value, slope
        torch.testing.assert_close(got, expected, **TIGHT)  # exactly 0 off the mask
        torch.testing.assert_close(grad_of(lambda x: kl_penalty(x, ref_logp, mask, estimator).sum(), logp),
                                   expected_grad, **TIGHT)
        # As a reward penalty: rewards - coef * KL on action tokens, 0 elsewhere, no gradient.
        rewards = torch.randn(batch, length, dtype=F64, generator=torch.Generator().manual_seed(seed))
        leaf = logp.clone().requires_grad_(True)
        shaped = kl_reward_penalty(rewards, leaf, ref_logp, mask, 0.05, estimator)
        assert not shaped.requires_grad
        torch.testing.assert_close(shaped, torch.where(mask, rewards - 0.05 * expected, 0.0), **TIGHT)


def test_kl_estimator_worked_values():
    # log(ref/pi) = x = log 0.5: k1 = -x = log 2 = 0.693147; k2 = x^2/2 = 0.240227;
    # k3 = (0.5 - 1) - log 0.5 = 0.193147.
    logp, ref_logp = t64([[math.log(0.4)]]), t64([[math.log(0.2)]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    expected = {"k1": math.log(2), "k2": 0.5 * math.log(2) ** 2, "k3": -0.5 + math.log(2)}
    for name, value in expected.items():
        assert kl_penalty(logp, ref_logp, mask, name).item() == pytest.approx(value, abs=1e-15)


@pytest.mark.parametrize("value_clip", [None, 0.2, 0.05])
@pytest.mark.parametrize("mode,agg_constant", AGG_MODES)
def test_value_loss_matches_reference(value_clip, mode, agg_constant):
    cfg = make_cfg(value_clip=value_clip, aggregation=mode, agg_constant=agg_constant)
    for seed, (batch, length) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(400 + seed)
        _, _, _, mask = random_batch(400 + seed, batch, length)
        old_values = torch.rand(batch, length, generator=g, dtype=F64)
        values = old_values + 0.3 * torch.randn(batch, length, generator=g, dtype=F64)
        returns = torch.rand(batch, length, generator=g, dtype=F64) * 2 - 0.5
        values = values.masked_fill(~mask, float("nan"))
        old_values = old_values.masked_fill(~mask, float("inf"))
        returns = returns.masked_fill(~mask, float("-inf"))
        leaf = values.clone().requires_grad_(True)
        loss, metrics = value_loss(leaf, old_values, returns, mask, cfg)
        loss.backward()
        ref_loss, ref_metrics, ref_grad = ref.value_loss(
            values.tolist(), old_values.tolist(), returns.tolist(), mask.tolist(),
            value_clip=value_clip, aggregation=mode, agg_constant=agg_constant)
        torch.testing.assert_close(loss.detach(), torch.tensor(ref_loss, dtype=F64), **TIGHT)
        torch.testing.assert_close(leaf.grad, t64(ref_grad), **TIGHT)
        assert set(metrics) == set(ref_metrics)
        for key, value in ref_metrics.items():
            torch.testing.assert_close(metrics[key], torch.tensor(value, dtype=F64), **TIGHT)


def test_batch_without_any_action_token_gives_zero_everywhere():
    logp, old_logp, advantages, _ = random_batch(7, 3, 4)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    for ratio_name, clip, mode, constant in COMBOS:
        cfg = make_cfg(ratio=ratio_name, clip=clip, aggregation=mode, agg_constant=constant)
        loss, metrics, grad = run_loss(clip, logp, old_logp, advantages, mask, cfg)
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
        assert all(v.item() == 0.0 for v in metrics.values()), metrics


# ============================================================== 3. gradients, by hand

def _token_batch(ratios: list[float], old: float = 0.3):
    old_logp = torch.full((1, len(ratios)), math.log(old), dtype=F64)
    return old_logp + torch.log(t64([ratios])), old_logp


def test_ppo_gradient_zero_outside_clip_in_advantage_direction():
    # eps_low 0.2, eps_high 0.28: range [0.8, 1.28]; N = 6 action tokens (+1 observation).
    #   r    A     branch                                   d loss / d logp = -A r / 6 or 0
    #  1.5  +1    A>0, r > 1.28: clipped                    0
    #  0.6  -1    A<0, r < 0.8: clipped                     0
    #  1.1  +2    inside                                    -2.2 / 6
    #  0.9  -0.5  inside                                    +0.45 / 6
    #  0.6  +1.5  A>0, r < 0.8: unclipped is the min        -0.9 / 6
    #  1.5  -2    A<0, r > 1.28: unclipped is the min       +3.0 / 6
    # losses: -1.28, 0.8, -2.2, 0.45, -0.9, 3.0 -> sum -0.13 -> mean -0.13 / 6
    ratios = [1.5, 0.6, 1.1, 0.9, 0.6, 1.5, 1.0]
    logp, old_logp = _token_batch(ratios)
    advantages = t64([[1.0, -1.0, 2.0, -0.5, 1.5, -2.0, 7.0]])
    mask = torch.tensor([[True] * 6 + [False]])
    loss, metrics, grad = run_loss("ppo", logp, old_logp, advantages, mask, make_cfg())
    torch.testing.assert_close(loss, torch.tensor(-0.13 / 6, dtype=F64), **TIGHT)
    torch.testing.assert_close(grad, t64([[0.0, 0.0, -2.2 / 6, 0.45 / 6, -0.9 / 6, 3.0 / 6, 0.0]]), **TIGHT)
    assert metrics["policy/clip_frac_high"].item() == pytest.approx(1 / 6, abs=1e-15)
    assert metrics["policy/clip_frac_low"].item() == pytest.approx(1 / 6, abs=1e-15)


def test_dual_clip_caps_negative_advantage_loss_at_c_abs_a():
    # c = 3, range [0.8, 1.28], A = -1 except the last token; N = 4.
    #  r = 4.0, A = -1: PPO loss 4.0 > cap 3 -> 3.0, grad 0          (dual clip active)
    #  r = 2.0, A = -1: PPO loss 2.0 < 3 -> 2.0, grad +2 / 4
    #  r = 0.5, A = -1: PPO clipped low -> 0.8, grad 0
    #  r = 4.0, A = +1: PPO clipped high -> -1.28, grad 0 (dual clip is for A < 0 only)
    # loss = (3 + 2 + 0.8 - 1.28) / 4 = 1.13; plain PPO would give (4 + 2 + 0.8 - 1.28) / 4 = 1.38
    logp, old_logp = _token_batch([4.0, 2.0, 0.5, 4.0], old=0.1)
    advantages = t64([[-1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    cfg = make_cfg(dual_clip_c=3.0)
    loss, metrics, grad = run_loss("dual_clip", logp, old_logp, advantages, mask, cfg)
    torch.testing.assert_close(loss, torch.tensor(1.13, dtype=F64), **TIGHT)
    torch.testing.assert_close(grad, t64([[0.0, 2.0 / 4, 0.0, 0.0]]), **TIGHT)
    assert metrics["policy/dual_clip_frac"].item() == pytest.approx(0.25, abs=1e-15)
    ppo_loss, _, ppo_grad = run_loss("ppo", logp, old_logp, advantages, mask, cfg)
    torch.testing.assert_close(ppo_loss, torch.tensor(1.38, dtype=F64), **TIGHT)
    assert ppo_grad[0, 0].item() == pytest.approx(4.0 / 4, abs=1e-14)  # what dual clip removes


def test_cispo_gradient_is_clipped_weight_times_advantage_for_every_token():
    # range [0.8, 1.28]; r = 0.5, 1.0, 2.0, 1.1 -> sg weights 0.8, 1.0, 1.28, 1.1
    # A = 1, -1, 1, -2: d loss / d logp_t = -w_t A_t / 4 = -0.8/4, 1/4, -1.28/4, 2.2/4:
    # no token loses its gradient, however far its ratio is clipped.
    logp, old_logp = _token_batch([0.5, 1.0, 2.0, 1.1])
    advantages = t64([[1.0, -1.0, 1.0, -2.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, metrics, grad = run_loss("cispo", logp, old_logp, advantages, mask, make_cfg(clip="cispo"))
    weights = t64([[0.8, 1.0, 1.28, 1.1]])
    torch.testing.assert_close(grad, -weights * advantages / 4, **TIGHT)
    torch.testing.assert_close(loss, (-weights * advantages * logp).sum() / 4, **TIGHT)
    assert metrics["policy/clip_frac_low"].item() == 0.25
    assert metrics["policy/clip_frac_high"].item() == 0.25


def test_tis_gradient_is_truncated_weight_times_advantage():
    # C = 2: r = 0.5, 1.0, 3.0, 2.5 -> weights 0.5, 1, 2, 2; A = 1, -1, 1, -2
    # d loss / d logp = -min(r, C) A / 4 = -0.5/4, 1/4, -2/4, 4/4
    logp, old_logp = _token_batch([0.5, 1.0, 3.0, 2.5], old=0.2)
    advantages = t64([[1.0, -1.0, 1.0, -2.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    _, metrics, grad = run_loss("tis", logp, old_logp, advantages, mask, make_cfg(clip="tis", tis_cap=2.0))
    torch.testing.assert_close(grad, t64([[-0.5 / 4, 1.0 / 4, -2.0 / 4, 4.0 / 4]]), **TIGHT)
    assert metrics["policy/clip_frac_high"].item() == 0.5
    assert metrics["policy/clip_frac_low"].item() == 0.0


def test_no_clip_gradient_is_ratio_times_advantage():
    # -r A: d/d logp = -r A / N for every token, however large r is: 0.5, 3.0 with A = 1, -2
    logp, old_logp = _token_batch([0.5, 3.0], old=0.2)
    advantages = t64([[1.0, -2.0]])
    _, _, grad = run_loss("none", logp, old_logp, advantages, torch.ones(1, 2, dtype=torch.bool),
                          make_cfg(clip="none"))
    torch.testing.assert_close(grad, t64([[-0.5 / 2, 6.0 / 2]]), **TIGHT)


def _ragged():
    g = torch.Generator().manual_seed(11)
    old_logp = -2.0 * torch.rand(3, 5, generator=g, dtype=F64) - 0.1
    logp = old_logp + 0.3 * torch.randn(3, 5, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    return logp, old_logp, mask


def test_gspo_sequence_ratio_and_gradient():
    # s_b = exp((1/|y_b|) sum_{t in y_b} log r_t); d s_b / d logp_t = s_b / |y_b| for every
    # action token t of row b, 0 for observation tokens and other rows.
    logp, old_logp, mask = _ragged()
    cfg = make_cfg(ratio="sequence")

    def explicit(x):
        log_ratio = (x - old_logp) * mask
        lengths = mask.sum(1, keepdim=True).clamp(min=1)
        s = torch.exp(log_ratio.sum(1, keepdim=True) / lengths)
        return torch.where(mask, s, torch.ones_like(x))

    fn = lambda x: RATIOS.get("sequence")(x, old_logp, mask, cfg)  # noqa: E731
    torch.testing.assert_close(fn(logp), explicit(logp), **TIGHT)
    jac = jacobian(fn, logp)
    torch.testing.assert_close(jac, jacobian(explicit, logp), **TIGHT)
    s = fn(logp)
    lengths = mask.sum(1)
    for b, t, c, u in itertools.product(range(3), range(5), range(3), range(5)):
        expected = s[b, t] / lengths[b] if (b == c and mask[b, t] and mask[c, u]) else 0.0
        assert jac[b, t, c, u].item() == pytest.approx(float(expected), abs=1e-14)


def test_gspo_token_value_s_gradient_only_at_own_token():
    logp, old_logp, mask = _ragged()
    cfg = make_cfg()
    s = RATIOS.get("sequence")(logp, old_logp, mask, cfg)
    fn = lambda x: RATIOS.get("sequence_token")(x, old_logp, mask, cfg)  # noqa: E731
    torch.testing.assert_close(fn(logp), s, **TIGHT)
    # d ratio_t / d logp_u = sg(s) if u == t (action token) else 0
    expected = torch.zeros(3, 5, 3, 5, dtype=F64)
    for b, t in itertools.product(range(3), range(5)):
        if mask[b, t]:
            expected[b, t, b, t] = s[b, t]
    torch.testing.assert_close(jacobian(fn, logp), expected, **TIGHT)


def test_ctpo_prefix_ratio_is_running_product_with_own_token_gradient():
    logp, old_logp, mask = _ragged()
    cfg = make_cfg()
    token = RATIOS.get("token")(logp, old_logp, mask, cfg)
    fn = lambda x: RATIOS.get("ctpo")(x, old_logp, mask, cfg)  # noqa: E731
    prefix = fn(logp)
    expected = torch.ones(3, 5, dtype=F64)
    for b in range(3):
        running = 1.0
        for t in range(5):
            if mask[b, t]:
                running *= token[b, t].item()
                expected[b, t] = running
    torch.testing.assert_close(prefix, expected, **TIGHT)
    expected_jac = torch.zeros(3, 5, 3, 5, dtype=F64)
    for b, t in itertools.product(range(3), range(5)):
        if mask[b, t]:
            expected_jac[b, t, b, t] = prefix[b, t]  # P_t, and 0 towards earlier tokens
    torch.testing.assert_close(jacobian(fn, logp), expected_jac, **TIGHT)


def test_cumulative_ratio_gradient_flows_through_every_action_token():
    logp, old_logp, mask = _ragged()
    cfg = make_cfg()
    fn = lambda x: RATIOS.get("cumulative")(x, old_logp, mask, cfg)  # noqa: E731
    total = fn(logp)
    token = RATIOS.get("token")(logp, old_logp, mask, cfg)
    for b in range(3):
        product = math.prod(token[b, t].item() for t in range(5) if mask[b, t])
        for t in range(5):
            assert total[b, t].item() == pytest.approx(product if mask[b, t] else 1.0, rel=1e-13)
    expected_jac = torch.zeros(3, 5, 3, 5, dtype=F64)
    for b, t, u in itertools.product(range(3), range(5), range(5)):
        if mask[b, t] and mask[b, u]:
            expected_jac[b, t, b, u] = total[b, t]  # d R / d logp_u = R for every action u
    torch.testing.assert_close(jacobian(fn, logp), expected_jac, **TIGHT)


@pytest.mark.parametrize("name", RATIO_NAMES)
def test_observation_tokens_get_ratio_one_and_no_gradient(name):
    logp, old_logp, mask = _ragged()
    fn = lambda x: RATIOS.get(name)(x, old_logp, mask, make_cfg())  # noqa: E731
    r = fn(logp)
    assert torch.equal(r[~mask], torch.ones(int((~mask).sum()), dtype=F64))
    jac = jacobian(fn, logp)
    assert torch.count_nonzero(jac[~mask]) == 0  # the ratio there does not move
    assert torch.count_nonzero(jac[:, :, ~mask]) == 0  # and logp there moves nothing


def test_log_weight_clamp_keeps_ratio_finite():
    # log r = 100 would overflow no float32; it is clamped to max_log_ratio = 20: e^20.
    logp, old_logp = t64([[0.0, 0.0]]), t64([[-100.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = make_cfg()
    torch.testing.assert_close(RATIOS.get("token")(logp, old_logp, mask, cfg), t64([[math.exp(20), math.e]]),
                               **TIGHT)
    torch.testing.assert_close(RATIOS.get("cumulative")(logp, old_logp, mask, cfg),
                               t64([[math.exp(20), math.exp(20)]]), **TIGHT)
    r32 = RATIOS.get("token")(logp.float(), old_logp.float(), mask, cfg)
    assert torch.isfinite(r32).all()


# ============================================================== 4. properties (hypothesis)

_ratio_st = st.floats(-6.0, 6.0)
_adv_st = st.floats(-5.0, 5.0).filter(lambda a: abs(a) > 1e-3)


@settings(max_examples=50, deadline=None)
@given(log_ratio=_ratio_st, advantage=_adv_st, eps_low=st.floats(0.01, 0.99), eps_high=st.floats(0.01, 2.0),
       c=st.floats(1.01, 10.0))
def test_ppo_and_dual_clip_bounds(log_ratio, advantage, eps_low, eps_high, c):
    cfg = make_cfg(eps_low=eps_low, eps_high=eps_high, dual_clip_c=c)
    old_logp = t64([[-1.0]])
    logp = old_logp + log_ratio
    adv = t64([[advantage]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    r = math.exp(log_ratio)
    low, high = 1.0 - eps_low, 1.0 + eps_high
    loss, _, grad = run_loss("ppo", logp, old_logp, adv, mask, cfg)
    tol = 1e-12 * (1 + abs(advantage) * max(r, 1.0))
    # The objective -loss never credits more than the clipped weight: r_eff <= 1 + eps_high
    # for A > 0 and >= 1 - eps_low for A < 0; and it is pessimistic: -loss <= r A.
    if advantage > 0:
        assert loss.item() >= -high * advantage - tol
    else:
        assert loss.item() >= -low * advantage - tol
    assert -loss.item() <= r * advantage + tol
    if (advantage > 0 and r > high) or (advantage < 0 and r < low):
        assert grad.item() == 0.0
    else:
        assert grad.item() == pytest.approx(-advantage * r, rel=1e-10)

    loss, _, grad = run_loss("dual_clip", logp, old_logp, adv, mask, cfg)
    if advantage < 0:
        assert loss.item() <= -c * advantage + tol  # capped at c |A|
        assert abs(grad.item()) <= c * abs(advantage) + tol


@settings(max_examples=50, deadline=None)
@given(log_ratio=_ratio_st, advantage=_adv_st, eps_low=st.floats(0.01, 1.0), eps_high=st.floats(0.01, 2.0),
       cap=st.floats(0.1, 10.0), ratio_name=st.sampled_from(RATIO_NAMES))
def test_cispo_and_tis_weights_stay_in_bounds(log_ratio, advantage, eps_low, eps_high, cap, ratio_name):
    cfg = make_cfg(ratio=ratio_name, eps_low=eps_low, eps_high=eps_high, tis_cap=cap)
    old_logp = t64([[-1.0]])
    logp = old_logp + log_ratio
    adv = t64([[advantage]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    r = math.exp(log_ratio)
    _, _, grad = run_loss("cispo", logp, old_logp, adv, mask, cfg)
    weight = -grad.item() / advantage  # d loss / d logp = -w A
    assert 1.0 - eps_low - 1e-12 <= weight <= 1.0 + eps_high + 1e-12
    assert weight == pytest.approx(min(max(r, 1.0 - eps_low), 1.0 + eps_high), rel=1e-12)
    _, _, grad = run_loss("tis", logp, old_logp, adv, mask, cfg)
    weight = -grad.item() / advantage
    assert weight == pytest.approx(min(r, cap), rel=1e-12) and weight <= cap * (1 + 1e-12)


def _all_outputs(ratio_name, clip, mode, constant, logp, old_logp, advantages, mask,
                 ref_logp=None, entropy=None):
    """Ratio, loss, metrics and gradients of one configuration, for bitwise comparison."""
    cfg = make_cfg(ratio=ratio_name, clip=clip, aggregation=mode, agg_constant=constant,
                   dual_clip_c=1.5, tis_cap=1.3, kl_coef=0.1, entropy_coef=0.01)
    out = {"ratio": RATIOS.get(ratio_name)(logp, old_logp, mask, cfg)}
    leaf = logp.clone().requires_grad_(True)
    ent = None if entropy is None else entropy.clone().requires_grad_(True)
    loss, metrics = policy_objective(logp=leaf, old_logp=old_logp, advantages=advantages, mask=mask,
                                     cfg=cfg, ref_logp=ref_logp, entropy=ent)
    loss.backward()
    out["loss"] = loss.detach()
    out["grad_logp"] = leaf.grad
    if ent is not None:
        out["grad_entropy"] = ent.grad
    out.update({f"metric:{k}": v for k, v in metrics.items()})
    ratio_leaf = logp.clone().requires_grad_(True)
    weights = torch.arange(1, logp.numel() + 1, dtype=F64).reshape(logp.shape)
    (RATIOS.get(ratio_name)(ratio_leaf, old_logp, mask, cfg) * torch.where(mask, weights, 0.0)).sum().backward()
    out["grad_ratio"] = ratio_leaf.grad
    return out


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.isfinite(a[key]).all(), key
        assert torch.equal(a[key], b[key]), (key, a[key], b[key])


_GARBAGE = [float("nan"), float("inf"), float("-inf"), 1e300, -1e300, 1e4]


@pytest.mark.parametrize("ratio_name,clip,mode,constant", COMBOS)
def test_observation_values_never_change_any_output(ratio_name, clip, mode, constant):
    logp, old_logp, advantages, mask = random_batch(500, 4, 7, garbage=False)
    ref_logp = logp + 0.2
    entropy = torch.rand(4, 7, dtype=F64)
    clean = _all_outputs(ratio_name, clip, mode, constant, logp, old_logp, advantages, mask,
                         ref_logp, entropy)
    n_obs = int((~mask).sum())
    for shift, _ in enumerate(_GARBAGE):
        junk = torch.tensor([_GARBAGE[(i + shift) % len(_GARBAGE)] for i in range(n_obs)], dtype=F64)

        def dirty(x, offset):
            x = x.clone()
            x[~mask] = junk.roll(offset)
            return x

        _assert_same(clean, _all_outputs(ratio_name, clip, mode, constant, dirty(logp, 0), dirty(old_logp, 1),
                                         dirty(advantages, 2), mask, dirty(ref_logp, 3), dirty(entropy, 4)))


_junk_st = st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=60, deadline=None)
@given(combo=st.sampled_from(COMBOS), batch=st.integers(1, 4), length=st.integers(1, 6),
       seed=st.integers(0, 2**31 - 1), data=st.data())
def test_observation_values_never_change_any_output_hypothesis(combo, batch, length, seed, data):
    bits = data.draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length))
    mask = torch.tensor(bits, dtype=torch.bool).reshape(batch, length)
    logp, old_logp, advantages, _ = random_batch(seed, batch, length, garbage=False)
    ref_logp = logp + 0.1
    entropy = torch.rand(batch, length, dtype=F64)
    clean = _all_outputs(*combo, logp, old_logp, advantages, mask, ref_logp, entropy)
    n_obs = int((~mask).sum())
    tensors = []
    for x in (logp, old_logp, advantages, ref_logp, entropy):
        junk = data.draw(st.lists(_junk_st, min_size=n_obs, max_size=n_obs))
        x = x.clone()
        x[~mask] = torch.tensor(junk, dtype=F64)
        tensors.append(x)
    _assert_same(clean, _all_outputs(*combo, *tensors[:3], mask, *tensors[3:]))


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), value_clip=st.sampled_from([None, 0.1, 1.0]), data=st.data())
def test_value_loss_ignores_observation_values(seed, value_clip, data):
    _, _, _, mask = random_batch(seed, 3, 5)
    g = torch.Generator().manual_seed(seed)
    values, old_values, returns = (torch.randn(3, 5, generator=g, dtype=F64) for _ in range(3))
    cfg = make_cfg(value_clip=value_clip)

    def run(v, ov, r):
        leaf = v.clone().requires_grad_(True)
        loss, metrics = value_loss(leaf, ov, r, mask, cfg)
        loss.backward()
        return {"loss": loss.detach(), "grad": leaf.grad, **metrics}

    n_obs = int((~mask).sum())
    dirty = []
    for x in (values, old_values, returns):
        x = x.clone()
        x[~mask] = torch.tensor(data.draw(st.lists(_junk_st, min_size=n_obs, max_size=n_obs)), dtype=F64)
        dirty.append(x)
    _assert_same(run(values, old_values, returns), run(*dirty))


# ============================================================== 5. KL estimators, Monte Carlo

def _sample_tokens(pi: torch.Tensor, ref_probs: torch.Tensor, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.multinomial(pi, n, replacement=True, generator=g)
    return pi.log()[idx].reshape(1, n), ref_probs.log()[idx].reshape(1, n)


def _mean_and_se(x: torch.Tensor) -> tuple[float, float]:
    return x.mean().item(), (x.std() / math.sqrt(x.numel())).item()


def test_k1_and_k3_are_unbiased_for_kl_pi_ref_k2_is_biased():
    # pi = [0.5, 0.5], ref = [0.9, 0.1]:
    # KL(pi || ref) = 0.5 log(0.5/0.9) + 0.5 log(0.5/0.1) = 0.5 (-0.587787 + 1.609438) = 0.510826
    # E_pi[k2] = 0.5 * (0.5 * 0.587787^2 + 0.5 * 1.609438^2) = 0.733925: bias +0.223.
    pi, ref_probs = t64([0.5, 0.5]), t64([0.9, 0.1])
    exact_kl = float((pi * (pi / ref_probs).log()).sum())
    assert exact_kl == pytest.approx(0.510826, abs=1e-6)
    exact_k2 = float((pi * 0.5 * (pi / ref_probs).log() ** 2).sum())
    n = 200_000
    logp, ref_logp = _sample_tokens(pi, ref_probs, n, seed=0)
    mask = torch.ones(1, n, dtype=torch.bool)
    for name in ("k1", "k3"):
        mean, se = _mean_and_se(kl_penalty(logp, ref_logp, mask, name))
        assert abs(mean - exact_kl) < 4 * se, (name, mean, exact_kl, se)
        assert se < 0.01 * exact_kl  # the test has power: a 1% bias would be visible
    mean, se = _mean_and_se(kl_penalty(logp, ref_logp, mask, "k2"))
    assert abs(mean - exact_k2) < 4 * se
    assert mean - exact_kl > 50 * se  # biased upwards here, far beyond sampling noise


def test_k1_and_k3_unbiased_on_a_random_categorical():
    g = torch.Generator().manual_seed(3)
    pi = torch.softmax(torch.randn(7, generator=g, dtype=F64), 0)
    ref_probs = torch.softmax(torch.randn(7, generator=g, dtype=F64), 0)
    exact_kl = float((pi * (pi / ref_probs).log()).sum())
    n = 200_000
    logp, ref_logp = _sample_tokens(pi, ref_probs, n, seed=4)
    mask = torch.ones(1, n, dtype=torch.bool)
    for name in ("k1", "k3"):
        mean, se = _mean_and_se(kl_penalty(logp, ref_logp, mask, name))
        assert abs(mean - exact_kl) < 4 * se, (name, mean, exact_kl, se)
        assert se < 0.02 * exact_kl


@settings(max_examples=50, deadline=None)
@given(logp=st.lists(st.floats(-60.0, 0.0), min_size=1, max_size=8), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_k3_is_never_negative(logp, data, dtype):
    ref_logp = data.draw(st.lists(st.floats(-60.0, 0.0), min_size=len(logp), max_size=len(logp)))
    lp, rp = torch.tensor([logp], dtype=dtype), torch.tensor([ref_logp], dtype=dtype)
    k3 = kl_penalty(lp, rp, torch.ones_like(lp, dtype=torch.bool), "k3")
    assert (k3 >= 0).all(), (lp, rp, k3)


# ============================================================== 6. entropy

@pytest.mark.parametrize("chunk_size", [1, 3, 4, 7, 1024])
def test_entropy_from_logits_matches_naive(chunk_size):
    g = torch.Generator().manual_seed(chunk_size)
    logits = 3.0 * torch.randn(2, 7, 11, generator=g, dtype=F64)
    naive = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    got = entropy_from_logits(logits, chunk_size=chunk_size)
    assert got.shape == (2, 7) and got.dtype == torch.float64  # float64 stays float64
    torch.testing.assert_close(got, naive, **TIGHT)
    assert entropy_from_logits(logits.float(), chunk_size=chunk_size).dtype == torch.float32
    for b, t in itertools.product(range(2), range(7)):
        assert got[b, t].item() == pytest.approx(ref.entropy(logits[b, t].tolist()), rel=1e-5, abs=1e-6)
    # differentiable like the naive version
    grad = grad_of(lambda x: entropy_from_logits(x, chunk_size=chunk_size).sum(), logits.float())
    naive_grad = grad_of(lambda x: (-(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)).sum(), logits)
    torch.testing.assert_close(grad.double(), naive_grad, rtol=1e-4, atol=1e-5)


def test_entropy_from_logits_edge_cases():
    assert entropy_from_logits(torch.zeros(3, 0, 5)).shape == (3, 0)
    # uniform over 4: log 4; one-hot-like logits: ~0; bfloat16 input is computed in float32
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]], dtype=torch.bfloat16)
    got = entropy_from_logits(logits)
    assert got[0, 0].item() == pytest.approx(math.log(4), rel=1e-6)
    assert 0.0 <= got[0, 1].item() < 1e-30


def test_entropy_from_logits_with_masked_out_vocabulary():
    # -inf logits (a masked vocabulary entry) have probability 0 and add 0 * log 0 = 0:
    # softmax([0, -inf, log 3]) = [0.25, 0, 0.75] -> H = -(0.25 log 0.25 + 0.75 log 0.75) = 0.562335
    logits = torch.tensor([[[0.0, float("-inf"), math.log(3.0)]]], requires_grad=True)
    got = entropy_from_logits(logits)
    assert got.item() == pytest.approx(0.562335, abs=1e-6)
    got.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 1].item() == 0.0


def test_sampled_entropy_estimates_entropy_and_its_gradient():
    # For y ~ pi_theta: E[-log pi(y)] = H, and the surrogate's gradient
    # -log pi(y) * grad log pi(y) = -log pi(y) * (onehot(y) - p) averages to grad H.
    theta = t64([1.5, 0.2, -0.7, 0.0, -2.0])
    probs = torch.softmax(theta, 0)
    exact = grad_of(lambda x: -(torch.softmax(x, 0) * torch.log_softmax(x, 0)).sum(), theta)
    exact_h = float(-(probs * probs.log()).sum())
    n = 200_000
    idx = torch.multinomial(probs, n, replacement=True, generator=torch.Generator().manual_seed(5))
    leaf = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(leaf, 0)[idx].reshape(1, n)
    surrogate = entropy_from_sampled_logprobs(logp)
    surrogate.mean().backward()
    mean_h, se_h = _mean_and_se(surrogate.detach())
    assert abs(mean_h - exact_h) < 4 * se_h
    # per-sample gradients in closed form, for the standard error (and the estimator's form)
    per_sample = -probs.log()[idx].unsqueeze(1) * (torch.nn.functional.one_hot(idx, 5).double() - probs)
    torch.testing.assert_close(leaf.grad, per_sample.mean(0), rtol=1e-9, atol=1e-12)
    se = per_sample.std(0) / math.sqrt(n)
    assert ((leaf.grad - exact).abs() < 4 * se).all(), (leaf.grad, exact, se)
    assert exact.abs().max() > 20 * se.max()  # power: a zero or wrong-sign gradient would fail
    # the naive -log pi(y) with full gradient averages to ~0, not grad H
    naive = -(torch.nn.functional.one_hot(idx, 5).double() - probs).mean(0)
    assert (naive - exact).abs().max() > 20 * se.max()


# ============================================================== 8. the full objective

def _objective_inputs():
    logp, old_logp, advantages, mask = random_batch(42, 3, 6, garbage=False)
    ref_logp = old_logp - 0.3 * torch.rand(3, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    entropy = torch.rand(3, 6, dtype=F64, generator=torch.Generator().manual_seed(2))
    return logp, old_logp, advantages, mask, ref_logp, entropy


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_policy_objective_kl_term_only_when_enabled(mode):
    logp, old_logp, advantages, mask, ref_logp, _ = _objective_inputs()
    base_cfg = make_cfg(aggregation=mode, kl_coef=0.0)
    policy_only, _ = POLICY_LOSSES.get("ppo")(logp, old_logp, advantages, mask, base_cfg)
    kl_agg = aggregate(kl_penalty(logp, ref_logp, mask, "k3"), mask, base_cfg)
    kl_mean = kl_penalty(logp, ref_logp, mask, "k3")[mask].mean()
    assert kl_agg.item() > 0.01  # so adding it is visible

    cases = [  # (kl_coef, kl_in_reward, ref given, expected loss)
        (0.0, False, True, policy_only),
        (0.1, False, True, policy_only + 0.1 * kl_agg),
        (0.1, True, True, policy_only),
    ]
    # A KL term in the loss without reference log-probs is an error, not a silent no-op.
    with pytest.raises(ValueError, match="ref_logp is None"):
        policy_objective(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask,
                         cfg=make_cfg(aggregation=mode, kl_coef=0.1, kl_estimator="k3"), ref_logp=None)
    for kl_coef, in_reward, give_ref, expected in cases:
        cfg = make_cfg(aggregation=mode, kl_coef=kl_coef, kl_in_reward=in_reward, kl_estimator="k3")
        loss, metrics = policy_objective(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask,
                                         cfg=cfg, ref_logp=ref_logp if give_ref else None)
        torch.testing.assert_close(loss, expected, **TIGHT)
        torch.testing.assert_close(metrics["loss/total"], expected, **TIGHT)
        assert ("policy/kl_ref" in metrics) == give_ref
        if give_ref:
            torch.testing.assert_close(metrics["policy/kl_ref"], kl_mean, **TIGHT)
        assert "policy/entropy" not in metrics
        assert RATIO_METRICS <= set(metrics)


def test_policy_objective_kl_gradient():
    # k2 = (log pi - log ref)^2 / 2 with kl_coef 0.1 and token_mean: the KL adds
    # 0.1 * (log pi - log ref) / N to d loss / d logp at each action token.
    logp, old_logp, advantages, mask, ref_logp, _ = _objective_inputs()
    cfg = make_cfg(kl_coef=0.1, kl_estimator="k2")
    policy_grad = grad_of(lambda x: POLICY_LOSSES.get("ppo")(x, old_logp, advantages, mask, cfg)[0], logp)
    total_grad = grad_of(lambda x: policy_objective(logp=x, old_logp=old_logp, advantages=advantages,
                                                    mask=mask, cfg=cfg, ref_logp=ref_logp)[0], logp)
    n = int(mask.sum())
    expected = torch.where(mask, 0.1 * (logp - ref_logp) / n, 0.0)
    torch.testing.assert_close(total_grad - policy_grad, expected, **TIGHT)


def test_policy_objective_entropy_bonus():
    logp, old_logp, advantages, mask, _, entropy = _objective_inputs()
    cfg0 = make_cfg(entropy_coef=0.0)
    policy_only, _ = POLICY_LOSSES.get("ppo")(logp, old_logp, advantages, mask, cfg0)
    entropy_mean = entropy[mask].mean()
    for coef in (0.0, 0.01):
        cfg = make_cfg(entropy_coef=coef)
        leaf = entropy.clone().requires_grad_(True)
        loss, metrics = policy_objective(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask,
                                         cfg=cfg, entropy=leaf)
        torch.testing.assert_close(loss, policy_only - coef * aggregate(entropy, mask, cfg), **TIGHT)
        torch.testing.assert_close(metrics["policy/entropy"], entropy_mean, **TIGHT)
        assert "policy/kl_ref" not in metrics
        if coef:
            loss.backward()  # more entropy lowers the loss: d loss / d H_t = -coef / N
            torch.testing.assert_close(leaf.grad, mask.to(F64) * (-coef / int(mask.sum())),
                                       **TIGHT)


def test_reference_log_probs_never_receive_gradient():
    # The reference model is a fixed anchor: KL(pi || ref) trains pi only.
    logp = torch.log(torch.tensor([[0.5, 0.25]], dtype=F64)).requires_grad_(True)
    ref_logp = torch.log(torch.tensor([[0.25, 0.5]], dtype=F64)).requires_grad_(True)
    mask = torch.tensor([[True, True]])
    cfg = make_cfg(kl_coef=0.1, kl_in_reward=False)
    loss, _ = policy_objective(logp=logp, old_logp=logp.detach(), advantages=torch.zeros(1, 2, dtype=F64),
                               mask=mask, cfg=cfg, ref_logp=ref_logp)
    loss.backward()
    assert ref_logp.grad is None
    assert logp.grad is not None and logp.grad.abs().sum() > 0


def test_approx_kl_metric_stays_finite_for_huge_float32_log_ratios():
    # log-ratio 200 would overflow expm1 in float32 (max ~88); the metric clamps like the weights.
    logp = torch.tensor([[0.0, -1.0]], dtype=torch.float32)
    old_logp = torch.tensor([[-200.0, -1.0]], dtype=torch.float32)
    mask = torch.tensor([[True, True]])
    _, metrics = POLICY_LOSSES.get("ppo")(logp, old_logp, torch.ones(1, 2), mask, make_cfg())
    limit = make_cfg().max_log_ratio
    expected = (math.expm1(limit) - limit) / 2  # one clamped token, one with ratio 1
    assert torch.isfinite(metrics["policy/approx_kl"])
    assert metrics["policy/approx_kl"].item() == pytest.approx(expected, rel=1e-5)
    assert metrics["policy/clip_frac"].item() == pytest.approx(0.5)


def test_exploration_collapse_worked_numbers_and_the_entropy_bonus_pushes_back():
    # Lecture: three actions at 0.2/0.6/0.2 drift to 0.01/0.98/0.01.
    # H(0.2, 0.6, 0.2)    = -(2 * 0.2 ln 0.2 + 0.6 ln 0.6)     = 0.643775 + 0.306495 = 0.950271
    # H(0.01, 0.98, 0.01) = -(2 * 0.01 ln 0.01 + 0.98 ln 0.98) = 0.092103 + 0.019799 = 0.111902
    before = torch.log(t64([0.2, 0.6, 0.2])).view(1, 1, 3)
    after = torch.log(t64([0.01, 0.98, 0.01])).view(1, 1, 3)
    assert entropy_from_logits(before).item() == pytest.approx(0.950271, abs=1e-6)
    assert entropy_from_logits(after).item() == pytest.approx(0.111902, abs=1e-6)
    # With zero advantages the objective is the entropy bonus alone; a gradient step on it
    # moves probability back to the rare actions A and C.
    logits = after.clone().requires_grad_(True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    logp = torch.log_softmax(logits, -1)[..., 1]
    loss, metrics = policy_objective(logp=logp, old_logp=logp.detach(), advantages=torch.zeros(1, 1, dtype=F64),
                                     mask=mask, cfg=make_cfg(entropy_coef=0.1), entropy=entropy_from_logits(logits))
    assert metrics["policy/entropy"].item() == pytest.approx(0.111902, abs=1e-6)
    loss.backward()
    stepped = (logits - 10.0 * logits.grad).detach()
    probs = torch.softmax(stepped, -1).flatten()
    assert probs[0] > 0.01 and probs[2] > 0.01 and probs[1] < 0.98
    assert entropy_from_logits(stepped).item() > 0.111902


def test_kl_estimators_as_loss_terms_have_the_documented_expected_gradients():
    # Exact expectation over a categorical pi (no sampling noise): the loss term's expected
    # gradient w.r.t. the logits is sum_a pi(a) * d k(a) / d logits, samples held fixed.
    # k1 -> 0; k2 -> grad KL(pi || ref); k3 -> grad KL(ref || pi) (Tang & Munos 2025).
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, generator=g, dtype=F64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(5, generator=g, dtype=F64), 0)
    mask = torch.ones(1, 5, dtype=torch.bool)

    def expected_grad(estimator: str) -> torch.Tensor:
        logp = torch.log_softmax(logits, 0)
        per_action = kl_penalty(logp.view(1, 5), ref.view(1, 5), mask, estimator).view(5)
        (grad,) = torch.autograd.grad((logp.exp().detach() * per_action).sum(), logits)
        return grad

    def kl_grad(forward: bool) -> torch.Tensor:
        logp = torch.log_softmax(logits, 0)
        kl = (logp.exp() * (logp - ref)).sum() if forward else (ref.exp() * (ref - logp)).sum()
        (grad,) = torch.autograd.grad(kl, logits)
        return grad

    torch.testing.assert_close(expected_grad("k1"), torch.zeros(5, dtype=F64), atol=1e-15, rtol=0)
    torch.testing.assert_close(expected_grad("k2"), kl_grad(forward=True), **TIGHT)
    torch.testing.assert_close(expected_grad("k3"), kl_grad(forward=False), **TIGHT)
    assert not torch.allclose(kl_grad(forward=True), kl_grad(forward=False))  # the distinction is real


def test_k1_in_the_loss_is_a_config_error():
    with pytest.raises(ConfigError, match="zero expected gradient") as info:
        AlgoConfig(preset="grpo", kl_estimator="k1", kl_coef=0.1, kl_in_reward=False)
    assert info.value.field == "kl_estimator"
    AlgoConfig(preset="grpo", kl_estimator="k1", kl_coef=0.1, kl_in_reward=True)  # fine as a reward penalty


@pytest.mark.parametrize("ratio_name", ["token", "sequence", "ctpo"])
@pytest.mark.parametrize("clip", ["ppo", "cispo"])
def test_half_precision_inputs_are_computed_in_float32(ratio_name, clip):
    # GSPO-scale clip bounds (1 +- 3e-4) are below bf16's resolution at 1.0 (0.0078): the loss
    # must upcast, so bf16 inputs give what float32 gives on the same (bf16-rounded) values.
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(4, 6, dtype=torch.bool)
    logp = (-1.0 - torch.rand(4, 6, generator=g)).to(torch.bfloat16)
    old_logp = (logp.float() - 0.002 * torch.randn(4, 6, generator=g)).to(torch.bfloat16)
    advantages = torch.randn(4, 6, generator=g).to(torch.bfloat16)
    cfg = make_cfg(ratio=ratio_name, clip=clip, eps_low=3e-4, eps_high=4e-4)
    half_leaf = logp.clone().requires_grad_(True)
    full_leaf = logp.float().clone().requires_grad_(True)
    half_loss, half_metrics = POLICY_LOSSES.get(clip)(half_leaf, old_logp, advantages, mask, cfg)
    full_loss, full_metrics = POLICY_LOSSES.get(clip)(full_leaf, old_logp.float(), advantages.float(), mask, cfg)
    assert half_loss.dtype == torch.float32
    torch.testing.assert_close(half_loss, full_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(half_metrics["policy/clip_frac"], full_metrics["policy/clip_frac"])
    half_loss.backward()
    full_loss.backward()
    torch.testing.assert_close(half_leaf.grad.float(), full_leaf.grad.to(torch.bfloat16).float())


def test_whitening_equal_advantages_gives_zero_not_amplified_rounding_noise():
    from keelrl.algos.masked import masked_whiten

    values = torch.full((10, 100), 0.1, dtype=torch.float32)
    mask = torch.ones_like(values, dtype=torch.bool)
    assert torch.equal(masked_whiten(values, mask), torch.zeros_like(values))
    spread = values + torch.linspace(-1, 1, 1000).view(10, 100)
    whitened = masked_whiten(spread, mask)
    assert abs(whitened.mean().item()) < 1e-5 and abs(whitened.std(unbiased=False).item() - 1) < 1e-4


def test_entropy_of_an_all_minus_inf_position_stays_finite_with_gradient():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [float("-inf")] * 3]], dtype=F64, requires_grad=True)
    entropy = entropy_from_logits(logits, chunk_size=1)
    assert torch.isfinite(entropy).all()
    entropy[0, 0].backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 1].abs().sum() == 0


def test_checkpointed_entropy_gradient_equals_the_plain_one():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 7, 5, generator=g, dtype=F64, requires_grad=True)
    chunked = entropy_from_logits(logits, chunk_size=3)
    (chunked_grad,) = torch.autograd.grad((chunked * torch.arange(7)).sum(), logits)
    log_probs = torch.log_softmax(logits, -1)
    plain = -(log_probs.exp() * log_probs).sum(-1)
    (plain_grad,) = torch.autograd.grad((plain * torch.arange(7)).sum(), logits)
    torch.testing.assert_close(chunked, plain.detach(), **TIGHT)
    torch.testing.assert_close(chunked_grad, plain_grad, **TIGHT)


def test_kl_is_weight_weights_each_kl_term_by_the_truncated_ratio_to_the_behaviour_policy():
    """kl_is_weight: loss = PPO + coef x token_mean(min(pi/mu, cap) x k3), the weight detached;
    against a float64 loop, value and gradient. On samples from mu = ref after pi fell on them,
    unweighted k3 explodes and the weighted one stays at most 1."""
    from keelrl.algos.ratios import token_log_ratio

    for seed, (batch, length) in enumerate(SHAPES):
        logp, ref_logp, old_logp, mask = random_batch(700 + seed, batch, length)
        advantages = torch.randn(batch, length, dtype=F64, generator=torch.Generator().manual_seed(seed))
        plain = make_cfg(kl_coef=0.1, kl_estimator="k3")
        weighted = make_cfg(kl_coef=0.1, kl_estimator="k3", kl_is_weight=True, behaviour_weight_cap=2.0)
        leaf = logp.clone().requires_grad_(True)
        base, _ = policy_objective(logp=leaf, old_logp=old_logp, advantages=advantages, mask=mask, cfg=plain,
                                   ref_logp=ref_logp)
        base_grad = torch.autograd.grad(base, leaf)[0]
        leaf = logp.clone().requires_grad_(True)
        got, metrics = policy_objective(logp=leaf, old_logp=old_logp, advantages=advantages, mask=mask, cfg=weighted,
                                        ref_logp=ref_logp)
        got_grad = torch.autograd.grad(got, leaf)[0]
        tokens = int(mask.sum())
        kl_plain = kl_weighted = 0.0
        grad_shift = torch.zeros(batch, length, dtype=F64)
        for b, t in itertools.product(range(batch), range(length)):
            if not mask[b, t]:
                continue
            value, slope = ref.kl_estimate("k3", logp[b, t].item(), ref_logp[b, t].item())
            w = min(math.exp(logp[b, t].item() - old_logp[b, t].item()), 2.0)
            kl_plain += value / tokens
            kl_weighted += w * value / tokens
            grad_shift[b, t] = 0.1 * (w - 1.0) * slope / tokens  # the weight is a constant in the gradient
        assert got.item() == pytest.approx(base.item() + 0.1 * (kl_weighted - kl_plain), abs=1e-12)
        assert metrics["policy/kl_ref_weighted"].item() == pytest.approx(kl_weighted, abs=1e-12)
        torch.testing.assert_close(got_grad, base_grad + grad_shift, **TIGHT)
    # mu = ref, and pi fell to e^-8 of it on every sampled token: k3 ~ e^8, weighted k3 <= 1
    ref_logp = t64([[math.log(0.5), math.log(0.3)]])
    logp = ref_logp - 8.0
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = make_cfg(kl_coef=1.0, kl_estimator="k3", kl_is_weight=True)
    _, metrics = policy_objective(logp=logp, old_logp=ref_logp, advantages=torch.zeros(1, 2, dtype=F64), mask=mask,
                                  cfg=cfg, ref_logp=ref_logp)
    assert metrics["policy/kl_ref"].item() == pytest.approx(math.expm1(8.0) - 8.0)
    assert 0 < metrics["policy/kl_ref_weighted"].item() <= 1.0
    assert token_log_ratio(logp, ref_logp, mask).max().item() == pytest.approx(-8.0)


# ------------------------------------------------------------------ token_view (the viewer's per-token clip)

def test_token_view_ratio_and_clip_by_hand():
    from keelrl.algos.losses import token_view

    # ratios e^0.4 = 1.49, e^0.4, e^-0.7 = 0.50, e^-0.7, e^0.1 = 1.11, and a padded position
    logp = torch.tensor([[0.4, 0.4, -0.7, -0.7, 0.1, 9.0]], dtype=torch.float64)
    old = torch.zeros_like(logp)
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, True, False]])
    expected_ratio = [math.exp(0.4), math.exp(0.4), math.exp(-0.7), math.exp(-0.7), math.exp(0.1), 0.0]
    cases = {
        # ppo [0.8, 1.2]: the clip removes the gradient of r > 1.2 with A > 0 and r < 0.8 with A < 0
        "ppo": [True, False, True, False, False, False],
        "dual_clip": [True, False, True, False, False, False],
        # cispo clamps the weight of every token outside [0.8, 1.2], whatever A's sign
        "cispo": [True, True, True, True, False, False],
        # tis truncates weights above the cap (1.3 here)
        "tis": [True, True, False, False, False, False],
        "none": [False] * 6,
    }
    for clip, clipped in cases.items():
        cfg = make_cfg(clip=clip, eps_low=0.2, eps_high=0.2, tis_cap=1.3)
        ratio, mask_out = token_view(logp=logp, old_logp=old, advantages=advantages, mask=mask, cfg=cfg)
        assert ratio[0].tolist() == pytest.approx(expected_ratio, rel=1e-12), clip
        assert mask_out[0].tolist() == clipped, clip


def test_token_view_decoupled_measures_against_the_proximal_policy():
    from keelrl.algos.losses import token_view

    logp = torch.tensor([[0.3, 0.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-2.0, -2.0]], dtype=torch.float64)  # far stale: r vs mu would be e^2.3
    prox = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True]])
    cfg = make_cfg(decoupled=True, clip="ppo", eps_low=0.2, eps_high=0.2)
    ratio, clipped = token_view(logp=logp, old_logp=behaviour, advantages=torch.ones_like(logp), mask=mask,
                                cfg=cfg, prox_logp=prox)
    assert ratio[0].tolist() == pytest.approx([math.exp(0.3), 1.0], rel=1e-12)
    assert clipped[0].tolist() == [True, False]
