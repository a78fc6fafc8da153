"""Overlong episodes (`algo.overlong`, keelrl.algos.overlong): DAPO's soft overlong punishment
against hand-worked numbers and a float64 loop, what keep, mask and penalty do to a batch with
one cut episode, the config's errors, the learner's empty minibatch, and a tiny run's metrics."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from conftest import FAST_RUN, float64_model

from keelrl.algos import AlgoConfig, policy_objective
from keelrl.algos.overlong import OVERLONG_MODES, overlong_filter, overlong_shaping, soft_overlong_penalty
from keelrl.components import explain
from keelrl.config import TINY_RUN, load_config
from keelrl.errors import ConfigError
from keelrl.rollout.trajectory import CUT_TERMINATIONS, Batch, Trajectory, collate
from keelrl.train.advantage import AdvantageStage
from keelrl.train.learner import Learner, UpdateInputs
from keelrl.train.trainer import Trainer

F64 = torch.float64
EXACT = dict(rtol=0.0, atol=1e-12)


# ------------------------------------------------------------------ the soft penalty (DAPO eq. 13)

def test_soft_penalty_worked_numbers():
    # L_max = 100, L_cache = 20: no penalty up to 100 - 20 = 80, then (80 - |y|) / 20 down to -1
    # at |y| = 100, and -1 past it: 81 -> -1/20 = -0.05, 90 -> -10/20 = -0.5, 99 -> -0.95.
    lengths = torch.tensor([0, 80, 81, 90, 99, 100, 101, 250])
    want = torch.tensor([0.0, 0.0, -0.05, -0.5, -0.95, -1.0, -1.0, -1.0], dtype=F64)
    torch.testing.assert_close(soft_overlong_penalty(lengths, 100, 20), want, **EXACT)
    # L_cache = 0: a step at L_max (100 is still allowed, 101 is over).
    torch.testing.assert_close(soft_overlong_penalty(torch.tensor([99, 100, 101]), 100, 0),
                               torch.tensor([0.0, 0.0, -1.0], dtype=F64), **EXACT)
    # L_cache = L_max: the ramp starts at length 0 (50 -> -50/100 = -0.5).
    torch.testing.assert_close(soft_overlong_penalty(torch.tensor([0, 50, 100]), 100, 100),
                               torch.tensor([0.0, -0.5, -1.0], dtype=F64), **EXACT)


def reference_penalty(lengths: list[int], max_len: int, buffer: int) -> list[float]:
    """Eq. 13 of DAPO, branch by branch, in Python floats."""
    out = []
    for length in lengths:
        if length <= max_len - buffer:
            out.append(0.0)
        elif length <= max_len:
            out.append(((max_len - buffer) - length) / buffer)
        else:
            out.append(-1.0)
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("size", [1, 7, 64])
def test_soft_penalty_matches_the_plain_loop(seed, size):
    generator = torch.Generator().manual_seed(seed)
    max_len = int(torch.randint(1, 4096, (1,), generator=generator))
    buffer = int(torch.randint(0, max_len + 1, (1,), generator=generator))
    lengths = torch.randint(0, 2 * max_len, (size,), generator=generator)
    want = torch.tensor(reference_penalty(lengths.tolist(), max_len, buffer), dtype=F64)
    got = soft_overlong_penalty(lengths, max_len, buffer)
    torch.testing.assert_close(got, want, **EXACT)
    assert got.dtype == F64 and bool((got <= 0).all() and (got >= -1).all())


def test_soft_penalty_refuses_a_buffer_outside_the_limit():
    with pytest.raises(ValueError, match="buffer"):
        soft_overlong_penalty(torch.tensor([5]), 10, 11)
    with pytest.raises(ValueError, match="buffer"):
        soft_overlong_penalty(torch.tensor([5]), 10, -1)


# ------------------------------------------------------------------ which episodes are cut

def test_the_turn_and_context_limits_cut_an_episode_and_nothing_else_does():
    assert set(CUT_TERMINATIONS) == {"max_turns", "context_limit"}
    for termination, cut in [("submitted", False), ("max_turns", True), ("context_limit", True),
                             ("env_error", False)]:
        assert Trajectory("t", 0, termination=termination).cut is cut


# ------------------------------------------------------------------ one group, one cut episode

# Four attempts at one task, rewards 1, 0, 0, 0; attempt 2 ran out of turns. Each row: prompt,
# two action tokens, an observation, one action token, an observation (3 action tokens a row);
# row 3's prompt is 3 tokens, so it is 8 tokens long against the others' 6.
REWARDS = [1.0, 0.0, 0.0, 0.0]
TERMINATIONS = ["submitted", "submitted", "max_turns", "submitted"]
PROMPTS = [1, 1, 1, 3]


def group_batch() -> Batch:
    trajectories = []
    for row, (reward, termination, prompt) in enumerate(zip(REWARDS, TERMINATIONS, PROMPTS)):
        t = Trajectory("task", 0, reward=reward, termination=termination)
        t.extend([5] * prompt, action=False, turn=0)
        t.extend([6 + row, 7], action=True, turn=0, logprobs=[-1.0, -1.5])
        t.extend([8], action=False, turn=0)
        t.extend([9], action=True, turn=1, logprobs=[-0.5])
        t.extend([8], action=False, turn=1)
        trajectories.append(t)
    return collate(trajectories, pad_id=0)


def stage_for(mode: str, *extra: str) -> AdvantageStage:
    """The advantage stage of Dr.GRPO (no std division: round numbers) without any model: one
    update a step takes its proximal log-probs from the update (`prox_from_update`)."""
    cfg = load_config(overrides=["algo.preset=dr_grpo", f"algo.overlong={mode}", "train.minibatch_size=4",
                                 "train.epochs=1", *extra])
    return AdvantageStage(cfg, model=None, value_head=None, reference=None, prm=None, teacher=None,
                          autocast=contextlib.nullcontext)


def row_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Each row's advantage, after checking it is one value over the row's action tokens."""
    out = []
    for row in range(advantages.shape[0]):
        values = advantages[row][mask[row]].unique()
        assert values.numel() == 1, values
        out.append(float(values))
    return out


def test_keep_changes_nothing_and_logs_the_cut_share():
    batch = group_batch()
    assert batch.cut.tolist() == [False, False, True, False]
    kept = stage_for("keep")(batch)
    before = stage_for("keep")(Batch(**{**batch.__dict__, "cut": None}))  # a batch without the field: none cut
    assert torch.equal(kept.inputs.advantages, before.inputs.advantages)
    assert torch.equal(kept.inputs.batch.action_mask, batch.action_mask)
    # rewards 1, 0, 0, 0: mean 0.25, advantages +0.75, -0.25, -0.25, -0.25
    assert row_advantages(kept.inputs.advantages, batch.action_mask) == [0.75, -0.25, -0.25, -0.25]
    assert kept.stats["train/overlong_frac"] == 0.25 and before.stats["train/overlong_frac"] == 0.0
    assert not [key for key in kept.stats if key.startswith("train/overlong_") and key != "train/overlong_frac"]


def test_mask_drops_the_cut_episode_from_the_loss_and_keeps_it_in_the_baseline():
    batch = group_batch()
    kept = stage_for("keep")(batch).inputs
    masked = stage_for("mask")(batch)
    inputs = masked.inputs
    # The baseline still holds the cut episode's 0: the others' advantages are keep's, bit for bit.
    for row in (0, 1, 3):
        assert torch.equal(inputs.advantages[row], kept.advantages[row])
        assert torch.equal(inputs.batch.action_mask[row], batch.action_mask[row])
    assert not bool(inputs.batch.action_mask[2].any()) and not bool(inputs.advantages[2].any())
    assert masked.stats["train/overlong_frac"] == 0.25
    assert masked.stats["train/overlong_masked_token_frac"] == 0.25  # 3 of the batch's 12 action tokens
    # The loss over the masked batch is the loss over the three submitted rows alone, for every
    # aggregation that does not count rows without tokens, whatever the cut row's log-probs.
    generator = torch.Generator().manual_seed(0)
    logp = (batch.behaviour_logprobs + 0.1 * torch.randn(batch.behaviour_logprobs.shape, generator=generator,
                                                         dtype=F64)).requires_grad_(True)
    submitted = torch.tensor([0, 1, 3])
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        cfg = AlgoConfig(preset="dr_grpo", aggregation=aggregation, overlong="mask")
        loss, _ = policy_objective(logp=logp, old_logp=batch.behaviour_logprobs.double(),
                                   advantages=inputs.advantages, mask=inputs.batch.action_mask, cfg=cfg)
        want, _ = policy_objective(logp=logp[submitted], old_logp=batch.behaviour_logprobs.double()[submitted],
                                   advantages=kept.advantages[submitted], mask=batch.action_mask[submitted], cfg=cfg)
        torch.testing.assert_close(loss, want, **EXACT)
        (grad,) = torch.autograd.grad(loss, logp)
        assert not bool(grad[2].any()) and bool(grad[0].any())
        wild = logp.detach().clone()
        wild[2] = 1e6  # the cut row's values never reach the loss
        again, _ = policy_objective(logp=wild, old_logp=batch.behaviour_logprobs.double(),
                                    advantages=inputs.advantages, mask=inputs.batch.action_mask, cfg=cfg)
        torch.testing.assert_close(again, loss.detach(), **EXACT)


def test_penalty_shapes_the_rewards_of_the_cut_episode_and_those_in_the_buffer():
    # L_max = rollout.max_context_tokens = 10, L_cache = 4: no penalty up to 6 tokens. Rows 0 and 1
    # (6 tokens, submitted) keep their rewards; row 2 is cut: -1; row 3 (8 tokens, submitted) is in
    # the buffer: (6 - 8) / 4 = -0.5. Rewards 1, 0, -1, -0.5: mean -0.125, Dr.GRPO advantages
    # 1.125, 0.125, -0.875, -0.375.
    batch = group_batch()
    out = stage_for("penalty", "rollout.max_context_tokens=10", "algo.overlong_buffer=4")(batch)
    assert row_advantages(out.inputs.advantages, batch.action_mask) == [1.125, 0.125, -0.875, -0.375]
    assert torch.equal(out.inputs.batch.action_mask, batch.action_mask)  # every episode stays in the loss
    assert out.stats["train/overlong_penalty_mean"] == -0.375  # (0 + 0 - 1 - 0.5) / 4
    assert out.stats["train/overlong_penalised_frac"] == 0.5
    assert out.stats["train/overlong_frac"] == 0.25
    # The rewards themselves: the uncut ones outside the buffer are untouched, bit for bit; a
    # penalty of 0.5 halves the change.
    cfg = AlgoConfig(overlong="penalty", overlong_buffer=4, overlong_penalty=0.5)
    lengths = batch.attention_mask.sum(1)
    shaped, _ = overlong_shaping(batch.rewards, lengths, batch.cut, 10, cfg)
    assert shaped.dtype == batch.rewards.dtype
    assert shaped.tolist() == [1.0, 0.0, -0.5, -0.25]
    # With no buffer only the cut episode pays.
    shaped, _ = overlong_shaping(batch.rewards, lengths, batch.cut, 10, AlgoConfig(overlong="penalty",
                                                                                   overlong_buffer=0))
    assert shaped.tolist() == [1.0, 0.0, -1.0, 0.0]


@pytest.mark.parametrize("mode", OVERLONG_MODES)
def test_each_mode_leaves_what_it_does_not_change_as_it_was(mode):
    batch = group_batch()
    cfg = AlgoConfig(overlong=mode)
    lengths = batch.attention_mask.sum(1)
    shaped, _ = overlong_shaping(batch.rewards, lengths, batch.cut, 2048, cfg)
    advantages = torch.ones(batch.action_mask.shape, dtype=F64)
    filtered, mask, _ = overlong_filter(advantages, batch.action_mask, batch.cut, cfg)
    assert (shaped is batch.rewards) == (mode != "penalty")
    assert (mask is batch.action_mask and filtered is advantages) == (mode != "mask")


# ------------------------------------------------------------------ the config

def test_every_preset_keeps_cut_episodes_unless_told():
    from keelrl.algos import PRESETS

    for name in PRESETS:
        cfg = AlgoConfig(preset=name)
        assert (cfg.overlong, cfg.overlong_buffer, cfg.overlong_penalty) == ("keep", 512, 1.0), name


@pytest.mark.parametrize("override, field, text", [
    ("algo.overlong=truncate", "algo.overlong", "keep, mask, penalty"),
    ("algo.overlong_buffer=-1", "algo.overlong_buffer", "-1"),
    ("algo.overlong_buffer=0.5", "algo.overlong_buffer", "int"),
    ("algo.overlong_penalty=-0.5", "algo.overlong_penalty", "-0.5"),
])
def test_a_bad_overlong_setting_names_its_field(override, field, text):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert info.value.field == field and text in str(info.value)


def test_the_penalty_buffer_must_fit_in_the_context():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["algo.overlong=penalty", "rollout.max_context_tokens=256", "algo.overlong_buffer=300"])
    assert info.value.field == "algo.overlong_buffer" and "rollout.max_context_tokens=256" in str(info.value)
    load_config(overrides=["rollout.max_context_tokens=256", "algo.overlong_buffer=300"])  # unread unless penalty


def test_keel_config_explain_lists_the_modes():
    rows = {path: help_text for path, _, help_text in explain()}
    assert rows["algo.overlong"].endswith("Choices: keep, mask, penalty.")
    assert "L_cache" in rows["algo.overlong_buffer"]


# ------------------------------------------------------------------ the learner

def test_a_minibatch_of_masked_episodes_makes_no_optimiser_step():
    # AdamW would move the weights on a zero gradient after a real step (momentum): the learner
    # must not step at all on a minibatch without a token in the loss.
    torch.manual_seed(0)
    model = float64_model(40)
    cfg = load_config(overrides=["algo.preset=dr_grpo", "train.minibatch_size=4", "perf.learner_precision=float32",
                                 "optim.weight_decay=0.1"])
    learner = Learner(cfg, model, None, None, torch.device("cpu"))
    batch = group_batch()
    batch.behaviour_logprobs = batch.behaviour_logprobs.double()
    advantages = torch.where(batch.action_mask, torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64)[:, None], 0.0)

    def update(mask: torch.Tensor) -> tuple[int, int]:
        inputs = UpdateInputs(batch=Batch(**{**batch.__dict__, "action_mask": mask}), advantages=advantages,
                              returns=torch.zeros_like(advantages), old_values=None, ref_logp=None, prox_logp=None)
        result = learner.update(inputs, [0, 0, 0, 0], step=1)
        return result.updates, result.skipped

    assert update(batch.action_mask) == (1, 0)
    before = [p.detach().clone() for p in model.parameters()]
    assert update(torch.zeros_like(batch.action_mask)) == (0, 0)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


# ------------------------------------------------------------------ a tiny run

@pytest.mark.parametrize("mode", ["mask", "penalty"])
def test_a_tiny_run_logs_the_cut_share_every_step(tiny_model_dir, tmp_path, mode):
    # One turn an episode: an episode whose first action does not submit is cut by the turn limit.
    cfg = load_config(overrides=[*TINY_RUN, *FAST_RUN, f"run_dir={tmp_path}", f"model.path={tiny_model_dir}",
                                 "train.steps=2", "eval.every=2", "eval.tasks=2", "eval.before_rl=false",
                                 "rollout.engine=sync", "env.max_turns=1", "train.minibatch_size=4",
                                 f"algo.overlong={mode}", "algo.dynamic_sampling=false"])
    trainer = Trainer(cfg)
    trainer.warm_start = lambda: {}  # type: ignore[method-assign]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] >= 1]
    assert len(steps) == 2
    if mode == "mask" and all(row["train/overlong_frac"] == 1.0 for row in steps):  # (the tiny model's case)
        assert all(torch.equal(p.detach(), b) for p, b in zip(trainer.model.parameters(), before))
    for row in steps:
        share = row["train/overlong_frac"]
        assert 0.0 <= share <= 1.0
        if mode == "mask":
            assert (row["train/overlong_masked_token_frac"] == 1.0) == (share == 1.0)
            if share == 1.0:  # nothing left to learn from: no optimiser step
                assert row["train/updates"] == 0 and row["train/skipped_updates"] == 0
        else:
            assert row["train/overlong_penalty_mean"] <= -share  # a cut episode pays the full 1
