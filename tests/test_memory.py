"""The learner's memory bound: micro-batches with accumulated gradients, chunked no-grad passes,
activation checkpointing and the memory metrics.

The references are independent of the code under test: one forward pass over the whole
minibatch with the full [B, T, V] logits from the HF model, and the loss from
`policy_objective` over the whole minibatch. The model is a small float64 Qwen2, so the
micro-batched gradients must match to float64 rounding, not to a loose tolerance.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from conftest import float64_model

from keelrl.algos import policy_objective, value_loss
from keelrl.algos.config import AlgoConfig
from keelrl.config import DistillConfig
from keelrl.algos.registries import AGGREGATIONS
from keelrl.policy.model import row_lengths, split_rows, token_logprobs
from keelrl.policy.prefix import chunked_token_logprobs
from keelrl.rollout.trajectory import Batch
from keelrl.train import learner as learner_module
from keelrl.train.learner import Learner, UpdateInputs, aggregation_weights, enable_gradient_checkpointing
from keelrl.train.trainer import Trainer

NOT_CODING = ("env.partial_credit=false", "env.show_file=true")
"""After TINY_RUN (a coding recipe): its coding-only settings back to their defaults, which another kind refuses."""

VOCAB = 40
LENGTHS = [23, 7, 15, 30, 11, 30]  # right-padded to 30; row 5 has no action tokens


class Float64Critic(torch.nn.Module):
    """A value head like keelrl's, kept in float64 (ValueHead computes in float32)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 1, dtype=torch.float64)
        torch.nn.init.normal_(self.linear.weight, std=0.3, generator=torch.Generator().manual_seed(seed))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        values = self.linear(hidden).squeeze(-1)  # [B, T]
        return torch.cat([values[:, :1], values[:, :-1]], dim=1)


def make_batch(seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    rows, width = len(LENGTHS), max(LENGTHS)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    action = torch.zeros(rows, width, dtype=torch.bool)
    for row, n in enumerate(LENGTHS):
        input_ids[row, :n] = torch.randint(2, VOCAB, (n,), generator=generator)
        attention[row, :n] = 1
        if row != 5:
            action[row, 2:n] = torch.rand(n - 2, generator=generator) < 0.6
    behaviour = torch.randn(rows, width, generator=generator, dtype=torch.float64) * 0.3 - 3.5
    turns = torch.zeros(rows, width, dtype=torch.long)
    rewards = torch.rand(rows, generator=generator)
    return Batch(input_ids, attention, action, behaviour, turns, rewards, torch.arange(rows) // 2)


def reference_logp(model, batch: Batch) -> dict[str, torch.Tensor]:
    """One pass over the whole batch, the full [B, T, V] logits at once (no chunking, no checkpoints)."""
    hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    log_probs = torch.log_softmax(model.lm_head(hidden)[:, :-1], dim=-1)  # [B, T-1, V]
    logp = log_probs.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    pad = torch.zeros(logp.shape[0], 1, dtype=logp.dtype)
    return {"logp": torch.cat([pad, logp], 1), "entropy": torch.cat([pad, entropy], 1), "hidden": hidden}


def algo_config(aggregation: str, ratio: str) -> AlgoConfig:
    return AlgoConfig(preset="ppo", aggregation=aggregation, ratio=ratio, agg_constant=32, kl_coef=0.05,
                      kl_estimator="k3", kl_in_reward=False, entropy_coef=0.01, value_coef=0.5, value_clip=0.2)


@pytest.mark.parametrize("ratio", ["token", "sequence"])
def test_micro_batched_gradients_equal_one_pass_for_every_aggregation_mode(ratio):
    model = float64_model(VOCAB)
    critic = Float64Critic()
    params = list(model.parameters()) + list(critic.parameters())
    batch = make_batch(seed=1)
    generator = torch.Generator().manual_seed(2)
    shape = batch.input_ids.shape
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    returns = torch.randn(shape, generator=generator, dtype=torch.float64)
    old_values = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.1
    with torch.no_grad():
        noise = torch.randn(shape, generator=generator, dtype=torch.float64)
        ref_all = reference_logp(model, batch)["logp"] + 0.2 * noise
    prox_all = batch.behaviour_logprobs
    rows = torch.tensor([3, 0, 5, 1, 4, 2])  # a shuffled minibatch, as rl_step passes it
    minibatch = Batch(**{name: None if value is None else value[rows] for name, value in batch.__dict__.items()})
    assert len(AGGREGATIONS.names()) >= 4
    for aggregation in AGGREGATIONS.names():
        algo = algo_config(aggregation, ratio)
        # The reference: the whole minibatch in one pass.
        out = reference_logp(model, minibatch)
        loss, want = policy_objective(logp=out["logp"], old_logp=minibatch.behaviour_logprobs,
                                      advantages=advantages[rows], mask=minibatch.action_mask, cfg=algo,
                                      ref_logp=ref_all[rows], entropy=out["entropy"], prox_logp=prox_all[rows])
        new_values = critic(minibatch.input_ids, minibatch.attention_mask, out["hidden"])
        vloss, vmetrics = value_loss(new_values, old_values[rows], returns[rows], minibatch.action_mask, algo)
        want.update(vmetrics)
        want_grads = torch.autograd.grad(loss + algo.value_coef * vloss, params)
        # Micro-batches of at most 40 padded tokens, longest first: 30 | 30 | 23 | 15,11 | 7.
        learner = SimpleNamespace(cfg=SimpleNamespace(algo=algo, distill=DistillConfig(),
                                                  perf=SimpleNamespace(micro_batch_tokens=40, share_prefix=False,
                                                                        gradient_checkpointing=False),
                                                  rollout=SimpleNamespace(temperature=1.0)),
                                  model=model, value_head=critic, autocast=contextlib.nullcontext, loss_teacher=None)
        for p in params:
            p.grad = None
        result = Learner.accumulate_gradients(learner, UpdateInputs(batch, advantages, returns,  # type: ignore[arg-type]
                                                                    old_values, ref_all, prox_all), rows)
        got, passes = result.metrics, result.passes
        assert passes == 5, aggregation
        for p, expected in zip(params, want_grads):
            torch.testing.assert_close(p.grad, expected, rtol=1e-9, atol=1e-12, msg=aggregation)
        assert got is not None and set(got) == set(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(float(value), rel=1e-9, abs=1e-12), (aggregation, key)


def test_a_row_longer_than_the_budget_runs_alone():
    model = float64_model(VOCAB)
    batch = make_batch(seed=3)
    algo = algo_config("token_mean", "token")
    rows = torch.arange(len(LENGTHS))
    learner = SimpleNamespace(cfg=SimpleNamespace(algo=algo, distill=DistillConfig(),
                                                  perf=SimpleNamespace(micro_batch_tokens=5, share_prefix=False,
                                                                        gradient_checkpointing=False),
                                                  rollout=SimpleNamespace(temperature=1.0)),
                              model=model, value_head=None, autocast=contextlib.nullcontext, loss_teacher=None)
    zeros = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    advantages = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        ref_all = reference_logp(model, batch)["logp"]
    result = Learner.accumulate_gradients(learner, UpdateInputs(batch, advantages, zeros,  # type: ignore[arg-type]
                                                                None, ref_all, batch.behaviour_logprobs), rows)
    metrics, passes = result.metrics, result.passes
    assert passes == len(LENGTHS) and metrics is not None  # every row is longer than 5 tokens
    out = reference_logp(model, batch)
    loss, _ = policy_objective(logp=out["logp"], old_logp=batch.behaviour_logprobs, advantages=advantages,
                               mask=batch.action_mask, cfg=algo, ref_logp=ref_all, entropy=out["entropy"])
    want = torch.autograd.grad(loss, list(model.parameters()))
    for p, expected in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, expected, rtol=1e-9, atol=1e-12)


def test_split_rows_respects_the_budget_and_covers_every_row_once():
    generator = torch.Generator().manual_seed(0)
    for budget in (1, 7, 40, 100, 10_000):
        lengths = torch.randint(1, 60, (17,), generator=generator).tolist()
        groups = split_rows(lengths, budget)
        assert sorted(row for group in groups for row in group) == list(range(17))
        for group in groups:
            assert len(group) == 1 or len(group) * max(lengths[row] for row in group) <= budget
    assert split_rows([3, 9, 5, 9], 18) == [[1, 3], [2, 0]]  # longest first, ties in order
    with pytest.raises(ValueError):
        split_rows([3], 0)


def test_chunked_no_grad_logprobs_and_values_equal_one_pass():
    model = float64_model(VOCAB)
    critic = Float64Critic()
    batch = make_batch(seed=5)
    attended = batch.attention_mask.bool()
    with torch.no_grad():
        want = reference_logp(model, batch)
        want_values = critic(batch.input_ids, batch.attention_mask, want["hidden"])
    assert torch.equal(row_lengths(batch.attention_mask), torch.tensor(LENGTHS))
    for budget in (1, 30, 45, 1000):
        got = chunked_token_logprobs(model, batch.input_ids, batch.attention_mask, max_tokens=budget,
                                     value_fn=critic)
        torch.testing.assert_close(got["logp"][attended], want["logp"][attended], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got["values"][attended], want_values[attended], rtol=1e-10, atol=1e-12)
        assert not got["logp"].requires_grad


def test_activation_checkpointing_gives_the_same_gradients_and_recomputes():
    batch = make_batch(seed=6)
    grads, calls = [], []
    for checkpointed in (False, True):
        model = float64_model(VOCAB)
        if checkpointed:
            enable_gradient_checkpointing(model)
        model.train()
        count = [0]
        # A pre-hook: the recompute stops once the saved tensors are back, before the MLP returns.
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *args: count.__setitem__(0, count[0] + 1))
        out = token_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True, chunk_size=8)
        loss = (out["logp"] * batch.action_mask).sum() + out["entropy"].sum()
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
        calls.append(count[0])
    assert calls == [1, 2]  # the checkpointed layer ran again in the backward pass
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-10, atol=1e-12)


def test_a_non_linear_aggregation_cannot_be_split_and_says_so(monkeypatch):
    mask = make_batch(seed=7).action_mask
    algo = algo_config("token_mean", "token")
    assert torch.allclose(aggregation_weights(mask, algo).sum(), torch.tensor(1.0, dtype=torch.float64))
    monkeypatch.setattr(learner_module, "aggregate", lambda per_token, mask, cfg: (per_token * mask).sum() ** 2)
    with pytest.raises(ValueError, match="algo.aggregation='token_mean'.*micro_batch_tokens"):
        aggregation_weights(mask, algo)


def test_a_step_logs_memory_and_micro_batches(tiny_model_dir, tmp_path):
    from keelrl.config import TINY_RUN, load_config
    from keelrl.envs.guess import BinarySearchTeacher
    from keelrl.errors import ConfigError
    from keelrl.rollout.agent_loop import run_episodes, scripted_actor
    from keelrl.rollout.engines import StepRollouts

    cfg = load_config(overrides=[*TINY_RUN, *NOT_CODING, 
        f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", "env.name=guess", "env.max_turns=6",
        "perf.micro_batch_tokens=64", "perf.gradient_checkpointing=true", "train.minibatch_size=4",
        "warm_start.demos=2", "warm_start.epochs=1", "warm_start.batch_size=2", "output.sample_trajectories=0"])
    trainer = Trainer(cfg)
    assert trainer.warm_start()["warm_start/demos"] == 2  # micro-batched too (rows of > 64 tokens)
    # Scripted episodes stand in for sampled ones: the update, not the sampling, is under test.
    teacher = BinarySearchTeacher(mistake_rate=0.5, seed=0)
    tasks = trainer.train_tasks[:4]
    trajectories = run_episodes(trainer._env(training=True), tasks, trainer.tokenizer,
                                scripted_actor(trainer.tokenizer, [teacher.policy(task) for task in tasks]),
                                trainer._limits())
    row = trainer.rl_step(1, StepRollouts(trajectories, {}))
    assert row["train/updates"] == 1 and row["train/micro_batches"] == 4  # 4 rows of > 64 tokens: one each
    assert row["memory/peak_rss_gb"] >= row["memory/rss_gb"] > 0
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["perf.micro_batch_tokens=0"])
    assert info.value.field == "perf.micro_batch_tokens"


def test_logprobs_at_chosen_positions_equal_the_full_pass_there_and_give_the_same_gradients():
    """The head run only where the loss reads (`positions`) changes nothing the loss sees."""
    import torch

    from keelrl.policy.model import token_logprobs
    from keelrl.policy.tiny import TinyModelSpec, build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model(TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64), 264, 0, 1)
    model = model.double()
    ids = torch.randint(2, 264, (3, 23))
    attention = torch.ones_like(ids)
    attention[2, 17:] = 0
    positions = torch.rand(3, 23) < 0.4
    positions[:, 0] = True  # position 0 has nothing before it: 0 either way
    full = token_logprobs(model, ids, attention, with_entropy=True, chunk_size=5)
    part = token_logprobs(model, ids, attention, with_entropy=True, chunk_size=5, positions=positions)
    chosen = positions.clone()
    chosen[:, 0] = False
    for key in ("logp", "entropy"):
        torch.testing.assert_close(part[key][chosen], full[key][chosen], rtol=1e-12, atol=1e-12)
        assert (part[key][~chosen] == 0).all()
    grads = []
    for out in (full, part):
        model.zero_grad()
        loss = (out["logp"] * chosen).sum() + 0.3 * (out["entropy"] * chosen).sum()
        loss.backward(inputs=list(model.parameters()))
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- the fused head
def _naive_head(hidden, weight, bias, targets, temperature):
    """The reference: autograd through one full log-softmax (float64)."""
    log_q = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias) / temperature, dim=-1)  # [N, V]
    return log_q.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_q.exp() * log_q).sum(-1)


@pytest.mark.parametrize("seed,count,chunk,temperature,with_bias", [
    (0, 17, 5, 1.0, False), (1, 9, 1, 0.7, True), (2, 32, 32, 1.3, False), (3, 11, 64, 0.5, True)])
def test_head_logprobs_matches_a_full_log_softmax_in_values_and_every_gradient(seed, count, chunk, temperature,
                                                                                with_bias):
    """HeadLogprobs' hand-written backward (onehot - q for logp, -q (log q + H) for the entropy,
    divided by the temperature) against autograd through a full float64 log-softmax."""
    from keelrl.policy.model import HeadLogprobs

    g = torch.Generator().manual_seed(seed)
    vocab, size = 23, 6
    hidden = torch.randn(count, size, generator=g, dtype=torch.float64) * 2
    weight = torch.randn(vocab, size, generator=g, dtype=torch.float64)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64) if with_bias else None
    targets = torch.randint(vocab, (count,), generator=g)
    w_logp, w_entropy = torch.randn(count, generator=g, dtype=torch.float64), torch.randn(count, generator=g,
                                                                                          dtype=torch.float64)
    results = []
    for fn in ("fused", "naive"):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)] + \
                 ([bias.clone().requires_grad_(True)] if bias is not None else [])
        b = leaves[2] if bias is not None else None
        if fn == "fused":
            logp, entropy = HeadLogprobs.apply(leaves[0], leaves[1], b, targets, temperature, True, chunk)
        else:
            logp, entropy = _naive_head(leaves[0], leaves[1], b, targets, temperature)
        ((logp * w_logp).sum() + (entropy * w_entropy).sum()).backward()
        results.append([logp.detach(), entropy.detach()] + [leaf.grad for leaf in leaves])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_head_logprobs_passes_gradcheck_with_and_without_the_entropy():
    from keelrl.policy.model import HeadLogprobs

    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(9, (5,), generator=g)
    assert torch.autograd.gradcheck(lambda h, w, b: HeadLogprobs.apply(h, w, b, targets, 0.8, True, 2),
                                    (hidden, weight, bias))
    assert torch.autograd.gradcheck(lambda h, w, b: HeadLogprobs.apply(h, w, b, targets, 1.0, False, 3)[0],
                                    (hidden, weight, bias))


def test_head_chunk_bounds_the_logits_of_one_call_and_rejects_a_bad_size():
    from keelrl.policy.model import HEAD_CHUNK_BYTES, head_chunk

    assert head_chunk(1, 49152, None) == 256  # capped: 256 x 49,152 x 4 bytes = 48 MiB
    assert head_chunk(1, 151936, None) == HEAD_CHUNK_BYTES // (4 * 151936) == 110
    assert head_chunk(4, 151936, None) == 27  # rows share the budget
    assert head_chunk(1, 10**9, None) == 8  # never fewer than 8 positions a call
    assert head_chunk(3, 151936, 5) == 5
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        head_chunk(1, 100, 0)
