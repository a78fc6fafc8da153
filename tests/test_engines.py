"""Rollout engines: the staleness bound, sync == async at zero staleness, behaviour log-probs
against the weights that sampled them, and the decoupled objective."""

from __future__ import annotations

import random
import time

import pytest
import torch
from conftest import FAST_RUN, limits
from hypothesis import given, settings
from hypothesis import strategies as st

from keelrl.components import check
from keelrl.algos import AlgoConfig, policy_objective
from keelrl.config import TINY_RUN, load_config
from keelrl.envs.base import CheckResult, Grade
from keelrl.errors import ConfigError
from keelrl.policy.model import load_policy
from keelrl.inference import SamplingParams
from keelrl.rollout.engines import LocalEngine, staleness_metrics
from keelrl.rollout.scheduler import GroupRequest
from keelrl.train.trainer import Trainer


class ByteTokenizer:
    """Enough of a tokenizer for the scheduler: one id per byte, and a plain chat template."""

    chat_template = "[role]content[end]"
    eos_token_id = None
    all_special_ids: list[int] = []

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"[{m['role']}]{m['content']}[end]" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")


class LatencyEnv:
    """An episode of `turns[task]` steps, each sleeping the latency the schedule gives it."""

    def __init__(self, latency, turns):
        self.latency, self.turns = latency, turns

    def reset(self, task):
        self.task, self.turn = task, 0
        return f"task {task}"

    def step(self, action):
        time.sleep(self.latency(self.task, self.turn))
        self.turn += 1
        return "ok", self.turn >= self.turns(self.task), {"termination": "submitted"}

    def grade(self):
        return Grade(1.0, (CheckResult("done", True),))


def versions_actor(model):
    """Acts without a language model: one token whose id is the version-stamped weight."""

    def act(active):
        return [([int(model.weight.item())], [0.0], "a") for _ in active]

    return act


def run_fake_learner(engine, steps, learn_seconds, model):
    """Consume each step's batch, then 'update' (the weight becomes the version) and publish."""
    engine.start(0)
    out = []
    for step in range(1, steps + 1):
        rollouts = engine.batch(step)
        out.append(rollouts)
        time.sleep(learn_seconds[step - 1])
        with torch.no_grad():
            model.weight.fill_(step)
        engine.publish({"weight": model.weight.detach().clone(), "bias": model.bias.detach().clone()}, step)
    engine.close()
    return out


@settings(max_examples=25)
@given(seed=st.integers(0, 10**6), max_staleness=st.integers(0, 3), interruptible=st.booleans(),
       steps=st.integers(1, 5), groups=st.integers(1, 3))
def test_staleness_never_exceeds_the_bound_and_every_request_arrives_once(seed, max_staleness, interruptible,
                                                                         steps, groups):
    rng = random.Random(seed)
    latencies = {(task, turn): rng.choice([0.0, 0.0005, 0.002, 0.01]) for task in range(100) for turn in range(4)}
    turns = {task: rng.randint(1, 4) for task in range(100)}
    learn_seconds = [rng.choice([0.0, 0.003, 0.015]) for _ in range(steps)]

    def requests_for(step):
        return [GroupRequest(index=(step - 1) * groups + i, task=(step - 1) * groups + i, group_size=2, seed=i)
                for i in range(groups)]

    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(0)
    engine = LocalEngine(requests_for, model=model, tokenizer=ByteTokenizer(),
                         make_env=lambda: LatencyEnv(lambda t, k: latencies[(t, k)], lambda t: turns[t]),
                         sampling=SamplingParams(), rollout=limits(max_turns=4, env_threads=8,
                                                                          interruptible=interruptible),
                         asynchronous=True, max_staleness=max_staleness, act_for=versions_actor)
    results = run_fake_learner(engine, steps, learn_seconds, model)
    for step, rollouts in enumerate(results, start=1):
        trajectories = rollouts.trajectories
        assert [t.task_id for t in trajectories] == [str(r.task) for r in requests_for(step) for _ in range(2)]
        for t in trajectories:
            # The weights that acted are the versions recorded (the fake actor emits its weight).
            assert [tok for tok, m in zip(t.token_ids, t.action_mask) if m] == t.versions
            assert t.versions == sorted(t.versions) and len(t.versions) == turns[int(t.task_id)]
            assert 0 <= (step - 1) - min(t.versions) <= max_staleness
            assert max(t.versions) <= step - 1
            if not interruptible:
                assert len(set(t.versions)) == 1
        assert rollouts.metrics["rollout/staleness_max"] <= max_staleness


def test_staleness_metrics_count_trajectories_and_tokens_per_lag():
    from keelrl.rollout.trajectory import Trajectory

    a = Trajectory("a", 0)
    a.extend([1], action=False, turn=0)
    a.extend([2, 3], action=True, turn=0, logprobs=[0.0, 0.0])
    a.extend([4, 5, 6], action=True, turn=1, logprobs=[0.0] * 3)
    a.versions = [3, 4]
    b = Trajectory("b", 0)
    b.extend([7], action=True, turn=0, logprobs=[0.0])
    b.versions = [5]
    m = staleness_metrics(6, [a, b], max_staleness=2)  # learner version 5
    assert m["rollout/staleness_max"] == 2 and m["rollout/staleness_mean"] == 1.0
    assert m["rollout/staleness_frac_0"] == 0.5 and m["rollout/staleness_frac_2"] == 0.5
    assert m["rollout/token_share_lag_0"] == pytest.approx(1 / 6)
    assert m["rollout/token_share_lag_1"] == pytest.approx(3 / 6)
    assert m["rollout/token_share_lag_2"] == pytest.approx(2 / 6)


FAST = [*FAST_RUN, "eval.tasks=2", "eval.every=10", "train.minibatch_size=2", "output.sample_trajectories=0",
        "train.steps=3"]


class RecordingTrainer(Trainer):
    def rl_step(self, step, rollouts, started=None):
        self.seen = getattr(self, "seen", []) + [[(t.token_ids, t.behaviour_logprobs, t.versions)
                                                 for t in rollouts.trajectories]]
        return super().rl_step(step, rollouts, started)


def test_async_engine_at_zero_staleness_reproduces_the_sync_engine(tiny_model_dir, tmp_path):
    runs = {}
    for engine in ("sync", "async"):
        cfg = load_config(overrides=[*TINY_RUN, f"run_dir={tmp_path / engine}", f"model.path={tiny_model_dir}",
                                     f"rollout.engine={engine}", "rollout.max_staleness=0", *FAST])
        trainer = RecordingTrainer(cfg)
        trainer.run()
        rows = [__import__("json").loads(line) for line in (tmp_path / engine / "metrics.jsonl").read_text().splitlines()]
        runs[engine] = (trainer.seen, rows)
    (sync_seen, sync_rows), (async_seen, async_rows) = runs["sync"], runs["async"]
    assert len(sync_seen) == 3
    for sync_step, async_step in zip(sync_seen, async_seen):
        for (ids, logp, versions), (ids2, logp2, versions2) in zip(sync_step, async_step):
            assert ids == ids2 and versions == versions2
            torch.testing.assert_close(torch.tensor(logp2), torch.tensor(logp), rtol=1e-5, atol=1e-5)
    for want, got in zip(sync_rows, async_rows):
        for key, value in want.items():
            if key.startswith(("time/", "engine/", "memory/")) or not isinstance(value, (int, float)):
                continue  # wall-clock, scheduling counters and process memory differ by design
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_behaviour_logprobs_equal_a_recompute_under_the_weights_that_sampled_them(tiny_model_dir):
    """Weights change every step while episodes are in flight; each turn is checked against its version."""
    from keelrl.envs.coding import CodingEnv
    from keelrl.envs.coding_tasks import bundled_tasks

    model, tokenizer = load_policy(str(tiny_model_dir), "cpu")
    tasks = bundled_tasks(None)[:6]

    def requests_for(step):
        return [GroupRequest(index=(step - 1) * 2 + i, task=tasks[((step - 1) * 2 + i) % len(tasks)], group_size=2, seed=step * 10 + i)
                for i in range(2)]

    engine = LocalEngine(requests_for, model=model, tokenizer=tokenizer,
                         make_env=lambda: CodingEnv(max_turns=3, use_git=False),
                         sampling=SamplingParams(temperature=1.0, max_new_tokens=12),
                         rollout=limits(max_turns=3, env_threads=4), asynchronous=True, max_staleness=1)
    states = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    engine.start(0)
    engine.publish(states[0], 0)
    trajectories = []
    generator = torch.Generator().manual_seed(0)
    for step in range(1, 5):
        rollouts = engine.batch(step)
        trajectories += rollouts.trajectories
        with torch.no_grad():  # a large 'update', so a wrong version would show
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.5)
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}
        engine.publish(states[step], step)
    engine.close()
    checked_versions = set()
    wrong_gaps = []
    for t in trajectories:
        ids = torch.tensor([t.token_ids])
        turn_ids = torch.tensor(t.turn_ids)
        action = torch.tensor(t.action_mask)

        def recompute(version):
            model.load_state_dict(states[version])
            with torch.no_grad():  # the sampled distribution: temperature 1, nothing suppressed
                logits = model(input_ids=ids).logits[0, :-1].float()
                return torch.cat([torch.zeros(1), torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]])

        for version in set(t.versions):
            turns = [turn for turn, v in enumerate(t.versions) if v == version]
            where = action & torch.isin(turn_ids, torch.tensor(turns))
            # The sampler's KV-cache pass and this full pass add in different orders in float32:
            # up to 3e-4 apart on some CPUs (AVX2 kernels) at these large weights. A wrong
            # version is orders of magnitude further off (checked below).
            behaviour = torch.tensor(t.behaviour_logprobs)[where]
            torch.testing.assert_close(behaviour, recompute(version)[where], rtol=0, atol=2e-3)
            wrong_gaps.append(float((behaviour - recompute((version + 1) % len(states))[where]).abs().max()))
            checked_versions.add(version)
    assert min(wrong_gaps) > 2e-2  # the tolerance above still tells every version from its neighbour
    # Step 4's requests cannot start before version 2 (max_staleness 1), step 1's ran under 0.
    assert 0 in checked_versions and max(checked_versions) >= 2


def test_engine_settings_are_validated_by_name():
    with pytest.raises(ConfigError, match="rollout.engine"):
        check(load_config(overrides=["rollout.engine=threads"]))
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_config(overrides=["rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match="behaviour_weight_cap"):
        load_config(overrides=["algo.behaviour_weight_cap=0.5"])


# ------------------------------------------------------------------ the decoupled objective

def _decoupled_reference(logp, prox, mu, adv, mask, eps, cap):
    """Float64 loop: token mean of min(pi_prox/mu, cap) * -min(r A, clip(r) A), r = pi / pi_prox."""
    total, count = 0.0, 0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            r = torch.exp(logp[b, t].double() - prox[b, t].double())
            w = min(float(torch.exp(prox[b, t].double() - mu[b, t].double())), cap)
            a = float(adv[b, t])
            total += w * -min(float(r) * a, min(max(float(r), 1 - eps), 1 + eps) * a)
            count += 1
    return total / count


@pytest.mark.parametrize("seed", range(5))
def test_decoupled_loss_matches_a_float64_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (3, 7)
    mu = -torch.rand(shape, generator=gen) * 3
    prox = mu + torch.randn(shape, generator=gen) * 0.6  # behaviour weights on both sides of the cap
    logp = (prox + torch.randn(shape, generator=gen) * 0.3).requires_grad_(True)
    adv = torch.randn(shape, generator=gen)
    mask = torch.rand(shape, generator=gen) > 0.3
    cfg = AlgoConfig(preset="decoupled", aggregation="token_mean")
    loss, metrics = policy_objective(logp=logp, old_logp=mu, advantages=adv, mask=mask, cfg=cfg, prox_logp=prox)
    expected = _decoupled_reference(logp.detach(), prox, mu, adv, mask, cfg.eps_low, cfg.behaviour_weight_cap)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    raw = torch.exp(prox - mu)[mask]
    assert float(metrics["policy/behaviour_weight_max"]) == pytest.approx(float(raw.max()), rel=1e-5)
    assert float(metrics["policy/behaviour_weight_trunc_frac"]) == pytest.approx(
        float((raw > cfg.behaviour_weight_cap).float().mean()), abs=1e-6)
    loss.backward()
    assert logp.grad is not None and torch.all(logp.grad[~mask] == 0)


def test_decoupled_equals_plain_ppo_when_the_batch_is_fresh():
    gen = torch.Generator().manual_seed(1)
    mu = -torch.rand(2, 5, generator=gen)
    logp = (mu + 0.1 * torch.randn(2, 5, generator=gen)).requires_grad_(True)
    adv, mask = torch.randn(2, 5, generator=gen), torch.ones(2, 5, dtype=torch.bool)
    decoupled, _ = policy_objective(logp=logp, old_logp=mu, advantages=adv, mask=mask,
                                    cfg=AlgoConfig(preset="decoupled"), prox_logp=mu.clone())
    plain, _ = policy_objective(logp=logp, old_logp=mu, advantages=adv, mask=mask,
                                cfg=AlgoConfig(preset="decoupled", decoupled=False))
    assert float(decoupled.detach()) == pytest.approx(float(plain.detach()), rel=1e-6)
    with pytest.raises(ValueError, match="prox_logp"):
        policy_objective(logp=logp, old_logp=mu, advantages=adv, mask=mask, cfg=AlgoConfig(preset="decoupled"))


@pytest.mark.parametrize("max_staleness", [1, 3])
def test_async_engine_never_samples_past_the_last_step(max_staleness):
    asked = []

    def requests_for(step):
        asked.append(step)
        return [GroupRequest(index=step, task=step, group_size=2, seed=step)]

    model = torch.nn.Linear(1, 1)
    engine = LocalEngine(requests_for, model=model, tokenizer=ByteTokenizer(),
                         make_env=lambda: LatencyEnv(lambda t, k: 0.0, lambda t: 1),
                         sampling=SamplingParams(), rollout=limits(max_turns=2),
                         asynchronous=True, max_staleness=max_staleness, act_for=versions_actor)
    engine.last_step = 3
    results = run_fake_learner(engine, 3, [0.0, 0.0, 0.0], model)
    assert [len(r.trajectories) for r in results] == [2, 2, 2]
    assert max(asked) == 3  # nothing was sent ahead for steps 4.. that the run never takes


def test_environment_work_is_handled_in_the_order_it_was_sent():
    """Resets that return in reverse order still queue their episodes in admission order, so the
    next generation batch does not depend on the order a set of finished futures iterates in."""
    import threading
    from concurrent.futures import wait

    from keelrl.rollout.scheduler import EpisodeScheduler

    n = 12
    gates = [threading.Event() for _ in range(n)]

    class GatedEnv(LatencyEnv):
        def reset(self, task):
            assert gates[task].wait(10)
            return super().reset(task)

    scheduler = EpisodeScheduler(lambda: GatedEnv(lambda task, turn: 0.0, lambda task: 1), ByteTokenizer(),
                                 versions_actor(torch.nn.Linear(1, 1)), limits(env_threads=n))
    try:
        scheduler.submit([GroupRequest(index=i, task=i, group_size=1, seed=i) for i in range(n)])
        scheduler._admit()
        for i in reversed(range(n)):  # each reset returns only after the one sent after it
            gates[i].set()
            while not any(future.done() and episode.request.index == i
                          for future, (_, episode) in scheduler._futures.items()):
                time.sleep(0.001)
        wait(list(scheduler._futures))
        scheduler._collect(0.0)
        assert [episode.request.index for episode in scheduler._ready] == list(range(n))
    finally:
        scheduler.close()


def test_lockstep_batches_do_not_depend_on_which_tool_call_returns_first():
    """With EpisodeLimits.lockstep the scheduler generates only when no reset or tool call is
    pending: every batch is all the unfinished episodes, in admission order, through the actor's
    whole-batch call and never its stream. Tool calls that return lowest task first or highest
    task first give the same batches, the ones worked out by hand from the episodes' lengths."""
    from keelrl.rollout.agent_loop import run_episodes

    def turns(task):
        return 2 + task % 3  # tasks 0 and 3: 2 turns; 1 and 4: 3; 2 and 5: 4

    class UnusedStream:
        busy = False

        def submit(self, episodes):
            raise AssertionError("lockstep must not stream")

        def cancel(self):
            pass

    def run(latency):
        batches = []

        def act(active):
            batches.append([(episode.request.task, episode.turn) for episode in active])
            return [([97], [0.0], "a") for _ in active]

        act.stream = UnusedStream()
        trajectories = run_episodes(lambda: LatencyEnv(latency, turns), list(range(6)), ByteTokenizer(), act,
                                    limits(env_threads=6, lockstep=True), seed=0)
        assert [len(t.actions) for t in trajectories] == [turns(task) for task in range(6)]
        return batches

    expected = [[(task, 0) for task in range(6)], [(task, 1) for task in range(6)],
                [(1, 2), (2, 2), (4, 2), (5, 2)], [(2, 3), (5, 3)]]
    assert run(lambda task, turn: 0.01 * task) == expected
    assert run(lambda task, turn: 0.01 * (5 - task)) == expected


def test_lockstep_does_not_wait_for_gradings():
    """A grading starts no turn, so lockstep generates beside one: task 0's grading waits until
    the next batch (task 1's second turn) has been generated, and would time out waiting if
    lockstep held that batch back for it."""
    import threading

    from keelrl.rollout.agent_loop import run_episodes

    acted, seen_by_grade = threading.Event(), []
    batches = []

    class SlowGradeEnv(LatencyEnv):
        def grade(self):
            if self.task == 0:
                seen_by_grade.append(acted.wait(10))
            return super().grade()

    def act(active):
        batches.append([episode.request.task for episode in active])
        if len(batches) == 2:
            acted.set()
        return [([97], [0.0], "a") for _ in active]

    run_episodes(lambda: SlowGradeEnv(lambda task, turn: 0.0, lambda task: 1 + 2 * task), [0, 1], ByteTokenizer(),
                 act, limits(env_threads=2, lockstep=True), seed=0)
    assert batches == [[0, 1], [1], [1]] and seen_by_grade == [True]


def test_lockstep_settings():
    """eval.lockstep is on by default and governs the evaluation whatever rollout.lockstep says;
    rollout.lockstep reaches the training rollouts' limits; the endpoint engine refuses it by name."""
    cfg = load_config(overrides=["rollout.lockstep=true", "eval.lockstep=false"])
    assert load_config().eval.lockstep and not load_config().rollout.lockstep
    from keelrl.rollout.scheduler import EpisodeLimits
    assert EpisodeLimits.of(cfg.rollout, 3).lockstep and not EpisodeLimits.of(load_config().rollout, 3).lockstep
    with pytest.raises(ConfigError, match="rollout.lockstep"):
        load_config(overrides=["rollout.engine=endpoint", "rollout.lockstep=true"])



@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_closed_engine_holds_neither_its_requests_source_nor_its_policy_copy(asynchronous):
    import gc
    import weakref

    class Source:  # stands for the trainer whose method makes the requests
        def requests_for(self, step):
            return [GroupRequest(index=step, task=step, group_size=2, seed=step)]

    source, model = Source(), torch.nn.Linear(1, 1)
    engine = LocalEngine(source.requests_for, model=model, tokenizer=ByteTokenizer(),
                         make_env=lambda: LatencyEnv(lambda t, k: 0.0, lambda t: 1),
                         sampling=SamplingParams(), rollout=limits(max_turns=2),
                         asynchronous=asynchronous, max_staleness=1, act_for=versions_actor)
    engine.last_step = 2
    policy = weakref.ref(engine.model)  # async: the engine's own copy; sync: the learner's model
    assert (engine.model is model) is not asynchronous
    source_ref = weakref.ref(source)
    del source
    gc.collect()
    assert source_ref() is not None  # the open engine needs its source
    results = run_fake_learner(engine, 2, [0.0, 0.0], model)  # ends with engine.close()
    assert [len(r.trajectories) for r in results] == [2, 2]
    gc.collect()
    assert source_ref() is None  # the closed engine, still in a variable, keeps no trainer alive
    assert (policy() is None) is asynchronous  # its own policy copy is gone; the learner's stays the caller's
    engine.close()  # closing twice is closing once
    for use in (lambda: engine.batch(3), lambda: engine.more(3, [GroupRequest(index=9, task=9, group_size=2, seed=9)]),
                lambda: engine.start(3), lambda: engine.publish({}, 3), lambda: engine.publish_model(model, 3)):
        with pytest.raises(RuntimeError, match="closed"):
            use()


def test_a_close_that_fails_still_lets_go_and_is_not_repeated():
    import gc
    import weakref

    class Source:
        def requests_for(self, step):
            return [GroupRequest(index=step, task=step, group_size=2, seed=step)]

    source, model = Source(), torch.nn.Linear(1, 1)
    engine = LocalEngine(source.requests_for, model=model, tokenizer=ByteTokenizer(),
                         make_env=lambda: LatencyEnv(lambda t, k: 0.0, lambda t: 1), sampling=SamplingParams(),
                         rollout=limits(max_turns=2), asynchronous=True, max_staleness=1, act_for=versions_actor)
    engine.start(0)
    calls = []

    def stuck_environments():  # as a user's environment whose close() raises
        calls.append(1)
        raise OSError("the sandbox would not stop")

    engine.scheduler.close = stuck_environments
    source_ref, copy_ref = weakref.ref(source), weakref.ref(engine.model)
    del source
    with pytest.raises(OSError, match="would not stop"):
        engine.close()
    gc.collect()
    assert engine.closed and source_ref() is None and copy_ref() is None  # let go all the same
    engine.close()  # not repeated
    assert calls == [1]
