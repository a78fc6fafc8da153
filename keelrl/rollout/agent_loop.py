"""The agent loop: policy and environments, turn by turn, many episodes at once.

Each episode's context grows in the model's own chat template (`keelrl.policy.chat`), e.g.

    <|user|>PROMPT<|end|><|assistant|>ACTION<|end|><|tool|>OBSERVATION<|end|><|assistant|>ACTION...

Actions are appended as generated (token ids and behaviour log-probs); observations are
tokenised and appended as non-action tokens. The turn-by-turn machinery lives in
`keelrl.rollout.scheduler` (continuous batching over episodes in flight); `run_episodes` is
its one-shot form: run these tasks now, under the current weights, and return trajectories.

The same layout serves scripted policies (the teacher's warm-start demonstrations), whose
action text is tokenised once and whose behaviour log-probs are 0.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from keelrl.envs.base import Turn
from keelrl.policy.sampling import SamplingConfig, draw_uniforms
from keelrl.rollout.scheduler import (ActFn, EpisodeInFlight, EpisodeScheduler, GroupRequest, EpisodeLimits,
                                      observation_tokens, prompt_tokens)
from keelrl.rollout.trajectory import Trajectory

__all__ = ["ActFn", "EpisodeInFlight", "EpisodeLimits", "model_actor",
           "observation_tokens", "prompt_tokens", "run_episodes", "scripted_actor"]


def run_episodes(make_env: Callable[[], Any], tasks: Sequence[Any], tokenizer: Any, act: ActFn,
                 cfg: EpisodeLimits, *, version: int = 0, group_ids: Sequence[int] | None = None,
                 seed: int = 0) -> list[Trajectory]:
    """One episode per entry of `tasks` (repeat a task G times for a group); returns trajectories.

    Episode i samples from a generator seeded with (seed, i), whatever else runs beside it.
    """
    requests = [GroupRequest(index=i, task=task, group_size=1, seed=seed * 1_000_033 + i,
                             group_id=group_ids[i] if group_ids is not None else i, min_version=version)
                for i, task in enumerate(tasks)]
    scheduler = EpisodeScheduler(make_env, tokenizer, act, cfg, refresh=lambda: version)
    try:
        results = scheduler.run(requests)
    finally:
        scheduler.close()
    return [result.trajectories[0] for result in results]


def model_actor(model: Any, tokenizer: Any, sampling: SamplingConfig) -> ActFn:
    """An ActFn that samples every waiting episode's next action from `model` in one batch.

    Each episode draws its uniforms from its own generator, so its actions do not depend on the
    batch it shares. The decoder (`sampling.decoder`) is built once and kept across calls, so an
    episode's kept keys and values (`sampling.keep_kv`) serve its next turn.
    """
    from keelrl.policy.decoders import build_decoder

    decoder = build_decoder(sampling.decoder, model, tokenizer, dtype=sampling.dtype, max_batch=sampling.max_batch,
                            kv_budget_mb=sampling.kv_budget_mb)

    def act(active: Sequence[EpisodeInFlight]) -> list[tuple[list[int], list[float], str]]:
        import torch

        reserved = min(episode.reserved for episode in active)
        if sampling.max_new_tokens > reserved:
            raise ValueError(f"sampling.max_new_tokens={sampling.max_new_tokens} is more than the "
                             f"{reserved} tokens the rollout reserves for an action (EpisodeLimits."
                             f"max_new_tokens): an action could overflow max_context_tokens")
        uniforms = torch.stack([draw_uniforms(episode.generator, sampling.max_new_tokens) for episode in active])
        caches = [episode.kv for episode in active] if sampling.keep_kv else None
        samples = decoder.generate([episode.trajectory.token_ids for episode in active], sampling, uniforms,
                                   caches=caches)
        for episode, s in zip(active, samples):
            episode.kv = s.cache
            episode.recomputed += s.recomputed
        return [(s.token_ids, s.logprobs, s.text) for s in samples]

    act.decoder = decoder  # type: ignore[attr-defined]  # its cache_usage() and counters, for logs and benchmarks
    return act


def scripted_actor(tokenizer: Any, policies: Sequence[Callable[[str, Sequence[Turn]], str]]) -> ActFn:
    """An ActFn replaying one scripted policy per episode (in admission order); log-probs are 0."""

    def act(active: Sequence[EpisodeInFlight]) -> list[tuple[list[int], list[float], str]]:
        out = []
        for episode in active:
            trajectory = episode.trajectory
            turns = [Turn(a, o) for a, o in zip(trajectory.actions, trajectory.observations)]
            text = policies[episode.index]("", turns)
            tokens = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            out.append((tokens, [0.0] * len(tokens), text))
        return out

    return act
