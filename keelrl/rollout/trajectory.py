"""Trajectory: one episode at token level, exactly as the policy saw and produced it.

Token ids are kept as generated: the policy's tokens are appended verbatim and only the
environment's observations are tokenised, so nothing is re-tokenised between turns (a
decoded-then-re-encoded action can split differently and silently change the training data).

`collate` pads a list of trajectories into the [B, T] tensors the algorithms take.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

CUT_TERMINATIONS = ("max_turns", "context_limit")
"""The terminations of an episode a limit ended, not the agent (`Trajectory.cut`): the turn limit,
the library's or the environment's own (an environment that ends the episode at its turn limit
says info["termination"] = "max_turns"), and the context limit. An episode the environment ended
with done (and no such info) is 'submitted'."""


@dataclass
class Trajectory:
    """Everything one episode produced (see DESIGN.md, Contracts)."""

    task_id: str
    group_id: int
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    """True where the policy generated the token."""
    behaviour_logprobs: list[float] = field(default_factory=list)
    """log mu(token) at sampling time for action tokens; 0.0 elsewhere."""
    turn_ids: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Policy version that generated each turn's action (one entry per turn)."""
    actions: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    prompt_length: int = 0
    prompt: str = ""
    """The first observation as text: what the prompt's tokens render in the chat template."""
    reward: float = 0.0
    success: bool = False
    partial: float = 0.0
    checks: list[dict[str, Any]] = field(default_factory=list)
    termination: str = ""
    """submitted | max_turns | context_limit | env_error (the environment itself failed: see `error`) |
    unfinished (a harness's episode that ended without a reward: keelrl.serve.sessions)."""
    error: str = ""
    """termination 'env_error': what the environment raised (or returned instead of its protocol's
    values) in reset or step, with where. Such an episode has no grade, so reward and partial are
    NaN, never a made-up 0: a consumer that does not set it aside fails loudly."""
    step_labels: list[int] = field(default_factory=list)
    """Process labels, one per turn (rollout label_steps): 1 the turn raised the hidden-check pass
    count, 0 it did not, -1 no label (a turn that cannot change the code: read, test, submit)."""
    step_passes: list[int] = field(default_factory=list)
    """The hidden checks passed before the first turn, then after each turn (the labels' evidence)."""
    action_errors: int = 0
    """Turns whose action the environment rejected (malformed call, bad argument: info["error"])."""
    turn_info: list[dict[str, Any]] = field(default_factory=list)
    """Each turn's `info` from env.step, its plain values only (str, int, float, bool): the tool
    (coding: info["tool"]), the error, the test counts, the turn's reward (info["reward"])."""
    seconds: dict[str, float] = field(default_factory=dict)
    episode: str = ""
    """The episode this trajectory is a sample of, where an episode gave several (a harness that
    rewrote its history: keelrl.serve.sessions); empty: the trajectory is the whole episode."""
    sample: int = 0
    """Its place among its episode's samples."""
    samples: int = 1
    """How many samples its episode gave; each carries the episode's reward, and the learner counts
    the episode once in its group's baseline (keelrl.train.advantage)."""

    def extend(self, tokens: Sequence[int], *, action: bool, turn: int, logprobs: Sequence[float] | None = None) -> None:
        """Append tokens: the policy's (action=True, with their behaviour log-probs) or the env's."""
        if action and (logprobs is None or len(logprobs) != len(tokens)):
            raise ValueError("action tokens need one behaviour log-prob each")
        self.token_ids.extend(tokens)
        self.action_mask.extend([action] * len(tokens))
        self.behaviour_logprobs.extend(logprobs if action and logprobs is not None else [0.0] * len(tokens))
        self.turn_ids.extend([turn] * len(tokens))

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def cut(self) -> bool:
        """A limit ended the episode, not the agent (termination in `CUT_TERMINATIONS`)."""
        return self.termination in CUT_TERMINATIONS

    @property
    def turn_rewards(self) -> list[float]:
        """Each turn's own reward (info["reward"], 0 where the environment gave none), beside the
        outcome reward the grade gives the episode."""
        return [float(info.get("reward", 0.0)) for info in self.turn_info]

    def to_text(self, tokenizer: Any) -> str:
        """A readable transcript: prompt, then each action and observation."""
        lines = [f"# task {self.task_id} (group {self.group_id}) reward={self.reward:g} "
                 f"success={self.success} termination={self.termination}",
                 tokenizer.decode(self.token_ids[:self.prompt_length])]
        for turn, action in enumerate(self.actions):
            lines += [f"--- turn {turn} (policy version {self.versions[turn] if turn < len(self.versions) else '?'})",
                      f"ACTION: {action}"]
            if turn < len(self.observations):  # the action whose step raised has none
                lines.append(f"OBSERVATION: {self.observations[turn]}")
        if self.error:
            lines.append(f"ENVIRONMENT ERROR: {self.error}")
        lines += [f"checks: {self.checks}", ""]
        return "\n".join(lines)


@dataclass
class Batch:
    """Padded tensors for a list of trajectories (right padding)."""

    input_ids: Tensor  # [B, T]
    attention_mask: Tensor  # [B, T]
    action_mask: Tensor  # [B, T] bool
    behaviour_logprobs: Tensor  # [B, T]
    turn_ids: Tensor  # [B, T]
    rewards: Tensor  # [B]
    group_ids: Tensor  # [B]
    observation_mask: Tensor | None = None
    """[B, T] bool: the environment's tokens after the prompt (tool outputs, observations)."""
    step_labels: Tensor | None = None
    """[B, T] long: each labelled turn's process label (0 or 1) at its last action token, -1 elsewhere."""
    step_rewards: Tensor | None = None
    """[B, T] float: each turn's own reward (`Trajectory.turn_rewards`) at its last action token, 0 elsewhere."""
    cut: Tensor | None = None
    """[B] bool: the episode was cut by a limit (`Trajectory.cut`); None reads as no episode cut."""
    episode_ids: Tensor | None = None
    """[B] long: rows of one episode share an id, where an episode gave several samples
    (`Trajectory.samples`); None: every row is a whole episode."""
    rejected: Tensor | None = None
    """[B, T] bool: the action tokens of turns whose action the environment rejected (a malformed
    call, a bad argument: the turn's info["error"]); None reads as none rejected."""

    def to(self, device: torch.device) -> "Batch":
        return Batch(**{name: None if value is None else value.to(device)  # type: ignore[arg-type]
                        for name, value in self.__dict__.items()})


def collate(trajectories: Sequence[Trajectory], pad_id: int) -> Batch:
    """Right-pad trajectories into a Batch."""
    width = max(len(t.token_ids) for t in trajectories)
    batch = len(trajectories)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    action = torch.zeros((batch, width), dtype=torch.bool)
    behaviour = torch.zeros((batch, width), dtype=torch.float32)
    turns = torch.zeros((batch, width), dtype=torch.long)
    observation = torch.zeros((batch, width), dtype=torch.bool)
    labels = torch.full((batch, width), -1, dtype=torch.long)
    step_rewards = torch.zeros((batch, width), dtype=torch.float32)
    rejected = torch.zeros((batch, width), dtype=torch.bool)
    for row, trajectory in enumerate(trajectories):
        for position, label in step_positions(trajectory):
            labels[row, position] = label
        last = last_action_positions(trajectory)
        for turn, reward in enumerate(trajectory.turn_rewards):
            if reward and turn in last:
                step_rewards[row, last[turn]] = reward
        n = len(trajectory.token_ids)
        input_ids[row, :n] = torch.tensor(trajectory.token_ids)
        attention[row, :n] = 1
        action[row, :n] = torch.tensor(trajectory.action_mask)
        observation[row, trajectory.prompt_length:n] = ~action[row, trajectory.prompt_length:n]
        behaviour[row, :n] = torch.tensor(trajectory.behaviour_logprobs)
        turns[row, :n] = torch.tensor(trajectory.turn_ids)
        refused = [turn for turn, info in enumerate(trajectory.turn_info) if info.get("error")]
        if refused:
            rejected[row, :n] = action[row, :n] & torch.isin(turns[row, :n], torch.tensor(refused))
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    groups = torch.tensor([t.group_id for t in trajectories], dtype=torch.long)
    cut = torch.tensor([t.cut for t in trajectories], dtype=torch.bool)
    episodes = None
    if any(t.samples > 1 for t in trajectories):
        names: dict[str, int] = {}
        episodes = torch.tensor([names.setdefault(t.episode or f"\x00row-{row}", len(names))
                                 for row, t in enumerate(trajectories)], dtype=torch.long)
    return Batch(input_ids, attention, action, behaviour, turns, rewards, groups, observation, labels, step_rewards,
                 cut, episodes, rejected)


def last_action_positions(trajectory: Trajectory) -> dict[int, int]:
    """{turn: position of the turn's last action token} for each turn with action tokens."""
    last: dict[int, int] = {}
    for position, (acting, turn) in enumerate(zip(trajectory.action_mask, trajectory.turn_ids)):
        if acting:
            last[turn] = position
    return last


def step_positions(trajectory: Trajectory) -> list[tuple[int, int]]:
    """(position of the turn's last action token, label) for each labelled turn of `trajectory`."""
    last = last_action_positions(trajectory)
    return [(last[turn], label) for turn, label in enumerate(trajectory.step_labels)
            if label >= 0 and turn in last]
