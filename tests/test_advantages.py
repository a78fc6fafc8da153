"""Advantage estimators: the lecture's worked numbers, float64 loop references, masks, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keelrl.algos import ADVANTAGES, AlgoConfig, compute_advantages, outcome_to_token_rewards, td_errors
from keelrl.algos.advantages import GROUP_STD_EPS

from reference_advantages import GROUP_ESTIMATORS, STEP_ESTIMATORS, TURN_ESTIMATORS, reference_advantages

F64 = torch.float64
EXACT = dict(rtol=0.0, atol=1e-12)  # hand-worked numbers, computed in float64
GROUP_NAMES = ("grpo", "dr_grpo", "rloo")  # the estimators with a group baseline
CRITIC_NAMES = tuple(e.name for e in ADVANTAGES.entries() if "critic" in e.tags)


def run(name: str, *, token_rewards, mask, group_ids=None, values=None, turn_ids=None, **cfg_fields):
    cfg = AlgoConfig(preset="grpo", advantage=name, **cfg_fields)
    if group_ids is None:
        group_ids = torch.zeros(mask.shape[0], dtype=torch.long)
    return ADVANTAGES.get(name)(token_rewards=token_rewards, mask=mask, group_ids=group_ids,
                                values=values, turn_ids=turn_ids, cfg=cfg)


def test_estimator_names_are_the_documented_ones():
    assert set(ADVANTAGES.names()) == set(GROUP_ESTIMATORS) | set(STEP_ESTIMATORS) | set(TURN_ESTIMATORS)
    assert set(CRITIC_NAMES) == {"td", "gae"}


# ------------------------------------------------------------------ worked numbers (DESIGN.md)

# Four attempts at one task. Each row: prompt, two action tokens, a tool observation, one more
# action token, trailing observation. Columns 1, 2 and 4 are action tokens.
LAYOUT = torch.tensor([False, True, True, False, True, False])
ACTION_COLUMNS = [1, 2, 4]
OBS_COLUMNS = [0, 3, 5]


def group_of_four(rewards: list[float]):
    mask = LAYOUT.expand(4, -1).clone()
    token_rewards = outcome_to_token_rewards(torch.tensor(rewards, dtype=F64), mask)
    return token_rewards, mask


def per_row(adv: torch.Tensor) -> list[float]:
    """The row's advantage, after checking it is the same at every action token, 0 elsewhere."""
    assert torch.equal(adv[:, OBS_COLUMNS], torch.zeros(adv.shape[0], len(OBS_COLUMNS), dtype=adv.dtype))
    for column in ACTION_COLUMNS[1:]:
        assert torch.equal(adv[:, column], adv[:, ACTION_COLUMNS[0]])
    return adv[:, ACTION_COLUMNS[0]].tolist()


def test_dr_grpo_group_of_four_one_success():
    # rewards 1,0,0,0: group mean 0.25; advantages 1 - 0.25 = +0.75 and 0 - 0.25 = -0.25
    token_rewards, mask = group_of_four([1.0, 0.0, 0.0, 0.0])
    out = run("dr_grpo", token_rewards=token_rewards, mask=mask)
    torch.testing.assert_close(torch.tensor(per_row(out.advantages), dtype=F64),
                               torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=F64), **EXACT)
    # returns: undiscounted reward-to-go, the outcome at every action token of the row
    torch.testing.assert_close(out.returns[:, ACTION_COLUMNS],
                               torch.tensor([[1.0] * 3, [0.0] * 3, [0.0] * 3, [0.0] * 3], dtype=F64), **EXACT)
    assert torch.equal(out.returns[:, OBS_COLUMNS], torch.zeros(4, 3, dtype=F64))


def test_grpo_group_of_four_divides_by_bessel_std():
    # deviations 0.75, -0.25, -0.25, -0.25; squared sum 0.5625 + 3 * 0.0625 = 0.75;
    # Bessel variance 0.75 / 3 = 0.25, std 0.5: advantages 0.75 / 0.5 = +1.5 and -0.25 / 0.5 = -0.5
    # (the implementation adds GROUP_STD_EPS = 1e-6 to the std before dividing).
    token_rewards, mask = group_of_four([1.0, 0.0, 0.0, 0.0])
    got = torch.tensor(per_row(run("grpo", token_rewards=token_rewards, mask=mask).advantages), dtype=F64)
    std = 0.5 + GROUP_STD_EPS
    torch.testing.assert_close(got, torch.tensor([0.75 / std] + [-0.25 / std] * 3, dtype=F64), **EXACT)
    torch.testing.assert_close(got, torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=F64), rtol=0, atol=1e-5)
    # without the std: same as Dr.GRPO
    got = per_row(run("grpo", token_rewards=token_rewards, mask=mask, norm_by_std=False).advantages)
    torch.testing.assert_close(torch.tensor(got, dtype=F64), torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=F64),
                               **EXACT)


def test_rloo_group_of_four_leaves_one_out():
    # success: 1 - mean(0, 0, 0) = 1; each failure: 0 - mean(1, 0, 0) = -1/3
    token_rewards, mask = group_of_four([1.0, 0.0, 0.0, 0.0])
    got = per_row(run("rloo", token_rewards=token_rewards, mask=mask).advantages)
    torch.testing.assert_close(torch.tensor(got, dtype=F64), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3], dtype=F64),
                               **EXACT)


def test_partial_credit_is_centred_and_pure_success_has_no_signal():
    # 0.25 a check, checks passed 0,1,2,1: rewards 0, 0.25, 0.5, 0.25, mean 0.25,
    # centred -0.25, 0, +0.25, 0
    token_rewards, mask = group_of_four([0.0, 0.25, 0.5, 0.25])
    got = per_row(run("dr_grpo", token_rewards=token_rewards, mask=mask).advantages)
    torch.testing.assert_close(torch.tensor(got, dtype=F64), torch.tensor([-0.25, 0.0, 0.25, 0.0], dtype=F64), **EXACT)
    # GRPO: squared deviations sum 0.125, Bessel std sqrt(0.125 / 3) = 0.20412; +-0.25 / 0.20412 = +-1.2247
    std = math.sqrt(0.125 / 3) + GROUP_STD_EPS
    got = per_row(run("grpo", token_rewards=token_rewards, mask=mask).advantages)
    torch.testing.assert_close(torch.tensor(got, dtype=F64),
                               torch.tensor([-0.25 / std, 0.0, 0.25 / std, 0.0], dtype=F64), **EXACT)
    # pure success reward for the same attempts: none passes all four checks, all rewards 0
    token_rewards, mask = group_of_four([0.0, 0.0, 0.0, 0.0])
    for name in GROUP_ESTIMATORS:
        assert per_row(run(name, token_rewards=token_rewards, mask=mask).advantages) == [0.0] * 4, name


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("name", GROUP_NAMES)
def test_all_pass_and_all_fail_groups_have_zero_advantage(name, dtype):
    # three interleaved groups with non-dense ids: all pass (7), all fail (-2), mixed (40)
    group_ids = torch.tensor([7, -2, 40, 7, -2, 40, 7, -2])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=dtype)
    mask = LAYOUT.expand(8, -1).clone()
    out = run(name, token_rewards=outcome_to_token_rewards(rewards, mask), mask=mask, group_ids=group_ids)
    uniform = (group_ids == 7) | (group_ids == -2)
    assert torch.equal(out.advantages[uniform], torch.zeros(int(uniform.sum()), 6, dtype=dtype))
    # the mixed group still has signal: +- 0.5 (dr_grpo), +-1 (rloo), +-0.5 / 0.7071 (grpo)
    assert bool((out.advantages[2, ACTION_COLUMNS] > 0.4).all())
    assert bool((out.advantages[5, ACTION_COLUMNS] < -0.4).all())


# TD errors 0.3, -0.2, -0.4 with gamma 1 and lambda 0.5 (DESIGN.md): a failed attempt (reward 0)
# whose critic says 0.3 before the first step (three of ten continuations succeed), 0.6 after
# reading the code, 0.4 after the first edit breaks the None case:
#   delta_0 = 0 + 0.6 - 0.3 = 0.3;  delta_1 = 0 + 0.4 - 0.6 = -0.2;  delta_2 = 0 + 0 - 0.4 = -0.4
#   A_2 = -0.4;  A_1 = -0.2 + 0.5 * -0.4 = -0.4;  A_0 = 0.3 + 0.5 * -0.4 = 0.1
#   returns = A + V: 0.1 + 0.3 = 0.4, -0.4 + 0.6 = 0.2, -0.4 + 0.4 = 0.0
STEP_VALUES = [0.3, 0.6, 0.4]
STEP_DELTAS = [0.3, -0.2, -0.4]
STEP_GAE = [0.1, -0.4, -0.4]
STEP_RETURNS = [0.4, 0.2, 0.0]


def test_gae_worked_example_token_level():
    # prompt, action, obs, obs, action, obs, action, obs; observation values and rewards are junk
    mask = torch.tensor([[False, True, False, False, True, False, True, False]])
    actions = [1, 4, 6]
    junk = torch.tensor([[5.0, 0.0, float("nan"), -3.0, 0.0, 1e9, 0.0, float("inf")]], dtype=F64)
    values = junk.clone()
    values[0, actions] = torch.tensor(STEP_VALUES, dtype=F64)
    token_rewards = junk.clone()
    token_rewards[0, actions] = 0.0

    expected = torch.zeros(1, 8, dtype=F64)
    expected[0, actions] = torch.tensor(STEP_DELTAS, dtype=F64)
    torch.testing.assert_close(td_errors(token_rewards, values, mask, gamma=1.0), expected, **EXACT)
    torch.testing.assert_close(run("td", token_rewards=token_rewards, mask=mask, values=values).advantages,
                               expected, **EXACT)

    out = run("gae", token_rewards=token_rewards, mask=mask, values=values, gamma=1.0, lam=0.5)
    expected[0, actions] = torch.tensor(STEP_GAE, dtype=F64)
    torch.testing.assert_close(out.advantages, expected, **EXACT)
    assert abs(out.advantages[0, 1].item() - 0.1) < 1e-12  # the lecture's number
    expected[0, actions] = torch.tensor(STEP_RETURNS, dtype=F64)
    torch.testing.assert_close(out.returns, expected, **EXACT)


def test_gae_worked_example_turn_level():
    # Three turns of several action tokens, observation tokens before, between and after.
    #   position: 0 1 | 2 3 4 | 5 6 | 7 8 | 9 | 10 11 12 13 | 14
    #   kind:     obs | turn0 | obs | t1  |obs| turn2       | obs
    kinds = ["o", "o", 0, 0, 0, "o", "o", 1, 1, "o", 2, 2, 2, 2, "o"]
    mask = torch.tensor([[k != "o" for k in kinds]])
    # turn ids at observation tokens are junk (ignored); non-decreasing at action tokens
    turn_ids = torch.tensor([[-9, 3, 0, 0, 0, 99, -1, 1, 1, 7, 2, 2, 2, 2, -5]])
    first = {0: 2, 1: 7, 2: 10}
    values = torch.full((1, 15), float("nan"), dtype=F64)  # NaN at observation tokens
    values[mask] = 7.0  # junk at non-first action tokens: a turn's value is its first token's
    for turn, position in first.items():
        values[0, position] = STEP_VALUES[turn]
    # per-token rewards inside a turn sum to the turn's reward, here 0 for every turn
    token_rewards = torch.full((1, 15), float("inf"), dtype=F64)
    token_rewards[mask] = 0.0
    token_rewards[0, [2, 3, 4]] = torch.tensor([0.25, -0.5, 0.25], dtype=F64)
    token_rewards[0, [11, 13]] = torch.tensor([0.125, -0.125], dtype=F64)

    def broadcast(per_turn: list[float]) -> torch.Tensor:
        return torch.tensor([[0.0 if k == "o" else per_turn[k] for k in kinds]], dtype=F64)

    td_out = run("td", token_rewards=token_rewards, mask=mask, values=values, turn_ids=turn_ids, level="turn")
    torch.testing.assert_close(td_out.advantages, broadcast(STEP_DELTAS), **EXACT)
    out = run("gae", token_rewards=token_rewards, mask=mask, values=values, turn_ids=turn_ids,
              gamma=1.0, lam=0.5, level="turn")
    torch.testing.assert_close(out.advantages, broadcast(STEP_GAE), **EXACT)  # 0.1 on every token of turn 0
    torch.testing.assert_close(out.returns, broadcast(STEP_RETURNS), **EXACT)


def test_turn_level_reward_is_the_sum_of_its_tokens():
    # two turns, gamma 0.5, no critic: turn rewards 0.25 + 0.5 = 0.75 and 1.0;
    # reward-to-go: turn 1 = 1.0, turn 0 = 0.75 + 0.5 * 1.0 = 1.25
    mask = torch.tensor([[True, True, False, True]])
    turn_ids = torch.tensor([[0, 0, 0, 1]])
    token_rewards = torch.tensor([[0.25, 0.5, 0.0, 1.0]], dtype=F64)
    out = run("reward_to_go", token_rewards=token_rewards, mask=mask, turn_ids=turn_ids, gamma=0.5, level="turn")
    torch.testing.assert_close(out.advantages, torch.tensor([[1.25, 1.25, 0.0, 1.0]], dtype=F64), **EXACT)
    # token level discounts per token: 1.0, then 0.5 * 1.0 + 0.5 = 1.0, then 0.25 + 0.5 * 1.0 = 0.75
    out = run("reward_to_go", token_rewards=token_rewards, mask=mask, gamma=0.5)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.75, 1.0, 0.0, 1.0]], dtype=F64), **EXACT)


def test_outcome_reward_sits_on_last_action_token():
    mask = torch.tensor([[True, True, False, True, False],
                         [False, False, False, False, False],  # no action token: reward nowhere
                         [False, True, False, False, False],
                         [True, True, True, True, True]])
    rewards = torch.tensor([1.5, 2.0, -0.5, 0.1], dtype=F64)
    expected = torch.tensor([[0, 0, 0, 1.5, 0], [0, 0, 0, 0, 0], [0, -0.5, 0, 0, 0], [0, 0, 0, 0, 0.1]], dtype=F64)
    got = outcome_to_token_rewards(rewards, mask)
    assert got.dtype == F64  # float64 rewards are not rounded through float32
    assert torch.equal(got, expected)
    got = outcome_to_token_rewards(torch.tensor([True, True, False, True]), mask)
    assert got.dtype == torch.get_default_dtype()
    assert got.tolist() == [[0, 0, 0, 1, 0], [0] * 5, [0] * 5, [0, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="rewards"):
        outcome_to_token_rewards(rewards.unsqueeze(1), mask)  # [B, 1] would broadcast to [B, B, T]


# ------------------------------------------------------------------ float64 loop references

def random_layout(generator: torch.Generator, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [B, T] and turn_ids [B, T]: alternating observation and action runs, ragged.

    Turn ids rise at action runs (by 0: a turn continued after a tool call, 1, or 2: a turn
    with no action tokens); ids at observation tokens are junk. Some rows have no actions.
    """
    mask = torch.zeros(batch, length, dtype=torch.bool)
    turn_ids = torch.randint(-50, 50, (batch, length), generator=generator)  # junk by default
    for b in range(batch):
        style = int(torch.randint(4, (1,), generator=generator))
        if style == 0:
            continue  # no action token at all
        if style == 1:  # unstructured: independent coin flips
            mask[b] = torch.rand(length, generator=generator) < 0.6
            turn_ids[b] = torch.cumsum(torch.randint(0, 2, (length,), generator=generator), 0)
            continue
        t, turn = 0, -1
        acting = bool(torch.rand(1, generator=generator) < 0.5)
        while t < length:
            run_length = int(torch.randint(1, 6, (1,), generator=generator))
            if acting:
                turn += [0, 1, 1, 2][int(torch.randint(4, (1,), generator=generator))] if turn >= 0 else 1
                mask[b, t:t + run_length] = True
                turn_ids[b, t:t + run_length] = turn
            t += run_length
            acting = not acting
    return mask, turn_ids


def random_inputs(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 10, (1,), generator=generator))
    length = int(torch.randint(1, 41, (1,), generator=generator))
    mask, turn_ids = random_layout(generator, batch, length)
    density = [1.0, 0.3, 0.0][seed % 3]  # dense (KL-like), sparse (process), none besides outcome
    token_rewards = torch.randn(batch, length, generator=generator, dtype=F64)
    token_rewards = token_rewards * (torch.rand(batch, length, generator=generator) < density)
    outcome = torch.randint(0, 5, (batch,), generator=generator).to(F64) / 4  # partial credit
    token_rewards = token_rewards + outcome_to_token_rewards(outcome, mask)
    # group ids: a few arbitrary, non-contiguous integers (singleton groups happen)
    pool = torch.randint(-1000, 1000, (int(torch.randint(1, 5, (1,), generator=generator)),), generator=generator)
    group_ids = pool[torch.randint(len(pool), (batch,), generator=generator)]
    values = torch.rand(batch, length, generator=generator, dtype=F64)
    return dict(token_rewards=token_rewards, mask=mask, group_ids=group_ids, values=values, turn_ids=turn_ids)


SEEDS = range(8)
GAMMA_LAM = [(1.0, 1.0), (1.0, 0.5), (0.9, 0.95), (0.5, 0.0), (0.0, 0.7)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("level", ["token", "turn"])
def test_group_estimators_match_loop_reference(name, seed, level):
    inputs = random_inputs(seed)
    for gamma, norm_by_std in [(1.0, True), (0.9, False), (0.5, True)]:
        out = run(name, **inputs, gamma=gamma, norm_by_std=norm_by_std, level=level)
        ref_adv, ref_ret = reference_advantages(name, **inputs, gamma=gamma, lam=1.0, level=level,
                                                norm_by_std=norm_by_std, std_eps=GROUP_STD_EPS)
        torch.testing.assert_close(out.advantages, ref_adv, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out.returns, ref_ret, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "turn"])
@pytest.mark.parametrize("name", STEP_ESTIMATORS)
def test_step_estimators_match_loop_reference(name, level, seed):
    inputs = random_inputs(seed)
    for gamma, lam in GAMMA_LAM:
        out = run(name, **inputs, gamma=gamma, lam=lam, level=level)
        ref_adv, ref_ret = reference_advantages(name, **inputs, gamma=gamma, lam=lam, level=level)
        torch.testing.assert_close(out.advantages, ref_adv, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out.returns, ref_ret, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "turn"])
def test_gae_limits_are_td_and_monte_carlo(level, seed):
    # lambda 0 is the one-step TD error; lambda 1 with a zero critic is the reward-to-go
    inputs = random_inputs(seed)
    for gamma in (1.0, 0.8):
        gae0 = run("gae", **inputs, gamma=gamma, lam=0.0, level=level)
        td_out = run("td", **inputs, gamma=gamma, level=level)
        assert torch.equal(gae0.advantages, td_out.advantages)
        assert torch.equal(gae0.returns, td_out.returns)
        zero_critic = dict(inputs, values=torch.zeros_like(inputs["values"]))
        gae1 = run("gae", **zero_critic, gamma=gamma, lam=1.0, level=level)
        rtg = run("reward_to_go", **inputs, gamma=gamma, level=level)
        torch.testing.assert_close(gae1.advantages, rtg.advantages, rtol=0, atol=1e-12)
    if level == "token":
        torch.testing.assert_close(td_errors(inputs["token_rewards"], inputs["values"], inputs["mask"], gamma=0.8),
                                   td_out.advantages, rtol=0, atol=0)


# ------------------------------------------------------------------ whitening

@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("name", ["gae", "grpo", "reward_to_go"])
def test_whitening_gives_zero_mean_unit_std_over_action_tokens(name, seed):
    inputs = random_inputs(seed)
    inputs["mask"][0, 0] = True  # at least one action token in the batch
    inputs["mask"][-1, -1] = True
    mask = inputs["mask"]
    cfg = AlgoConfig(preset="grpo", advantage=name, whiten=True, gamma=0.95, lam=0.9)
    raw = run(name, **inputs, gamma=0.95, lam=0.9)
    out = compute_advantages(cfg=cfg, **inputs)
    assert torch.equal(out.returns, raw.returns)  # the critic's target is never whitened
    assert torch.equal(out.advantages[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
    action_adv = out.advantages[mask]
    raw_adv = raw.advantages[mask]
    raw_std = raw_adv.std(unbiased=False)
    if raw_std > 1e-3:
        assert abs(action_adv.mean().item()) < 1e-9
        assert abs(action_adv.std(unbiased=False).item() - 1.0) < 1e-6
    # an affine map of the raw advantages: (A - mean) / (population std + 1e-8)
    torch.testing.assert_close(action_adv, (raw_adv - raw_adv.mean()) / (raw_std + 1e-8), rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ properties (hypothesis)

FINITE = st.floats(-100.0, 100.0, allow_nan=False, allow_infinity=False, width=32)
JUNK = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                 st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -1e308]))


def draw_grid(draw, shape: tuple[int, int], elements) -> torch.Tensor:
    batch, length = shape
    rows = draw(st.lists(st.lists(elements, min_size=length, max_size=length), min_size=batch, max_size=batch))
    return torch.tensor(rows, dtype=F64).reshape(batch, length)


@st.composite
def batches(draw, *, every_row_acts: bool = False) -> dict:
    """Estimator inputs: ragged mask, finite rewards and values, ids from a small set."""
    shape = (draw(st.integers(1, 6)), draw(st.integers(1, 10)))
    mask = draw_grid(draw, shape, st.booleans()).bool()
    if every_row_acts:
        mask[:, draw(st.integers(0, shape[1] - 1))] = True
    turn_steps = draw_grid(draw, shape, st.integers(0, 2)).long()  # 0: same turn, 2: a turn skipped
    group_ids = torch.tensor(draw(st.lists(st.integers(-3, 3), min_size=shape[0], max_size=shape[0])))
    return dict(token_rewards=draw_grid(draw, shape, FINITE), mask=mask, group_ids=group_ids,
                values=draw_grid(draw, shape, FINITE), turn_ids=torch.cumsum(turn_steps, dim=1))


@settings(max_examples=50, deadline=None)
@given(inputs=batches(every_row_acts=True), dtype=st.sampled_from([torch.float32, F64]),
       scores=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=7, max_size=7),
       norm_by_std=st.booleans())
def test_all_equal_groups_get_exactly_zero(inputs, dtype, scores, norm_by_std):
    # every member of group g scores scores[g]: one reward on one action token, in any dtype
    rewards = torch.tensor([scores[g + 3] for g in inputs["group_ids"].tolist()], dtype=dtype)
    token_rewards = outcome_to_token_rewards(rewards, inputs["mask"])
    for name in GROUP_NAMES:
        out = run(name, token_rewards=token_rewards, mask=inputs["mask"], group_ids=inputs["group_ids"],
                  norm_by_std=norm_by_std)
        assert torch.equal(out.advantages, torch.zeros_like(token_rewards)), name


@settings(max_examples=50, deadline=None)
@given(inputs=batches(), data=st.data(), gamma=st.sampled_from([1.0, 0.9, 0.0]),
       lam=st.sampled_from([1.0, 0.5, 0.0]))
def test_observation_positions_never_change_any_output(inputs, data, gamma, lam):
    # junk (NaN, inf, 1e308, huge turn ids) at observation tokens: outputs identical bit for bit
    mask = inputs["mask"]
    dirty = dict(inputs)
    dirty["token_rewards"] = torch.where(mask, inputs["token_rewards"], draw_grid(data.draw, mask.shape, JUNK))
    dirty["values"] = torch.where(mask, inputs["values"], draw_grid(data.draw, mask.shape, JUNK))
    junk_ids = draw_grid(data.draw, mask.shape, st.integers(-10**6, 10**6)).long()
    dirty["turn_ids"] = torch.where(mask, inputs["turn_ids"], junk_ids)
    for name in ADVANTAGES.names():
        for level in ("token", "turn"):
            clean = run(name, **inputs, gamma=gamma, lam=lam, level=level)
            noisy = run(name, **dirty, gamma=gamma, lam=lam, level=level)
            for field in ("advantages", "returns"):
                a, b = getattr(clean, field), getattr(noisy, field)
                assert torch.equal(a, b), (name, level, field)
                assert bool(torch.isfinite(a).all()), (name, level, field)
                assert torch.equal(a[~mask], torch.zeros(int((~mask).sum()), dtype=a.dtype)), (name, level, field)


# ------------------------------------------------------------------ errors

def small_inputs() -> dict:
    mask = torch.tensor([[True, False, True], [False, True, True]])
    return dict(token_rewards=torch.zeros(2, 3), mask=mask, group_ids=torch.tensor([0, 0]),
                values=torch.zeros(2, 3), turn_ids=torch.tensor([[0, 0, 1], [0, 0, 1]]))


@pytest.mark.parametrize("level", ["token", "turn"])
@pytest.mark.parametrize("name", CRITIC_NAMES)
def test_critic_estimators_need_values(name, level):
    with pytest.raises(ValueError, match="values"):
        run(name, **dict(small_inputs(), values=None), level=level)
    cfg = AlgoConfig(preset="ppo", advantage=name, level=level)
    assert cfg.uses_critic
    with pytest.raises(ValueError, match="values"):
        compute_advantages(cfg=cfg, **dict(small_inputs(), values=None))


@pytest.mark.parametrize("name", STEP_ESTIMATORS)
def test_turn_level_needs_turn_ids(name):
    with pytest.raises(ValueError, match="turn_ids"):
        run(name, **dict(small_inputs(), turn_ids=None), level="turn")
    with pytest.raises(ValueError, match="turn_ids"):
        run(name, **dict(small_inputs(), turn_ids=torch.zeros(2, 4, dtype=torch.long)), level="turn")
    with pytest.raises(ValueError, match="turn_ids"):
        run(name, **dict(small_inputs(), turn_ids=torch.tensor([[0, 0, -1], [0, 0, 1]])), level="turn")


@pytest.mark.parametrize("name", sorted(ADVANTAGES.names()))
def test_shape_mismatches_raise(name):
    with pytest.raises(ValueError, match="shape"):
        run(name, **dict(small_inputs(), token_rewards=torch.zeros(2, 4)))
    with pytest.raises(ValueError, match="shape"):
        run(name, **dict(small_inputs(), token_rewards=torch.zeros(3)))
    with pytest.raises(TypeError, match="bool"):
        run(name, **dict(small_inputs(), mask=small_inputs()["mask"].long()))
    if name in CRITIC_NAMES:
        for bad in (torch.zeros(2, 1), torch.zeros(3), torch.zeros(2, 4)):  # [B, 1] would broadcast
            with pytest.raises(ValueError, match="values"):
                run(name, **dict(small_inputs(), values=bad))
    if name in GROUP_NAMES:
        for bad in (torch.tensor([0, 0, 1]), torch.tensor([[0], [0]])):
            with pytest.raises(ValueError, match="group_ids"):
                run(name, **dict(small_inputs(), group_ids=bad))


def test_td_errors_checks_values_shape():
    inputs = small_inputs()
    with pytest.raises(ValueError, match="values"):
        td_errors(inputs["token_rewards"], torch.zeros(2, 1), inputs["mask"])


# ------------------------------------------------------------ credit across episode lengths

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", TURN_ESTIMATORS)
def test_turn_index_estimators_match_loop_reference(name, seed):
    inputs = random_inputs(seed)
    for gamma, norm_by_std in [(1.0, True), (0.9, False), (0.5, True)]:
        out = run(name, **inputs, gamma=gamma, norm_by_std=norm_by_std)
        ref_adv, ref_ret = reference_advantages(name, **inputs, gamma=gamma, lam=1.0, level="turn",
                                                norm_by_std=norm_by_std, std_eps=GROUP_STD_EPS)
        torch.testing.assert_close(out.advantages, ref_adv, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out.returns, ref_ret, rtol=1e-10, atol=1e-10)


def _episodes(turns: list[int], rewards: list[float]) -> dict:
    """One action token per turn, the outcome reward on the last; rows padded to the longest."""
    width = max(turns)
    mask = torch.tensor([[k < n for k in range(width)] for n in turns])
    turn_ids = torch.arange(width).expand(len(turns), width).clone()
    return dict(token_rewards=outcome_to_token_rewards(torch.tensor(rewards, dtype=F64), mask), mask=mask,
                turn_ids=turn_ids, group_ids=torch.zeros(len(turns), dtype=torch.long))


def test_per_turn_index_normalisation_by_hand():
    """Three attempts: submits at once and fails (1 turn, R 0), tests and fixes (3 turns, R 1),
    gives up after two turns (R 0). Turn 0 compares all three (G = 0, 1, 0: mean 1/3, Bessel std
    sqrt(1/3)); turn 1 the two that reached it (1, 0: mean 1/2, std sqrt(1/2)); turn 2 only the
    fixer, who gets nothing for it under turn_grpo."""
    inputs = _episodes([1, 3, 2], [0.0, 1.0, 0.0])
    grpo = run("turn_grpo", **inputs).advantages
    s3, s2 = math.sqrt(1 / 3) + GROUP_STD_EPS, math.sqrt(1 / 2) + GROUP_STD_EPS
    expected = torch.tensor([[-1 / 3 / s3, 0, 0], [2 / 3 / s3, 0.5 / s2, 0.0], [-1 / 3 / s3, -0.5 / s2, 0]], dtype=F64)
    torch.testing.assert_close(grpo, expected, **EXACT)
    # Leave-one-out per index; turn 2 of the fixer, which no other attempt reached, against the
    # others' whole returns (0 and 0).
    rloo = run("turn_rloo", **inputs).advantages
    torch.testing.assert_close(rloo, torch.tensor([[-0.5, 0, 0], [1.0, 1.0, 1.0], [-0.5, -1.0, 0]], dtype=F64), **EXACT)


def _expected_gradient(estimator: str, aggregation: str, p: float, q: float, group: int) -> tuple[float, float]:
    """E[the update's gradient] in (theta1, theta2) over every outcome of `group` attempts, exactly.

    The agent's first turn submits (probability p = sigmoid(theta1), reward 0.5, one turn) or goes
    on (two turns); its second turn fixes the bug (probability q = sigmoid(theta2), reward 1) or
    not (0). One token per turn, so a turn's gradient of log pi is its token's. Aggregations:
    seq_mean_token_sum (each episode's token sum over the group) and token_mean (all tokens' sum
    over the batch's token count, which depends on how long the sampled episodes were)."""
    import itertools

    outcomes = {"short": (p, 1, 0.5, [(1 - p, 0.0)]),
                "fixed": ((1 - p) * q, 2, 1.0, [(-p, 0.0), (0.0, 1 - q)]),
                "failed": ((1 - p) * (1 - q), 2, 0.0, [(-p, 0.0), (0.0, -q)])}
    total = [0.0, 0.0]
    for combo in itertools.product(outcomes, repeat=group):
        probability = math.prod(outcomes[o][0] for o in combo)
        inputs = _episodes([outcomes[o][1] for o in combo], [outcomes[o][2] for o in combo])
        advantages = run(estimator, **inputs).advantages
        tokens = sum(outcomes[o][1] for o in combo)
        normaliser = group if aggregation == "seq_mean_token_sum" else tokens
        for row, o in enumerate(combo):
            for k, grad in enumerate(outcomes[o][3]):
                for axis in (0, 1):
                    total[axis] += probability * float(advantages[row, k]) * grad[axis] / normaliser
    return total[0], total[1]


def test_only_a_leave_one_out_turn_baseline_and_an_episode_sum_follow_the_true_gradient():
    """The policy gradient of J = 0.5 p + (1 - p) q is (p (1 - p) (0.5 - q), (1 - p) q (1 - q)).
    turn_rloo with per-episode sums gives it exactly; Dr.GRPO's broadcast mean baseline gives
    (1 - 1/G) times it (its own reward is in its baseline, the same share for every episode);
    per-turn-index normalisation and token-mean aggregation each tilt it, because long and short
    episodes weigh differently (float64, every outcome of a group of 3 enumerated)."""
    p, q, group = 0.4, 0.3, 3
    truth = (p * (1 - p) * (0.5 - q), (1 - p) * q * (1 - q))
    assert _expected_gradient("turn_rloo", "seq_mean_token_sum", p, q, group) == pytest.approx(truth, rel=1e-12)
    assert _expected_gradient("rloo", "seq_mean_token_sum", p, q, group) == pytest.approx(truth, rel=1e-12)
    shrunk = tuple((1 - 1 / group) * g for g in truth)
    assert _expected_gradient("dr_grpo", "seq_mean_token_sum", p, q, group) == pytest.approx(shrunk, rel=1e-12)

    def tilt(gradient: tuple[float, float]) -> float:
        """The angle between `gradient` and the true one, in degrees."""
        cosine = (gradient[0] * truth[0] + gradient[1] * truth[1]) / (math.hypot(*gradient) * math.hypot(*truth))
        return math.degrees(math.acos(min(1.0, cosine)))

    assert tilt(_expected_gradient("dr_grpo", "token_mean", p, q, group)) > 1.0  # 2.3 degrees
    assert tilt(_expected_gradient("turn_grpo", "seq_mean_token_sum", p, q, group)) > 20.0  # 28.5
    assert tilt(_expected_gradient("grpo", "seq_mean_token_sum", p, q, group)) > 5.0  # 8.9: the std division
