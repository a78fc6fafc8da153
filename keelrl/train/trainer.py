"""The trainer: warm start, then RL steps with any preset, with independent evaluation.

One RL step (DESIGN.md, data flow):

    sample tasks -> G attempts each (agent loop, behaviour log-probs recorded) -> rewards
    -> [KL reward penalty] -> advantages (group, or critic + GAE) -> for each epoch and
    minibatch: recompute log-probs -> ratio -> clip rule -> aggregation + KL + entropy
    [+ clipped value loss] -> AdamW step with grad clipping.

The reference model of the KL term is the policy as RL starts (after the warm start), frozen:
the anchor is what RL began from, not the untrained initialisation. It is saved in the run
directory (reference/) so a resumed run anchors to the same weights.

Every `eval_every` steps (and before RL, after the warm start) the policy is evaluated on
held-out tasks it never trains on, with the strong verifier, whatever the training verifier
is. A step whose loss or gradient is not finite is skipped and counted. Task sampling and
sampling seeds are functions of (seed, step), so a resumed run repeats exactly what an
uninterrupted one would have done.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from keelrl.algos import compute_advantages, outcome_to_token_rewards, policy_objective, value_loss
from keelrl.algos.losses import kl_reward_penalty
from keelrl.config import KeelConfig, dump_config
from keelrl.envs.coding import CodingEnv
from keelrl.envs.guess import BinarySearchTeacher, GuessEnvFactory
from keelrl.envs.tasks import Task
from keelrl.envs.teacher import ScriptedTeacher
from keelrl.alarms import PATCH_TOOLS, AlarmEvent, AlarmMonitor, distinct_patches
from keelrl.monitor import MetricsLogger, plot_run, read_metrics
from keelrl.policy.critic import build_critic
from keelrl.policy.model import load_policy, resolve_device, token_logprobs
from keelrl.policy.sampling import SamplingConfig
from keelrl.rollout.agent_loop import RolloutConfig, model_actor, run_episodes, scripted_actor
from keelrl.rollout.engines import LocalEngine, RolloutEngine, StepRollouts
from keelrl.rollout.scheduler import GroupRequest
from keelrl.rollout.trajectory import Batch, Trajectory, collate
from keelrl.sandbox import Sandbox, default_hidden_paths
from keelrl.train.dynamic import fill_batch
from keelrl.verifiers import DEFAULT_LIMITS, make_verifier


def load_task_splits(cfg: KeelConfig) -> tuple[list[Any], list[Any]]:
    """(train, heldout) tasks of the configured source and split seed."""
    from keelrl.envs.coding_tasks import bundled_tasks
    from keelrl.envs.tasks import load_tasks, split_of

    tasks: Sequence[Any]
    if cfg.env.name == "guess":
        from keelrl.envs.guess import guess_tasks

        tasks = guess_tasks(cfg.env.guess_tasks, cfg.env.guess_n, seed=cfg.env.split_seed)
    elif cfg.env.tasks == "bundled":
        tasks = bundled_tasks(None, seed=cfg.env.split_seed)
    else:
        tasks = load_tasks(cfg.env.tasks)
    train = [t for t in tasks if split_of(t.id, cfg.env.split_seed) == "train"]
    heldout = [t for t in tasks if split_of(t.id, cfg.env.split_seed) == "heldout"]
    if not train or not heldout:
        raise ValueError(f"env.tasks {cfg.env.tasks!r} gives {len(train)} train and {len(heldout)} held-out tasks; "
                         f"both must be non-empty")
    return train, heldout


def action_error_frac(trajectories: Sequence[Trajectory]) -> float:
    """Share of turns whose action the environment rejected."""
    return sum(t.action_errors for t in trajectories) / max(1, sum(len(t.actions) for t in trajectories))


EXTRA_INDEX_BASE = 1 << 40
"""Request indices of dynamic sampling's extra groups start here (apart from the step stream)."""


class CodingEnvFactory:
    """A picklable `make_env` for CodingEnv (Ray workers build their own sandbox and verifier)."""

    def __init__(self, verifier: str, *, partial_credit: bool = True, max_turns: int = 6,
                 show_tools: bool = False, key_weight: float = 1.0, hidden_paths: Sequence[str] = ()) -> None:
        self.verifier, self.partial_credit, self.key_weight = verifier, partial_credit, key_weight
        self.hidden_paths = list(hidden_paths)
        self.max_turns, self.show_tools = max_turns, show_tools
        self._built: tuple[Sandbox, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_built": None}

    def __call__(self) -> CodingEnv:
        if self._built is None:
            sandbox = Sandbox(DEFAULT_LIMITS, hidden_paths=self.hidden_paths or None)
            self._built = (sandbox, make_verifier(self.verifier, sandbox, partial_credit=self.partial_credit,
                                                  key_weight=self.key_weight))
        sandbox, verifier = self._built
        return CodingEnv(verifier, sandbox=sandbox, max_turns=self.max_turns, show_tools=self.show_tools)


class Trainer:
    """Runs one training job into cfg.run_dir (see the module docstring)."""

    def __init__(self, cfg: KeelConfig, progress: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.progress = progress or (lambda event, info: None)
        self.device = resolve_device(cfg.device)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.model, self.tokenizer = load_policy(cfg.model.path, self.device)
        self.pad_id = self.tokenizer.pad_token_id
        self.value_head = None
        if cfg.algo.uses_critic:
            self.value_head = build_critic(cfg.model.critic, self.model, self.tokenizer, model_path=cfg.model.path,
                                           device=self.device, stop_gradient=cfg.model.value_stop_gradient)
        self.reference = None
        if cfg.algo.kl_coef > 0:
            self.reference, _ = load_policy(cfg.model.path, self.device)
            self.reference.eval().requires_grad_(False)
        self.train_tasks, self.heldout_tasks = load_task_splits(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)  # exists before the sandbox hides it
        self.sandbox = Sandbox(DEFAULT_LIMITS, hidden_paths=self.hidden_paths())
        self.train_verifier = make_verifier(cfg.env.verifier, self.sandbox, partial_credit=cfg.env.partial_credit,
                                            key_weight=cfg.env.key_check_weight)
        self.eval_verifier = make_verifier("strong", self.sandbox)
        self.optimizer = self._optimizer(cfg.train.lr)
        self.step = 0
        self.skipped_steps = 0
        self.summary: dict[str, Any] = {}

    # ----------------------------------------------------------------- helpers
    def _freeze_reference(self) -> None:
        """Make the reference a frozen copy of the current policy and save it for resumes."""
        if self.reference is None:
            return
        self.reference.load_state_dict(self.model.state_dict())
        self.reference.eval().requires_grad_(False)
        self.reference.save_pretrained(self.run_dir / "reference")

    def _load_reference(self) -> None:
        if self.reference is None:
            return
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(self.run_dir / "reference",
                                                     dtype=next(self.reference.parameters()).dtype)
        self.reference.load_state_dict(saved.state_dict())
        self.reference.eval().requires_grad_(False)

    def _parameters(self) -> list[torch.nn.Parameter]:
        params = list(self.model.parameters())
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        return params

    def hidden_paths(self) -> list[str]:
        """What the sandbox hides from the code it runs: keelrl's source, the directory the run
        started in, the run directory (checkpoints, solved transcripts) and the task file."""
        paths = [*default_hidden_paths(), Path(self.cfg.run_dir).resolve()]
        if self.cfg.env.tasks != "bundled":
            paths.append(Path(self.cfg.env.tasks).resolve())
        return [str(path) for path in paths]

    def _optimizer(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self._parameters(), lr=lr, weight_decay=self.cfg.train.weight_decay)

    def _env(self, training: bool) -> Callable[[], Any]:
        """Environments graded by the training verifier, or by `strong` for the held-out eval."""
        if self.cfg.env.name == "guess":
            return GuessEnvFactory(self.cfg.env.max_turns, self.cfg.env.verifier if training else "strong")
        verifier = self.train_verifier if training else self.eval_verifier
        return lambda: CodingEnv(verifier, sandbox=self.sandbox, max_turns=self.cfg.env.max_turns,
                                 show_tools=self.cfg.env.show_tools)

    @property
    def _answer_tools(self) -> tuple[str, ...]:
        """The tools whose calls are an episode's answer, for the distinct-answers metric."""
        return ("guess",) if self.cfg.env.name == "guess" else PATCH_TOOLS

    def _rollout_cfg(self, group_size: int) -> RolloutConfig:
        r = self.cfg.rollout
        return RolloutConfig(group_size=group_size, max_turns=self.cfg.env.max_turns,
                             max_context_tokens=r.max_context_tokens, env_threads=r.env_threads,
                             interruptible=r.interruptible)

    def requests_for(self, step: int) -> list[GroupRequest]:
        """The group requests of RL step `step`: a function of (seed, step) only."""
        r = self.cfg.rollout
        rng = random.Random(f"{self.cfg.seed}:step:{step}")
        chosen = rng.sample(self.train_tasks, min(r.tasks_per_step, len(self.train_tasks)))
        return [GroupRequest(index=(step - 1) * r.tasks_per_step + i, task=task, group_size=r.group_size,
                             seed=(self.cfg.seed * 1_000_003 + step) * 1009 + i, group_id=i)
                for i, task in enumerate(chosen)]

    def train_env_factory(self) -> Callable[[], Any]:
        """A picklable factory of training environments (override to wrap them, e.g. in bench/)."""
        env = self.cfg.env
        if env.name == "guess":
            return GuessEnvFactory(env.max_turns, env.verifier)
        return CodingEnvFactory(env.verifier, partial_credit=env.partial_credit, max_turns=env.max_turns,
                                show_tools=env.show_tools, key_weight=env.key_check_weight,
                                hidden_paths=self.hidden_paths())

    def extra_requests(self, step: int, start: int, count: int) -> list[GroupRequest]:
        """Dynamic sampling's extra groups `start..start+count-1` of step `step` (deterministic)."""
        r = self.cfg.rollout
        rng = random.Random(f"{self.cfg.seed}:step:{step}:extra")
        tasks = [rng.choice(self.train_tasks) for _ in range(start + count)][start:]
        return [GroupRequest(index=EXTRA_INDEX_BASE + step * 100_000 + start + j, task=task, group_size=r.group_size,
                             seed=(self.cfg.seed * 1_000_003 + step) * 1009 + 500_000 + start + j,
                             group_id=r.tasks_per_step + start + j)
                for j, task in enumerate(tasks)]

    def dynamic_fill(self, engine: RolloutEngine, step: int, rollouts: StepRollouts) -> StepRollouts:
        """DAPO dynamic sampling over the engine's batch (see keelrl.train.dynamic)."""
        size = self.cfg.rollout.group_size
        trajectories = rollouts.trajectories
        groups = [trajectories[i:i + size] for i in range(0, len(trajectories), size)]
        drawn = [0]

        def draw(count: int) -> list[list[Trajectory]]:
            results = engine.more(step, self.extra_requests(step, drawn[0], count))
            drawn[0] += count
            return [result.trajectories for result in results]

        filled = fill_batch(groups, draw, target=len(groups), max_extra=self.cfg.rollout.dynamic_max_extra_groups)
        return StepRollouts([t for group in filled.groups for t in group], {**rollouts.metrics, **filled.metrics})

    def make_engine(self, last_step: int | None = None) -> RolloutEngine:
        """The configured rollout engine over this trainer's policy and training environment; it
        sends no requests ahead past `last_step` (default: train.steps)."""
        r = self.cfg.rollout
        sampling = SamplingConfig(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)
        make_env = self.train_env_factory()
        engine: RolloutEngine
        if r.engine == "ray":
            from keelrl.rollout.ray_engine import RayEngine

            engine = RayEngine(self.requests_for, model_path=self.cfg.model.path, tokenizer=self.tokenizer,
                               make_env=make_env, sampling=sampling, rollout=self._rollout_cfg(r.group_size),
                               max_staleness=r.max_staleness, workers=r.workers, worker_cpus=r.worker_cpus,
                               seed=self.cfg.seed)
        else:
            engine = LocalEngine(self.requests_for, model=self.model, tokenizer=self.tokenizer, make_env=make_env,
                                 sampling=sampling, rollout=self._rollout_cfg(r.group_size),
                                 asynchronous=r.engine == "async", max_staleness=r.max_staleness)
        engine.last_step = self.cfg.train.steps if last_step is None else last_step
        return engine

    def publish(self, engine: RolloutEngine, version: int) -> None:
        """Hand the engine a copy of the current weights as `version` (the sync engine shares them)."""
        state = {} if engine.name == "sync" else {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        engine.publish(state, version)

    # ----------------------------------------------------------------- warm start
    def warm_start(self) -> dict[str, float]:
        """SFT on the scripted teacher's successful trajectories over training tasks."""
        ws = self.cfg.warm_start
        if ws.demos == 0:
            return {}
        teacher: Any = (BinarySearchTeacher(mistake_rate=ws.mistake_rate, seed=self.cfg.seed)
                        if self.cfg.env.name == "guess" else
                        ScriptedTeacher(success_rate=1.0, mistake_rate=ws.mistake_rate, seed=self.cfg.seed))
        rng = random.Random(f"{self.cfg.seed}:demos")
        tasks = [self.train_tasks[i % len(self.train_tasks)] for i in range(ws.demos)]
        rng.shuffle(tasks)
        policies = [teacher.policy(task) for task in tasks]
        demos = run_episodes(self._env(training=True), tasks, self.tokenizer,
                             scripted_actor(self.tokenizer, policies), self._rollout_cfg(1))
        demos = [d for d in demos if d.success]
        if not demos:
            raise RuntimeError(f"warm start: none of the teacher's {ws.demos} demonstrations succeeded "
                               f"(env.max_turns={self.cfg.env.max_turns} may be too few for the task)")
        self.progress("warm_start", {"demos": len(demos)})
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=ws.lr)
        self.model.train()
        losses = []
        for epoch in range(ws.epochs):
            rng.shuffle(demos)
            for start in range(0, len(demos), ws.batch_size):
                batch = collate(demos[start:start + ws.batch_size], self.pad_id).to(self.device)
                logp = token_logprobs(self.model, batch.input_ids, batch.attention_mask)["logp"]
                mask = batch.action_mask
                loss = -(logp * mask).sum() / mask.sum().clamp(min=1)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.max_grad_norm)
                optimizer.step()
                losses.append(loss.item())
            self.progress("warm_start_epoch", {"epoch": epoch + 1, "loss": losses[-1]})
        return {"warm_start/demos": len(demos), "warm_start/final_loss": losses[-1] if losses else math.nan}

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, tasks: Sequence[Task] | None = None) -> dict[str, float]:
        """Held-out success with the strong verifier, one attempt per task."""
        tasks = list(tasks if tasks is not None else self.heldout_tasks[: self.cfg.train.eval_tasks])
        sampling = SamplingConfig(temperature=self.cfg.train.eval_temperature, top_p=1.0,
                                  max_new_tokens=self.cfg.rollout.max_new_tokens)
        self.model.eval()
        trajectories = run_episodes(self._env(training=False), tasks, self.tokenizer,
                                    model_actor(self.model, self.tokenizer, sampling),
                                    self._rollout_cfg(1), seed=self.cfg.seed + 7919)
        return {"eval/success": sum(t.success for t in trajectories) / len(trajectories),
                "eval/partial": sum(t.partial for t in trajectories) / len(trajectories),
                "eval/action_error_frac": action_error_frac(trajectories),
                "eval/tasks": len(trajectories)}

    # ----------------------------------------------------------------- RL
    @torch.no_grad()
    def _advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                 torch.Tensor | None, torch.Tensor, dict[str, float]]:
        """-> (advantages, returns, old values, reference log-probs, proximal log-probs, statistics).

        The proximal log-probs are the learner's, before this step's update: the decoupled
        objective's pi_prox, and (against the behaviour log-probs) a measure of how off-policy
        the batch arrived.
        """
        algo = self.cfg.algo
        mask = batch.action_mask
        prox_out = token_logprobs(self.model, batch.input_ids, batch.attention_mask,
                                  with_hidden=self.value_head is not None)
        prox_logp = prox_out["logp"]
        log_w = (prox_logp - batch.behaviour_logprobs).masked_fill(~mask, 0.0).clamp(-algo.max_log_ratio,
                                                                                     algo.max_log_ratio)
        arrival = torch.exp(log_w)
        token_rewards = outcome_to_token_rewards(batch.rewards, mask)
        ref_logp = None
        if self.reference is not None:
            ref_logp = token_logprobs(self.reference, batch.input_ids, batch.attention_mask)["logp"]
            if algo.kl_in_reward:
                token_rewards = kl_reward_penalty(token_rewards, batch.behaviour_logprobs, ref_logp, mask,
                                                  algo.kl_coef, algo.kl_estimator)
        values = None
        if self.value_head is not None:
            values = self.value_head(batch.input_ids, batch.attention_mask, prox_out["hidden"])
        out = compute_advantages(token_rewards=token_rewards, mask=mask, group_ids=batch.group_ids, cfg=algo,
                                 values=values, turn_ids=batch.turn_ids)
        same = batch.group_ids.unsqueeze(0) == batch.group_ids.unsqueeze(1)
        spread = torch.where(same, batch.rewards.unsqueeze(0), float("nan"))
        mixed = (spread.nan_to_num(-1e9).amax(1) != spread.nan_to_num(1e9).amin(1)).float()
        stats = {"train/zero_advantage_frac": 1.0 - mixed.mean().item(),
                 "rollout/arrival_is_weight_mean": (arrival * mask).sum().item() / max(1, int(mask.sum())),
                 "rollout/arrival_is_weight_max": arrival.masked_fill(~mask, 0.0).max().item()}
        return out.advantages, out.returns, values, ref_logp, prox_logp, stats

    def rl_step(self, step: int, rollouts: StepRollouts, started: float | None = None) -> dict[str, Any]:
        """One update from `rollouts` (the engine's batch for `step`); returns the step's metrics row."""
        started = time.monotonic() if started is None else started
        trajectories = rollouts.trajectories
        if not trajectories:  # dynamic sampling kept no group: nothing to learn from this step
            return {**rollouts.metrics, "train/updates": 0, "train/skipped_updates": 0,
                    "time/step_s": time.monotonic() - started}
        learn_started = time.monotonic()
        batch = collate(trajectories, self.pad_id).to(self.device)
        advantages, returns, old_values, ref_all, prox_all, stats = self._advantages(batch)
        algo, train = self.cfg.algo, self.cfg.train
        lr = train.lr * min(1.0, step / train.warmup_steps) if train.warmup_steps else train.lr  # step >= 1
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        sums: dict[str, float] = {}
        updates = skipped = 0
        order = list(range(len(trajectories)))
        rng = random.Random(f"{self.cfg.seed}:minibatch:{step}")
        for _ in range(train.epochs):
            rng.shuffle(order)
            for start in range(0, len(order), train.minibatch_size):
                rows = torch.tensor(order[start:start + train.minibatch_size], device=self.device)
                mb = Batch(**{name: value[rows] for name, value in batch.__dict__.items()})
                out = token_logprobs(self.model, mb.input_ids, mb.attention_mask, with_entropy=True,
                                     with_hidden=self.value_head is not None)
                ref = None if ref_all is None or algo.kl_in_reward else ref_all[rows]
                loss, metrics = policy_objective(logp=out["logp"], old_logp=mb.behaviour_logprobs,
                                                 advantages=advantages[rows], mask=mb.action_mask, cfg=algo,
                                                 ref_logp=ref, entropy=out["entropy"], prox_logp=prox_all[rows])
                if self.value_head is not None and old_values is not None:
                    new_values = self.value_head(mb.input_ids, mb.attention_mask, out["hidden"])
                    vloss, vmetrics = value_loss(new_values, old_values[rows], returns[rows],
                                                 mb.action_mask, algo)
                    loss = loss + algo.value_coef * vloss
                    metrics.update(vmetrics)
                self.optimizer.zero_grad(set_to_none=True)
                if not torch.isfinite(loss):
                    skipped += 1
                    continue
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self._parameters(), train.max_grad_norm)
                if not torch.isfinite(grad_norm):
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                self.optimizer.step()
                updates += 1
                metrics["train/grad_norm"] = grad_norm
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        self.skipped_steps += skipped
        seconds = time.monotonic() - started
        tokens = int(batch.attention_mask.sum())
        row: dict[str, Any] = {key: value / max(1, updates) for key, value in sums.items()}
        row.update(stats)
        row.update(rollouts.metrics)
        learn_seconds = time.monotonic() - learn_started
        row.update({
            "train/reward": sum(t.reward for t in trajectories) / len(trajectories),
            "train/success": sum(t.success for t in trajectories) / len(trajectories),
            "train/partial": sum(t.partial for t in trajectories) / len(trajectories),
            "train/episode_tokens": tokens / len(trajectories),
            "train/action_tokens": sum(t.num_action_tokens for t in trajectories) / len(trajectories),
            "train/turns": sum(len(t.actions) for t in trajectories) / len(trajectories),
            "train/action_error_frac": action_error_frac(trajectories),
            "train/distinct_patches": distinct_patches(self._groups(trajectories), self._answer_tools),
            "train/updates": updates, "train/skipped_updates": skipped, "train/lr": lr,
            "time/step_s": seconds, "time/learn_s": learn_seconds,
            "time/learner_util": learn_seconds / max(seconds, 1e-9),
            "time/tokens_per_s": tokens / max(seconds, 1e-9),
        })
        self._write_samples(step, trajectories)
        return row

    @staticmethod
    def _groups(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
        groups: dict[int, list[Trajectory]] = {}
        for t in trajectories:
            groups.setdefault(t.group_id, []).append(t)
        return list(groups.values())

    def _write_samples(self, step: int, trajectories: Sequence[Trajectory]) -> None:
        count = self.cfg.train.sample_trajectories
        if count <= 0:
            return
        folder = self.run_dir / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        text = "\n\n".join(t.to_text(self.tokenizer) for t in trajectories[:count])
        (folder / f"step_{step:04d}.txt").write_text(text)

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        path = self.run_dir / "checkpoint"
        tmp = self.run_dir / "checkpoint.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(tmp / "model")
        self.tokenizer.save_pretrained(tmp / "model")
        state = {"step": self.step, "optimizer": self.optimizer.state_dict(), "skipped_steps": self.skipped_steps,
                 "summary": self.summary, "torch_rng": torch.random.get_rng_state(),
                 "value_head": self.value_head.state_dict() if self.value_head is not None else None}
        torch.save(state, tmp / "state.pt")
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)
        return path

    def load_checkpoint(self) -> None:
        from transformers import AutoModelForCausalLM

        path = self.run_dir / "checkpoint"
        state = torch.load(path / "state.pt", map_location=self.device, weights_only=False)
        loaded = AutoModelForCausalLM.from_pretrained(path / "model", dtype=next(self.model.parameters()).dtype)
        self.model.load_state_dict(loaded.state_dict())
        if self.value_head is not None and state["value_head"] is not None:
            self.value_head.load_state_dict(state["value_head"])
        self.optimizer = self._optimizer(self.cfg.train.lr)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.random.set_rng_state(state["torch_rng"])
        self.step, self.skipped_steps, self.summary = state["step"], state["skipped_steps"], state["summary"]

    def _raise_alarms(self, events: Sequence[AlarmEvent], trajectories: Sequence[Trajectory]) -> str | None:
        """Record, print and sample around each alarm; returns the name of one that stops the run."""
        stop = None
        for event in events:
            with (self.run_dir / "alarms.jsonl").open("a") as handle:
                handle.write(json.dumps(event.as_dict()) + "\n")
            folder = self.run_dir / "alarms"
            folder.mkdir(exist_ok=True)
            text = "\n\n".join(t.to_text(self.tokenizer) for t in trajectories[:max(4, self.cfg.train.sample_trajectories)])
            (folder / f"{event.name}_step_{event.step:04d}.txt").write_text(f"# {event.message}\n\n{text}")
            self.progress("alarm", event.as_dict())
            if event.name in self.cfg.monitor.stop_on or "any" in self.cfg.monitor.stop_on:
                stop = stop or event.name
        return stop

    # ----------------------------------------------------------------- the job
    def run(self, resume: bool = False, stop_after: int | None = None) -> dict[str, Any]:
        """Warm start (unless resuming), then RL to cfg.train.steps; returns summary.json's content."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        logger = MetricsLogger(self.run_dir)
        monitor = AlarmMonitor(self.cfg.monitor)
        if resume and (self.run_dir / "checkpoint" / "state.pt").exists():
            self.load_checkpoint()
            self._load_reference()
            logger.truncate_after(self.step)
            for old in read_metrics(self.run_dir):  # replay: alarms that fired before stay fired
                monitor.update(int(old["step"]), old)
            self.progress("resumed", {"step": self.step})
        else:
            for stale in ("metrics.jsonl", "alarms.jsonl"):
                if (self.run_dir / stale).exists():
                    (self.run_dir / stale).unlink()
            warm = self.warm_start()
            self._freeze_reference()
            before = self.evaluate()
            self.summary = {"eval_success_before_rl": before["eval/success"], **warm}
            logger.log(0, {**warm, **before})
            monitor.update(0, before)
            self.progress("eval", {"step": 0, **before})
        total = self.cfg.train.steps
        engine = self.make_engine(last_step=total if stop_after is None else min(total, stop_after))
        try:
            if engine.name != "sync":
                self.publish(engine, self.step)
            engine.start(self.step)
            while self.step < total:
                if stop_after is not None and self.step >= stop_after:
                    break
                step = self.step + 1
                started = time.monotonic()
                rollouts = engine.batch(step)
                if self.cfg.algo.dynamic_sampling:
                    rollouts = self.dynamic_fill(engine, step, rollouts)
                row = self.rl_step(step, rollouts, started)
                self.publish(engine, step)
                if step % self.cfg.train.eval_every == 0 or step == total:
                    row.update(self.evaluate())
                self.step = step
                events = monitor.update(step, row)
                row.update({f"alarm/{event.name}": 1.0 for event in events})
                logger.log(step, row)
                self.progress("step", {"step": step, "total": total, **row})
                stop = self._raise_alarms(events, rollouts.trajectories)
                if stop or step % self.cfg.train.checkpoint_every == 0 or step == total:
                    self.save_checkpoint()
                if stop:
                    self.summary["stopped_by_alarm"] = stop
                    break
        finally:
            engine.close()
            logger.close()
        if self.step >= total or "stopped_by_alarm" in self.summary:
            last = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]
            evals = [row["eval/success"] for row in last if "eval/success" in row]
            self.summary.update({"eval_success_after_rl": evals[-1] if evals else None, "steps": self.step,
                                 "skipped_updates": self.skipped_steps, "preset": self.cfg.algo.preset})
            self.summary["plots"] = [str(p) for p in plot_run(self.run_dir)]
            (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
        return self.summary

