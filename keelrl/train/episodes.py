"""Each RL step's episodes, token by token, for reading trajectories (`keel view`).

`run_dir/episodes/step_NNNN.jsonl` holds one JSON line per episode of the step: the task, the
group, the reward and the checks behind it, how the episode ended, the prompt, and for each
turn its action and observation and the action's tokens. Each action token is
`[text, advantage, logp, behaviour_logp, ratio, clipped]`: its advantage as the update used it,
its log-prob under the policy at the update (the first epoch's pass, before that minibatch's
step), the behaviour log-prob recorded at sampling, the importance ratio the clip rule saw, and
whether the clip rule limited it (`keelrl.algos.losses.token_view`). Episodes the update did
not use (a group with a failed environment) are written with their turns' text and no token
values (`"tokens": null`), so the error they show is not lost.

`TokenRecord` collects the learner's per-token values on the device while the update runs and
moves them to the host once, when the step's file is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from keelrl.rollout.trajectory import Trajectory


@dataclass
class TokenRecord:
    """The learner's per-token values of one step's batch, each [B, T] (filled by the update)."""

    logp: Tensor
    ratio: Tensor
    clipped: Tensor

    @classmethod
    def like(cls, behaviour_logprobs: Tensor) -> "TokenRecord":
        zeros = torch.zeros(behaviour_logprobs.shape, dtype=torch.float32, device=behaviour_logprobs.device)
        return cls(zeros, zeros.clone(), torch.zeros(zeros.shape, dtype=torch.bool, device=zeros.device))

    def write(self, rows: Tensor, width: int, logp: Tensor, ratio: Tensor, clipped: Tensor) -> None:
        """Store a micro-batch's values (rows [b], each [b, width]) without leaving the device."""
        self.logp[rows, :width] = logp.detach().to(self.logp.dtype)
        self.ratio[rows, :width] = ratio.detach().to(self.ratio.dtype)
        self.clipped[rows, :width] = clipped


def _number(value: float) -> float | None:
    return round(value, 5) if math.isfinite(value) else None


def _turns_text(trajectory: Trajectory) -> list[dict[str, Any]]:
    return [{"version": trajectory.versions[turn] if turn < len(trajectory.versions) else None,
             "action": action,
             "observation": trajectory.observations[turn] if turn < len(trajectory.observations) else None,
             "tokens": None}
            for turn, action in enumerate(trajectory.actions)]


def episode_rows(step: int, trajectories: Sequence[Trajectory], used: Sequence[Trajectory], tokenizer: Any,
                 advantages: Tensor | None = None, record: TokenRecord | None = None,
                 kinds: Mapping[str, str] | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The step's episode lines: `trajectories` (all of the step), of which `used` are the
    batch's rows in order, with `advantages` [B, T] and `record` for those rows."""
    row_of = {id(t): row for row, t in enumerate(used)}
    host = None
    if advantages is not None and record is not None:
        host = [part.detach().cpu() for part in (advantages.float(), record.logp, record.ratio, record.clipped)]
    out = []
    for trajectory in trajectories[:limit]:
        turns = _turns_text(trajectory)
        row = row_of.get(id(trajectory))
        if host is not None and row is not None:
            adv, logp, ratio, clipped = host
            for turn in turns:
                turn["tokens"] = []
            for position, (token, acting, turn_id) in enumerate(zip(trajectory.token_ids, trajectory.action_mask,
                                                                     trajectory.turn_ids)):
                if acting and turn_id < len(turns):
                    turns[turn_id]["tokens"].append([
                        tokenizer.decode([token]), _number(float(adv[row, position])),
                        _number(float(logp[row, position])),
                        _number(trajectory.behaviour_logprobs[position]),
                        _number(float(ratio[row, position])), bool(clipped[row, position])])
        out.append({
            "step": step, "task_id": trajectory.task_id, "kind": (kinds or {}).get(trajectory.task_id, ""),
            "group_id": trajectory.group_id, "reward": _number(trajectory.reward),
            **({"episode": trajectory.episode, "sample": trajectory.sample, "samples": trajectory.samples}
               if trajectory.episode else {}),
            "success": trajectory.success, "partial": _number(trajectory.partial),
            "termination": trajectory.termination, "error": trajectory.error, "checks": trajectory.checks,
            "prompt": trajectory.prompt or tokenizer.decode(trajectory.token_ids[:trajectory.prompt_length]),
            "turns": turns, "used": row is not None,
        })
    return out
