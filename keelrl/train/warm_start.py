"""The warm start: supervised fine-tuning on the scripted teacher's successful demonstrations.

The first `warm_start.demos` training tasks (cycled; played in an order shuffled by the seed)
are played by the environment's scripted teacher; the episodes it solves are the
demonstrations. The turns a teacher's policy marks as its mistakes (`mistake_turns`) are left
out of the loss, kept in the context, unless `warm_start.imitate_mistakes`. The policy then
takes `warm_start.epochs` passes over them in batches of `warm_start.batch_size`, each one
update of the token-mean negative log-likelihood of the action tokens, run in the learner's
micro-batches (`Learner.sft_update`), with its own AdamW at `warm_start.lr`.

With `warm_start.own_mistakes`, a second round follows in the manner of DAgger (Ross, Gordon
and Bagnell 2011: the expert labels the states the learner reaches). The student, warm-started,
takes one action on each of that many further training tasks; where that action is an edit
that fails a visible test, the teacher continues from the file it left (`recovery`: test, the
real fix, test, submit). The solved continuations, the student's edit masked, are trained on as
the demos were, mixed with as many of the first round's demos (so that a passing test is still
seen followed by `submit`). The first round's mistakes are the task's one plausible wrong fix;
the student's own first edits are other mistakes, and after them it had not learned what to do.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, Callable, Iterable, Sequence


from keelrl.config import KeelConfig
from keelrl.envs.registry import EnvSpec, runs_own_mistakes
from keelrl.policy.lora import trainable_parameters
from keelrl.rollout.agent_loop import ActFn, EpisodeLimits, run_episodes, scripted_actor
from keelrl.rollout.trajectory import Trajectory, collate
from keelrl.train.learner import Learner, adamw


def warm_start(cfg: KeelConfig, env_spec: EnvSpec, train_tasks: Sequence[Any], make_env: Callable[[], Any],
               rollout: EpisodeLimits, tokenizer: Any, learner: Learner,
               progress: Callable[[str, dict[str, Any]], None],
               student: Callable[[], ActFn] | None = None) -> dict[str, float]:
    """Run the warm start (module docstring) on `learner`'s policy; -> its metrics ({} when
    warm_start.demos is 0). `make_env` builds the training environments, `rollout` (one
    attempt per task) how the demonstrations are played, `student` the actor sampling the
    policy for the own-mistakes round (required where it runs: `runs_own_mistakes`)."""
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
    optimizer = adamw(trainable_parameters(learner.model), lr=ws.lr, weight_decay=0.01)  # torch's AdamW default
    losses = _sft(demos, ws.epochs, ws.batch_size, tokenizer, learner, optimizer, rng, progress, "warm_start_epoch")
    out = {"warm_start/demos": len(demos), "warm_start/final_loss": losses[-1] if losses else math.nan}
    if not ws.imitate_mistakes:
        out["warm_start/masked_turns"] = masked
    if runs_own_mistakes(cfg, teacher):
        if student is None:
            raise ValueError("the own-mistakes round (warm_start.own_mistakes) needs `student`, an actor "
                             "sampling the policy")
        more = [train_tasks[(ws.demos + i) % len(train_tasks)] for i in range(ws.own_mistakes)]
        rng.shuffle(more)
        learner.model.eval()
        own, continued = own_mistake_demos(teacher, more, make_env, rollout, tokenizer, student(), seed=cfg.seed)
        progress("warm_start_own_mistakes", {"tried": len(more), "continued": continued, "demos": len(own)})
        # as many of the first round's demos beside them: a passing test is still followed by submit
        mixed = own + rng.sample(demos, min(len(own), len(demos)))
        losses = _sft(mixed, ws.epochs, ws.batch_size, tokenizer, learner, optimizer, rng, progress,
                      "warm_start_own_epoch")
        out.update({"warm_start/own_tried": len(more), "warm_start/own_continued": continued,
                    "warm_start/own_demos": len(own)})
        if losses:
            out["warm_start/own_final_loss"] = losses[-1]
    return out


def own_mistake_demos(teacher: Any, tasks: Sequence[Any], make_env: Callable[[], Any], rollout: EpisodeLimits,
                      tokenizer: Any, act: ActFn, seed: int = 0) -> tuple[list[Trajectory], int]:
    """The own-mistakes round's demonstrations (module docstring): `act` takes one action on each
    of `tasks`; the teacher's `recovery` continues the ones it can within rollout.max_turns,
    each played in full under `rollout`, and the solved ones are returned with their first (the student's) turn masked.
    -> (demos, how many first actions the teacher continued)."""
    firsts = run_episodes(make_env, tasks, tokenizer, act, dataclasses.replace(rollout, max_turns=1), seed=seed)
    picked, policies = [], []
    env = make_env()
    try:
        for task, first in zip(tasks, firsts):
            if not first.actions:  # no room for an action (context limit)
                continue
            env.reset(task)
            policy = teacher.recovery(task, first.actions[0], env)
            if policy is not None and len(policy.plan.actions) <= rollout.max_turns:
                picked.append(task)
                policies.append(policy)
    finally:
        env.close()
    if not policies:
        return [], 0
    played = run_episodes(make_env, picked, tokenizer, scripted_actor(tokenizer, policies), rollout, seed=seed)
    demos = [demo for demo in played if demo.success]
    for demo in demos:
        mask_turns(demo, {0})
    return demos, len(policies)


def _sft(demos: list[Trajectory], epochs: int, batch_size: int, tokenizer: Any, learner: Learner, optimizer: Any,
         rng: random.Random, progress: Callable[[str, dict[str, Any]], None], event: str) -> list[float]:
    """`epochs` passes over `demos` in shuffled batches of `batch_size`, one `sft_update` each;
    -> the losses."""
    learner.model.train()
    losses: list[float] = []
    if not demos:
        return losses
    for epoch in range(epochs):
        rng.shuffle(demos)
        for start in range(0, len(demos), batch_size):
            batch = collate(demos[start:start + batch_size], tokenizer.pad_token_id).to(learner.device)
            losses.append(learner.sft_update(batch, optimizer))
        progress(event, {"epoch": epoch + 1, "loss": losses[-1]})
    return losses


def mask_turns(trajectory: Trajectory, turns: Iterable[int]) -> int:
    """Leave the action tokens of `turns` (0-based turn indices) out of `trajectory`'s action mask,
    in place: they stay in the context but are not learned. Returns how many turns it masked."""
    turns = {turn for turn in turns if 0 <= turn < len(trajectory.actions)}
    trajectory.action_mask = [bool(m) and t not in turns for m, t in zip(trajectory.action_mask, trajectory.turn_ids)]
    return len(turns)
