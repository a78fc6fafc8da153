"""DAPO dynamic sampling: kept groups are whole and mixed, the batch fills or the cap is reached."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keelrl.config import TINY_RUN, load_config
from keelrl.rollout.trajectory import Trajectory
from keelrl.train.dynamic import fill_batch, is_mixed
from keelrl.train.trainer import Trainer


def make_group(rng: random.Random, size: int, p_uniform: float, name: str) -> list[Trajectory]:
    group = [Trajectory(task_id=name, group_id=0) for _ in range(size)]
    if rng.random() < p_uniform:
        value = rng.choice([0.0, 1.0, 0.5])
        rewards = [value] * size
    else:
        rewards = [rng.choice([0.0, 0.25, 1.0]) for _ in range(size)]
    for t, r in zip(group, rewards):
        t.reward = r
    return group


@settings(max_examples=200)
@given(seed=st.integers(0, 10**6), target=st.integers(1, 8), size=st.integers(1, 5),
       p_uniform=st.sampled_from([0.0, 0.3, 0.8, 1.0]), max_extra=st.integers(0, 20))
def test_dynamic_sampling_invariants(seed, target, size, p_uniform, max_extra):
    rng = random.Random(seed)
    first = [make_group(rng, size, p_uniform, f"first{i}") for i in range(target)]
    drawn: list[list[Trajectory]] = list(first)
    calls = []

    def draw(count):
        calls.append(count)
        more = [make_group(rng, size, p_uniform, f"extra{len(drawn) + i}") for i in range(count)]
        drawn.extend(more)
        return more

    filled = fill_batch(first, draw, target=target, max_extra=max_extra)
    ids = {id(g) for g in drawn}
    for group in filled.groups:
        assert id(group) in ids and len(group) == size  # a kept group is a drawn group, whole
        assert is_mixed(group) and len({t.reward for t in group}) > 1  # no all-equal group kept
    assert len({id(g) for g in filled.groups}) == len(filled.groups)
    extra = sum(calls)
    assert extra <= max_extra and all(c > 0 for c in calls)
    assert len(filled.groups) == target or extra == max_extra  # full, or the cap was reached
    assert len(filled.groups) <= target
    m = filled.metrics
    assert m["dynamic/extra_groups"] == extra and m["dynamic/groups_drawn"] == len(drawn)
    assert m["dynamic/zero_adv_frac_before"] == pytest.approx(sum(not is_mixed(g) for g in drawn) / len(drawn))
    assert m["dynamic/cap_reached"] == float(len(filled.groups) < target)
    # Kept groups come in draw order.
    order = [next(i for i, g in enumerate(drawn) if g is k) for k in filled.groups]
    assert order == sorted(order)


def test_no_draws_when_the_first_batch_is_all_mixed():
    rng = random.Random(0)
    first = [make_group(rng, 4, 0.0, str(i)) for i in range(3)]
    filled = fill_batch(first, lambda n: pytest.fail("drew"), target=3, max_extra=10)
    assert filled.groups == first and filled.metrics["dynamic/draws_per_kept_group"] == 1.0


def test_bad_fill_arguments_are_rejected():
    with pytest.raises(ValueError, match="target"):
        fill_batch([], lambda n: [], target=0, max_extra=1)


@pytest.mark.parametrize("engine", ["sync", "async"])
def test_trainer_with_dapo_fills_with_extra_groups(tiny_model_dir, tmp_path_factory, engine):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config(overrides=[*TINY_RUN, 
        f"run_dir={run_dir}", f"model.path={tiny_model_dir}", "algo.preset=dapo", f"rollout.engine={engine}",
        "rollout.dynamic_max_extra_groups=3", "train.steps=2", "eval.tasks=2", "eval.every=10",
        "warm_start.demos=4", "warm_start.epochs=1", "rollout.tasks_per_step=2", "rollout.group_size=3",
        "rollout.max_new_tokens=16", "env.max_turns=2", "train.minibatch_size=6", "output.sample_trajectories=0"])
    Trainer(cfg).run()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    for row in rows:
        assert row["dynamic/groups_drawn"] == 2 + row["dynamic/extra_groups"]
        assert row["dynamic/extra_groups"] <= 3
        if row["dynamic/kept_groups"] > 0:
            assert row["train/zero_advantage_frac"] == 0.0  # only mixed groups reached the loss
        else:
            assert row["train/updates"] == 0 and row["dynamic/extra_groups"] == 3
