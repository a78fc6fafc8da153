"""`rollout.engine=endpoint`: training rollouts from an agent harness that talks to an OpenAI-style API.

The engine serves its own copy of the policy on an `Endpoint` (keelrl.serve.app) and, unless
the harness is attached from outside (`rollout.harness` empty), starts the harness command as a
subprocess with OPENAI_BASE_URL, OPENAI_API_KEY, KEEL_ENDPOINT and KEEL_MODEL in its
environment. The harness takes episodes (POST /keel/v1/episodes: a session id, the task's first
messages and its tools), plays each with its own loop through /v1/chat/completions, and has
keelrl's environment run each completion (POST /keel/v1/episodes/{id}/step), which grades the
episode when it ends. Every call is recorded token for token (keelrl.serve.sessions); a
harness that rewrites its history gives an episode several samples, each with the episode's
reward.

The contract of keelrl.rollout.engines holds: each step's requests are handed out as G episode
tickets per group, in request order; a ticket of step s is handed out only once the endpoint
holds weights of at least s - 1 - max_staleness (the async engine's rule), so no trajectory is
staler than the bound; `publish` hands the endpoint new weights (a merged state dict), which its
decoder loads (`load_weights`) between decode steps when nothing is decoding. `batch(step)` returns the step's groups in request order.

Nothing hangs silently: a harness that exits before the run ends, or makes no call for
`rollout.harness_timeout_s`, stops `batch` with an error naming the sessions still open and
the harness's last output; its open episodes are kept, marked unfinished.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import subprocess
import tempfile
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable

from keelrl.envs.formats import format_of, prompt_tools
from keelrl.inference import DecoderOptions, SamplingParams, own_copy
from keelrl.rollout.build import ENGINES
from keelrl.rollout.engines import RequestsFor, RolloutEngine, StepRollouts, staleness_metrics
from keelrl.rollout.scheduler import EpisodeLimits, GroupRequest, GroupResult, episode_generator
from keelrl.serve.app import Endpoint, EndpointConfig
from keelrl.serve.render import RequestError
from keelrl.serve.sessions import Session

ENV_VARS = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "KEEL_ENDPOINT", "KEEL_MODEL")
"""What the harness command finds in its environment."""


@dataclasses.dataclass
class _Ticket:
    request: GroupRequest
    attempt: int
    step: int


class EndpointEngine(RolloutEngine):
    """Rollouts from a harness through the endpoint (module docstring)."""

    name = "endpoint"

    def __init__(self, requests_for: RequestsFor, *, model: Any, tokenizer: Any, make_env: Callable[[], Any],
                 sampling: SamplingParams, rollout: EpisodeLimits, max_staleness: int, harness: str = "",
                 harness_timeout_s: float = 600.0, host: str = "127.0.0.1", port: int = 0, api_key: str = "",
                 model_name: str = "keel-policy", seed: int = 0,
                 decoder_options: DecoderOptions = DecoderOptions()) -> None:
        super().__init__(requests_for, max_staleness)
        self.make_env, self.limits, self.harness_command = make_env, rollout, harness
        self.harness_timeout_s = harness_timeout_s
        probe = make_env()
        self.tool_format = getattr(probe, "tool_format", "call")
        self.shown = prompt_tools(probe)
        self.tools = [spec.schema() for spec in getattr(probe, "tools", {}).values()] if self.shown else []
        if hasattr(probe, "close"):
            probe.close()
        if not getattr(format_of(self.tool_format), "native", False):
            raise ValueError(f"rollout.engine=endpoint needs a tool-call format an OpenAI-style API carries "
                             f"(env.tool_format=hermes or json), got {self.tool_format!r}")
        own = own_copy(model)
        self.config = EndpointConfig(model_name=model_name, host=host, port=port, api_key=api_key,
                                     tool_format=self.tool_format, max_context_tokens=rollout.max_context_tokens,
                                     sampling=sampling, decoder=decoder_options, fixed_sampling=True, seed=seed)
        self.endpoint = Endpoint(own, tokenizer, self.config, source=self)
        self._cv = threading.Condition()
        self._tickets: deque[_Ticket] = deque()
        self._open: dict[str, Session] = {}
        self._by_request: dict[int, dict[int, Session]] = {}
        self._results: dict[int, GroupResult] = {}
        self._process: subprocess.Popen | None = None
        self._log: Any = None
        self._last_activity = time.monotonic()
        self._failure: BaseException | None = None
        """The verifier failed grading an episode (in an HTTP handler's thread): `batch` raises it."""
        self._counted: dict[str, int] = {}
        """The endpoint's counters at the last batch: each step logs what happened since."""

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return self.endpoint.url

    def start(self, version: int) -> None:
        super().start(version)
        self.endpoint.loop.version = version
        if not self.endpoint.url:
            self.endpoint.__enter__()
        if self.harness_command and self._process is None:
            self._log = tempfile.NamedTemporaryFile(prefix="keel-harness-", suffix=".log", delete=False)
            env = {**os.environ, "OPENAI_BASE_URL": f"{self.url}/v1",
                   "OPENAI_API_KEY": self.config.api_key or "keel-local", "KEEL_ENDPOINT": self.url,
                   "KEEL_MODEL": self.config.model_name}
            self._process = subprocess.Popen(shlex.split(self.harness_command), env=env, stdout=self._log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._last_activity = time.monotonic()

    def publish(self, state: dict[str, Any], version: int) -> None:
        super().publish(state, version)
        self.endpoint.loop.offer(state, version)
        with self._cv:
            self._cv.notify_all()

    def _shutdown(self) -> None:
        """Close the run to harnesses (410 from then on), stop the harness process, abandon the
        open episodes and stop the endpoint's server."""
        with self._cv:
            self._tickets.clear()
            self._cv.notify_all()
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        for session in list(self._open.values()):
            self._abandon(session, "the run closed the endpoint with the episode open")
        self.endpoint.close()

    # ------------------------------------------------------------------ the endpoint's episode source
    def claim(self) -> Any:
        """The next ticket the endpoint may hand out now, or None; never blocks (the route polls, so a
        client that gives up takes no ticket). RequestError 410 once the run is closed."""
        with self._cv:
            self._last_activity = time.monotonic()
            if self.closed:  # set by close(): harnesses asking for more hear so (410); before, 503 (dynamic
                # sampling may still ask for more groups of the last step)
                raise RequestError("the training run needs no more episodes", status=410, code="run_over")
            if self._tickets and self._tickets[0].request.min_version <= self.endpoint.loop.version:
                return self._tickets.popleft()
            return None

    def open(self, ticket: Any) -> Session:
        """A claimed ticket's session, its environment made and reset (an environment that fails
        ends it ungraded, as env_error)."""
        request = ticket.request
        session = Session(id=f"step{ticket.step}-request{request.index}-attempt{ticket.attempt}",
                          generator=episode_generator(request.seed, ticket.attempt),
                          task_id=str(getattr(request.task, "id", request.task)),
                          group_id=request.group_id if request.group_id >= 0 else request.index, ticket=ticket)
        with self._cv:
            self._open[session.id] = session
            self._by_request.setdefault(request.index, {})[ticket.attempt] = session
        try:
            session.env = self.make_env()
            observation = session.env.reset(request.task)
            if not isinstance(observation, str):
                raise TypeError(f"reset must return the first observation as a str, got {type(observation).__name__}")
            session.first_observation = observation
        except Exception as error:  # noqa: BLE001 - the environment failed: the episode ends ungraded
            self._env_failed(session, "reset", error)
        return session

    def describe(self, session: Session) -> dict[str, Any]:
        return {"session_id": session.id, "task_id": session.task_id, "model": self.config.model_name,
                "messages": [{"role": "user", "content": session.first_observation}],
                "tools": self.tools, "max_turns": self.limits.max_turns, "done": session.finished}

    def step(self, session: Session) -> dict[str, Any]:
        self._last_activity = time.monotonic()
        with session.lock:  # one step per completion, even when a client retries
            if session.finished:
                raise RequestError(f"session {session.id!r} has ended", status=409, code="session_ended")
            if session.stepped:
                raise RequestError(f"session {session.id!r} has no completion to step: make a chat call first",
                                   status=409, code="call_first")
            session.stepped = True
        try:
            out = session.env.step(session.last_text)
            if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], str) and isinstance(out[2], dict)):
                raise TypeError(f"step must return (observation: str, done: bool, info: dict), got {out!r:.200}")
            observation, done, info = out
        except Exception as error:  # noqa: BLE001 - the environment failed: the episode ends ungraded
            self._env_failed(session, "step", error)
            return {"observation": "", "done": True, "termination": "env_error", "reward": None}
        with session.lock:
            session.observe(observation, info)
        termination = ""
        if done:
            termination = info.get("termination", "submitted")
        elif session.turns >= self.limits.max_turns:
            termination = "max_turns"
        if not termination:
            return {"observation": observation, "done": False}
        reward = self._grade(session, termination)
        return {"observation": observation, "done": True, "termination": termination, "reward": reward}

    def cut(self, session: Session, why: str) -> None:
        if not session.finished:
            self._grade(session, "context_limit")

    def ended(self, session: Session) -> None:
        ticket: _Ticket | None = session.ticket
        with self._cv:
            self._open.pop(session.id, None)
            self._last_activity = time.monotonic()
            if ticket is None:
                return
            group = self._by_request.get(ticket.request.index, {})
            if len(group) == ticket.request.group_size and all(s.finished for s in group.values()):
                del self._by_request[ticket.request.index]
                trajectories = [t for attempt in sorted(group) for t in group[attempt].trajectories()]
                self._results[ticket.request.index] = GroupResult(ticket.request, trajectories)
            self._cv.notify_all()

    def _grade(self, session: Session, termination: str) -> float | None:
        """Grade and end the episode. A verifier that raises stops the run (the learner's next wait
        raises it): no reward is made up; the episode is kept unfinished."""
        try:
            grade = session.env.grade()
        except Exception as error:
            failure = RuntimeError(f"the verifier failed grading session {session.id}: {type(error).__name__}: "
                                   f"{error}")
            failure.__cause__ = error
            with self._cv:
                self._failure = self._failure or failure
            self._abandon(session, str(failure))
            raise failure from error
        with session.lock:
            first = session.finish(grade.reward, success=grade.success, partial=grade.partial,
                                   termination=termination,
                                   checks=[{"name": c.name, "passed": c.passed, "detail": c.detail}
                                           for c in grade.checks])
        if first:
            self.ended(session)
        return grade.reward

    def _env_failed(self, session: Session, kind: str, error: Exception) -> None:
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        where = f" (at {frame.filename}:{frame.lineno} in {frame.name})" if frame else ""
        with session.lock:
            first = session.finish(math.nan, success=False, partial=math.nan, termination="env_error",
                                   error=f"env.{kind} raised {type(error).__name__}: {error}{where}")
        if first:
            self.ended(session)

    def _abandon(self, session: Session, why: str) -> None:
        with session.lock:
            first = session.abandon(why)
        if first:
            self.ended(session)

    # ------------------------------------------------------------------ the learner's side
    def _queue(self, step: int, requests: list[GroupRequest]) -> None:
        with self._cv:
            for request in requests:
                self._tickets.extend(_Ticket(request, attempt, step) for attempt in range(request.group_size))
            self._cv.notify_all()

    def _wait(self, requests: list[GroupRequest]) -> list[GroupResult]:
        """The groups of `requests`, sampling on this (the learner's) thread while it waits (the
        loop's own thread samples while the learner updates: keelrl.serve.service)."""
        wanted = [r.index for r in requests]
        failure: list[BaseException] = []
        checked = [0.0]

        def ready() -> bool:
            with self._cv:
                if all(index in self._results for index in wanted):
                    return True
                if time.monotonic() - checked[0] >= 0.25:
                    checked[0] = time.monotonic()
                    try:
                        self._check_harness(wanted)
                    except BaseException as error:  # noqa: BLE001 - raised below, outside the loop
                        failure.append(error)
                        return True
            return False

        self.endpoint.loop.run(until=ready)
        if failure:
            raise failure[0]
        with self._cv:
            return [self._results.pop(index) for index in wanted]

    def _check_harness(self, wanted: list[int]) -> None:
        """Under the lock: an episode with no call for harness_timeout_s is abandoned (kept, unfinished;
        its group is then complete and left out of the update); raise, abandoning every open episode,
        when the harness command exited or nothing at all happened for harness_timeout_s."""
        if self.endpoint.loop.error is not None:
            raise RuntimeError("the endpoint's decode loop failed") from self.endpoint.loop.error
        if self._failure is not None:
            raise self._failure
        now = time.monotonic()
        stale = [s for s in self._open.values() if now - s.last_seen > self.harness_timeout_s]
        self._abandon_all(stale, f"no call in this episode for {self.harness_timeout_s:g} s "
                                 f"(rollout.harness_timeout_s): the harness went away from it")
        exited = self._process.poll() if self._process is not None else None
        idle = now - max([self._last_activity, *(s.last_seen for s in self._open.values())])
        if exited is None and idle < self.harness_timeout_s:
            return
        open_sessions = sorted(self._open)
        why = (f"the harness command exited with code {exited}" if exited is not None else
               f"the harness made no call for {idle:.0f} s (rollout.harness_timeout_s={self.harness_timeout_s:g})")
        self._abandon_all(list(self._open.values()), why)
        waiting = len([i for i in wanted if i not in self._results])
        raise RuntimeError(f"{why} while {waiting} group(s) of this step were not finished; episodes left open "
                           f"(kept, marked unfinished): {', '.join(open_sessions[:8]) or 'none'}"
                           f"{' ...' if len(open_sessions) > 8 else ''}; endpoint {self.url}; "
                           f"harness output (last lines):\n{self.harness_output()}")

    def _abandon_all(self, sessions: list[Session], why: str) -> None:
        """Abandon `sessions` from under the lock (`ended` takes it again)."""
        if not sessions:
            return
        self._cv.release()
        try:
            for session in sessions:
                self._abandon(session, why)
        finally:
            self._cv.acquire()

    def harness_output(self, lines: int = 20) -> str:
        """The last lines the harness command wrote (stdout and stderr), or '' when keelrl did not start it."""
        if self._log is None:
            return ""
        self._log.flush()
        with open(self._log.name, encoding="utf-8", errors="replace") as handle:
            return "\n".join(handle.read().splitlines()[-lines:])

    def batch(self, step: int) -> StepRollouts:
        self._check_open()
        requests = self._requests(step)
        tick = time.monotonic()
        for future_step in self._steps_to_submit(step):
            self._queue(future_step, self._requests(future_step))
        results = self._wait(requests)
        trajectories = [t for result in results for t in result.trajectories]
        metrics = staleness_metrics(step, [t for t in trajectories if t.versions], self.max_staleness)
        counters, before = dict(self.endpoint.counters), self._counted
        self._counted = counters
        metrics.update({"time/learner_wait_s": time.monotonic() - tick,
                        **{f"endpoint/{name}": float(counters[name] - before.get(name, 0))
                           for name in ("requests", "rejected", "new_samples", "continued", "sampling_overridden")},
                        "endpoint/samples_per_episode": len(trajectories) / max(1, sum(r.request.group_size
                                                                                        for r in results)),
                        "endpoint/unfinished": float(sum(t.termination == "unfinished" for t in trajectories))})
        return StepRollouts(trajectories, metrics)

    def more(self, step: int, requests: list[GroupRequest]) -> list[GroupResult]:
        self._check_open()
        min_version = max(0, step - 1 - self.max_staleness)
        requests = [dataclasses.replace(r, min_version=min_version) for r in requests]
        self._queue(step, requests)
        return self._wait(requests)


def check_settings(cfg: Any) -> None:
    """ConfigError, before any work, for a run whose settings the endpoint engine cannot serve."""
    from keelrl.errors import ConfigError

    if not getattr(format_of(cfg.env.tool_format), "native", False):
        raise ConfigError("env.tool_format", f"rollout.engine=endpoint needs a format whose tool calls an "
                                             f"OpenAI-style API carries: hermes or json, got {cfg.env.tool_format!r}")
    try:
        shlex.split(cfg.rollout.harness)
    except ValueError as error:
        raise ConfigError("rollout.harness", f"cannot split {cfg.rollout.harness!r} into a command: {error}") from None


@ENGINES.register("endpoint", summary="an agent harness plays the episodes through an OpenAI-compatible endpoint "
                                      "that records every call (rollout.harness)")
def _endpoint(settings: Any, requests_for: RequestsFor, **parts: Any) -> RolloutEngine:
    return EndpointEngine(requests_for, model=parts["model"], tokenizer=parts["tokenizer"],
                          make_env=parts["make_env"], sampling=parts["sampling"], rollout=parts["rollout"],
                          max_staleness=settings.max_staleness, harness=settings.harness,
                          harness_timeout_s=settings.harness_timeout_s, host=settings.endpoint_host,
                          port=settings.endpoint_port, api_key=settings.endpoint_key, seed=parts["seed"],
                          decoder_options=parts["decoder_options"])
