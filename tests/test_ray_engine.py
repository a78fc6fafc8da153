"""The Ray engine on a local 2-CPU cluster: it trains the tiny model, and survives a killed worker."""

from __future__ import annotations

import json
import os
import threading

import pytest
import ray

from keelrl.config import TINY_RUN, load_config
from keelrl.envs.coding_tasks import bundled_tasks
from keelrl.policy.model import load_policy
from keelrl.policy.sampling import SamplingConfig
from keelrl.policy.tiny import TinyModelSpec, save_tiny_default
from keelrl.rollout.ray_engine import RayEngine
from keelrl.rollout.scheduler import GroupRequest, RolloutConfig
from keelrl.train.trainer import CodingEnvFactory, Trainer

SMALL = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_positions=2048)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_TMPDIR"] = str(tmp_path_factory.mktemp("ray"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_default(tmp_path_factory.mktemp("model"), SMALL)


def test_ray_engine_trains_the_tiny_model(cluster, model_dir, tmp_path):
    cfg = load_config(overrides=[*TINY_RUN, 
        f"run_dir={tmp_path}", f"model.path={model_dir}", "rollout.engine=ray", "rollout.workers=2",
        "rollout.max_staleness=1", "train.steps=3", "train.eval_tasks=2", "train.eval_every=10",
        "warm_start.demos=4", "warm_start.epochs=1", "rollout.tasks_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=16", "env.max_turns=2", "train.minibatch_size=2", "train.sample_trajectories=0"])
    trainer = Trainer(cfg)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    summary = trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and [row["step"] for row in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        assert row["engine/workers"] == 2 and row["rollout/staleness_max"] <= 1
        assert row["train/updates"] >= 1
    assert any(not (p.detach() == before[name]).all() for name, p in trainer.model.named_parameters())
    assert ray.is_initialized()  # the engine joined the test's cluster and left it running


def test_a_killed_worker_is_replaced_and_its_episodes_requeued(cluster, model_dir):
    tasks = bundled_tasks(None)[:40]

    def requests_for(step):
        return [GroupRequest(index=(step - 1) * 4 + i, task=tasks[((step - 1) * 4 + i) % len(tasks)], group_size=2,
                             seed=step * 100 + i) for i in range(4)]

    model, tokenizer = load_policy(str(model_dir), "cpu")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine = RayEngine(requests_for, model_path=str(model_dir), tokenizer=tokenizer,
                       make_env=CodingEnvFactory("strong", max_turns=2), sampling=SamplingConfig(max_new_tokens=12),
                       rollout=RolloutConfig(max_turns=2, env_threads=2), max_staleness=1, workers=2)
    try:
        engine.start(0)
        engine.publish(state, 0)
        victim = engine.actors[0]
        killer = threading.Timer(1.5, lambda: ray.kill(victim, no_restart=True))
        killer.start()  # mid-step: the victim holds requests it has not returned
        results = []
        for step in range(1, 4):
            results.append(engine.batch(step))
            killer.join()
            engine.publish(state, step)
        assert engine.workers_replaced >= 1 and engine.requests_requeued >= 1
        for step, rollouts in enumerate(results, start=1):
            assert [t.task_id for t in rollouts.trajectories] == [r.task.id for r in requests_for(step) for _ in range(2)]
            assert all(t.termination for t in rollouts.trajectories)
            assert rollouts.metrics["rollout/staleness_max"] <= 1
        assert results[-1].metrics["engine/workers_replaced"] >= 1
    finally:
        engine.close()
