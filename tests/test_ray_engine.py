"""The Ray engine on a local 2-CPU cluster: it trains the tiny model, and survives a killed worker.
Its wait loop against a stand-in Ray module with a fake clock: a slow worker is waited for, a
dead one replaced at once, a silent one replaced after worker_timeout_s."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import types

import pytest
import ray

from conftest import limits
from keelrl.config import TINY_RUN, load_config
from keelrl.envs.coding_tasks import bundled_tasks
from keelrl.policy.model import load_policy
from keelrl.inference import SamplingParams
from keelrl.rollout.ray_engine import RayEngine, init_local_ray
from keelrl.rollout.scheduler import GroupRequest, GroupResult, SchedulerStats
from keelrl.envs.coding import CodingEnvFactory
from keelrl.train.trainer import Trainer


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # A short path of its own: Ray's socket paths under it must fit AF_UNIX's 107 bytes, which a
    # pytest temp dir (deeper under pytest-xdist's per-worker folders) does not leave room for.
    tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    init_local_ray(num_cpus=2)
    yield
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def test_ray_engine_trains_the_tiny_model(cluster, tiny_model_dir, tmp_path):
    cfg = load_config(overrides=[*TINY_RUN, 
        f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "rollout.engine=ray", "rollout.workers=2",
        "rollout.max_staleness=1", "train.steps=3", "eval.tasks=2", "eval.every=10",
        "warm_start.demos=4", "warm_start.epochs=1", "rollout.tasks_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=16", "env.max_turns=2", "train.minibatch_size=2", "output.sample_trajectories=0"])
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


def test_a_killed_worker_is_replaced_and_its_episodes_requeued(cluster, tiny_model_dir):
    tasks = bundled_tasks(None)[:40]

    def requests_for(step):
        return [GroupRequest(index=(step - 1) * 4 + i, task=tasks[((step - 1) * 4 + i) % len(tasks)], group_size=2,
                             seed=step * 100 + i) for i in range(4)]

    model, tokenizer = load_policy(str(tiny_model_dir), "cpu")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine = RayEngine(requests_for, model_path=str(tiny_model_dir), tokenizer=tokenizer,
                       make_env=CodingEnvFactory("strong", max_turns=2), sampling=SamplingParams(max_new_tokens=12),
                       rollout=limits(max_turns=2, env_threads=2), max_staleness=1, workers=2)
    try:
        engine.start(0)
        engine.publish(state, 0)
        victim = engine.actors[0]
        submit = engine._submit

        def submit_then_kill(requests):  # mid-step: the victim holds requests it has not returned
            submit(requests)
            if victim in engine.actors and engine.outstanding[engine.actors.index(victim)]:
                ray.kill(victim, no_restart=True)

        engine._submit = submit_then_kill
        results = []
        for step in range(1, 4):
            results.append(engine.batch(step))
            engine.publish(state, step)
        assert engine.workers_replaced >= 1 and engine.requests_requeued >= 1
        for step, rollouts in enumerate(results, start=1):
            assert [t.task_id for t in rollouts.trajectories] == [r.task.id for r in requests_for(step) for _ in range(2)]
            assert all(t.termination for t in rollouts.trajectories)
            assert rollouts.metrics["rollout/staleness_max"] <= 1
        assert results[-1].metrics["engine/workers_replaced"] >= 1
    finally:
        engine.close()


@pytest.mark.slow  # two more actors to start; the tests above cover training and a worker's replacement
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="pinning to separate cores needs two cores")
def test_workers_are_pinned_to_their_cores_with_one_torch_thread(cluster, tiny_model_dir):
    """rollout.worker_cores: worker i runs every thread on core worker_cores[i % n], one torch thread."""
    model, tokenizer = load_policy(str(tiny_model_dir), "cpu")
    engine = RayEngine(lambda step: [], model_path=str(tiny_model_dir), tokenizer=tokenizer,
                       make_env=CodingEnvFactory("strong", max_turns=1), sampling=SamplingParams(max_new_tokens=4),
                       rollout=limits(max_turns=1, env_threads=1), workers=2, worker_cores=(1,),
                       worker_cpus=0.5)
    try:
        placements = [ray.get(actor.placement.remote(), timeout=600) for actor in engine.actors]
    finally:
        engine.close()
    assert len({p["pid"] for p in placements}) == 2
    for placement in placements:
        assert placement["thread_cores"] == [(1,)] and placement["torch_threads"] == 1


def test_ray_workers_run_at_the_drivers_priority(cluster):
    @ray.remote(num_cpus=0)
    def niceness():
        return os.nice(0)

    assert ray.get(niceness.remote(), timeout=600) == os.nice(0)


class FakeRay:
    """Enough of the `ray` module for RayEngine's wait loop, on a fake clock. Each actor's `mode`:
    ok (answers polls at once), slow (answers only `delay` fake seconds after a poll is sent),
    dead (every call raises RayActorError) or hung (never answers)."""

    def __init__(self, modes):
        self.now = 0.0
        self.modes = list(modes)  # the mode of each actor in spawn order; later spawns are ok
        self.spawned = []
        self.killed = []
        self.polls_sent = 0

    def is_initialized(self):
        return True

    def remote(self, **_options):
        return lambda cls: types.SimpleNamespace(remote=self._spawn)

    def _spawn(self, spec):
        actor = FakeActor(self, self.modes.pop(0) if self.modes else "ok")
        self.spawned.append(actor)
        return actor

    def put(self, value):
        return value

    def kill(self, actor, **_options):
        self.killed.append(actor)
        actor.mode = "dead"

    def sleep(self, seconds):
        self.now += seconds

    def wait(self, refs, num_returns, timeout):
        self.now += timeout
        ready = [ref for ref in refs if ref.ready(self.now)]
        return ready, [ref for ref in refs if ref not in ready]

    def get(self, ref):
        return ref.value()


class FakeRef:
    def __init__(self, actor, at, result):
        self.actor, self.at, self.result = actor, at, result

    def ready(self, now):
        return self.actor.mode == "dead" or (self.actor.mode != "hung" and now >= self.at)

    def value(self):
        from ray.exceptions import RayActorError

        if self.actor.mode == "dead":
            raise RayActorError()
        return self.result()


class FakeActor:
    def __init__(self, fake, mode, delay=300.0):
        self.fake, self.mode, self.delay = fake, mode, delay
        self.held = []
        self.poll = types.SimpleNamespace(remote=self._poll)
        self.submit = types.SimpleNamespace(remote=lambda requests: self.held.extend(requests))
        self.set_weights = types.SimpleNamespace(remote=lambda state, version: version)
        self.shutdown = types.SimpleNamespace(remote=lambda: None)

    def _poll(self):
        self.fake.polls_sent += 1
        delay = self.delay if self.mode == "slow" else 0.0

        def finish():
            done, self.held = self.held, []
            return [GroupResult(request=r, trajectories=[]) for r in done], SchedulerStats()

        return FakeRef(self, self.fake.now + delay, finish)


def _fake_engine(model_dir, modes, **options):
    fake = FakeRay(modes)
    requests = [GroupRequest(index=i, task=None, group_size=1, seed=i) for i in range(4)]
    engine = RayEngine(lambda step: requests, model_path=str(model_dir), tokenizer=None, make_env=lambda: None,
                       sampling=SamplingParams(), rollout=limits(), workers=2, poll_interval=1.0,
                       ray_module=fake, clock=lambda: fake.now, sleep=fake.sleep, **options)
    return fake, engine, requests


def test_a_slow_worker_is_waited_for_not_replaced(tiny_model_dir):
    fake, engine, requests = _fake_engine(tiny_model_dir, ["slow", "ok"], worker_timeout_s=600.0)
    results = engine.more(1, requests)
    assert [r.request.index for r in results] == [0, 1, 2, 3]
    assert engine.workers_replaced == 0 and fake.killed == []
    assert fake.now >= 300.0  # it really waited out the slow worker's 300 fake seconds


def test_a_dead_worker_is_replaced_at_once_and_its_requests_rerun(tiny_model_dir):
    fake, engine, requests = _fake_engine(tiny_model_dir, ["dead", "ok"], worker_timeout_s=600.0)
    results = engine.more(1, requests)
    assert [r.request.index for r in results] == [0, 1, 2, 3]
    assert engine.workers_replaced == 1 and engine.workers_hung == 0 and engine.requests_requeued == 2
    assert len(fake.spawned) == 3 and fake.now < 10.0


def test_a_silent_worker_is_replaced_after_the_timeout(tiny_model_dir):
    fake, engine, requests = _fake_engine(tiny_model_dir, ["hung", "ok"], worker_timeout_s=50.0)
    results = engine.more(1, requests)
    assert [r.request.index for r in results] == [0, 1, 2, 3]
    assert engine.workers_hung == 1 and engine.workers_replaced == 1 and engine.requests_requeued == 2
    assert fake.killed == [fake.spawned[0]]
    assert 50.0 < fake.now < 60.0  # replaced once silent for worker_timeout_s, not before


def test_one_poll_in_flight_per_worker(tiny_model_dir):
    fake, engine, requests = _fake_engine(tiny_model_dir, ["slow", "slow"], worker_timeout_s=600.0)
    engine.more(1, requests)
    assert fake.polls_sent == 2  # each slow worker was asked once and waited for, not asked again and again
