"""The environment protocol: what a user implements, and the episode loop the library owns.

An environment is any object with:

    reset(task) -> str                       first observation (the task as the agent sees it)
    step(action_text) -> (str, bool, dict)   observation, done, info
    grade() -> Grade                         reward and per-check results, at the episode's end
    max_turns: int                           the library stops the episode after this many steps

`step` never raises on a bad action: a malformed or unknown tool call becomes an error
observation that says what was wrong and what is accepted (info["error"] is set), so a
policy's mistake is a training signal, not a crash. `grade` never returns a default reward
on failure: a check that cannot run is a failed check with the reason, and a verifier that
cannot work at all raises `VerifierError`. An environment that ends the episode at its own
turn limit says so with info["termination"] = "max_turns" on that last step.

`run_episode` drives one episode with any policy callable (scripted or a model); the token-
level rollout engine uses the same protocol. `check_env` validates a user's environment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable


class VerifierError(RuntimeError):
    """The verifier itself failed (not the candidate): the run must report it, not score 0."""


@dataclass(frozen=True)
class CheckResult:
    """One behavioural check of a grading."""

    name: str
    passed: bool
    detail: str = ""
    """Why it failed (expected vs got, the exception, the sandbox verdict)."""
    weight: float = 1.0


@dataclass(frozen=True)
class Grade:
    """The outcome of an episode: reward for training, and the evidence behind it."""

    reward: float
    checks: tuple[CheckResult, ...]
    verifier: str = ""

    @property
    def success(self) -> bool:
        """Strict success: every check passed (and there was at least one)."""
        return bool(self.checks) and all(check.passed for check in self.checks)

    @property
    def partial(self) -> float:
        """Partial credit: the weighted fraction of checks passed."""
        total = sum(check.weight for check in self.checks)
        return sum(check.weight for check in self.checks if check.passed) / total if total else 0.0

    @property
    def passed(self) -> int:
        """How many checks passed (process labels compare it turn by turn)."""
        return sum(bool(check.passed) for check in self.checks)

    def summary(self) -> str:
        failing = [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]
        head = f"reward {self.reward:g}, {self.passed}/{len(self.checks)} checks passed"
        return head + "".join(f"\n  FAIL {line}" for line in failing)


@runtime_checkable
class Env(Protocol):
    """A multi-turn text environment (see the module docstring)."""

    max_turns: int

    def reset(self, task: Any) -> str: ...

    def step(self, action_text: str) -> tuple[str, bool, dict]: ...

    def grade(self) -> Grade: ...


@dataclass
class Turn:
    """One step of an episode: what the policy said and what the environment answered."""

    action: str
    observation: str
    info: dict = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Episode:
    """A finished text-level episode."""

    task_id: str
    prompt: str
    turns: list[Turn]
    grade: Grade
    termination: str
    """submitted (the env said done) | max_turns (the turn limit ended it, the library's or the env's)."""
    seconds: float


Policy = Callable[[str, Sequence[Turn]], str]
"""A policy maps (first observation, turns so far) to the next action text."""


def run_episode(env: Env, task: Any, policy: Policy) -> Episode:
    """Run `policy` in `env` on `task` until the env says done or max_turns steps pass."""
    started = time.monotonic()
    prompt = env.reset(task)
    turns: list[Turn] = []
    termination = "max_turns"
    for _ in range(env.max_turns):
        action = policy(prompt, turns)
        step_started = time.monotonic()
        observation, done, info = env.step(action)
        turns.append(Turn(action, observation, info, time.monotonic() - step_started))
        if done:
            # An env that stops at its own turn limit says so; that is not a submission.
            termination = "max_turns" if info.get("termination") == "max_turns" else "submitted"
            break
    return Episode(task_id=str(getattr(task, "id", task)), prompt=prompt, turns=turns, grade=env.grade(),
                   termination=termination, seconds=time.monotonic() - started)


class EnvCheckError(AssertionError):
    """`check_env` found the environment breaks the protocol; the message lists every problem."""


def check_env(env: Any, task: Any, good_actions: Sequence[str] = (),
              bad_actions: Sequence[str] = ("", "not a tool call", "<call>no_such_tool</call>")) -> None:
    """Validate `env` against the protocol on `task`, raising EnvCheckError with all problems.

    Checks: the methods and max_turns exist; reset returns text; each bad action yields an
    error observation (a non-empty str, done False unless it was the episode's last allowed
    turn, info["error"] set) instead of raising; `good_actions`, from a fresh reset, run
    without errors; grade returns a Grade whose reward is a finite number and whose checks are
    CheckResults; reset starts a fresh episode (the whole check runs twice).
    """
    problems: list[str] = []
    for name in ("reset", "step", "grade"):
        if not callable(getattr(env, name, None)):
            problems.append(f"missing method {name}()")
    if not isinstance(getattr(env, "max_turns", None), int) or env.max_turns < 1:
        problems.append("max_turns must be a positive int")
    if problems:
        raise EnvCheckError("; ".join(problems))
    for attempt in range(2):  # twice: reset must start a fresh episode
        try:
            first = env.reset(task)
        except Exception as error:  # noqa: BLE001 - reporting is the point
            problems.append(f"reset() raised {error!r}")
            break
        if not isinstance(first, str) or not first:
            problems.append(f"reset() returned {type(first).__name__}, expected a non-empty str")
        steps = 0  # since the last reset: a bad action may end the episode only at the turn limit
        for action in bad_actions:
            if steps >= env.max_turns:
                env.reset(task)
                steps = 0
            steps += 1
            try:
                observation, done, info = env.step(action)
            except Exception as error:  # noqa: BLE001 - reporting is the point
                problems.append(f"step({action!r}) raised {error!r}; it must return an error observation")
                continue
            if not isinstance(observation, str) or not observation:
                problems.append(f"step({action!r}) observation is not a non-empty str")
            if done and steps < env.max_turns:
                problems.append(f"step({action!r}) ended the episode; a malformed action must not")
            if not isinstance(info, dict) or not info.get("error"):
                problems.append(f"step({action!r}) did not set info['error']")
            if done:
                steps = env.max_turns  # reset before the next action
        if bad_actions and good_actions:
            env.reset(task)  # the good actions get a fresh episode and the whole turn budget
        for action in good_actions:
            try:
                observation, done, info = env.step(action)
            except Exception as error:  # noqa: BLE001
                problems.append(f"step({action!r}) raised {error!r}")
                break
            if isinstance(info, dict) and info.get("error"):
                problems.append(f"step({action!r}) was rejected: {observation[:200]}")
            if done:
                break
        try:
            grade = env.grade()
        except Exception as error:  # noqa: BLE001
            problems.append(f"grade() raised {error!r}")
            break
        if not isinstance(grade, Grade):
            problems.append(f"grade() returned {type(grade).__name__}, expected Grade")
        elif not (isinstance(grade.reward, (int, float)) and grade.reward == grade.reward
                  and abs(grade.reward) != float("inf")):
            problems.append(f"grade().reward is not a finite number: {grade.reward!r}")
        elif not all(isinstance(check, CheckResult) for check in grade.checks):
            problems.append("grade().checks must be CheckResult instances")
        if problems:
            break
    if problems:
        raise EnvCheckError("environment breaks the protocol:\n- " + "\n- ".join(problems))
