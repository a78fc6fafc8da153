"""A synthetic workload for keelrl's real `Trainer`: fixed prompts, K turns, exact lengths, a text reward.

Benchmarks that time RL steps run the library's own trainer and rollout engine, not a copy of
their logic, on a workload that takes no sandbox:

- `requests_for` serves prompts in a fixed order (step s: prompts (s-1)P .. sP-1, group i of a
  step gets group id i), so another library can be given the very same prompts;
- the environment (`TurnsEnv`) answers every action with the same observation text until its
  K-th turn, then the episode ends and `reward_of` scores the actions' text, a pure function
  of it (the share of letters and spaces), so groups have a spread and the loss a gradient;
  each call first waits as long as a tool would (`ToolLatency`: none unless asked);
- every action is exactly `completion_tokens` long: no stop strings, and `min_new_tokens`
  holds end tokens back until then (in every rollout process: Ray workers load their own model);
- evaluation and checkpoints are switched off (they are not part of a step).

Everything else is the configured library: `overrides` reach `load_config` as they would from
`keel train`.
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence


def reward_of(text: str) -> float:
    """The share of a text's characters that are letters or spaces (0 for an empty one)."""
    return sum(ch.isalpha() or ch == " " for ch in text) / len(text) if text else 0.0


@dataclass(frozen=True)
class PromptTask:
    id: str
    prompt: str


@dataclass(frozen=True)
class ToolLatency:
    """How long a tool call (running a repository's tests) takes: log-normal around `median_s`.

    delay = median_s x exp(sigma x N(0, 1)), drawn from a generator seeded with (seed, task id,
    turn): every attempt at a task waits as long on its t-th call (the same test suite), and
    two runs over the same tasks draw the same delays. The mean is median_s x exp(sigma^2 / 2).
    """

    median_s: float = 0.0
    sigma: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.median_s >= 0 and self.sigma >= 0):
            raise ValueError(f"ToolLatency needs median_s >= 0 and sigma >= 0, got {self.median_s}, {self.sigma}")

    def delay(self, task_id: str, turn: int) -> float:
        if self.median_s == 0:
            return 0.0
        rng = random.Random(f"{self.seed}:{task_id}:{turn}")
        return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    @property
    def mean_s(self) -> float:
        return self.median_s * math.exp(self.sigma ** 2 / 2)


class TurnsEnv:
    """`turns` turns: each action is answered with `observation` after the tool's latency; after
    the last, `reward_of` the actions."""

    def __init__(self, turns: int = 1, observation: str = "", latency: ToolLatency | None = None) -> None:
        self.max_turns = turns
        self.observation = observation
        self.latency = latency or ToolLatency()
        self.actions: list[str] = []
        self.task_id = ""

    def reset(self, task: PromptTask) -> str:
        self.actions = []
        self.task_id = task.id
        return task.prompt

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        delay = self.latency.delay(self.task_id, len(self.actions))
        if delay > 0:
            time.sleep(delay)
        self.actions.append(action_text)
        done = len(self.actions) >= self.max_turns
        return ("" if done else self.observation), done, {"tool_s": delay}

    def grade(self) -> Any:
        from keelrl.envs.base import CheckResult, Grade

        reward = reward_of("".join(self.actions))
        return Grade(reward=reward, checks=(CheckResult("letters", reward >= 0.5),), verifier="letters")


@dataclass(frozen=True)
class TurnsEnvFactory:
    """A picklable factory of `TurnsEnv` (the Ray engine ships it to its workers)."""

    turns: int
    observation: str
    latency: ToolLatency | None = None

    def __call__(self) -> TurnsEnv:
        return TurnsEnv(self.turns, self.observation, self.latency)


OBSERVATION_TEXT = (
    "$ python -m pytest -q tests/test_config.py\n"
    "F..F                                                                     [100%]\n"
    "FAILED tests/test_config.py::test_zero_disables_retries - assert 3 == 0\n"
    "FAILED tests/test_config.py::test_none_keeps_default - TypeError: '<' not supported\n"
    "2 failed, 2 passed in 0.03s\n"
)


def observation_text(tokenizer: Any, target: int) -> str:
    """A failing test run's report (repeated if short) cut by tokens so that, rendered as an observation
    after an action that did not end its turn, it is at most `target` tokens."""
    from keelrl.rollout.scheduler import observation_tokens

    frame = len(observation_tokens(tokenizer, ""))
    if frame >= target:
        raise ValueError(f"observation of {target} tokens: the chat template's frame alone takes {frame}")
    text = OBSERVATION_TEXT
    while len(observation_tokens(tokenizer, text)) < target:
        text += OBSERVATION_TEXT
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    keep = max(0, len(ids) - (len(observation_tokens(tokenizer, text)) - target))
    while keep > 0 and len(observation_tokens(tokenizer, tokenizer.decode(ids[:keep]))) > target:
        keep -= 1  # re-tokenising the cut text can merge differently
    return tokenizer.decode(ids[:keep])


def base_overrides(model: str, run_dir: str | Path, *, prompts: int, group: int, completion_tokens: int,
                   steps: int, turns: int = 1, lr: float = 1e-6) -> list[str]:
    """The config of a synthetic GRPO run without KL (one update a step on the whole batch)."""
    return [
        f"model.path={model}", "device=cpu", f"run_dir={run_dir}", "algo.preset=grpo", "algo.kl_coef=0", "seed=0",
        "warm_start.demos=0", "eval.base=false", "eval.before_rl=false",
        f"train.steps={steps}", f"optim.lr={lr}", "optim.warmup_steps=0", "optim.weight_decay=0",
        "optim.max_grad_norm=1.0", "train.epochs=1", f"train.minibatch_size={prompts * group}",
        "perf.learner_precision=float32", "rollout.temperature=1.0", "rollout.top_p=1.0",
        f"rollout.group_size={group}", f"rollout.tasks_per_step={prompts}", f"rollout.max_new_tokens={completion_tokens}",
        "rollout.max_context_tokens=1000000", f"env.max_turns={turns}",
    ]


def synthetic_trainer(overrides: Sequence[str], texts: Sequence[str], *, observation: str = "",
                      latency: ToolLatency | None = None,
                      progress: Callable[[str, dict[str, Any]], None] | None = None) -> Any:
    """A `Trainer` over `texts` with the synthetic workload (see the module docstring)."""
    from keelrl.config import load_config
    from keelrl.inference import SamplingParams
    from keelrl.rollout.scheduler import GroupRequest
    from keelrl.train.trainer import Trainer

    cfg = load_config(None, list(overrides))
    r = cfg.rollout
    prompts, group = r.tasks_per_step, r.group_size
    if len(texts) < prompts * cfg.train.steps:
        raise ValueError(f"{len(texts)} prompts for {cfg.train.steps} steps of {prompts}")
    # (an async engine asks up to max_staleness steps ahead: those requests wrap around `texts`)
    factory = TurnsEnvFactory(cfg.env.max_turns, observation, latency)

    class SyntheticTrainer(Trainer):
        def train_env_factory(self) -> Any:
            return factory

        def requests_for(self, step: int) -> list[GroupRequest]:
            first = (step - 1) * prompts
            return [GroupRequest(index=first + i, task=PromptTask(f"p{first + i}", texts[(first + i) % len(texts)]),
                                 group_size=group, seed=step * 1009 + i, group_id=i) for i in range(prompts)]

        def rollout_sampling(self) -> SamplingParams:  # no stop strings, no early end: exactly max_new_tokens
            return SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, stop=(),
                                  min_new_tokens=r.max_new_tokens, keep_kv=r.keep_kv)

        def evaluate(self, tasks: Any = None) -> dict[str, float]:
            return {}

        def save_checkpoint(self) -> Path:
            return self.run_dir

    return SyntheticTrainer(cfg, progress=progress)


def run_synthetic(overrides: Sequence[str], texts: Sequence[str], *, observation: str = "",
                  latency: ToolLatency | None = None) -> list[dict[str, Any]]:
    """Train with the synthetic workload; the metrics row of every step."""
    rows: list[dict[str, Any]] = []
    trainer = synthetic_trainer(overrides, texts, observation=observation, latency=latency,
                                progress=lambda event, info: rows.append(info) if event == "step" else None)
    trainer.run()
    return rows


def scratch_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="keelrl-bench-")
