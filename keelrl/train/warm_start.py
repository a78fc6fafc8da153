"""The warm start: supervised fine-tuning on the scripted teacher's successful demonstrations.

`warm_start.demos` training tasks (cycled, shuffled by the seed) are played by the
environment's scripted teacher; the episodes it solves are the demonstrations. The turns a
teacher's policy marks as its mistakes (`mistake_turns`) are left out of the loss, kept in
the context, unless `warm_start.imitate_mistakes`. The policy then
takes `warm_start.epochs` passes over them in batches of `warm_start.batch_size`, each one
update of the token-mean negative log-likelihood of the action tokens, run in the learner's
micro-batches (`Learner.sft_update`), with its own AdamW at `warm_start.lr`.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Iterable, Sequence


from keelrl.config import KeelConfig
from keelrl.envs.registry import EnvSpec
from keelrl.rollout.agent_loop import EpisodeLimits, run_episodes, scripted_actor
from keelrl.rollout.trajectory import Trajectory, collate
from keelrl.train.learner import Learner, adamw


def warm_start(cfg: KeelConfig, env_spec: EnvSpec, train_tasks: Sequence[Any], make_env: Callable[[], Any],
               rollout: EpisodeLimits, tokenizer: Any, learner: Learner,
               progress: Callable[[str, dict[str, Any]], None]) -> dict[str, float]:
    """Run the warm start (module docstring) on `learner`'s policy; -> its metrics ({} when
    warm_start.demos is 0). `make_env` builds the training environments, `rollout` (one
    attempt per task) how the demonstrations are played."""
    ws = cfg.warm_start
    if ws.demos == 0:
        return {}
    assert env_spec.teacher is not None  # resolve_env: no warm start without a teacher
    teacher = env_spec.teacher(cfg)
    rng = random.Random(f"{cfg.seed}:demos")
    tasks = [train_tasks[i % len(train_tasks)] for i in range(ws.demos)]
    rng.shuffle(tasks)
    policies = [teacher.policy(task) for task in tasks]
    demos = run_episodes(make_env, tasks, tokenizer, scripted_actor(tokenizer, policies), rollout)
    solved = [(demo, policy) for demo, policy in zip(demos, policies) if demo.success]
    masked = 0 if ws.imitate_mistakes else sum(mask_turns(demo, getattr(policy, "mistake_turns", ()))
                                               for demo, policy in solved)
    demos = [demo for demo, _ in solved]
    if not demos:
        raise RuntimeError(f"warm start: none of the teacher's {ws.demos} demonstrations succeeded "
                           f"(env.max_turns={cfg.env.max_turns} may be too few for the task)")
    progress("warm_start", {"demos": len(demos), **({} if ws.imitate_mistakes else {"masked_turns": masked})})
    optimizer = adamw(list(learner.model.parameters()), lr=ws.lr, weight_decay=0.01)  # torch's AdamW default
    learner.model.train()
    losses = []
    for epoch in range(ws.epochs):
        rng.shuffle(demos)
        for start in range(0, len(demos), ws.batch_size):
            batch = collate(demos[start:start + ws.batch_size], tokenizer.pad_token_id).to(learner.device)
            losses.append(learner.sft_update(batch, optimizer))
        progress("warm_start_epoch", {"epoch": epoch + 1, "loss": losses[-1]})
    out = {"warm_start/demos": len(demos), "warm_start/final_loss": losses[-1] if losses else math.nan}
    return out if ws.imitate_mistakes else {**out, "warm_start/masked_turns": masked}


def mask_turns(trajectory: Trajectory, turns: Iterable[int]) -> int:
    """Leave the action tokens of `turns` (0-based turn indices) out of `trajectory`'s action mask,
    in place: they stay in the context but are not learned. Returns how many turns it masked."""
    turns = {turn for turn in turns if 0 <= turn < len(trajectory.actions)}
    trajectory.action_mask = [bool(m) and t not in turns for m, t in zip(trajectory.action_mask, trajectory.turn_ids)]
    return len(turns)
