"""Learner passes by shared prompt (keelrl.policy.prefix) against the plain pass.

The reference is the plain pass over the whole batch: one forward of the HF model with the full
[B, T, V] logits (as tests/test_memory.py's), on a small float64 Qwen2. Log-probs, entropies
and hidden states must match to float64 rounding. Gradients too, row by row; summed over the
rows of a group they match to 1e-6 relative, not float64 rounding: HF's RMSNorm computes in
float32 whatever the weights' dtype, and the shared pass adds a group's gradients at the
prompt's positions before that float32 backward instead of after it (checked below: each row's
gradient alone matches to 1e-12).
"""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import float64_model

from keelrl.algos.config import AlgoConfig
from keelrl.config import DistillConfig
from keelrl.config import TINY_RUN, load_config
from keelrl.policy import prefix as prefix_module
from keelrl.policy.prefix import chunked_token_logprobs
from keelrl.policy.prefix import (PrefixUnit, can_share, find_prefix_units, localize, plan_micro_batches,
                                  plan_passes, prefix_token_logprobs)
from keelrl.rollout.trajectory import Batch
from keelrl.train.learner import Learner, UpdateInputs, enable_gradient_checkpointing
from keelrl.train.trainer import Trainer

VOCAB = 40
# (prompt length, [continuation lengths]) per group: prompts of different lengths, rows of one
# group of different lengths, a group of one.
GROUPS = [(7, [3, 5, 1]), (12, [4, 4]), (3, [6]), (9, [2, 7, 3, 3])]


def grouped_batch(groups=GROUPS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows -> (input_ids, attention_mask, positions: each continuation, group ids)."""
    generator = torch.Generator().manual_seed(seed)
    rows, keys, starts = [], [], []
    for key, (prompt, continuations) in enumerate(groups):
        shared = torch.randint(2, VOCAB, (prompt,), generator=generator)
        for length in continuations:
            rows.append(torch.cat([shared, torch.randint(2, VOCAB, (length,), generator=generator)]))
            keys.append(key)
            starts.append(prompt)
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention, positions = torch.zeros_like(ids), torch.zeros(len(rows), width, dtype=torch.bool)
    for index, row in enumerate(rows):
        ids[index, :len(row)], attention[index, :len(row)] = row, 1
        positions[index, starts[index]:len(row)] = True
    return ids, attention, positions, torch.tensor(keys)


def reference(model, ids, attention, positions, temperature: float) -> dict[str, torch.Tensor]:
    """The plain pass, every position through the head at once, then masked to `positions`."""
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    log_probs = torch.log_softmax(model.lm_head(hidden)[:, :-1] / temperature, dim=-1)
    logp = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    pad = torch.zeros(ids.shape[0], 1, dtype=logp.dtype)
    scored = positions.clone()
    scored[:, 0] = False
    return {"logp": torch.cat([pad, logp], 1) * scored, "entropy": torch.cat([pad, entropy], 1) * scored,
            "hidden": hidden}


def test_units_share_the_checked_common_prefix_before_the_first_scored_token():
    ids, attention, positions, keys = grouped_batch()
    units = find_prefix_units(ids, attention, keys, positions)
    assert units == [PrefixUnit((0, 1, 2), 7), PrefixUnit((3, 4), 12), PrefixUnit((5,), 3), PrefixUnit((6, 7, 8, 9), 9)]
    # A row of group 0 that differs at token 4: the group shares 4 tokens, whatever the key says.
    changed = ids.clone()
    changed[1, 4] = (changed[1, 4] + 1) % VOCAB
    assert find_prefix_units(changed, attention, keys, positions)[0] == PrefixUnit((0, 1, 2), 4)
    # ...at token 1: fewer than two shared tokens, so one unit per row, each up to its first scored token.
    changed[1, 1] = (changed[1, 1] + 1) % VOCAB
    assert find_prefix_units(changed, attention, keys, positions)[:3] == [PrefixUnit((0,), 7), PrefixUnit((1,), 7),
                                                                         PrefixUnit((2,), 7)]
    # A scored token inside the common prefix (identical first actions of a multi-turn group) caps it.
    early = positions.clone()
    early[3, 5] = True
    assert find_prefix_units(ids, attention, keys, early)[1] == PrefixUnit((3, 4), 5)
    # Without positions every token is scored: nothing can be shared.
    assert all(unit.shared == 1 for unit in find_prefix_units(ids, attention, keys))
    with pytest.raises(ValueError, match="3 keys for a batch of 10"):
        find_prefix_units(ids, attention, [0, 0, 1], positions)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_pass_equals_the_plain_pass(temperature):
    model = float64_model(VOCAB).train()
    ids, attention, positions, keys = grouped_batch()
    units = find_prefix_units(ids, attention, keys, positions)
    assert can_share(model, units)
    want = reference(model, ids, attention, positions, temperature)
    got = prefix_token_logprobs(model, ids, attention, units, positions=positions, with_entropy=True, with_hidden=True,
                                temperature=temperature)
    torch.testing.assert_close(got["logp"], want["logp"], rtol=0, atol=1e-12)
    torch.testing.assert_close(got["entropy"], want["entropy"], rtol=0, atol=1e-12)
    attended = attention.bool().unsqueeze(-1)
    torch.testing.assert_close(got["hidden"] * attended, want["hidden"] * attended, rtol=0, atol=1e-12)
    assert got["logp"].shape == ids.shape and got["hidden"].shape == want["hidden"].shape

    params = list(model.parameters())
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def grads(out: dict[str, torch.Tensor], rows: list[int]) -> list[torch.Tensor]:
        loss = (out["logp"] * weights)[rows].sum() + 0.1 * out["entropy"][rows].sum()
        return list(torch.autograd.grad(loss, params, retain_graph=True))

    for row in range(ids.shape[0]):  # one row's gradient, through the copied prefix: float64 rounding
        for expected, actual in zip(grads(want, [row]), grads(got, [row])):
            torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)
    everything = list(range(ids.shape[0]))
    for expected, actual in zip(grads(want, everything), grads(got, everything)):  # RMSNorm's float32 backward
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_bad_units_are_refused():
    model = float64_model(VOCAB)
    ids, attention, positions, keys = grouped_batch()
    units = find_prefix_units(ids, attention, keys, positions)
    with pytest.raises(ValueError, match="each row exactly once"):
        prefix_token_logprobs(model, ids, attention, units[:-1], positions=positions)
    with pytest.raises(ValueError, match="at least 2"):
        prefix_token_logprobs(model, ids, attention, [*units[:-1], PrefixUnit((6, 7, 8, 9), 1)], positions=positions)
    assert not can_share(model, [PrefixUnit((0,), 1)])
    model.train()
    enable_gradient_checkpointing(model)
    assert not can_share(model, units)  # a checkpointed layer would replay its cache update
    with torch.no_grad():
        assert can_share(model, units)  # no backward, nothing replayed


def test_plans_keep_the_budget_and_cover_every_row_once():
    generator = torch.Generator().manual_seed(3)
    for trial in range(200):
        groups = [(int(torch.randint(2, 30, (), generator=generator)),
                   [int(n) for n in torch.randint(1, 20, (int(torch.randint(1, 6, (), generator=generator)),),
                                                  generator=generator)])
                  for _ in range(int(torch.randint(1, 6, (), generator=generator)))]
        ids, attention, positions, keys = grouped_batch(groups, seed=trial)
        lengths = attention.sum(1).tolist()
        budget = int(torch.randint(1, 200, (), generator=generator))
        units = find_prefix_units(ids, attention, keys, positions)
        for batch in plan_micro_batches(units, lengths, budget):
            rows = [row for unit in batch for row in unit.rows]
            cuts = max(unit.cut for unit in batch)
            widest = max(lengths[row] - unit.cut for unit in batch for row in unit.rows)
            assert len(batch) * cuts + len(rows) * widest <= budget or len(rows) == 1, (trial, budget)
            assert all(unit in units or any(set(unit.rows) <= set(u.rows) and unit.shared == u.shared for u in units)
                       for unit in batch)
        plan = plan_passes(ids, attention, budget, keys=keys, positions=positions)
        covered = sorted(row for micro in plan for row in micro.rows)
        assert covered == list(range(ids.shape[0])), trial
        for micro in plan:
            assert micro.width == max(lengths[row] for row in micro.rows)
            if micro.units is not None:
                assert sorted(r for unit in micro.units for r in unit.rows) == list(range(len(micro.rows)))
    assert localize([PrefixUnit((4, 2), 3), PrefixUnit((0,), 5)]) == ([4, 2, 0], [PrefixUnit((0, 1), 3),
                                                                                  PrefixUnit((2,), 5)])
    assert all(micro.units is None for micro in plan_passes(ids, attention, 64))  # no keys: plain passes


def test_a_group_of_very_different_lengths_splits_where_that_saves_more_padding_than_a_pass_costs():
    """Hand-worked: one group sharing 11 tokens (cut 10), continuations 100, 30, 28 and 20 wide.
    In one pass: 10 + 4 x 100 = 410 padded tokens. The longest alone, then the other three:
    (10 + 100) + (10 + 3 x 30) = 210, the best of all splits (three parts: 110 + 70 + 30 = 210
    as well, but a pass more; 110 + 40 + 66 = 216). With a pass worth 8 tokens: 226 against 418,
    so two parts; worth 250: 710 against 660, so one; off (None): the fewest the budget allows."""
    lengths = [110, 40, 38, 30]
    unit = PrefixUnit((2, 0, 3, 1), 11)
    assert plan_micro_batches([unit], lengths, 1000, overhead=8) == [[PrefixUnit((0,), 11)],
                                                                      [PrefixUnit((1, 2, 3), 11)]]
    assert plan_micro_batches([unit], lengths, 1000, overhead=250) == [[PrefixUnit((0, 1, 2, 3), 11)]]
    assert plan_micro_batches([unit], lengths, 1000) == [[PrefixUnit((0, 1, 2, 3), 11)]]
    assert plan_micro_batches([unit], lengths, 300) == [[PrefixUnit((0, 1), 11)], [PrefixUnit((2, 3), 11)]]
    # Two units of similar width share a pass when that adds no more padding than a pass costs:
    # cuts 10 and 12, widths 30 and 28: together 2 x 12 + 2 x 30 = 84 against 40 + 40 = 80 apart.
    pair = [PrefixUnit((0,), 11), PrefixUnit((1,), 13)]
    assert plan_micro_batches(pair, [40, 40], 1000, overhead=4) == [pair]
    assert plan_micro_batches(pair, [40, 40], 1000, overhead=3) == [[pair[0]], [pair[1]]]
    with pytest.raises(ValueError, match="overhead"):
        plan_micro_batches([unit], lengths, 1000, overhead=-1)
    ids, attention, positions, keys = grouped_batch([(11, [99, 29, 27, 19])])
    plan = plan_passes(ids, attention, 1000, keys=keys, positions=positions)  # a CPU batch: PASS_OVERHEAD_TOKENS (64)
    assert [micro.rows for micro in plan] == [(0,), (1, 2, 3)] and plan[1].width == 11 + 29
    assert len(plan_passes(ids, attention, 1000, keys=keys, positions=positions, overhead=None)) == 1
    assert prefix_module.pass_overhead(torch.device("cpu")) == prefix_module.PASS_OVERHEAD_TOKENS
    assert prefix_module.pass_overhead(torch.device("cuda")) is None


def partitions(items: list[int]):
    """Every partition of `items` into non-empty parts."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in partitions(rest):
        yield [[first], *partition]
        for index in range(len(partition)):
            yield [*partition[:index], [first, *partition[index]], *partition[index + 1:]]


def test_a_units_split_by_length_is_the_cheapest_of_every_partition_of_its_rows():
    """Brute force over every partition of a unit's rows (not only runs of the sorted order): the
    plan's parts cost (padded tokens + overhead a part) no more than the cheapest partition
    within the budget, and never more than the split with no overhead counted (`overhead=None`)."""
    generator = torch.Generator().manual_seed(11)
    for trial in range(150):
        rows = int(torch.randint(1, 7, (), generator=generator))
        shared = int(torch.randint(2, 40, (), generator=generator))
        lengths = [shared + int(torch.randint(1, 200, (), generator=generator)) for _ in range(rows)]
        overhead = int(torch.randint(0, 120, (), generator=generator))
        budget = int(torch.randint(150, 1200, (), generator=generator))
        unit = PrefixUnit(tuple(range(rows)), shared)

        def cost(parts):
            return sum(unit.cut + len(part) * max(lengths[r] - unit.cut for r in part) + overhead for part in parts)

        def allowed(parts):
            return all(len(p) == 1 or unit.cut + len(p) * max(lengths[r] - unit.cut for r in p) <= budget
                       for p in parts)

        best = min(cost(parts) for parts in partitions(list(range(rows))) if allowed(parts))
        split = prefix_module._split_unit(unit, lengths, budget, overhead)
        assert sorted(r for part in split for r in part.rows) == list(range(rows))
        assert allowed([part.rows for part in split]) and cost([part.rows for part in split]) == best, trial
        fewest = prefix_module._split_unit(unit, lengths, budget, None)
        assert cost([part.rows for part in split]) <= cost([part.rows for part in fewest]), trial


def test_chunked_passes_by_shared_prefix_equal_plain_ones():
    model = float64_model(VOCAB).eval()
    ids, attention, positions, keys = grouped_batch()
    for budget in (1, 30, 1000):
        plain = chunked_token_logprobs(model, ids, attention, max_tokens=budget, positions=positions, temperature=0.7)
        shared = chunked_token_logprobs(model, ids, attention, max_tokens=budget, positions=positions, temperature=0.7,
                                        keys=keys)
        torch.testing.assert_close(shared["logp"], plain["logp"], rtol=0, atol=1e-12)
    # a group of very different lengths, split by length into two passes (a CPU batch), against plain
    ids, attention, positions, keys = grouped_batch([(11, [99, 29, 27, 19]), (5, [3, 4])])
    assert len(plan_passes(ids, attention, 1000, keys=keys, positions=positions)) == 2
    plain = chunked_token_logprobs(model, ids, attention, max_tokens=1000, positions=positions, temperature=0.7)
    split = chunked_token_logprobs(model, ids, attention, max_tokens=1000, positions=positions, temperature=0.7,
                                   keys=keys)
    torch.testing.assert_close(split["logp"], plain["logp"], rtol=0, atol=1e-12)


def learner_namespace(model, algo: AlgoConfig, *, budget: int, share: bool) -> SimpleNamespace:
    """What `Learner.accumulate_gradients` reads of a learner: micro-batches of `budget` padded
    tokens, by shared prompt or not; the policy alone, no teacher."""
    return SimpleNamespace(cfg=SimpleNamespace(algo=algo, distill=DistillConfig(), rollout=SimpleNamespace(temperature=1.0),
                                               perf=SimpleNamespace(micro_batch_tokens=budget, share_prefix=share,
                                                                    gradient_checkpointing=False)),
                           model=model.train(), value_head=None, autocast=contextlib.nullcontext, loss_teacher=None)


def update_case(model, groups, *, seed: int, draw: int):
    """A grouped batch (`grouped_batch`) with random behaviour log-probs, rewards and advantages
    (seeded by `draw`), the plain pass's log-probs as the reference, and GRPO with a k3 KL and an
    entropy bonus -> (batch, advantages, ref_logp, algo)."""
    ids, attention, positions, keys = grouped_batch(groups, seed=seed)
    generator = torch.Generator().manual_seed(draw)
    behaviour = (torch.randn(ids.shape, generator=generator, dtype=torch.float64) * 0.3 - 3.5) * positions
    batch = Batch(ids, attention, positions, behaviour, torch.zeros_like(ids), torch.rand(len(ids), generator=generator),
                  keys)
    advantages = torch.randn(ids.shape, generator=generator, dtype=torch.float64)
    algo = AlgoConfig(preset="grpo", kl_coef=0.05, kl_estimator="k3", kl_in_reward=False, entropy_coef=0.01)
    with torch.no_grad():
        ref_all = reference(model, ids, attention, positions, 1.0)["logp"]
    return batch, advantages, ref_all, algo


def test_accumulated_update_by_shared_prefix_equals_the_plain_one():
    """Learner.accumulate_gradients, micro-batched by shared prompt, against micro-batched plainly."""
    model = float64_model(VOCAB)
    batch, advantages, ref_all, algo = update_case(model, GROUPS, seed=0, draw=5)
    behaviour = batch.behaviour_logprobs
    rows = torch.tensor([9, 0, 4, 1, 2, 3, 5, 8, 6, 7])
    results = {}
    for share in (False, True):
        learner = learner_namespace(model, algo, budget=40, share=share)
        model.zero_grad(set_to_none=True)
        result = Learner.accumulate_gradients(learner, UpdateInputs(  # type: ignore[arg-type]
            batch, advantages, torch.zeros_like(advantages), None, ref_all, behaviour), rows)
        metrics, passes = result.metrics, result.passes
        results[share] = (metrics, passes, [p.grad.clone() for p in model.parameters()])
    (plain_metrics, plain_passes, plain_grads), (metrics, passes, grads) = results[False], results[True]
    assert passes < plain_passes  # each prompt counted once: fewer micro-batches in the same budget
    for key, value in plain_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for expected, actual in zip(plain_grads, grads):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9)


def test_an_update_split_by_length_equals_the_plain_one():
    """Learner.accumulate_gradients on a group of very different lengths: split into two passes
    by length (a CPU batch, PASS_OVERHEAD_TOKENS), in one pass (no overhead: the fewest passes),
    and plainly; the same metrics and gradients (float64, as the test above)."""
    model = float64_model(VOCAB)
    batch, advantages, ref_all, algo = update_case(model, [(11, [99, 29, 27, 19]), (6, [5, 40, 3])], seed=4, draw=6)
    behaviour = batch.behaviour_logprobs
    rows = torch.arange(batch.input_ids.shape[0])
    results = {}
    real = prefix_module.pass_overhead
    for mode in ("plain", "one pass", "split"):
        prefix_module.pass_overhead = real if mode == "split" else (lambda device: None)
        learner = learner_namespace(model, algo, budget=1000, share=mode != "plain")
        model.zero_grad(set_to_none=True)
        try:
            result = Learner.accumulate_gradients(learner, UpdateInputs(  # type: ignore[arg-type]
                batch, advantages, torch.zeros_like(advantages), None, ref_all, behaviour), rows)
        finally:
            prefix_module.pass_overhead = real
        results[mode] = (result.metrics, result.passes, [p.grad.clone() for p in model.parameters()])
    # split: the 100-wide row with the 41-wide one (together they pad no more than a pass costs), then the rest
    assert results["one pass"][1] == 1 and results["split"][1] == 2
    for mode in ("one pass", "split"):
        metrics, _, grads = results[mode]
        for key, value in results["plain"][0].items():
            assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (mode, key)
        for expected, actual in zip(results["plain"][2], grads):  # HF's float32 RMSNorm: see the module docstring
            torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-8)


def test_the_trainer_runs_its_passes_by_shared_prompt_and_updates_as_without(tiny_model_dir, tmp_path, monkeypatch):
    """One RL step of a real (tiny) run with perf.share_prefix on and off: the same rollouts,
    the same update up to float32 rounding; the shared run really took the shared path."""
    calls = {"n": 0}
    original = prefix_module.prefix_token_logprobs

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(prefix_module, "prefix_token_logprobs", counting)
    params, rows = {}, {}
    for share in (False, True):
        run_dir = tmp_path / f"share-{share}"
        cfg = load_config(overrides=[*TINY_RUN, f"run_dir={run_dir}", f"model.path={tiny_model_dir}",
                                     "rollout.engine=sync", "train.steps=1", "eval.every=1", "eval.tasks=2",
                                     "warm_start.demos=4", "rollout.tasks_per_step=2", "rollout.group_size=3",
                                     "rollout.max_new_tokens=16", "env.max_turns=2", "algo.preset=grpo",
                                     f"perf.share_prefix={str(share).lower()}"])
        before = calls["n"]
        trainer = Trainer(cfg)
        trainer.run()
        assert (calls["n"] > before) == share
        params[share] = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        rows[share] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[1])
    assert rows[True]["train/reward"] == rows[False]["train/reward"]  # the same rollouts
    for key in ("policy/loss", "policy/entropy", "policy/kl_ref", "train/grad_norm"):
        assert rows[True][key] == pytest.approx(rows[False][key], rel=1e-4, abs=1e-6), key
    for name, value in params[False].items():
        torch.testing.assert_close(params[True][name], value, rtol=1e-4, atol=1e-6, msg=name)
