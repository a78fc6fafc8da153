"""What the endpoint records: calls grouped into episodes by session, episodes as training samples.

A session is one episode of a harness: the calls that carry the same session id (the
`X-Session-Id` header, else the request's `user` field). Each call records its exact prompt
and completion token ids, the completion's behaviour log-probs, and the policy version that
sampled it (`CallRecord`).

Samples. A call whose prompt continues the previous call's context (`keelrl.serve.render`)
extends the session's current sample: its new messages' tokens are laid out as non-action
tokens, its completion as the next turn's action, exactly as keelrl's own agent loop lays out
an episode. A call that does not (the history was rewritten) starts a new sample whose prompt
is the history rendered afresh; every sample keeps the exact tokens sampled in its calls. When
the episode ends, its reward (the credit of the whole episode) is carried to every sample: each
`Trajectory` names its episode (`episode`) and its place among the episode's samples, and the
learner counts the episode once in its group's baseline (keelrl.train.advantage).

An episode that ends without a reward (its harness went away, or ended it) is kept, marked
`unfinished`, with reward NaN: saved with the run's episodes, never trained on. A call still
decoding when its episode ends (the harness gave up waiting and sent the reward) is recorded
among the session's calls, marked `late`, and in no sample: the reward was given for the episode
without it.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from keelrl.rollout.trajectory import Trajectory
from keelrl.serve.render import Rendered, Reply

UNFINISHED = "unfinished"


@dataclass
class CallRecord:
    """One chat call as sampled."""

    sample: int
    """Which of the session's samples the call's completion belongs to."""
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str
    continued: bool
    """The prompt continued the previous call's context (no new sample)."""
    late: bool = False
    """Sampled after its episode had ended (its reward came while the call was decoding): recorded,
    but in no sample, since the episode the reward was given for did not include it."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Session:
    """One episode of a harness (see the module docstring)."""

    id: str
    generator: torch.Generator
    task_id: str = ""
    group_id: int = -1
    group: str = ""
    """The group a harness files the episode under (the reward route's "group": e.g. its task), for
    a trainer that groups a harness's own episodes."""
    ticket: Any = None
    """The episode ticket an engine handed out for it (keelrl.serve.engine), if any."""
    env: Any = None
    """The environment, for an episode whose tools keelrl runs (`/keel/v1/episodes`)."""
    first_observation: str = ""
    """That environment's first observation (the episode's first user message)."""
    calls: list[CallRecord] = field(default_factory=list)
    samples: list[Trajectory] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    previous_text: str = ""
    previous_context: list[int] = field(default_factory=list)
    last_text: str = ""
    """The latest completion's text as sampled (what an environment's step takes)."""
    stepped: bool = True
    """The latest completion has been stepped in the environment (or there is none)."""
    kv: Any = None
    finished: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards the recording (the decode loop's thread and the HTTP handlers both write it)."""
    call_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One chat call of the session at a time (held by the HTTP handler on the event loop)."""

    # ------------------------------------------------------------------ recording
    def record(self, rendered: Rendered, reply: Reply, logprobs: list[float], version: int, finish_reason: str,
               observation: str, action_text: str) -> CallRecord:
        """Record one call's completion (see the module docstring); `observation`: the text of the
        messages that continued the previous sample, for the transcript; `action_text`: the
        completion's text as the decoder gave it (special tokens kept), the turn's action."""
        self.last_seen = time.monotonic()
        starts_sample = not rendered.continues or not self.samples
        if self.finished:
            where = -1
        else:
            where = len(self.samples) if starts_sample else len(self.samples) - 1
        call = CallRecord(sample=where, prompt_ids=list(rendered.token_ids), completion_ids=list(reply.token_ids),
                          logprobs=list(logprobs), version=version, finish_reason=finish_reason,
                          continued=rendered.continues, late=self.finished)
        self.calls.append(call)
        if call.late:
            return call
        if starts_sample:
            sample = Trajectory(task_id=self.task_id or self.id, group_id=self.group_id)
            sample.extend(rendered.token_ids, action=False, turn=0)
            sample.prompt_length, sample.prompt = len(rendered.token_ids), rendered.text
            sample.episode, sample.sample = self.id, len(self.samples)
            self.samples.append(sample)
        else:
            sample = self.samples[-1]
            previous_turn = len(sample.actions) - 1
            if len(sample.observations) <= previous_turn:  # a harness's own tools: the messages are the observation
                sample.observations.append(observation)
            sample.extend(rendered.new_tokens, action=False, turn=previous_turn)
        turn = len(sample.actions)
        sample.extend(list(reply.token_ids), action=True, turn=turn, logprobs=logprobs)
        sample.actions.append(action_text)
        sample.versions.append(version)
        self.replies.append(reply)
        self.previous_text = rendered.text
        self.previous_context = list(rendered.token_ids) + list(reply.token_ids)
        return call

    def observe(self, observation: str, info: dict[str, Any]) -> None:
        """The environment's answer to the latest completion (an episode whose tools keelrl runs)."""
        if self.finished:
            return
        sample = self.samples[-1]
        sample.observations.append(observation)
        sample.turn_info.append({k: v for k, v in info.items() if isinstance(v, (str, int, float, bool))})
        if info.get("error"):
            sample.action_errors += 1
        self.stepped = True
        self.last_seen = time.monotonic()

    @property
    def turns(self) -> int:
        return len(self.calls)

    def finish(self, reward: float, *, success: bool | None = None, partial: float | None = None,
               termination: str = "submitted", checks: list[dict[str, Any]] | None = None, error: str = "") -> bool:
        """End the episode: its reward is carried to every sample. False (and nothing changes) when it
        had already ended."""
        if self.finished:
            return False
        self.finished = True
        for sample in self.samples:
            sample.reward = float(reward)
            sample.success = bool(reward >= 1.0) if success is None else bool(success)
            sample.partial = float(reward) if partial is None else float(partial)
            sample.termination, sample.error = termination, error
            sample.checks = list(checks or [])
            sample.samples = len(self.samples)
            sample.seconds = {"total": time.monotonic() - self.started}
        self.kv = None
        if self.env is not None and hasattr(self.env, "close"):
            self.env.close()
        return True

    def abandon(self, why: str) -> bool:
        """End the episode without a reward: kept, marked unfinished, reward NaN (never trained on).
        False when it had already ended."""
        return self.finish(math.nan, success=False, partial=math.nan, termination=UNFINISHED, error=why)

    def trajectories(self) -> list[Trajectory]:
        """The episode's samples; an episode that made no call yet is one empty sample."""
        if self.samples:
            return list(self.samples)
        empty = Trajectory(task_id=self.task_id or self.id, group_id=self.group_id)
        empty.episode, empty.sample = self.id, 0
        empty.reward = empty.partial = math.nan
        empty.termination = UNFINISHED
        empty.error = ("no completion of this episode was sampled before it ended" if self.finished
                       else "the harness made no call in this episode")
        return [empty]
