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
from keelrl.inference import DecoderOptions, SamplingParams, build_decoder, draw_seed, draw_uniforms
from keelrl.rollout.scheduler import (ActFn, EpisodeInFlight, EpisodeScheduler, GroupRequest, EpisodeLimits,
                                      observation_tokens, prompt_tokens)
from keelrl.rollout.trajectory import Trajectory

__all__ = ["ActFn", "ActionStream", "EpisodeInFlight", "EpisodeLimits", "model_actor",
           "observation_tokens", "prompt_tokens", "run_episodes", "scripted_actor"]


def run_episodes(make_env: Callable[[], Any], tasks: Sequence[Any], tokenizer: Any, act: ActFn,
                 cfg: EpisodeLimits, *, version: int = 0, group_ids: Sequence[int] | None = None,
                 seed: int = 0, first_index: int = 0) -> list[Trajectory]:
    """One episode per entry of `tasks` (repeat a task G times for a group); returns trajectories.

    Episode i samples from a generator seeded with (seed, first_index + i), whatever else runs
    beside it; `first_index` lets a list run in parts with the seeds it would have in one call.
    """
    requests = [GroupRequest(index=first_index + i, task=task, group_size=1, seed=seed * 1_000_033 + first_index + i,
                             group_id=group_ids[i] if group_ids is not None else first_index + i, min_version=version)
                for i, task in enumerate(tasks)]
    scheduler = EpisodeScheduler(make_env, tokenizer, act, cfg, refresh=lambda: version)
    try:
        results = scheduler.run(requests)
    finally:
        scheduler.close()
    return [result.trajectories[0] for result in results]


def model_actor(model: Any, tokenizer: Any, sampling: SamplingParams,
                options: DecoderOptions = DecoderOptions()) -> ActFn:
    """An ActFn that samples every waiting episode's next action from `model` in one batch.

    Each episode draws its randomness from its own generator (uniforms, or a seed for a decoder
    that does not take uniforms), so its actions do not depend on the batch it shares. The
    decoder (`options`, keelrl.inference) is built once and kept across calls, so an episode's
    kept keys and values (`sampling.keep_kv`) serve its next turn; it is offered as
    `act.decoder`, the handle its new weights go through (`load_weights`). A decoder that can
    stream (`submit` and `step`, as keelrl's own) is also offered as `act.stream`, an
    `ActionStream`: the scheduler then adds episodes to the batch being decoded as they become
    ready, instead of waiting for the whole batch to finish.
    """
    decoder = build_decoder(model, tokenizer, options)

    def act(active: Sequence[EpisodeInFlight]) -> list[tuple[list[int], list[float], str]]:
        caches = [episode.kv for episode in active] if sampling.keep_kv else None
        samples = decoder.generate([episode.trajectory.token_ids for episode in active], sampling, caches=caches,
                                   **randomness(decoder, active, sampling))
        for episode, s in zip(active, samples):
            episode.kv = s.cache
            episode.recomputed += s.recomputed
        return [(s.token_ids, s.logprobs, s.text) for s in samples]

    act.decoder = decoder  # type: ignore[attr-defined]  # its weights seam, cache_usage() and counters
    act.stream = ActionStream(decoder, sampling) if hasattr(decoder, "submit") else None  # type: ignore[attr-defined]
    return act


def randomness(decoder: Any, active: Sequence[EpisodeInFlight], sampling: SamplingParams) -> dict[str, Any]:
    """The episodes' randomness for their next actions, from their own generators: uniforms
    [B, max_new_tokens] for a decoder that takes them, else one seed each."""
    import torch

    reserved = min(episode.reserved for episode in active)
    if sampling.max_new_tokens > reserved:
        raise ValueError(f"sampling.max_new_tokens={sampling.max_new_tokens} is more than the "
                         f"{reserved} tokens the rollout reserves for an action (EpisodeLimits."
                         f"max_new_tokens): an action could overflow max_context_tokens")
    if not getattr(decoder, "takes_uniforms", True):
        return {"seeds": [draw_seed(episode.generator) for episode in active]}
    return {"uniforms": torch.stack([draw_uniforms(episode.generator, sampling.max_new_tokens) for episode in active])}


class ActionStream:
    """Episodes' next actions from a streaming decoder: `submit` episodes at any time, `step` the
    decoder once and get back the episodes whose action finished. Each episode's tokens are those
    `act` would give it (its own uniforms, its own kept keys and values), whichever episodes
    shared its steps."""

    def __init__(self, decoder: Any, sampling: SamplingParams) -> None:
        self.decoder, self.sampling = decoder, sampling
        self._episodes: dict[int, EpisodeInFlight] = {}

    @property
    def busy(self) -> bool:
        """Rows are queued or decoding (new weights may be loaded only when not)."""
        return bool(self.decoder.in_flight)

    def submit(self, episodes: Sequence[EpisodeInFlight]) -> None:
        if not episodes:
            return
        caches = [episode.kv for episode in episodes] if self.sampling.keep_kv else None
        tickets = self.decoder.submit([episode.trajectory.token_ids for episode in episodes], self.sampling,
                                      caches=caches, **randomness(self.decoder, episodes, self.sampling))
        self._episodes.update(zip(tickets, episodes))

    def step(self) -> list[tuple[EpisodeInFlight, tuple[list[int], list[float], str]]]:
        out = []
        for ticket, s in self.decoder.step():
            episode = self._episodes.pop(ticket)
            episode.kv = s.cache
            episode.recomputed += s.recomputed
            out.append((episode, (s.token_ids, s.logprobs, s.text)))
        return out

    def cancel(self) -> None:
        """Drop every row in flight (their episodes get no action)."""
        self.decoder.cancel()
        self._episodes.clear()


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
