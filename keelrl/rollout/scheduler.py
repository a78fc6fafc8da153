"""The episode scheduler: many groups of episodes in flight, each advancing on its own.

One scheduler drives one policy copy. Work arrives as `GroupRequest`s (a task, G attempts, a
seed, and the oldest policy version allowed to start it). Each call of `run_once`:

1. admits waiting requests whose `min_version` the held weights satisfy (in request order);
2. collects finished environment work (resets, tool calls, gradings run in a thread pool), in
   the order it was sent, whatever order it finished in;
3. generates the next action of every episode that is waiting for one, in one batch, tagging
   the turn with the version of the weights that produced it; with a streaming actor
   (`act.stream`, keelrl's own decoder) it adds those episodes to the batch being decoded and
   runs one decode step, so an episode that becomes ready joins at the next token instead of
   waiting for a whole batch to finish, and a finished action goes to its environment at once
   (with `lockstep`: only once no reset or tool call is pending, and never through the stream);
4. hands back every group whose G episodes are all graded.

An episode waiting on a slow tool call never holds up the others: the next generation batch
takes whoever is ready. Sampling randomness is per episode (a generator seeded from the
request's seed and the attempt number), so an episode's tokens depend on its task, its seed and
the weights of each turn, not on which episodes happened to share a batch: a request run
alone, in a synchronous step or in an asynchronous engine gives the same trajectory when the
weights are the same, up to floating-point rounding. The rounding is the exception: a row's
logits are rounded differently beside other rows (a decode step's matmul shapes, a prefill's
chunking), and in bfloat16 that flips a near-tie now and then, so which tool call returned first
can change an episode's tokens. `EpisodeLimits.lockstep` takes timing out of the batches: it
generates only when no reset or tool call is pending, every waiting episode at once in admission
order, so the same requests and weights give the same tokens every time on one machine.

Environment failures. An environment whose `reset` or `step` raises (or returns something other
than the protocol's str / (str, bool, dict)) ends that episode alone, ungraded: termination
'env_error', the error and where it was raised in `Trajectory.error`, reward and partial NaN
(never a made-up 0 that would become training signal); the other episodes go on. A `grade` that
raises stops the run: the verifier failed, and no reward is made up for it.

Weights: before each generation batch the scheduler calls `refresh()`, which loads the newest
published weights, if any, and returns the version now held ("interruptible": an episode in
flight continues under the new weights, each turn recording its version). A streaming actor
loads them only when nothing is decoding: while newer weights wait, ready episodes are held
until the batch drains (at most one action's tokens), so no action mixes two versions. With
`interruptible=False` new weights are loaded only when no episode is in flight, and no request
is admitted while newer weights wait, so every episode finishes under the weights it began with.
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from keelrl.config import RolloutSettings
from keelrl.envs.formats import prompt_tools
from keelrl.policy.chat import ChatFormat
from keelrl.rollout.trajectory import Trajectory


@dataclass(frozen=True)
class GroupRequest:
    """G attempts at one task, started no earlier than policy version `min_version`."""

    index: int
    """Position in the request stream (batches are runs of consecutive indices)."""
    task: Any
    group_size: int
    seed: int
    """Episode a of the group samples from a generator seeded with (seed, a)."""
    group_id: int = -1
    """Group id written into the trajectories (the index when negative)."""
    min_version: int = 0


@dataclass
class GroupResult:
    """A finished group: its request and its G trajectories in attempt order."""

    request: GroupRequest
    trajectories: list[Trajectory]


@dataclass(frozen=True)
class EpisodeLimits:
    """What the scheduler enforces on every episode. No defaults of its own: a run's come from its
    config's rollout section and env.max_turns (`of`)."""

    max_turns: int
    """Turns per episode (env.max_turns)."""
    max_context_tokens: int
    """An episode whose context would exceed this ends with termination 'context_limit'."""
    max_new_tokens: int
    """Room kept for the next action (the sampler's `max_new_tokens`): an episode stops
    ('context_limit') before a turn that could push its context past `max_context_tokens`,
    never truncating anything."""
    env_threads: int
    """Threads running environment work (resets, tool calls, gradings)."""
    interruptible: bool
    """Load new weights between any two turns (False: only when no episode is in flight)."""
    label_steps: bool
    """Process labels: grade the hidden checks after every turn that can change the code, and
    label each such turn 1 when it raised the pass count, 0 when not (`Trajectory.step_labels`)."""
    lockstep: bool
    """Generate only when no reset or tool call is pending (gradings, which start no turn, may
    still run): every waiting episode at once, in admission order, through the actor's
    whole-batch call (never its stream). The decoder's batches are then a function of the
    requests admitted and what their environments returned, not of which tool call finished
    first, so a greedy evaluation gives the same tokens every time on one machine (in bfloat16 a
    row's rounding depends on the rows it shares a step with). Costs the overlap of tool calls
    with decoding: every episode waits for the slowest call of the round (a hung one, for its
    timeout)."""

    @classmethod
    def of(cls, rollout: RolloutSettings, max_turns: int, label_steps: bool = False) -> "EpisodeLimits":
        """The limits of the config's rollout section (rollout.lockstep among them), with
        `max_turns` turns per episode (env.max_turns) and process labels when `label_steps`
        (prm.enabled)."""
        return cls(max_turns=max_turns, max_context_tokens=rollout.max_context_tokens,
                   max_new_tokens=rollout.max_new_tokens, env_threads=rollout.env_threads,
                   interruptible=rollout.interruptible, label_steps=label_steps, lockstep=rollout.lockstep)


def prompt_tokens(tokenizer: Any, first_observation: str, *, tools: list[dict[str, Any]] | None = None,
                  system: str | None = None) -> list[int]:
    """The first observation as the first user message of the tokenizer's chat template, with
    `tools` (schemas) and `system` as `ChatFormat.prompt` takes them."""
    return ChatFormat.of(tokenizer).prompt(tokenizer, first_observation, tools=tools, system=system)


def env_prompt_tokens(tokenizer: Any, env: Any, first_observation: str) -> list[int]:
    """The first prompt of an episode of `env`: its first observation, with its tools where the
    environment shows them (`keelrl.envs.formats.prompt_tools`: env.show_tools, env.tools,
    env.tool_format). An environment without those attributes gets the observation alone."""
    shown = prompt_tools(env)
    if shown is None:
        return prompt_tokens(tokenizer, first_observation)
    return prompt_tokens(tokenizer, first_observation, tools=shown.schemas, system=shown.description)


def observation_tokens(tokenizer: Any, observation: str, previous_action: Sequence[int] = ()) -> list[int]:
    """An observation in the tokenizer's chat template, after an action whose tokens were
    `previous_action` (one that ended on the end-of-turn token does not get a second one)."""
    chat = ChatFormat.of(tokenizer)
    ended = bool(previous_action) and previous_action[-1] in chat.end_token_ids
    return chat.observation(tokenizer, observation, action_end=previous_action[-1] if ended else None)


def episode_generator(seed: int, attempt: int) -> torch.Generator:
    """The sampling generator of attempt `attempt` of a request with seed `seed`."""
    return torch.Generator().manual_seed((seed * 1_000_003 + attempt) % (2**63 - 1))


@dataclass
class EpisodeInFlight:
    """One episode in flight (what an `ActFn` sees); a finished one is its `Trajectory`
    (`keelrl.envs.base.Episode` is the text-level record of `run_episode`)."""

    index: int
    """Position among all episodes this scheduler has admitted (scripted actors key on it)."""
    request: GroupRequest
    attempt: int
    env: Any
    trajectory: Trajectory
    generator: torch.Generator
    turn: int = 0
    reserved: int = 1 << 30
    """Tokens the scheduler reserved for this episode's next action (`EpisodeLimits.max_new_tokens`)."""
    last_action: list[int] = field(default_factory=list)
    """Token ids of the latest action (its observation is laid out after it)."""
    started: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: {"generate": 0.0, "env": 0.0, "grade": 0.0})
    passes: list[int] = field(default_factory=list)
    """With label_steps: the hidden checks passed before the first turn, then after each turn."""
    acting: list[bool] = field(default_factory=list)
    """With label_steps: whether each turn could change the code (it gets a label)."""
    kv: Any = None
    """With SamplingParams.keep_kv: the episode's keys and values after its last turn (a RowCache),
    valid while the weights are those of `kv_version`."""
    kv_version: int = -1
    recomputed: int = 0
    """Context tokens the sampler ran for this episode (prefills), over all its turns."""
    recomputed_counted: int = 0
    """Of `recomputed`, what the scheduler's stats have counted (streaming actors)."""
    submitted: float = 0.0
    """When its current action was submitted to a streaming actor."""

    @property
    def task(self) -> Any:
        return self.request.task


ActFn = Callable[[Sequence[EpisodeInFlight]], list[tuple[list[int], list[float], str]]]
"""Given the episodes waiting for an action, return (token ids, behaviour log-probs, text) for each."""


@dataclass
class SchedulerStats:
    """Counters since the last `take_stats`."""

    generate_s: float = 0.0
    """Time spent generating actions."""
    idle_s: float = 0.0
    """Time with nothing to generate (waiting on tools, gradings, admission or requests; in
    lockstep also while ready episodes wait for the others' resets and tool calls)."""
    in_flight_sum: float = 0.0
    """Episodes in flight, summed over scheduling rounds (`rounds`)."""
    in_flight_max: int = 0
    rounds: int = 0
    batches: int = 0
    """Generation batches (a streaming actor: submissions to the batch being decoded)."""
    tokens_by_version: dict[int, int] = field(default_factory=dict)
    admitted: int = 0
    prefill_tokens: int = 0
    """Context tokens the sampler ran (prefills; with keep_kv only what no cache covered)."""


class WeightSlot:
    """New weights for a rollout side's decoder, handed across threads.

    The learner's side `offer`s a (merged) state dict and its version; the rollout thread calls
    `refresh` between generation batches, which hands the newest offer to `load` (the decoder's
    `load_weights(state, version)`, keelrl.inference.weights) and returns the version now held.
    Only the newest offer is kept.
    """

    def __init__(self, load: Callable[[Any, int], None], version: int = 0) -> None:
        self.load = load
        self.held = version
        self._lock = threading.Lock()
        self._pending: tuple[dict[str, Any], int] | None = None

    @classmethod
    def for_actor(cls, act: Any, model: Any, version: int = 0) -> "WeightSlot":
        """The slot of an actor: its decoder's `load_weights` (`act.decoder`, as `model_actor` makes
        it), else loading the state into `model` (an actor that reads the model itself)."""
        decoder = getattr(act, "decoder", None)
        if decoder is not None:
            return cls(decoder.load_weights, version)
        return cls(lambda state, _: model.load_state_dict(state), version)

    def offer(self, state: dict[str, Any], version: int) -> None:
        with self._lock:
            if self._pending is None or version > self._pending[1]:
                self._pending = (state, version)

    def has_newer(self) -> bool:
        with self._lock:
            return self._pending is not None

    def refresh(self) -> int:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            state, version = pending
            self.load(state, version)
            self.held = version
        return self.held


class EpisodeScheduler:
    """Runs `GroupRequest`s to completion with continuous batching (see the module docstring)."""

    def __init__(self, make_env: Callable[[], Any], tokenizer: Any, act: ActFn, cfg: EpisodeLimits,
                 refresh: Callable[[], int] | None = None, has_newer: Callable[[], bool] | None = None) -> None:
        self.make_env, self.tokenizer, self.act, self.cfg = make_env, tokenizer, act, cfg
        self.stream: Any = getattr(act, "stream", None)
        """The actor's `ActionStream` when it has one: episodes join the batch being decoded."""
        self.version: int = 0
        self.refresh = refresh or (lambda: self.version)
        self.has_newer = has_newer or (lambda: False)
        self.version = self.refresh()
        self.pool = ThreadPoolExecutor(max_workers=max(1, cfg.env_threads), thread_name_prefix="keel-env")
        self._incoming: deque[GroupRequest] = deque()
        self._lock = threading.Lock()
        self._waiting: deque[GroupRequest] = deque()
        self._ready: list[EpisodeInFlight] = []
        self._futures: dict[Future[Any], tuple[str, EpisodeInFlight]] = {}
        self._groups: dict[int, list[EpisodeInFlight]] = {}
        self._done: dict[int, list[EpisodeInFlight]] = {}
        self._episodes_admitted = 0
        self._base_passes: dict[str, int] = {}
        """label_steps: each task's pass count before any turn (the same for every attempt)."""
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ intake
    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """Queue requests (thread-safe); they start in order once their min_version holds."""
        with self._lock:
            self._incoming.extend(requests)

    @property
    def in_flight(self) -> int:
        """Episodes admitted and not yet graded."""
        return sum(len(episodes) for episodes in self._groups.values())

    @property
    def stalled(self) -> bool:
        """True when nothing is in flight and no queued request may start under the held weights."""
        with self._lock:
            incoming = bool(self._incoming)
        blocked = not self._waiting or self._waiting[0].min_version > self.version
        return not incoming and blocked and not self._groups

    def take_stats(self) -> SchedulerStats:
        stats, self.stats = self.stats, SchedulerStats()
        return stats

    def close(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        for future, (_, episode) in list(self._futures.items()):
            future.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)
        for episodes in self._groups.values():
            for episode in episodes:
                if hasattr(episode.env, "close"):
                    episode.env.close()

    # ------------------------------------------------------------------ the loop
    def _admit(self) -> None:
        with self._lock:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
        if self.cfg.interruptible:
            if self._waiting and self._waiting[0].min_version > self.version and not self._decoding():
                self.version = self.refresh()  # nothing may be generating: new weights must still admit
        elif self.has_newer():
            if not self._groups:
                self.version = self.refresh()
            else:
                return  # finish the episodes in flight under the weights they began with
        while self._waiting and self._waiting[0].min_version <= self.version:
            request = self._waiting.popleft()
            self._groups[request.index] = []
            self.stats.admitted += 1
            for attempt in range(request.group_size):
                trajectory = Trajectory(task_id=str(getattr(request.task, "id", request.task)),
                                        group_id=request.group_id if request.group_id >= 0 else request.index)
                episode = EpisodeInFlight(index=self._episodes_admitted, request=request, attempt=attempt,
                                          env=self.make_env(), trajectory=trajectory,
                                          generator=episode_generator(request.seed, attempt), started=time.monotonic(),
                                          reserved=self.cfg.max_new_tokens)
                self._episodes_admitted += 1
                self._groups[request.index].append(episode)
                reset = _reset_counted if self.cfg.label_steps else _reset
                self._futures[self.pool.submit(self._timed, reset, episode.env, request.task,
                                               self._base_passes)] = ("reset", episode)

    def _decoding(self) -> bool:
        """A streaming actor has rows in flight (weights may not change under them)."""
        return self.stream is not None and self.stream.busy

    @staticmethod
    def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        tick = time.monotonic()
        return fn(*args), time.monotonic() - tick

    def _collect(self, timeout: float) -> list[GroupResult]:
        """Handle finished environment work (waiting up to `timeout` s for some); returns finished groups."""
        if not self._futures:
            if timeout > 0:
                time.sleep(timeout)
            return []
        done, _ = wait(list(self._futures), timeout=timeout, return_when=FIRST_COMPLETED)
        finished = [future for future in self._futures if future in done]  # in the order sent, not set order
        results = []
        for future in finished:
            kind, episode = self._futures.pop(future)
            try:
                value, seconds = future.result()
            except Exception as error:  # noqa: BLE001 - recorded in the trajectory, not swallowed
                if kind == "grade":
                    raise  # the verifier failed (VerifierError): the run reports it, no reward is made up
                result = self._env_failed(episode, kind, error)
                if result is not None:
                    results.append(result)
                continue
            trajectory = episode.trajectory
            if kind == "reset":
                episode.seconds["env"] += seconds
                if self.cfg.label_steps:
                    value, base = value
                    episode.passes.append(base)
                trajectory.extend(env_prompt_tokens(self.tokenizer, episode.env, value), action=False, turn=0)
                trajectory.prompt_length, trajectory.prompt = len(trajectory.token_ids), value
                if trajectory.prompt_length + self.cfg.max_new_tokens > self.cfg.max_context_tokens:
                    trajectory.termination = "context_limit"  # not even one action fits: graded as is
                    self._futures[self.pool.submit(self._timed, episode.env.grade)] = ("grade", episode)
                else:
                    self._ready.append(episode)
            elif kind == "step":
                episode.seconds["env"] += seconds
                self._after_step(episode, *value)
            else:  # grade
                episode.seconds["grade"] += seconds
                result = self._after_grade(episode, value)
                if result is not None:
                    results.append(result)
        return results

    def _after_step(self, episode: EpisodeInFlight, observation: str, done: bool, info: dict[str, Any],
                    passes: int | None = None) -> None:
        trajectory = episode.trajectory
        if self.cfg.label_steps:  # a turn that was not graded left the pass count where it was
            episode.passes.append(episode.passes[-1] if passes is None else passes)
            episode.acting.append(info.get("tool") not in getattr(episode.env, "read_only_tools", ()))
        trajectory.observations.append(observation)
        trajectory.turn_info.append({key: value for key, value in info.items()
                                     if isinstance(value, (str, int, float, bool))})
        if info.get("error"):
            trajectory.action_errors += 1
        turn = episode.turn
        episode.turn += 1
        if done:
            trajectory.termination = info.get("termination", "submitted")
        else:
            tokens = observation_tokens(self.tokenizer, observation, episode.last_action)
            if len(trajectory.token_ids) + len(tokens) + self.cfg.max_new_tokens > self.cfg.max_context_tokens:
                trajectory.termination = "context_limit"
            elif episode.turn >= self.cfg.max_turns:
                trajectory.extend(tokens, action=False, turn=turn)
                trajectory.termination = "max_turns"
            else:
                trajectory.extend(tokens, action=False, turn=turn)
                self._ready.append(episode)
                return
        self._futures[self.pool.submit(self._timed, episode.env.grade)] = ("grade", episode)

    def _after_grade(self, episode: EpisodeInFlight, grade: Any) -> GroupResult | None:
        trajectory = episode.trajectory
        trajectory.reward, trajectory.success, trajectory.partial = grade.reward, grade.success, grade.partial
        trajectory.checks = [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in grade.checks]
        if self.cfg.label_steps and episode.acting:
            episode.passes[-1] = grade.passed  # the final grade is the state after the last turn
            trajectory.step_passes = list(episode.passes)
            trajectory.step_labels = step_labels(episode.passes, episode.acting)
        return self._finish(episode)

    def _env_failed(self, episode: EpisodeInFlight, kind: str, error: Exception) -> GroupResult | None:
        """The env's reset or step raised: the episode ends here, ungraded (its env state is unknown)."""
        trajectory = episode.trajectory
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        where = f" (at {frame.filename}:{frame.lineno} in {frame.name})" if frame else ""
        trajectory.termination = "env_error"
        trajectory.error = f"env.{kind} raised {type(error).__name__}: {error}{where}"
        trajectory.reward = trajectory.partial = math.nan
        trajectory.success = False
        return self._finish(episode)

    def _finish(self, episode: EpisodeInFlight) -> GroupResult | None:
        """Close a graded (or failed) episode; returns its group once all G episodes are done."""
        trajectory = episode.trajectory
        trajectory.seconds = {"total": time.monotonic() - episode.started, **episode.seconds}
        if hasattr(episode.env, "close"):
            episode.env.close()
        episode.kv = None  # the episode is over: its keys and values are not needed again
        index = episode.request.index
        done = self._done.setdefault(index, [])
        done.append(episode)
        if len(done) < episode.request.group_size:
            return None
        del self._done[index], self._groups[index]
        done.sort(key=lambda e: e.attempt)
        return GroupResult(episode.request, [e.trajectory for e in done])

    def _generate(self) -> None:
        if self.cfg.interruptible:
            self.version = self.refresh()
        batch, self._ready = self._ready, []
        self._drop_stale_kv(batch)
        before = sum(episode.recomputed for episode in batch)
        tick = time.monotonic()
        actions = self.act(batch)
        self.stats.prefill_tokens += sum(episode.recomputed for episode in batch) - before
        for episode in batch:
            episode.kv_version = self.version
        seconds = time.monotonic() - tick
        self.stats.generate_s += seconds
        self.stats.batches += 1
        for episode, (tokens, logprobs, text) in zip(batch, actions):
            episode.seconds["generate"] += seconds
            self._acted(episode, tokens, logprobs, text, self.version)

    def _drop_stale_kv(self, batch: Sequence[EpisodeInFlight]) -> None:
        for episode in batch:  # keys and values made under other weights are not this policy's
            if episode.kv is not None and episode.kv_version != self.version:
                episode.kv = None

    def _acted(self, episode: EpisodeInFlight, tokens: list[int], logprobs: list[float], text: str,
               version: int) -> None:
        """Record an episode's new action (made under weights `version`) and send it to its env."""
        trajectory = episode.trajectory
        trajectory.extend(tokens, action=True, turn=episode.turn, logprobs=logprobs)
        episode.last_action = list(tokens)
        trajectory.actions.append(text)
        trajectory.versions.append(version)
        counts = self.stats.tokens_by_version
        counts[version] = counts.get(version, 0) + len(tokens)
        step = _step_counted if self.cfg.label_steps else _step
        self._futures[self.pool.submit(self._timed, step, episode.env, text)] = ("step", episode)

    def _stream_round(self) -> None:
        """Streaming actor: add the ready episodes to the decoder's batch, run one decode step and
        send the finished actions on. Weights are loaded only while nothing decodes; while newer
        weights wait (interruptible), ready episodes are held until the decoder drains, so every
        action is made under one version."""
        stream = self.stream
        assert stream is not None
        if self._ready:
            if not stream.busy:
                if self.cfg.interruptible:
                    self.version = self.refresh()
                submit = True
            else:
                submit = not (self.cfg.interruptible and self.has_newer())
            if submit:
                batch, self._ready = self._ready, []
                self._drop_stale_kv(batch)
                now = time.monotonic()
                for episode in batch:
                    episode.kv_version = self.version
                    episode.submitted = now
                stream.submit(batch)
                self.stats.batches += 1
        if stream.busy:
            tick = time.monotonic()
            finished = stream.step()
            now = time.monotonic()
            self.stats.generate_s += now - tick
            for episode, (tokens, logprobs, text) in finished:
                episode.seconds["generate"] += now - episode.submitted
                self.stats.prefill_tokens += episode.recomputed - episode.recomputed_counted
                episode.recomputed_counted = episode.recomputed
                self._acted(episode, tokens, logprobs, text, episode.kv_version)

    def run_once(self, timeout: float = 0.05) -> list[GroupResult]:
        """One scheduling round (see the module docstring); waits up to `timeout` s when nothing is ready."""
        self._admit()
        in_flight = self.in_flight
        self.stats.in_flight_sum += in_flight
        self.stats.rounds += 1
        self.stats.in_flight_max = max(self.stats.in_flight_max, in_flight)
        if self.cfg.lockstep:
            if self._ready and all(kind == "grade" for kind, _ in self._futures.values()):
                self._ready.sort(key=lambda episode: episode.index)
                self._generate()
                return []
        elif self.stream is not None and (self._ready or self.stream.busy):
            results = self._collect(0.0)
            self._stream_round()
            return results
        elif self.stream is None and self._ready:
            results = self._collect(0.0)
            self._generate()
            return results
        tick = time.monotonic()
        results = self._collect(timeout)
        self.stats.idle_s += time.monotonic() - tick
        return results

    def run(self, requests: Sequence[GroupRequest]) -> list[GroupResult]:
        """Run `requests` to completion in this thread; results in request order."""
        self.submit(requests)
        results: dict[int, GroupResult] = {}
        while len(results) < len(requests):
            for result in self.run_once():
                results[result.request.index] = result
            if len(results) < len(requests) and self.stalled:
                self.version = self.refresh()
                if self.stalled:
                    missing = [r.index for r in requests if r.index not in results]
                    raise RuntimeError(f"requests {missing[:5]} cannot start: their min_version is above the "
                                       f"held weights' version {self.version}")
        return [results[r.index] for r in requests]


def step_labels(passes: Sequence[int], acting: Sequence[bool]) -> list[int]:
    """Process labels from pass counts: passes[0] before the first turn, passes[t + 1] after
    turn t. A turn that could change the code (`acting[t]`) is labelled 1 when it raised the
    count and 0 when not; the others (reads, test runs) -1, no label."""
    if len(passes) != len(acting) + 1:
        raise ValueError(f"need one pass count before the turns and one after each: "
                         f"{len(passes)} counts for {len(acting)} turns")
    return [int(after > before) if act else -1 for before, after, act in zip(passes, passes[1:], acting)]


def _reset(env: Any, task: Any, base_passes: dict[str, int] | None = None) -> str:
    """env.reset(task), checked against the protocol (a wrong return type is the env's failure)."""
    prompt = env.reset(task)
    if not isinstance(prompt, str):
        raise TypeError(f"reset must return the first observation as a str, got {type(prompt).__name__}")
    return prompt


def _reset_counted(env: Any, task: Any, base_passes: dict[str, int]) -> tuple[str, int]:
    """`_reset`, and the hidden checks the untouched task passes (graded once per task id)."""
    prompt = _reset(env, task)
    key = str(getattr(task, "id", task))
    if key not in base_passes:
        base_passes[key] = env.grade().passed
    return prompt, base_passes[key]


def _step_counted(env: Any, action: str) -> tuple[str, bool, dict[str, Any], int | None]:
    """`_step`, and the hidden checks passed after it when the turn could have changed the
    code and the episode goes on (the final grade counts the last turn); otherwise None."""
    observation, done, info = _step(env, action)
    acted = not info.get("error") and info.get("tool") not in getattr(env, "read_only_tools", ())
    return observation, done, info, env.grade().passed if acted and not done else None


def _step(env: Any, action: str) -> tuple[str, bool, dict[str, Any]]:
    """env.step(action), checked against the protocol: (observation str, done, info dict)."""
    result = env.step(action)
    if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], str)
            and isinstance(result[2], dict)):
        raise TypeError(f"step must return (observation: str, done: bool, info: dict), got {repr(result)[:120]}")
    observation, done, info = result
    return observation, bool(done), info
