"""How the endpoint's decode loop and engine fail: loudly, losing nothing (keelrl.serve.service, engine)."""

from __future__ import annotations

import threading

import pytest
import torch

from keelrl.algos.config import AlgoConfig
from keelrl.algos.advantages import outcome_to_token_rewards
from keelrl.inference import Sample, SamplingParams
from keelrl.serve.render import RequestError
from keelrl.serve.service import DecodeLoop, Job
from keelrl.train.advantage import episode_advantages


class _FailingDecoder:
    """A streaming decoder whose submit raises (out of memory, a KV budget), or raises `error`."""

    def __init__(self, error: BaseException) -> None:
        self.error, self.in_flight = error, 0

    def submit(self, *args, **kwargs):
        raise self.error

    def step(self):
        return []


def _loop(error: BaseException) -> DecodeLoop:
    """The real DecodeLoop's state over `_FailingDecoder`, built without a model."""
    loop = DecodeLoop.__new__(DecodeLoop)
    loop.model, loop.decoder, loop.streaming, loop._stream = None, _FailingDecoder(error), True, None
    loop._stream = loop.decoder
    loop.version, loop._cv = 0, threading.Condition()
    from collections import deque
    loop._waiting, loop._tickets, loop._weights, loop._stop, loop.error = deque(), {}, None, False, None
    loop.stats = {"jobs": 0, "steps": 0, "busy_s": 0.0, "weight_loads": 0, "completion_tokens": 0}
    loop._driver, loop._handover, loop._thread = threading.Lock(), threading.Event(), None
    return loop


def _job(failures: list[BaseException], done: list[Sample]) -> Job:
    params = SamplingParams(stop=(), max_new_tokens=4)
    return Job(context=[1, 2, 3], params=params, uniforms=torch.rand(4), done=lambda s, v: done.append(s),
               failed=failures.append)


def test_a_batch_the_decoder_refuses_fails_its_callers_instead_of_losing_them():
    loop = _loop(MemoryError("kv budget"))
    failures: list[BaseException] = []
    done: list[Sample] = []
    loop.submit(_job(failures, done))
    loop.submit(_job(failures, done))
    with pytest.raises(RuntimeError, match="decode loop failed"):
        loop.run(until=lambda: False)
    assert len(failures) == 2 and all(isinstance(f, MemoryError) for f in failures) and not done
    with pytest.raises(RuntimeError, match="decode loop failed"):
        loop.submit(_job(failures, done))  # a failed loop takes no more work


def test_ctrl_c_in_the_loop_reaches_the_caller_as_itself_and_fails_the_waiting_calls():
    loop = _loop(KeyboardInterrupt())
    failures: list[BaseException] = []
    loop.submit(_job(failures, []))
    with pytest.raises(KeyboardInterrupt):
        loop.run(until=lambda: False)
    assert len(failures) == 1 and loop.error is None  # not a failure of the loop: keel serve exits cleanly


def test_episode_advantages_take_a_split_episodes_outcome_from_its_last_sample():
    # Episode A in two samples whose length-shaped outcomes differ (0.9 then 0.8), episode B one sample (0.0):
    # A scores 0.8 (its last sample's), B 0.0; dr_grpo: A +0.4, B -0.4, on every action token of each sample.
    mask = torch.tensor([[False, True], [False, True], [False, True]])
    rewards = torch.tensor([0.9, 0.8, 0.0], dtype=torch.float64)
    token_rewards = outcome_to_token_rewards(rewards, mask)
    for order in ([0, 1, 2], [2, 0, 1]):  # samples keep their order (0.9 before 0.8) wherever B sits
        picked = torch.tensor(order)
        episodes = torch.tensor([0, 0, 1])[picked]
        out = episode_advantages(token_rewards[picked], mask[picked], rewards[picked], torch.zeros(3, dtype=torch.long),
                                 episodes, AlgoConfig(advantage="dr_grpo"))
        by_row = {int(o): float(out.advantages[i, 1]) for i, o in enumerate(order)}
        assert by_row[0] == pytest.approx(0.4) and by_row[1] == pytest.approx(0.4) and by_row[2] == pytest.approx(-0.4)


def test_the_engine_answers_503_before_it_closes_and_410_after(tmp_path):
    from keelrl.serve.engine import EndpointEngine

    engine = EndpointEngine.__new__(EndpointEngine)
    engine._cv, engine.closed, engine._tickets = threading.Condition(), False, __import__("collections").deque()
    engine._last_activity = 0.0
    engine.endpoint = type("E", (), {"loop": type("L", (), {"version": 0})()})()
    assert engine.claim() is None  # nothing ready: the route answers 503 (ask again), never 410 early
    engine.closed = True
    with pytest.raises(RequestError) as refused:
        engine.claim()
    assert refused.value.status == 410 and refused.value.code == "run_over"
