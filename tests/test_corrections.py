"""Rollout corrections (keelrl.algos.corrections): hand-worked numbers, a float64 loop reference over
seeds and shapes, masks, the mismatch metrics, config errors, and the learner applying the weights."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import FAST_RUN, float64_model

from keelrl.algos import ROLLOUT_CORRECTIONS, AlgoConfig, PRESETS, policy_objective
from keelrl.algos.corrections import correction_weights, mismatch_metrics
from keelrl.algos.losses import token_view
from keelrl.config import TINY_RUN, DistillConfig, load_config
from keelrl.errors import ConfigError
from keelrl.rollout.trajectory import Batch
from keelrl.train.advantage import arrival_stats
from keelrl.train.learner import Learner, UpdateInputs

F64 = torch.float64
EXACT = dict(rtol=0.0, atol=1e-12)  # hand-worked numbers, computed in float64
NAMES = ("none", "token_tis", "seq_mask", "geo_mask", "icepop")
TOKEN_KEYS = ("correction/weight_mean", "correction/weight_max", "correction/masked_token_frac",
              "correction/masked_seq_frac", "mismatch/kl", "mismatch/k3", "mismatch/log_ratio_abs_max")


def cfg_for(name: str, **fields) -> AlgoConfig:
    return AlgoConfig(preset="grpo", kl_coef=0.0, rollout_correction=name, **fields)


def test_the_registered_names_are_the_documented_ones():
    assert ROLLOUT_CORRECTIONS.names() == list(NAMES)
    assert all(AlgoConfig(preset=name).rollout_correction == "none" for name in PRESETS)


# ------------------------------------------------------------------ the float64 loop reference

def reference(name: str, prox: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, cfg: AlgoConfig):
    """Plain loops over rows and tokens, in Python floats: (weights [B][T], metrics)."""
    rows, width = mask.shape
    weights = [[0.0] * width for _ in range(rows)]
    rejected = [[False] * width for _ in range(rows)]
    log_ratios, clamped, truncated, wholly_rejected = [], [], [], []
    for b in range(rows):
        tokens = [t for t in range(width) if mask[b, t]]
        if not tokens:
            continue
        ratio = {t: float(prox[b, t]) - float(mu[b, t]) for t in tokens}  # log pi_prox - log mu
        total = sum(ratio.values())
        for t in tokens:
            c = min(max(ratio[t], -cfg.max_log_ratio), cfg.max_log_ratio)
            log_ratios.append(ratio[t])
            clamped.append(c)
            if name == "none":
                w = 1.0
            elif name == "token_tis":
                w = min(math.exp(c), cfg.correction_cap)
                truncated.append(math.exp(c) > cfg.correction_cap)
            elif name == "seq_mask":
                keep = cfg.seq_mask_low <= math.exp(total) <= cfg.seq_mask_high
                w = math.exp(total) if keep else 0.0
                rejected[b][t] = not keep
            elif name == "geo_mask":
                keep = cfg.geo_mask_low <= math.exp(total / len(tokens)) <= cfg.geo_mask_high
                w = 1.0 if keep else 0.0
                rejected[b][t] = not keep
            else:  # icepop
                keep = cfg.icepop_low <= math.exp(ratio[t]) <= cfg.icepop_high
                w = math.exp(ratio[t]) if keep else 0.0
                rejected[b][t] = not keep
            weights[b][t] = w
        wholly_rejected.append(all(rejected[b][t] for t in tokens))
    kept = [weights[b][t] for b in range(rows) for t in range(width) if mask[b, t]]
    flags = [rejected[b][t] for b in range(rows) for t in range(width) if mask[b, t]]
    n = max(1, len(kept))
    metrics = {
        "mismatch/kl": sum(-x for x in log_ratios) / n,
        "mismatch/k3": sum(math.expm1(c) - c for c in clamped) / n,
        "mismatch/log_ratio_abs_max": max((abs(x) for x in log_ratios), default=0.0),
        "correction/weight_mean": sum(kept) / n,
        "correction/weight_max": max(kept, default=0.0),
        "correction/masked_token_frac": sum(flags) / n,
        "correction/masked_seq_frac": sum(wholly_rejected) / max(1, len(wholly_rejected)),
    }
    if name == "token_tis":
        metrics["correction/truncated_frac"] = sum(truncated) / n
    return weights, metrics


NOISE = {"none": 0.5, "token_tis": 0.6, "seq_mask": 0.3, "geo_mask": 0.02, "icepop": 0.8}
"""Per-token log-ratio spread that puts tokens (or rows) on both sides of each default window."""


def random_case(name: str, seed: int, shape: tuple[int, int], dtype: torch.dtype = F64):
    gen = torch.Generator().manual_seed(seed)
    mu = -torch.rand(shape, generator=gen, dtype=F64) * 4
    row_offset = torch.randn(shape[0], 1, generator=gen, dtype=F64) * NOISE[name] * 0.5
    prox = mu + row_offset + torch.randn(shape, generator=gen, dtype=F64) * NOISE[name]
    mask = torch.rand(shape, generator=gen) < 0.7
    if shape[0] > 1:
        mask[-1] = False  # a row without action tokens (its padding must not count as a sequence)
    # Padding holds garbage: nothing off the mask may reach a weight or a metric.
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30], dtype=F64)
    fill = garbage[torch.randint(0, 4, shape, generator=gen)]
    prox, mu = torch.where(mask, prox, fill), torch.where(mask, mu, fill.flip(0))
    return prox.to(dtype), mu.to(dtype), mask


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", [(1, 1), (2, 5), (4, 9), (7, 16)])
def test_each_correction_matches_the_float64_loop(name, seed, shape):
    prox, mu, mask = random_case(name, seed, shape)
    cfg = cfg_for(name)
    weights, metrics = ROLLOUT_CORRECTIONS.get(name)(prox, mu, mask, cfg)
    want_weights, want_metrics = reference(name, prox, mu, mask, cfg)
    assert weights.dtype == F64 and not weights.requires_grad
    torch.testing.assert_close(weights, torch.tensor(want_weights, dtype=F64), rtol=1e-12, atol=1e-12)
    assert set(metrics) == set(want_metrics)
    for key, value in want_metrics.items():
        assert float(metrics[key]) == pytest.approx(value, rel=1e-10, abs=1e-12), key


def test_the_cases_reach_both_sides_of_every_window():
    """The reference test above checks something: over its seeds and shapes every mask both keeps and rejects."""
    for name in ("seq_mask", "geo_mask", "icepop"):
        fractions = [float(ROLLOUT_CORRECTIONS.get(name)(*random_case(name, seed, (7, 16)), cfg_for(name))[1]
                           ["correction/masked_token_frac"]) for seed in range(3)]
        assert 0 < min(fractions) and max(fractions) < 1, (name, fractions)
    truncated = [float(correction_weights(*random_case("token_tis", seed, (7, 16)), cfg_for("token_tis"))[1]
                       ["correction/truncated_frac"]) for seed in range(3)]
    assert 0 < min(truncated) and max(truncated) < 1


@pytest.mark.parametrize("name", NAMES)
def test_float32_inputs_give_float32_weights_that_agree(name):
    prox, mu, mask = random_case(name, 4, (4, 9), dtype=torch.float32)
    weights, _ = ROLLOUT_CORRECTIONS.get(name)(prox, mu, mask, cfg_for(name))
    want, _ = reference(name, prox.double(), mu.double(), mask, cfg_for(name))
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ hand-worked numbers

# Two rows, four columns. Row 0: action tokens at columns 0-2 with ratios rho = pi_prox / mu of
# 1.25, 0.4, 1.25, then padding. Row 1: 2.5, 0.9, padding, 1.1.
RHO = [[1.25, 0.4, 1.25, 1.0], [2.5, 0.9, 1.0, 1.1]]
MASK = torch.tensor([[True, True, True, False], [True, True, False, True]])


def hand_case():
    mu = torch.tensor([[-0.5, -1.5, -2.0, 7.0], [-1.0, -0.25, 9.0, -3.0]], dtype=F64)
    prox = mu + torch.tensor(RHO, dtype=F64).log()
    prox = torch.where(MASK, prox, torch.tensor(float("nan"), dtype=F64))  # padding: never read
    return prox, mu, MASK


def run(name: str, **fields):
    weights, metrics = ROLLOUT_CORRECTIONS.get(name)(*hand_case(), cfg_for(name, **fields))
    return weights, {key: float(value) for key, value in metrics.items()}


def test_hand_worked_mismatch_metrics():
    # log rho: ln 1.25 = 0.22314, ln 0.4 = -0.91629, 0.22314 | ln 2.5 = 0.91629, ln 0.9 = -0.10536, ln 1.1 = 0.09531.
    # Their sum is 0.43624, so the sampled KL(mu || pi_prox) = mean(log mu - log pi_prox) = -0.43624 / 6
    # = -0.07271: negative, as a sample estimate of a KL may be on six tokens.
    # k3 = (rho - 1) - ln rho: 0.02686, 0.31629, 0.02686 | 0.58371, 0.00536, 0.00469; mean 0.96377 / 6 = 0.16063.
    # The largest |log rho| is ln 2.5 = -ln 0.4 = 0.91629.
    _, metrics = run("none")
    logs = [math.log(x) for x in (1.25, 0.4, 1.25, 2.5, 0.9, 1.1)]
    assert metrics["mismatch/kl"] == pytest.approx(-sum(logs) / 6, abs=1e-12)
    assert metrics["mismatch/kl"] == pytest.approx(-0.07271, abs=1e-5)
    assert metrics["mismatch/k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in logs) / 6, abs=1e-12)
    assert metrics["mismatch/k3"] == pytest.approx(0.16063, abs=1e-5)
    assert metrics["mismatch/log_ratio_abs_max"] == pytest.approx(math.log(2.5), abs=1e-12)


def test_hand_worked_none_weighs_every_action_token_one():
    weights, metrics = run("none")
    torch.testing.assert_close(weights, MASK.to(F64), **EXACT)
    assert (metrics["correction/weight_mean"], metrics["correction/masked_token_frac"],
            metrics["correction/masked_seq_frac"]) == (1.0, 0.0, 0.0)


def test_hand_worked_token_tis():
    # Cap 2: only 2.5 is cut, to 2. Weights 1.25, 0.4, 1.25 | 2, 0.9, 1.1: mean 6.9 / 6 = 1.15,
    # max 2, one token in six truncated, none masked.
    weights, metrics = run("token_tis", correction_cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.25, 0.4, 1.25, 0.0], [2.0, 0.9, 0.0, 1.1]], dtype=F64),
                               **EXACT)
    assert metrics["correction/weight_mean"] == pytest.approx(1.15, abs=1e-12)
    assert metrics["correction/weight_max"] == pytest.approx(2.0, abs=1e-12)
    assert metrics["correction/truncated_frac"] == pytest.approx(1 / 6, abs=1e-12)
    assert metrics["correction/masked_token_frac"] == 0.0


def test_hand_worked_seq_mask():
    # Row products: 1.25 * 0.4 * 1.25 = 0.625 (inside [0.5, 2]: weight 0.625 at each of its three
    # tokens) and 2.5 * 0.9 * 1.1 = 2.475 (above 2: the whole row is rejected).
    weights, metrics = run("seq_mask")
    torch.testing.assert_close(weights, torch.tensor([[0.625, 0.625, 0.625, 0.0], [0.0] * 4], dtype=F64), **EXACT)
    assert metrics["correction/masked_token_frac"] == pytest.approx(0.5, abs=1e-12)  # 3 of 6 tokens
    assert metrics["correction/masked_seq_frac"] == pytest.approx(0.5, abs=1e-12)  # 1 of 2 rows
    # A window up to 2.5 keeps row 1 too, at its product 2.475.
    weights, _ = run("seq_mask", seq_mask_high=2.5)
    torch.testing.assert_close(weights[1], torch.tensor([2.475, 2.475, 0.0, 2.475], dtype=F64), rtol=0, atol=1e-12)


def test_hand_worked_geo_mask():
    # Geometric means: 0.625 ** (1/3) = 0.85499 and 2.475 ** (1/3) = 1.35267. The default window
    # [0.99, 1.01] rejects both rows; [0.8, 1.25] keeps row 0 (weight 1) and rejects row 1.
    weights, metrics = run("geo_mask")
    torch.testing.assert_close(weights, torch.zeros(2, 4, dtype=F64), **EXACT)
    assert (metrics["correction/masked_token_frac"], metrics["correction/masked_seq_frac"]) == (1.0, 1.0)
    weights, metrics = run("geo_mask", geo_mask_low=0.8, geo_mask_high=1.25)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0] * 4], dtype=F64), **EXACT)
    assert metrics["correction/masked_seq_frac"] == pytest.approx(0.5, abs=1e-12)


def test_hand_worked_icepop():
    # Window [0.5, 5]: 0.4 is masked, every other token keeps its ratio: 1.25, 0, 1.25 | 2.5, 0.9, 1.1.
    # One token in six masked, no row wholly masked; weight mean 7 / 6.
    weights, metrics = run("icepop")
    torch.testing.assert_close(weights, torch.tensor([[1.25, 0.0, 1.25, 0.0], [2.5, 0.9, 0.0, 1.1]], dtype=F64),
                               rtol=0, atol=1e-12)
    assert metrics["correction/masked_token_frac"] == pytest.approx(1 / 6, abs=1e-12)
    assert metrics["correction/masked_seq_frac"] == 0.0
    assert metrics["correction/weight_mean"] == pytest.approx(7 / 6, abs=1e-12)
    # [0.95, 1.2] keeps only 1.1: row 0 is then wholly masked.
    weights, metrics = run("icepop", icepop_low=0.95, icepop_high=1.2)
    torch.testing.assert_close(weights, torch.tensor([[0.0] * 4, [0.0, 0.0, 0.0, 1.1]], dtype=F64), rtol=0, atol=1e-12)
    assert metrics["correction/masked_seq_frac"] == pytest.approx(0.5, abs=1e-12)


# ------------------------------------------------------------------ masks and fresh data

@pytest.mark.parametrize("name", NAMES)
def test_padding_never_changes_weights_or_metrics(name):
    prox, mu, mask = random_case(name, 7, (5, 11))
    clean_prox, clean_mu = torch.where(mask, prox, 0.0), torch.where(mask, mu, 0.0)
    cfg = cfg_for(name)
    weights, metrics = ROLLOUT_CORRECTIONS.get(name)(prox, mu, mask, cfg)
    clean_weights, clean_metrics = ROLLOUT_CORRECTIONS.get(name)(clean_prox, clean_mu, mask, cfg)
    assert torch.equal(weights, clean_weights) and torch.all(weights[~mask] == 0)
    assert {k: float(v) for k, v in metrics.items()} == {k: float(v) for k, v in clean_metrics.items()}
    # Extra padding columns and an extra row without action tokens change nothing either.
    wide = torch.nn.functional.pad(prox, (0, 3), value=float("nan"))
    wide_mu = torch.nn.functional.pad(mu, (0, 3), value=5.0)
    wide_mask = torch.nn.functional.pad(mask, (0, 3), value=False)
    extra = (torch.cat([wide, wide[:1]]), torch.cat([wide_mu, wide_mu[:1]]),
             torch.cat([wide_mask, torch.zeros_like(wide_mask[:1])]))
    more_weights, more_metrics = ROLLOUT_CORRECTIONS.get(name)(*extra, cfg)
    # (sums over other shapes may add the same numbers in another order: equal to rounding)
    torch.testing.assert_close(more_weights[:-1, :-3], weights, rtol=1e-13, atol=0)
    assert torch.all(more_weights[-1] == 0) and torch.all(more_weights[:, -3:] == 0)
    assert more_metrics.keys() == metrics.keys()
    for key, value in metrics.items():
        assert float(more_metrics[key]) == pytest.approx(float(value), rel=1e-13, abs=1e-15), key


@pytest.mark.parametrize("name", NAMES)
def test_no_mismatch_gives_zero_metrics_and_weight_one(name):
    """mu == pi_prox (a learner in the sampler's precision): every correction is the identity."""
    _, mu, mask = random_case(name, 2, (4, 9))
    weights, metrics = ROLLOUT_CORRECTIONS.get(name)(mu.clone(), mu, mask, cfg_for(name))
    assert torch.equal(weights, mask.to(F64))
    for key in ("mismatch/kl", "mismatch/k3", "mismatch/log_ratio_abs_max", "correction/masked_token_frac",
                "correction/masked_seq_frac"):
        assert float(metrics[key]) == 0.0, key
    assert float(metrics["correction/weight_mean"]) == 1.0


def test_no_action_tokens_gives_zero_metrics_not_nan():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for name in NAMES:
        weights, metrics = ROLLOUT_CORRECTIONS.get(name)(torch.zeros(2, 3), torch.ones(2, 3), mask, cfg_for(name))
        assert torch.equal(weights, torch.zeros(2, 3))
        assert all(float(value) == 0.0 for value in metrics.values()), name


def test_mismatch_metrics_are_every_components_and_the_arrival_stats():
    prox, mu, mask = random_case("icepop", 3, (4, 9), dtype=torch.float32)
    cfg = cfg_for("icepop")
    want = {key: float(value) for key, value in mismatch_metrics(prox, mu, mask, cfg).items()}
    for name in NAMES:
        _, metrics = ROLLOUT_CORRECTIONS.get(name)(prox, mu, mask, cfg_for(name))
        assert {key: float(metrics[key]) for key in want} == want
    batch = Batch(torch.zeros(4, 9, dtype=torch.long), torch.ones(4, 9, dtype=torch.long), mask, mu,
                  torch.zeros(4, 9, dtype=torch.long), torch.zeros(4), torch.arange(4))
    stats = arrival_stats(prox, batch, cfg)
    assert set(TOKEN_KEYS) <= set(stats) and "rollout/arrival_is_weight_max" in stats
    assert all(stats[key] == pytest.approx(value, rel=1e-6) for key, value in want.items())
    _, icepop_metrics = correction_weights(prox, mu, mask, cfg)
    assert stats["correction/masked_token_frac"] == pytest.approx(float(icepop_metrics["correction/masked_token_frac"]))


# ------------------------------------------------------------------ the config

def test_an_unknown_correction_fails_at_config_time_listing_the_names():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["algo.rollout_correction=seq_mis"])
    assert info.value.field == "algo.rollout_correction"
    assert all(name in str(info.value) for name in NAMES)


@pytest.mark.parametrize("override, field", [
    ("algo.correction_cap=0.5", "algo.correction_cap"),
    ("algo.correction_cap=.inf", "algo.correction_cap"),
    ("algo.seq_mask_low=1.0", "algo.seq_mask_low"),
    ("algo.seq_mask_low=0", "algo.seq_mask_low"),
    ("algo.seq_mask_high=1", "algo.seq_mask_high"),
    ("algo.geo_mask_low=1.0001", "algo.geo_mask_low"),
    ("algo.geo_mask_high=0.9999", "algo.geo_mask_high"),
    ("algo.icepop_low=-0.5", "algo.icepop_low"),
    ("algo.icepop_low=.nan", "algo.icepop_low"),
    ("algo.icepop_high=.inf", "algo.icepop_high"),
    ("algo.icepop_high=true", "algo.icepop_high"),
    ("algo.rollout_correction=3", "algo.rollout_correction"),
])
def test_bad_correction_settings_name_the_dotted_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert info.value.field == field and str(info.value).startswith(field + ":")


def test_a_correction_with_the_decoupled_objective_is_refused():
    with pytest.raises(ConfigError, match="count the mismatch twice") as info:
        load_config(overrides=["algo.preset=decoupled", "algo.rollout_correction=icepop"])
    assert info.value.field == "algo.rollout_correction"
    cfg = load_config(overrides=["algo.preset=decoupled", "algo.decoupled=false", "algo.rollout_correction=icepop"])
    assert cfg.algo.ratio_to_proximal and not AlgoConfig(preset="grpo").ratio_to_proximal


# ------------------------------------------------------------------ the objective

def objective_case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (4, 9)
    mu = -torch.rand(shape, generator=gen, dtype=F64) * 3
    prox = mu + torch.randn(shape, generator=gen, dtype=F64) * 0.8
    logp = (prox + torch.randn(shape, generator=gen, dtype=F64) * 0.1).requires_grad_(True)
    advantages = torch.randn(shape, generator=gen, dtype=F64)
    mask = torch.rand(shape, generator=gen) < 0.7
    return logp, mu, prox, advantages, mask


@pytest.mark.parametrize("cap", [1.0, 2.0, 3.5])
def test_token_tis_is_the_decoupled_objective(cap):
    """decoupled=true is token_tis at behaviour_weight_cap: the same loss and gradient, to the bit."""
    logp, mu, prox, advantages, mask = objective_case()
    decoupled = AlgoConfig(preset="decoupled", behaviour_weight_cap=cap)
    tis = AlgoConfig(preset="decoupled", decoupled=False, rollout_correction="token_tis", correction_cap=cap)
    losses, grads = [], []
    for cfg in (decoupled, tis):
        loss, _ = policy_objective(logp=logp, old_logp=mu, advantages=advantages, mask=mask, cfg=cfg, prox_logp=prox)
        losses.append(loss.detach())
        grads.append(torch.autograd.grad(loss, logp)[0])
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])


def test_none_never_reads_the_proximal_logprobs():
    logp, mu, prox, advantages, mask = objective_case(1)
    cfg = cfg_for("none")
    with_prox, metrics = policy_objective(logp=logp, old_logp=mu, advantages=advantages, mask=mask, cfg=cfg,
                                          prox_logp=prox)
    without, plain = policy_objective(logp=logp, old_logp=mu, advantages=advantages, mask=mask, cfg=cfg)
    assert torch.equal(with_prox, without) and metrics.keys() == plain.keys()
    assert all(torch.equal(metrics[key], plain[key]) for key in metrics)


@pytest.mark.parametrize("name", NAMES[1:])
def test_a_correction_weighs_each_tokens_loss(name):
    """Reference: the clip rule (ppo) on pi / pi_prox times the loop reference's weight, token mean."""
    logp, mu, prox, advantages, mask = objective_case(2)
    cfg = AlgoConfig(preset="grpo", aggregation="token_mean", kl_coef=0.0, rollout_correction=name,
                     seq_mask_high=4.0, geo_mask_low=0.5, geo_mask_high=2.0)
    loss, _ = policy_objective(logp=logp, old_logp=mu, advantages=advantages, mask=mask, cfg=cfg, prox_logp=prox)
    weights, _ = reference(name, prox, mu, mask, cfg)
    total, count = 0.0, 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                r = math.exp(float(logp[b, t].detach()) - float(prox[b, t]))
                a = weights[b][t] * float(advantages[b, t])
                total += -min(r * a, min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high) * a)
                count += 1
    assert float(loss.detach()) == pytest.approx(total / count, rel=1e-10, abs=1e-12)
    with pytest.raises(ValueError, match="prox_logp"):
        policy_objective(logp=logp, old_logp=mu, advantages=advantages, mask=mask, cfg=cfg)


def test_the_viewers_ratio_is_to_the_proximal_policy_under_a_correction():
    logp, mu, prox, advantages, mask = objective_case(3)
    ratio, _ = token_view(logp=logp, old_logp=mu, advantages=advantages, mask=mask, cfg=cfg_for("icepop"),
                          prox_logp=prox)
    torch.testing.assert_close(ratio, torch.where(mask, torch.exp(logp.detach() - prox), 0.0), rtol=1e-12, atol=0)


# ------------------------------------------------------------------ the learner

VOCAB = 40


def learner_case(offset: torch.Tensor):
    """A float64 model and a batch whose behaviour log-probs are the model's own minus `offset` [B, T]
    at the action tokens (so log pi_prox / mu = offset on fresh data)."""
    from keelrl.policy.model import token_logprobs

    model = float64_model(VOCAB)
    gen = torch.Generator().manual_seed(5)
    lengths = [12, 9, 12, 6]
    rows, width = len(lengths), max(lengths)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    action = torch.zeros(rows, width, dtype=torch.bool)
    for row, n in enumerate(lengths):
        input_ids[row, :n] = torch.randint(2, VOCAB, (n,), generator=gen)
        attention[row, :n] = 1
        action[row, 3:n] = True
    with torch.no_grad():
        own = token_logprobs(model, input_ids, attention)["logp"]
    behaviour = torch.where(action, own - offset[:, :width], 0.0)
    batch = Batch(input_ids, attention, action, behaviour, torch.zeros(rows, width, dtype=torch.long),
                  torch.rand(rows, generator=gen), torch.arange(rows) // 2)
    advantages = torch.where(action, torch.randn(rows, width, generator=gen, dtype=F64), 0.0)
    return model, batch, advantages


def learner_gradients(model, batch, advantages, algo, prox_from_update: bool):
    learner = SimpleNamespace(cfg=SimpleNamespace(algo=algo, distill=DistillConfig(),
                                                  perf=SimpleNamespace(micro_batch_tokens=30, share_prefix=False,
                                                                       gradient_checkpointing=False),
                                                  rollout=SimpleNamespace(temperature=1.0)),
                              model=model, value_head=None, autocast=contextlib.nullcontext, loss_teacher=None)
    for p in model.parameters():
        p.grad = None
    prox = None
    if not prox_from_update:
        from keelrl.policy.model import token_logprobs

        with torch.no_grad():
            prox = token_logprobs(model, batch.input_ids, batch.attention_mask)["logp"]
    zeros = torch.zeros_like(advantages)
    inputs = UpdateInputs(batch, advantages, zeros, None, None, prox)
    result = Learner.accumulate_gradients(learner, inputs, torch.arange(batch.input_ids.shape[0]))  # type: ignore[arg-type]
    assert result.metrics is not None and result.passes > 1  # micro-batched
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("prox_from_update", [True, False])
def test_an_icepop_window_that_masks_every_token_gives_no_policy_gradient(prox_from_update):
    # Behaviour log-probs 1 nat above the learner's: pi_prox / mu = e^-1 = 0.37 < icepop_low 0.5 at every token.
    model, batch, advantages = learner_case(torch.full((4, 12), -1.0, dtype=F64))
    masked = AlgoConfig(preset="grpo", kl_coef=0.0, rollout_correction="icepop")
    grads = learner_gradients(model, batch, advantages, masked, prox_from_update)
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    plain = learner_gradients(model, batch, advantages, AlgoConfig(preset="grpo", kl_coef=0.0), prox_from_update)
    assert sum(float(g.abs().sum()) for g in plain) > 1e-6  # the same batch without the correction learns


def test_the_learner_applies_the_weights_token_by_token():
    """Against an independent pass over the whole batch: loss = -token mean of w A exp(logp - sg(logp))."""
    from keelrl.policy.model import token_logprobs

    gen = torch.Generator().manual_seed(9)
    offset = torch.randn(4, 12, generator=gen, dtype=F64) * 0.9  # some tokens in [0.5, 5], some out
    model, batch, advantages = learner_case(offset)
    algo = AlgoConfig(preset="grpo", kl_coef=0.0, aggregation="token_mean", rollout_correction="icepop")
    got = learner_gradients(model, batch, advantages, algo, prox_from_update=True)
    logp = token_logprobs(model, batch.input_ids, batch.attention_mask)["logp"]
    weights, metrics = reference("icepop", logp.detach(), batch.behaviour_logprobs, batch.action_mask, algo)
    assert 0 < metrics["correction/masked_token_frac"] < 1
    mask = batch.action_mask
    ratio = torch.exp(logp - logp.detach())  # value 1, gradient grad log pi: one update on fresh data
    per_token = -(torch.tensor(weights, dtype=F64) * advantages * ratio)
    loss = torch.where(mask, per_token, 0.0).sum() / mask.sum()
    want = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w, rtol=1e-9, atol=1e-12)


def test_every_rl_step_logs_the_mismatch_with_pi_prox_from_the_update(tiny_model_dir, tmp_path):
    """One update a step (pi_prox from the update's own pass): the row still has mismatch/* and
    correction/*; sampler and learner share a precision here, so the mismatch is round-off."""
    from keelrl.train.trainer import Trainer

    overrides = [*TINY_RUN, f"model.path={tiny_model_dir}", "train.steps=1", "rollout.engine=sync", *FAST_RUN,
                 "train.minibatch_size=4", "eval.every=5", "eval.tasks=2", "algo.rollout_correction=icepop",
                 f"run_dir={tmp_path}"]
    trainer = Trainer(load_config(overrides=overrides))
    engine = trainer.make_engine()
    engine.start(0)
    row = trainer.rl_step(1, engine.batch(1))
    engine.close()
    assert row["train/updates"] == 1
    for key in TOKEN_KEYS:
        assert key in row, key
    assert abs(row["mismatch/kl"]) < 1e-4 and row["mismatch/log_ratio_abs_max"] < 1e-2
    assert row["correction/masked_token_frac"] == 0.0
