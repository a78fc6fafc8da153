"""The agent loop: policy and environments, turn by turn, many episodes at once.

Each turn, every unfinished episode's context is continued in one batched `sample` call;
each action is appended as generated (token ids and behaviour log-probs), the environment
steps (in a thread pool: tool calls such as running tests take real time), and its
observation is appended as non-action tokens:

    <|user|>PROMPT<|end|><|assistant|>ACTION<|end|><|tool|>OBSERVATION<|end|><|assistant|>ACTION...

The same layout serves scripted policies (the teacher's warm-start demonstrations), whose
action text is tokenised once and whose behaviour log-probs are 0.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from keelrl.envs.base import Turn
from keelrl.policy.sampling import SamplingConfig, sample
from keelrl.rollout.trajectory import Trajectory

OBSERVATION_PREFIX, OBSERVATION_SUFFIX = "<|end|><|tool|>", "<|end|><|assistant|>"


@dataclass(frozen=True)
class RolloutConfig:
    """Episode limits for rollouts."""

    group_size: int = 4
    """Attempts per task (GRPO's G)."""
    max_turns: int = 8
    max_context_tokens: int = 3072
    """An episode whose context would exceed this ends with termination 'context_limit'."""
    env_threads: int = 4


def prompt_tokens(tokenizer: Any, first_observation: str) -> list[int]:
    """The first observation as a chat prompt (the tokenizer's template, or a plain fallback)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": first_observation}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = f"User: {first_observation}\nAssistant: "
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def observation_tokens(tokenizer: Any, observation: str) -> list[int]:
    return list(tokenizer(OBSERVATION_PREFIX + observation + OBSERVATION_SUFFIX,
                          add_special_tokens=False)["input_ids"])


@dataclass
class _Episode:
    index: int
    env: Any
    task: Any
    trajectory: Trajectory
    done: bool = False


ActFn = Callable[[Sequence[_Episode]], list[tuple[list[int], list[float], str]]]
"""Given the active episodes, return (token ids, behaviour log-probs, text) for each."""


def run_episodes(make_env: Callable[[], Any], tasks: Sequence[Any], tokenizer: Any, act: ActFn,
                 cfg: RolloutConfig, *, version: int = 0, group_ids: Sequence[int] | None = None) -> list[Trajectory]:
    """One episode per entry of `tasks` (repeat a task G times for a group); returns trajectories."""
    started = time.monotonic()
    episodes = []
    with ThreadPoolExecutor(max_workers=max(1, cfg.env_threads)) as pool:
        envs = [make_env() for _ in tasks]
        firsts = list(pool.map(lambda pair: pair[0].reset(pair[1]), zip(envs, tasks)))
        for index, (env, task, first) in enumerate(zip(envs, tasks, firsts)):
            trajectory = Trajectory(task_id=str(getattr(task, "id", task)),
                                    group_id=group_ids[index] if group_ids is not None else index)
            trajectory.extend(prompt_tokens(tokenizer, first), action=False, turn=0)
            trajectory.prompt_length = len(trajectory.token_ids)
            episodes.append(_Episode(index, env, task, trajectory))
        generate_seconds = env_seconds = 0.0
        for turn in range(cfg.max_turns):
            active = [episode for episode in episodes if not episode.done]
            if not active:
                break
            tick = time.monotonic()
            actions = act(active)
            generate_seconds += time.monotonic() - tick
            for episode, (tokens, logprobs, text) in zip(active, actions):
                episode.trajectory.extend(tokens, action=True, turn=turn, logprobs=logprobs)
                episode.trajectory.actions.append(text)
                episode.trajectory.versions.append(version)
            tick = time.monotonic()
            results = list(pool.map(lambda pair: pair[0].env.step(pair[1][2]), zip(active, actions)))
            env_seconds += time.monotonic() - tick
            for episode, (observation, done, info) in zip(active, results):
                trajectory = episode.trajectory
                trajectory.observations.append(observation)
                if done:
                    episode.done, trajectory.termination = True, info.get("termination", "submitted")
                    continue
                tokens = observation_tokens(tokenizer, observation)
                if len(trajectory.token_ids) + len(tokens) + 16 > cfg.max_context_tokens:
                    episode.done, trajectory.termination = True, "context_limit"
                    continue
                trajectory.extend(tokens, action=False, turn=turn)
        for episode in episodes:
            if not episode.done:
                episode.done, episode.trajectory.termination = True, "max_turns"
        tick = time.monotonic()
        grades = list(pool.map(lambda episode: episode.env.grade(), episodes))
        grade_seconds = time.monotonic() - tick
        for env in envs:
            if hasattr(env, "close"):
                env.close()
    total = time.monotonic() - started
    for episode, grade in zip(episodes, grades):
        trajectory = episode.trajectory
        trajectory.reward, trajectory.success, trajectory.partial = grade.reward, grade.success, grade.partial
        trajectory.checks = [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in grade.checks]
        trajectory.seconds = {"total": total, "generate": generate_seconds, "env": env_seconds, "grade": grade_seconds}
    return [episode.trajectory for episode in episodes]


def model_actor(model: Any, tokenizer: Any, sampling: SamplingConfig, seed: int | None = None) -> ActFn:
    """An ActFn that samples every active episode's next action from `model` in one batch."""
    calls = [0]

    def act(active: Sequence[_Episode]) -> list[tuple[list[int], list[float], str]]:
        calls[0] += 1
        samples = sample(model, tokenizer, [episode.trajectory.token_ids for episode in active], sampling,
                         generator_seed=None if seed is None else seed * 100003 + calls[0])
        return [(s.token_ids, s.logprobs, s.text) for s in samples]

    return act


def scripted_actor(tokenizer: Any, policies: Sequence[Callable[[str, Sequence[Turn]], str]]) -> ActFn:
    """An ActFn replaying one scripted policy per episode (in task order); log-probs are 0."""

    def act(active: Sequence[_Episode]) -> list[tuple[list[int], list[float], str]]:
        out = []
        for episode in active:
            trajectory = episode.trajectory
            turns = [Turn(a, o) for a, o in zip(trajectory.actions, trajectory.observations)]
            text = policies[episode.index]("", turns)
            tokens = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            out.append((tokens, [0.0] * len(tokens), text))
        return out

    return act
