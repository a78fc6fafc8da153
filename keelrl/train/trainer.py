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

Memory. No forward pass sees more than `train.micro_batch_tokens` padded tokens (rows x
longest row): the no-grad passes (proximal, reference, critic values) run over groups of rows,
and each optimiser minibatch (of RL and of the warm start) runs as micro-batches whose
gradients accumulate into the update of one pass over the minibatch. A row longer than the budget runs alone, over budget. The
aggregation modes weigh tokens by minibatch-wide normalisers (the minibatch's action tokens,
its rows, its rows with actions); `aggregation_weights` reads each mode's token weights off
the registered function, and each micro-batch's loss is scaled so that its weights are the
minibatch's weights on its rows (`micro_batch_scale`): the scaled micro-batch losses sum to
the minibatch loss for every mode whose loss is linear in the per-token terms, and any other
mode fails loudly. Every step logs memory/peak_rss_gb (a high-water mark of the process),
memory/rss_gb and, on CUDA, memory/cuda_peak_gb (peak since the previous step's row).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import resource
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from keelrl.algos import compute_advantages, outcome_to_token_rewards, policy_objective, value_loss
from keelrl.algos.config import AlgoConfig
from keelrl.algos.distill import forward_kl, generalized_jsd, reverse_kl, sampled_reverse_kl, top_token_disagreement
from keelrl.algos.losses import aggregate, kl_reward_penalty, token_view
from keelrl.config import KeelConfig, dump_config, to_dict
from keelrl.envs.coding import CodingEnvFactory  # noqa: F401 - still importable from here
from keelrl.envs.registry import EnvSpec, coding_hidden_paths, resolve_env
from keelrl.envs.tasks import Task
from keelrl.alarms import AlarmEvent, AlarmMonitor, alarm_sample_path, distinct_patches
from keelrl.monitor import MetricsLogger, plot_run, read_metrics, truncate_jsonl
from keelrl.sinks import check_sinks
from keelrl.train.episodes import TokenRecord, episode_rows, write_episodes
from keelrl.policy.critic import build_critic
from keelrl.policy.model import (chunked_token_logprobs, cpu_has_amx_bf16, learner_autocast, load_policy, pin_to_cores,
                                 resolve_device, row_lengths,
                                 split_rows, token_logprobs)
from keelrl.policy.prefix import micro_logprobs, plan_passes
from keelrl.train.curriculum import Curriculum, CurriculumConfig
from keelrl.train.distill import Teacher, TeacherView, head_logits
from keelrl.policy.sampling import SamplingConfig
from keelrl.rollout.agent_loop import RolloutConfig, model_actor, run_episodes, scripted_actor
from keelrl.rollout.engines import LocalEngine, RolloutEngine, StepRollouts
from keelrl.rollout.scheduler import GroupRequest
from keelrl.rollout.trajectory import Batch, Trajectory, collate
from keelrl.train.checkpoint import (CheckpointError, atomic_write_text, forget_checkpoints, fsync_tree,
                                     latest_checkpoint, save_checkpoint)
from keelrl.train.dynamic import fill_batch
from keelrl.train.prm import ProcessRewardModel, classification_metrics, labelled_turns, process_advantages
from keelrl.train.evaluation import finite_or_none, heldout_report, paired_difference


def load_task_splits(cfg: KeelConfig, env: EnvSpec | None = None) -> tuple[list[Any], list[Any]]:
    """(train, heldout) tasks of the run's environment (`env`, else the one registered as env.name)."""
    spec = resolve_env(cfg, env)
    train, heldout = spec.tasks(cfg)
    return list(train), list(heldout)


def context_limit_frac(trajectories: Sequence[Trajectory]) -> float:
    """Share of episodes ended because the next turn could not fit `rollout.max_context_tokens`."""
    return sum(t.termination == "context_limit" for t in trajectories) / max(1, len(trajectories))


def action_error_frac(trajectories: Sequence[Trajectory]) -> float:
    """Share of turns whose action the environment rejected."""
    return sum(t.action_errors for t in trajectories) / max(1, sum(len(t.actions) for t in trajectories))


OBJECTIVE_METRICS = frozenset({"policy/loss", "loss/total", "value/loss", "distill/loss"})
"""Metrics that are values of the aggregated objective: combined over micro-batches with the
loss scale. The others are action-token means (combined by token share) or `*_max` (max)."""


def aggregation_weights(mask: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """mask [B, T] -> weights [B, T] (float64) with aggregate(x, mask, cfg) == sum(weights * x) for all x.

    Read off the registered aggregation function by autograd, so every mode, present or
    future, is covered without a table typed by hand. Raises ValueError when the mode is not
    linear in the per-token terms (micro-batching could not split it).
    """
    count = mask.numel()
    probe = ((torch.arange(count, dtype=torch.float64, device=mask.device) * 0.618034) % 1.0 + 0.5)
    probe = probe.reshape(mask.shape).requires_grad_(True)  # [B, T], varied and non-zero
    with torch.enable_grad():
        total = aggregate(probe, mask, cfg)
        (weights,) = torch.autograd.grad(total, probe)
    if not torch.allclose(total.detach(), (weights * probe.detach()).sum(), rtol=1e-9, atol=1e-12):
        raise ValueError(f"algo.aggregation={cfg.aggregation!r} is not linear in the per-token losses, so "
                         f"train.micro_batch_tokens cannot split a minibatch into micro-batches")
    return weights


def micro_batch_scale(minibatch_weights: torch.Tensor, micro_mask: torch.Tensor, cfg: AlgoConfig) -> float:
    """The factor s with s * aggregate(x, micro_mask) == sum(minibatch_weights * x) on the micro-batch's rows.

    minibatch_weights [b, t]: `aggregation_weights` of the whole minibatch, at the micro-batch's
    rows and columns; micro_mask [b, t]. E.g. token_mean: s = micro-batch action tokens /
    minibatch action tokens; seq_mean_token_sum and constant: s = b / minibatch rows.
    """
    micro_weights = aggregation_weights(micro_mask, cfg)
    scale = float(minibatch_weights.sum() / micro_weights.sum()) if micro_weights.sum() != 0 else 0.0
    if not torch.allclose(minibatch_weights, scale * micro_weights, rtol=1e-9, atol=1e-15):
        raise ValueError(f"algo.aggregation={cfg.aggregation!r} weighs a micro-batch's tokens differently from "
                         f"the whole minibatch, so train.micro_batch_tokens cannot split it; raise "
                         f"train.micro_batch_tokens above the minibatch's padded tokens")
    return scale


def combine_micro_metrics(parts: Sequence[tuple[dict[str, torch.Tensor], float, float, bool]]) -> dict[str, float]:
    """Per-micro-batch metrics -> the minibatch's. Each part: (metrics, loss scale, share of the
    minibatch's action tokens, has action tokens).

    Objective values (OBJECTIVE_METRICS) add up with the loss scale, `*_max` metrics take the
    max over micro-batches with action tokens, and the rest (action-token means) add up with
    the token share.
    """
    combined: dict[str, float] = {}
    for key in parts[0][0]:
        if key in OBJECTIVE_METRICS:
            combined[key] = sum(float(metrics[key]) * scale for metrics, scale, _, _ in parts)
        elif key.endswith("_max"):
            acted = [float(metrics[key]) for metrics, _, _, has_tokens in parts if has_tokens]
            combined[key] = max(acted) if acted else 0.0
        else:
            combined[key] = sum(float(metrics[key]) * share for metrics, _, share, _ in parts)
    return combined


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Process memory in GiB: peak resident set (a high-water mark since the process started),
    current resident set (Linux) and, on CUDA, the peak allocated since the last reset."""
    row: dict[str, float] = {}
    statm = Path("/proc/self/statm")
    if statm.exists():
        resident_pages = int(statm.read_text().split()[1])
        row["memory/rss_gb"] = resident_pages * os.sysconf("SC_PAGE_SIZE") / (1 << 30)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak_gb = peak / (1 << 30) if sys.platform == "darwin" else peak / (1 << 20)
    # The kernel's high-water mark lags the live counters by a few pages; the peak is at least now.
    row["memory/peak_rss_gb"] = max(peak_gb, row.get("memory/rss_gb", 0.0))
    if device.type == "cuda":
        row["memory/cuda_peak_gb"] = torch.cuda.max_memory_allocated(device) / (1 << 30)
    return row


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute `model`'s layer activations in backward passes (non-reentrant checkpoints).

    Takes effect only in training mode with gradients enabled, so sampling and no-grad passes
    are unaffected.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def prefix_keys(train: Any, batch: Batch) -> torch.Tensor | None:
    """Which rows of `batch` the learner's passes may run by shared prompt: those of one group
    (the plan checks the tokens). None, so every pass runs plainly, unless train.share_prefix;
    never under activation checkpointing, which would replay the layers that fill the cache."""
    if not train.share_prefix or train.gradient_checkpointing:
        return None
    return batch.group_ids.cpu()


def arrival_stats(prox_logp: torch.Tensor, batch: Batch, algo: AlgoConfig) -> dict[str, float]:
    """How off-policy the batch arrived: the importance weight pi_prox / mu over its action tokens."""
    mask = batch.action_mask
    log_w = (prox_logp - batch.behaviour_logprobs).masked_fill(~mask, 0.0).clamp(-algo.max_log_ratio,
                                                                                 algo.max_log_ratio)
    arrival = torch.exp(log_w)  # [B, T]
    return {"rollout/arrival_is_weight_mean": (arrival * mask).sum().item() / max(1, int(mask.sum())),
            "rollout/arrival_is_weight_max": arrival.masked_fill(~mask, 0.0).max().item()}


def group_order(group_ids: Sequence[int], rng: random.Random) -> list[int]:
    """Row indices with the groups in a shuffled order and each group's rows together (in attempt
    order): minibatches cut from it hold whole groups when train.minibatch_size is a multiple of
    the group size, so each group's shared prompt runs once in its minibatch (as verl counts its
    minibatches in prompts). Rows shuffled one by one would split every group across minibatches."""
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(group_ids):
        groups.setdefault(group, []).append(row)
    keys = list(groups)
    rng.shuffle(keys)
    return [row for key in keys for row in groups[key]]


def take_rows(batch: Batch, rows: torch.Tensor, width: int) -> Batch:
    """The rows `rows` of `batch`, with [B, T] fields cut to the first `width` positions."""
    fields: dict[str, torch.Tensor | None] = {}
    for name, value in batch.__dict__.items():
        if value is None:
            fields[name] = None
            continue
        value = value[rows]
        fields[name] = value[:, :width] if value.dim() == 2 else value
    return Batch(**fields)  # type: ignore[arg-type]


EXTRA_INDEX_BASE = 1 << 40
"""Request indices of dynamic sampling's extra groups start here (apart from the step stream)."""


class Trainer:
    """Runs one training job into cfg.run_dir (see the module docstring).

    `env`: the environment to train on, overriding the one registered as `cfg.env.name` (which is
    set to `env.name`): a user's `EnvSpec` plugs in here without registering a name. `model`,
    `tasks` and `run_dir`, where given, replace model.path (a local HF causal LM, a .gguf file or
    a registered name), env.tasks (a task .jsonl file) and run_dir in `cfg`
    (`keelrl.api.with_paths`). The environment is resolved and checked against the config first,
    before any model loads. `progress(event, info)` hears of phases, evaluations, steps and
    alarms as they happen. Stable public API: `Trainer(cfg, progress=None, env=None, *, model=None,
    tasks=None, run_dir=None)`.
    """

    def __init__(self, cfg: KeelConfig, progress: Callable[[str, dict[str, Any]], None] | None = None,
                 env: EnvSpec | None = None, *, model: str | Path | None = None, tasks: str | Path | None = None,
                 run_dir: str | Path | None = None) -> None:
        from keelrl.api import with_paths

        cfg = with_paths(cfg, model=model, tasks=tasks, run_dir=run_dir,
                         env_name=env.name if isinstance(env, EnvSpec) else None)
        self.cfg = cfg
        self.env_spec = resolve_env(cfg, env)
        """The run's environment kind (keelrl.envs.registry)."""
        self.train_tasks, self.heldout_tasks = load_task_splits(cfg, self.env_spec)  # a bad file fails now
        self._task_kinds = {task.id: getattr(task, "kind", "") for task in self.train_tasks}
        self.run_dir = Path(cfg.run_dir)
        check_sinks(cfg.log, self.run_dir)  # a missing wandb/mlflow fails now, before the model loads
        self.progress = progress or (lambda event, info: None)
        self.device = resolve_device(cfg.device)
        if cfg.train.learner_cores:  # before the first torch op starts its thread pool
            pin_to_cores(cfg.train.learner_cores)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.model, self.tokenizer = load_policy(cfg.model.path, self.device)
        if cfg.train.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.pad_id = self.tokenizer.pad_token_id
        self.value_head = None
        if cfg.algo.uses_critic:
            self.value_head = build_critic(cfg.model.critic, self.model, self.tokenizer, model_path=cfg.model.path,
                                           device=self.device, stop_gradient=cfg.model.value_stop_gradient)
        self.reference = None
        if cfg.algo.kl_coef > 0:
            self.reference, _ = load_policy(cfg.model.path, self.device)
            self.reference.eval().requires_grad_(False)
        self.teacher: Teacher | None = None
        if cfg.distill.mode != "none":
            self.teacher = Teacher(cfg.distill, self.model, self.tokenizer, student_name=cfg.model.path,
                                   device=self.device, tasks=self.train_tasks, temperature=cfg.rollout.temperature,
                                   max_tokens=cfg.train.micro_batch_tokens)
        self._teacher_view: TeacherView | None = None
        self.prm: ProcessRewardModel | None = None
        if cfg.prm.enabled:
            self.prm = ProcessRewardModel(self.model.config.hidden_size, self.device, lr=cfg.prm.lr,
                                          fit_steps=cfg.prm.fit_steps, buffer=cfg.prm.buffer)
        self.curriculum: Curriculum | None = None
        self._curriculum_lock = threading.Lock()
        if cfg.curriculum.enabled:
            c = cfg.curriculum
            levels = c.level_of()
            self.curriculum = Curriculum([levels.get(getattr(task, "kind", ""), 0) for task in self.train_tasks],
                                         CurriculumConfig(band=(c.band_low, c.band_high), probe_weight=c.probe_weight,
                                                          advance_at=c.advance_at, min_attempts=c.min_attempts),
                                         seed=cfg.seed)
        self.run_dir.mkdir(parents=True, exist_ok=True)  # exists before a sandbox hides it
        # Built once: the warm start, evaluations and teacher rollouts share each factory (a coding
        # factory builds its sandbox and verifier once, on first use).
        self._local_envs = {True: self.env_spec.train_env(cfg), False: self.env_spec.eval_env(cfg)}
        self.optimizer = self._optimizer(cfg.train.lr)
        self.step = 0
        self.skipped_steps = 0
        self.summary: dict[str, Any] = {}
        self._eval_copy: Any = None
        self.last_eval_report: dict[str, Any] | None = None
        """The latest `evaluate`'s full report (per kind, per task), for summary.json."""

    # ----------------------------------------------------------------- helpers
    def _freeze_reference(self) -> None:
        """Make the reference a frozen copy of the current policy and save it for resumes."""
        if self.reference is None:
            return
        self.reference.load_state_dict(self.model.state_dict())
        self.reference.eval().requires_grad_(False)
        # Written whole before the step-0 checkpoint exists: any checkpoint a resume finds was
        # made after this reference was complete and durable.
        folder, tmp = self.run_dir / "reference", self.run_dir / f".reference.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.reference.save_pretrained(tmp)
        fsync_tree(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)

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
        """What the coding sandbox hides from the code it runs (`coding_hidden_paths`)."""
        return coding_hidden_paths(self.cfg)

    def _eval_model(self) -> Any:
        """The policy as evaluation samples it: itself, or a copy of its current weights in
        `train.eval_dtype` (bf16 decoding measured 2x float32's speed on the AMX CPU here,
        bench/bench_sampler.py; the evaluation needs no behaviour log-probs to match the learner)."""
        auto = torch.bfloat16 if self.device.type == "cpu" and cpu_has_amx_bf16() else self.model.dtype
        wanted = {"auto": auto, "float32": torch.float32, "bfloat16": torch.bfloat16}[self.cfg.train.eval_dtype]
        if wanted == self.model.dtype:
            return self.model
        if self._eval_copy is None:
            self._eval_copy = copy.deepcopy(self.model).to(wanted)
        self._eval_copy.load_state_dict(self.model.state_dict())  # cast into the copy's dtype
        return self._eval_copy.eval()

    def autocast(self) -> Any:
        """The learner's precision context (`train.learner_precision`); sampling never uses it."""
        return learner_autocast(self.device, self.cfg.train.learner_precision)

    def _optimizer(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self._parameters(), lr=lr, weight_decay=self.cfg.train.weight_decay)

    def _env(self, training: bool) -> Callable[[], Any]:
        """This process's environments: graded by the training verifier (warm start, teacher
        rollouts), or by `strong` for the held-out eval."""
        return self._local_envs[training]

    @property
    def _answer_tools(self) -> tuple[str, ...]:
        """The tools whose calls are an episode's answer, for the distinct-answers metric."""
        return self.env_spec.answer_tools

    def _rollout_cfg(self, group_size: int) -> RolloutConfig:
        r = self.cfg.rollout
        return RolloutConfig(group_size=group_size, max_turns=self.cfg.env.max_turns,
                             max_context_tokens=r.max_context_tokens, max_new_tokens=r.max_new_tokens,
                             env_threads=r.env_threads, interruptible=r.interruptible,
                             label_steps=self.prm is not None)

    def requests_for(self, step: int) -> list[GroupRequest]:
        """The group requests of RL step `step`: a function of (seed, step) only, or with a
        curriculum of (seed, step, the curriculum's state when the engine asks)."""
        r = self.cfg.rollout
        rng = random.Random(f"{self.cfg.seed}:step:{step}")
        if self.curriculum is not None:  # from the curriculum's weights as they are now (and the same step seed)
            with self._curriculum_lock:
                chosen = [self.train_tasks[i] for i in self.curriculum.sample(r.tasks_per_step, rng)]
        else:
            chosen = rng.sample(self.train_tasks, min(r.tasks_per_step, len(self.train_tasks)))
        return [GroupRequest(index=(step - 1) * r.tasks_per_step + i, task=task, group_size=r.group_size,
                             seed=(self.cfg.seed * 1_000_003 + step) * 1009 + i, group_id=i)
                for i, task in enumerate(chosen)]

    def train_env_factory(self) -> Callable[[], Any]:
        """A picklable factory of training environments, a fresh one per call, for the rollout
        engine (override to wrap them, e.g. in bench/)."""
        return self.env_spec.train_env(self.cfg)

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

    def rollout_sampling(self) -> SamplingConfig:
        """How training rollouts sample actions (override for other stop strings, as bench/ does)."""
        r = self.cfg.rollout
        return SamplingConfig(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                              keep_kv=r.keep_kv)

    def make_engine(self, last_step: int | None = None) -> RolloutEngine:
        """The configured rollout engine over this trainer's policy and training environment; it
        sends no requests ahead past `last_step` (default: train.steps)."""
        r = self.cfg.rollout
        sampling = self.rollout_sampling()
        make_env = self.train_env_factory()
        engine: RolloutEngine
        if r.engine == "ray":
            from keelrl.rollout.ray_engine import RayEngine

            engine = RayEngine(self.requests_for, model_path=self.cfg.model.path, tokenizer=self.tokenizer,
                               make_env=make_env, sampling=sampling, rollout=self._rollout_cfg(r.group_size),
                               max_staleness=r.max_staleness, workers=r.workers, worker_cpus=r.worker_cpus,
                               worker_cores=tuple(r.worker_cores),
                               worker_timeout_s=r.worker_timeout_s, seed=self.cfg.seed)
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
        assert self.env_spec.teacher is not None  # resolve_env: no warm start without a teacher
        teacher = self.env_spec.teacher(self.cfg)
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
                # Token mean over the whole batch: each micro-batch divides by the batch's count.
                action_tokens = batch.action_mask.sum().clamp(min=1)
                lengths = row_lengths(batch.attention_mask).tolist()
                optimizer.zero_grad(set_to_none=True)
                loss_value = 0.0
                for group in split_rows(lengths, self.cfg.train.micro_batch_tokens):
                    micro = take_rows(batch, torch.tensor(group, device=self.device), max(lengths[r] for r in group))
                    with self.autocast():
                        logp = token_logprobs(self.model, micro.input_ids, micro.attention_mask,
                                              positions=micro.action_mask)["logp"]
                    loss = -(logp * micro.action_mask).sum() / action_tokens
                    if loss.requires_grad:  # rows without action tokens: nothing to learn from
                        loss.backward()
                    loss_value += loss.item()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.max_grad_norm)
                optimizer.step()
                losses.append(loss_value)
            self.progress("warm_start_epoch", {"epoch": epoch + 1, "loss": losses[-1]})
        return {"warm_start/demos": len(demos), "warm_start/final_loss": losses[-1] if losses else math.nan}

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, tasks: Sequence[Task] | None = None) -> dict[str, float]:
        """Held-out success with the strong verifier, one attempt per task."""
        tasks = list(tasks if tasks is not None else self.heldout_tasks[: self.cfg.train.eval_tasks])
        sampling = SamplingConfig(temperature=self.cfg.train.eval_temperature, top_p=1.0,
                                  max_new_tokens=self.cfg.rollout.max_new_tokens, keep_kv=self.cfg.rollout.keep_kv)
        self.model.eval()
        trajectories = run_episodes(self._env(training=False), tasks, self.tokenizer,
                                    model_actor(self._eval_model(), self.tokenizer, sampling),
                                    self._rollout_cfg(1), seed=self.cfg.seed + 7919)
        report = heldout_report(trajectories, [getattr(task, "kind", "all") for task in tasks])
        self.last_eval_report = report
        return {"eval/success": report["success"], "eval/success_se": report["success_se"],
                "eval/partial": report["partial"], "eval/partial_se": report["partial_se"],
                "eval/action_error_frac": action_error_frac(trajectories),
                "eval/context_limit_frac": context_limit_frac(trajectories),
                "eval/tasks": len(trajectories), **self._heldout_prm(trajectories)}

    @torch.no_grad()
    def _heldout_prm(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """The process reward model's accuracy on the held-out episodes' labelled turns."""
        graded = [t for t in trajectories if t.termination != "env_error" and t.step_labels]
        if self.prm is None or not graded:
            return {}
        batch = collate(graded, self.pad_id).to(self.device)
        where, labels = labelled_turns(batch)
        with self.autocast():
            features = chunked_token_logprobs(self.model, batch.input_ids, batch.attention_mask,
                                              max_tokens=self.cfg.train.micro_batch_tokens, positions=where,
                                              hidden_at=where)["hidden_at"]
        return classification_metrics(self.prm.scores(features), labels, "eval/prm_")

    # ----------------------------------------------------------------- RL
    @torch.no_grad()
    def _advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                 torch.Tensor | None, torch.Tensor | None, dict[str, float]]:
        """-> (advantages, returns, old values, reference log-probs, proximal log-probs, statistics).

        The proximal log-probs are the learner's, before this step's update: the decoupled
        objective's pi_prox, and (against the behaviour log-probs) a measure of how off-policy
        the batch arrived. None when the update's own pass provides them (`prox_from_update`).
        """
        algo = self.cfg.algo
        mask = batch.action_mask
        budget = self.cfg.train.micro_batch_tokens
        keys = prefix_keys(self.cfg.train, batch)
        steps, step_labels = labelled_turns(batch)
        prox_out: dict[str, torch.Tensor] = {}
        if not self.prox_from_update(batch):
            with self.autocast():  # the same precision as the update's passes: fresh ratios stay 1
                prox_out = chunked_token_logprobs(self.model, batch.input_ids, batch.attention_mask, max_tokens=budget,
                                                  value_fn=self.value_head, positions=mask,
                                                  temperature=self.cfg.rollout.temperature, keys=keys,
                                                  hidden_at=steps if self.prm is not None else None)
        prox_logp = prox_out.get("logp")
        token_rewards = outcome_to_token_rewards(batch.rewards, mask)
        ref_logp = None
        if self.reference is not None:
            with self.autocast():
                ref_logp = chunked_token_logprobs(self.reference, batch.input_ids, batch.attention_mask,
                                                  max_tokens=budget, positions=mask,
                                                  temperature=self.cfg.rollout.temperature, keys=keys)["logp"]
            if algo.kl_in_reward:
                token_rewards = kl_reward_penalty(token_rewards, batch.behaviour_logprobs, ref_logp, mask,
                                                  algo.kl_coef, algo.kl_estimator)
        values = prox_out.get("values")
        out = compute_advantages(token_rewards=token_rewards, mask=mask, group_ids=batch.group_ids, cfg=algo,
                                 values=values, turn_ids=batch.turn_ids)
        advantages = out.advantages
        prm_stats: dict[str, float] = {}
        if self.prm is not None:
            features = prox_out["hidden_at"]
            scores = self.prm.scores(features)  # before this batch is fitted: an out-of-sample accuracy
            prm_stats = classification_metrics(scores, step_labels, "prm/")
            if self.cfg.prm.weight > 0:
                advantages = advantages + process_advantages(scores, steps, batch,
                                                             self.cfg.prm.weight).to(advantages.dtype)
            prm_stats.update(self.prm.fit(features, step_labels))
        distill_stats: dict[str, float] = {}
        if self.teacher is not None and self._teacher_view is not None:
            teacher_logp = self.teacher.logprobs(self._teacher_view, mask, keys)
            assert prox_logp is not None  # a teacher keeps the pre-update pass
            sampled_kl = sampled_reverse_kl(prox_logp, teacher_logp).masked_fill(~mask, 0.0)  # [B, T]
            distill_stats["distill/sampled_kl"] = sampled_kl.sum().item() / max(1, int(mask.sum()))
            if self.cfg.distill.form == "advantage":  # a dense per-token reward: -coef x the sampled reverse KL
                advantages = advantages - self.cfg.distill.coef * sampled_kl.to(advantages.dtype)
        same = batch.group_ids.unsqueeze(0) == batch.group_ids.unsqueeze(1)
        spread = torch.where(same, batch.rewards.unsqueeze(0), float("nan"))
        mixed = (spread.nan_to_num(-1e9).amax(1) != spread.nan_to_num(1e9).amin(1)).float()
        stats = {"train/zero_advantage_frac": 1.0 - mixed.mean().item(), **distill_stats, **prm_stats}
        if prox_logp is not None:
            stats.update(arrival_stats(prox_logp, batch, algo))
        return advantages, out.returns, values, ref_logp, prox_logp, stats

    def prox_from_update(self, batch: Batch) -> bool:
        """Whether the proximal log-probs come from the update's own forward pass, not a no-grad pass before it.

        When a step makes exactly one update (one epoch, the whole batch one minibatch), every
        row's forward pass in that update runs on the pre-update weights, so its detached
        log-probs are the proximal ones: the separate pass (a quarter of the learner's work)
        is redundant. Not so with a critic, a process reward model or a teacher, which need
        the pre-update pass's values, hidden states or log-probs before the update starts.
        """
        train = self.cfg.train
        return (train.epochs == 1 and batch.input_ids.shape[0] <= train.minibatch_size and self.value_head is None
                and self.prm is None and self.teacher is None)

    def teacher_samples(self, step: int) -> bool:
        """Whether step `step` trains on teacher-sampled histories (GKD's 1 - lambda of the steps,
        chosen by the seed and the step alone)."""
        share = self.cfg.distill.student_share
        return self.teacher is not None and share < 1.0 and random.Random(f"{self.cfg.seed}:gkd:{step}").random() >= share

    def teacher_rollouts(self, step: int) -> StepRollouts:
        """The step's groups (the same tasks, seeds and group ids as the student's), sampled by
        the teacher at the rollout temperature."""
        assert self.teacher is not None and self.teacher.model is not None
        requests = self.requests_for(step)
        tasks = [request.task for request in requests for _ in range(request.group_size)]
        groups = [request.group_id for request in requests for _ in range(request.group_size)]
        sampling = self.rollout_sampling()
        trajectories = run_episodes(self._env(training=True), tasks, self.tokenizer,
                                    model_actor(self.teacher.model, self.tokenizer, sampling),
                                    self._rollout_cfg(1), group_ids=groups, seed=requests[0].seed if requests else 0)
        return StepRollouts(trajectories, {"distill/teacher_histories": 1.0}, sampled_by_teacher=True)

    def rl_step(self, step: int, rollouts: StepRollouts, started: float | None = None) -> dict[str, Any]:
        """One update from `rollouts` (the engine's batch for `step`); returns the step's metrics row.

        Rollouts `sampled_by_teacher` (`teacher_rollouts`) get no RL term (advantages 0, old
        log-probs the student's own): the distillation loss alone."""
        started = time.monotonic() if started is None else started
        # A group with an episode whose environment failed (ungraded, reward NaN) has no baseline:
        # it is left out whole, and counted.
        failed_groups = {t.group_id for t in rollouts.trajectories if t.termination == "env_error"}
        trajectories = [t for t in rollouts.trajectories if t.group_id not in failed_groups]
        env_errors = {"train/env_error_frac": sum(t.termination == "env_error" for t in rollouts.trajectories)
                      / max(1, len(rollouts.trajectories)),
                      "train/env_error_groups_dropped": len(failed_groups)}
        if not trajectories:  # dynamic sampling kept no group, or every group failed: nothing to learn from
            self._write_episodes(step, rollouts.trajectories)
            return {**rollouts.metrics, **env_errors, "train/updates": 0, "train/skipped_updates": 0,
                    "time/step_s": time.monotonic() - started}
        learn_started = time.monotonic()
        batch = collate(trajectories, self.pad_id).to(self.device)
        self._teacher_view = None if self.teacher is None else self.teacher.view(batch, trajectories, self.pad_id)
        advantages, returns, old_values, ref_all, prox_all, stats = self._advantages(batch)
        if rollouts.sampled_by_teacher:  # another policy's samples: distil on them, do not reinforce them
            assert prox_all is not None  # a teacher keeps the pre-update pass
            advantages = torch.zeros_like(advantages)
            batch.behaviour_logprobs = prox_all.to(batch.behaviour_logprobs.dtype).masked_fill(~batch.action_mask, 0.0)
            stats.pop("distill/sampled_kl", None)  # a KL under the teacher's samples, not the student's
            stats.update({"rollout/arrival_is_weight_mean": 1.0, "rollout/arrival_is_weight_max": 1.0})
        algo, train = self.cfg.algo, self.cfg.train
        lr = train.lr * min(1.0, step / train.warmup_steps) if train.warmup_steps else train.lr  # step >= 1
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        sums: dict[str, float] = {}
        updates = skipped = micro_batches = 0
        rng = random.Random(f"{self.cfg.seed}:minibatch:{step}")
        fill_prox = prox_all is None  # filled by the update's own forward pass (prox_from_update)
        if prox_all is None:
            prox_all = torch.zeros_like(batch.behaviour_logprobs)
        learner = (advantages, returns, old_values, ref_all, prox_all)
        record = TokenRecord.like(batch.behaviour_logprobs) if train.save_episodes else None
        for epoch in range(train.epochs):
            order = group_order([t.group_id for t in trajectories], rng)
            for start in range(0, len(order), train.minibatch_size):
                rows = torch.tensor(order[start:start + train.minibatch_size], device=self.device)
                self.optimizer.zero_grad(set_to_none=True)
                metrics, passes = self.accumulate_gradients(batch, rows, *learner, fill_prox=fill_prox,
                                                            record=record if epoch == 0 else None)
                micro_batches += passes
                if metrics is None:  # a micro-batch's loss was not finite
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                grad_norm = torch.nn.utils.clip_grad_norm_(self._parameters(), train.max_grad_norm)
                if not torch.isfinite(grad_norm):
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                self.optimizer.step()
                updates += 1
                metrics["train/grad_norm"] = float(grad_norm)
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
        self.skipped_steps += skipped
        if fill_prox:
            stats.update(arrival_stats(prox_all, batch, algo))
        seconds = time.monotonic() - started
        tokens = int(batch.attention_mask.sum())
        row: dict[str, Any] = {key: value / max(1, updates) for key, value in sums.items()}
        row.update(stats)
        row.update(rollouts.metrics)
        row.update(env_errors)
        learn_seconds = time.monotonic() - learn_started
        row.update({
            "train/reward": sum(t.reward for t in trajectories) / len(trajectories),
            "train/success": sum(t.success for t in trajectories) / len(trajectories),
            "train/partial": sum(t.partial for t in trajectories) / len(trajectories),
            "train/episode_tokens": tokens / len(trajectories),
            "train/action_tokens": sum(t.num_action_tokens for t in trajectories) / len(trajectories),
            "train/turns": sum(len(t.actions) for t in trajectories) / len(trajectories),
            "train/action_error_frac": action_error_frac(trajectories),
            "train/context_limit_frac": context_limit_frac(trajectories),
            "train/distinct_patches": distinct_patches(self._groups(trajectories), self._answer_tools),
            "train/updates": updates, "train/skipped_updates": skipped, "train/lr": lr,
            "train/micro_batches": micro_batches,
            "time/step_s": seconds, "time/learn_s": learn_seconds,
            "time/learner_util": learn_seconds / max(seconds, 1e-9),
            "time/tokens_per_s": tokens / max(seconds, 1e-9),
        })
        row.update(memory_metrics(self.device))
        if self.device.type == "cuda":  # the next row's peak covers the next step only
            torch.cuda.reset_peak_memory_stats(self.device)
        self._write_samples(step, rollouts.trajectories)  # failed episodes too: they show the error
        self._write_episodes(step, rollouts.trajectories, trajectories, advantages, record)
        if self.curriculum is not None:
            row.update(self._record_curriculum(trajectories))
        return row

    def _record_curriculum(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Each graded attempt's outcome into the curriculum, then its update; -> its metrics."""
        assert self.curriculum is not None
        index = {task.id: i for i, task in enumerate(self.train_tasks)}
        with self._curriculum_lock:
            for trajectory in trajectories:
                if trajectory.task_id in index:  # dynamic sampling's extra groups are training tasks too
                    self.curriculum.record(index[trajectory.task_id], trajectory.success)
            self.curriculum.update()
            return self.curriculum.metrics()

    def accumulate_gradients(self, batch: Batch, rows: torch.Tensor, advantages: torch.Tensor,
                             returns: torch.Tensor, old_values: torch.Tensor | None, ref_all: torch.Tensor | None,
                             prox_all: torch.Tensor, fill_prox: bool = False,
                             record: TokenRecord | None = None) -> tuple[dict[str, float] | None, int]:
        """Backward of the minibatch `rows` of `batch`, in micro-batches -> (the minibatch's metrics, passes run).

        `fill_prox`: the proximal log-probs are this pass's own (detached), written into `prox_all`
        as each micro-batch runs (`prox_from_update`). `record`: each action token's log-prob,
        ratio and clip, as this pass's loss sees them, are stored there (for episodes/).

        Gradients add up in the parameters' .grad (the caller zeroes them first) to those of one
        pass over the whole minibatch: each micro-batch's loss is scaled by `micro_batch_scale`.
        Rows are sorted by length within the minibatch and each micro-batch is cut to its own
        longest row; a row longer than train.micro_batch_tokens runs alone. Metrics are `None`
        when a micro-batch's loss is not finite (the remaining micro-batches are not run).
        """
        algo = self.cfg.algo
        mask = batch.action_mask[rows]  # [b, T]
        minibatch_weights = aggregation_weights(mask, algo)  # [b, T]
        action_tokens = int(mask.sum())
        parts: list[tuple[dict[str, torch.Tensor], float, float, bool]] = []
        keys = prefix_keys(self.cfg.train, batch)
        distill = self.cfg.distill
        loss_teacher = self.teacher if distill.form == "loss" else None
        observation_coef = 0.0 if batch.observation_mask is None else distill.observation_coef
        observed = batch.observation_mask[rows] if observation_coef > 0 else None  # type: ignore[index]
        observation_tokens = max(1, int(observed.sum())) if observed is not None else 1
        observation_nll = 0.0
        scored = mask if observed is None else mask | observed
        for plan in plan_passes(batch.input_ids[rows], batch.attention_mask[rows], self.cfg.train.micro_batch_tokens,
                                keys=None if keys is None else keys[rows.cpu()],
                                positions=scored):
            group, width = list(plan.rows), plan.width
            micro_rows = rows[torch.tensor(group, device=rows.device)]
            micro = take_rows(batch, micro_rows, width)
            scale = micro_batch_scale(minibatch_weights[group, :width], micro.action_mask, algo)
            with self.autocast():
                out = micro_logprobs(self.model, micro.input_ids, micro.attention_mask, plan, with_entropy=True,
                                     with_hidden=self.value_head is not None or loss_teacher is not None,
                                     positions=scored[group, :width], temperature=self.cfg.rollout.temperature)
            ref = None if ref_all is None or algo.kl_in_reward else ref_all[micro_rows, :width]
            if fill_prox:
                prox_all[micro_rows, :width] = out["logp"].detach().to(prox_all.dtype)
            loss, metrics = policy_objective(logp=out["logp"], old_logp=micro.behaviour_logprobs,
                                             advantages=advantages[micro_rows, :width], mask=micro.action_mask,
                                             cfg=algo, ref_logp=ref, entropy=out["entropy"],
                                             prox_logp=prox_all[micro_rows, :width])
            if record is not None:
                record.write(micro_rows, width, out["logp"], *token_view(
                    logp=out["logp"], old_logp=micro.behaviour_logprobs, advantages=advantages[micro_rows, :width],
                    mask=micro.action_mask, cfg=algo, prox_logp=prox_all[micro_rows, :width]))
            if self.value_head is not None and old_values is not None:
                new_values = self.value_head(micro.input_ids, micro.attention_mask, out["hidden"])
                vloss, vmetrics = value_loss(new_values, old_values[micro_rows, :width],
                                             returns[micro_rows, :width], micro.action_mask, algo)
                loss = loss + algo.value_coef * vloss
                metrics.update(vmetrics)
            if loss_teacher is not None:
                dloss, dmetrics = self._distill_loss(loss_teacher, out["hidden"], micro.action_mask, micro_rows)
                loss = loss + dloss
                metrics.update(dmetrics)
            total = loss * scale
            if observed is not None:  # Echo: next-token loss on the observation tokens, minibatch token mean
                micro_observed = observed[group, :width]
                nll = -out["logp"].masked_fill(~micro_observed, 0.0).sum() / observation_tokens
                total = total + observation_coef * nll
                observation_nll += float(nll.detach())
            if not torch.isfinite(total):
                return None, len(parts) + 1
            if total.requires_grad:  # a micro-batch without action tokens has no graph: nothing to add
                total.backward()
            micro_tokens = int(micro.action_mask.sum())
            parts.append((metrics, scale, micro_tokens / max(1, action_tokens), micro_tokens > 0))
        combined = combine_micro_metrics(parts)
        if observed is not None:
            combined["train/observation_nll"] = observation_nll
            combined["train/observation_tokens"] = float(observed.sum())
        return combined, len(parts)

    def _distill_loss(self, teacher: Teacher, hidden: torch.Tensor, action_mask: torch.Tensor,
                      rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """coef x the aggregated divergence between the student's and the teacher's next-token
        distributions at each action token of a micro-batch (distill.form=loss), and its metrics."""
        assert self._teacher_view is not None
        cfg, algo = self.cfg.distill, self.cfg.algo
        student = head_logits(self.model, hidden, action_mask, self.cfg.rollout.temperature)  # [n, V]
        target = teacher.action_logits(self._teacher_view, rows)  # [n, V]
        if cfg.divergence == "reverse_kl":
            per_token = reverse_kl(student, target)
        elif cfg.divergence == "forward_kl":
            per_token = forward_kl(student, target, top_k=cfg.top_k or None)
        else:
            per_token = generalized_jsd(student, target, beta=cfg.beta)
        where = action_mask[:, 1:].nonzero(as_tuple=True)
        dense = torch.zeros(action_mask.shape, dtype=per_token.dtype, device=per_token.device)
        dense = dense.index_put((where[0], where[1] + 1), per_token)
        loss = cfg.coef * aggregate(dense, action_mask, algo)
        count = max(1, per_token.numel())
        return loss, {"distill/loss": loss.detach(), "distill/kl": per_token.detach().sum() / count,
                      "distill/top_token_differs": top_token_disagreement(student.detach(), target).sum() / count}

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

    def _write_episodes(self, step: int, trajectories: Sequence[Trajectory], used: Sequence[Trajectory] = (),
                        advantages: torch.Tensor | None = None, record: TokenRecord | None = None) -> None:
        """episodes/step_NNNN.jsonl for `keel view` (keelrl.train.episodes); `used` are the batch's rows."""
        count = self.cfg.train.save_episodes
        if count:
            write_episodes(self.run_dir, step, episode_rows(step, trajectories, used, self.tokenizer, advantages,
                                                            record, self._task_kinds, limit=count))

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Checkpoint the current step (crash-safe: keelrl.train.checkpoint); -> its folder."""

        def write(folder: Path) -> None:
            self.model.save_pretrained(folder / "model")
            self.tokenizer.save_pretrained(folder / "model")
            state = {"step": self.step, "optimizer": self.optimizer.state_dict(),
                     "skipped_steps": self.skipped_steps, "summary": self.summary,
                     "torch_rng": torch.random.get_rng_state(),
                     "value_head": self.value_head.state_dict() if self.value_head is not None else None,
                     "curriculum": self.curriculum.state_dict() if self.curriculum is not None else None,
                     "prm": self.prm.state_dict() if self.prm is not None else None}
            torch.save(state, folder / "state.pt")

        return save_checkpoint(self.run_dir, self.step, write)

    def load_checkpoint(self) -> None:
        """Load the checkpoint run_dir/checkpoint.json names; CheckpointError when there is none."""
        from transformers import AutoModelForCausalLM

        path = latest_checkpoint(self.run_dir)
        if path is None:
            raise CheckpointError(f"nothing to resume in {self.run_dir}: no checkpoint.json (a run writes its "
                                  f"first checkpoint at step 0, after the warm start and its evaluation; one "
                                  f"killed before that must start again, without --resume)")
        state = torch.load(path / "state.pt", map_location=self.device, weights_only=False)
        loaded = AutoModelForCausalLM.from_pretrained(path / "model", dtype=next(self.model.parameters()).dtype)
        self.model.load_state_dict(loaded.state_dict())
        if self.value_head is not None and state["value_head"] is not None:
            self.value_head.load_state_dict(state["value_head"])
        if self.curriculum is not None and state.get("curriculum") is not None:
            self.curriculum.load_state_dict(state["curriculum"])
        if self.prm is not None and state.get("prm") is not None:
            self.prm.load_state_dict(state["prm"])
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
            path = alarm_sample_path(self.run_dir, event.name, event.step)
            path.parent.mkdir(exist_ok=True)
            text = "\n\n".join(t.to_text(self.tokenizer) for t in trajectories[:max(4, self.cfg.train.sample_trajectories)])
            path.write_text(f"# {event.message}\n\n{text}")
            self.progress("alarm", event.as_dict())
            if event.name in self.cfg.monitor.stop_on or "any" in self.cfg.monitor.stop_on:
                stop = stop or event.name
        return stop

    # ----------------------------------------------------------------- the job
    def train(self) -> dict[str, Any]:
        """The whole job, from the start: `run()`. -> summary.json's content."""
        return self.run()

    def run(self, resume: bool = False, stop_after: int | None = None) -> dict[str, Any]:
        """Warm start (unless resuming), then RL to cfg.train.steps; returns summary.json's content."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self.load_checkpoint()  # before anything is written: a failed resume changes nothing
        else:
            forget_checkpoints(self.run_dir)  # first: no later resume may mix the old run's files with ours
        atomic_write_text(self.run_dir / "config.yaml", dump_config(self.cfg))
        logger = MetricsLogger(self.run_dir, self.cfg.log, config=to_dict(self.cfg),
                               resume_after=self.step if resume else None)
        with logger:  # closes every sink, telling W&B and MLflow whether the run failed
            monitor = AlarmMonitor(self.cfg.monitor)
            if resume:
                self._load_reference()
                truncate_jsonl(self.run_dir / "alarms.jsonl", self.step)
                for old in read_metrics(self.run_dir):  # replay: alarms that fired before stay fired
                    monitor.update(int(old["step"]), old)
                if self.step < self.cfg.train.steps:  # resumed to go further: the old end is not the end
                    self.summary.get("heldout", {}).pop("final", None)
                self.progress("resumed", {"step": self.step})
            else:
                for stale in ("metrics.jsonl", "alarms.jsonl"):
                    if (self.run_dir / stale).exists():
                        (self.run_dir / stale).unlink()
                for old_episodes in (self.run_dir / "episodes").glob("step_*.jsonl"):  # an earlier run's
                    old_episodes.unlink()
                heldout: dict[str, Any] = {}
                if self.cfg.train.eval_base and self.cfg.warm_start.demos > 0:
                    self.progress("phase", {"phase": "eval (base model)"})
                    base = self.evaluate()
                    heldout["base"] = self.last_eval_report
                    self.progress("eval_base", base)
                self.progress("phase", {"phase": "warm start"})
                warm = self.warm_start()
                self._freeze_reference()
                before: dict[str, float] = {}
                if self.cfg.train.eval_before_rl:
                    self.progress("phase", {"phase": "eval (before RL)"})
                    before = self.evaluate()
                    heldout["warm_start"] = self.last_eval_report
                self.summary = {"eval_success_before_rl": before.get("eval/success"), **warm, "heldout": heldout}
                if warm or before:
                    logger.log(0, {**warm, **before})
                monitor.update(0, before)
                if before:
                    self.progress("eval", {"step": 0, **before})
                self.save_checkpoint()  # step 0: a kill from here on resumes without redoing the warm start
            total = self.cfg.train.steps
            engine = self.make_engine(last_step=total if stop_after is None else min(total, stop_after))
            try:
                if engine.name != "sync":
                    self.publish(engine, self.step)
                engine.start(self.step)
                self.progress("phase", {"phase": "RL"})
                while self.step < total:
                    if stop_after is not None and self.step >= stop_after:
                        break
                    step = self.step + 1
                    started = time.monotonic()
                    teacher_step = self.teacher_samples(step)
                    if teacher_step and engine.name == "sync":
                        rollouts = self.teacher_rollouts(step)
                    else:
                        rollouts = engine.batch(step)  # (an async engine's batch is made anyway: keep its stream)
                        if teacher_step:
                            rollouts = self.teacher_rollouts(step)
                        elif self.cfg.algo.dynamic_sampling:
                            rollouts = self.dynamic_fill(engine, step, rollouts)
                    row = self.rl_step(step, rollouts, started)
                    self.publish(engine, step)
                    if step % self.cfg.train.eval_every == 0 or step == total:
                        row.update(self.evaluate())
                        if step == total:  # kept in the checkpoint with the summary
                            self.summary.setdefault("heldout", {})["final"] = self.last_eval_report
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
            if self.step >= total or "stopped_by_alarm" in self.summary:
                last = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]
                evals = [row["eval/success"] for row in last if "eval/success" in row]
                self.summary.update({"eval_success_after_rl": evals[-1] if evals else None, "steps": self.step,
                                     "skipped_updates": self.skipped_steps, "preset": self.cfg.algo.preset})
                self.summary.update(_lift_summary(self.summary.get("heldout", {})))
                self.summary["plots"] = [str(p) for p in plot_run(self.run_dir)]
                atomic_write_text(self.run_dir / "summary.json", json.dumps(self.summary, indent=2))
                logger.log_summary(self.summary)
        return self.summary


def _lift_summary(heldout: dict[str, Any]) -> dict[str, Any]:
    """Held-out strict success and partial credit (with standard errors) at base, after the warm
    start and at the end of RL, and RL's own lift (final - warm start) with its paired error."""
    out: dict[str, Any] = {}
    for stage in ("base", "warm_start", "final"):
        report = heldout.get(stage)
        if report:
            out[f"heldout_{stage}"] = {key: report[key] for key in ("tasks", "success", "success_se",
                                                                    "partial", "partial_se")}
    if heldout.get("warm_start") and heldout.get("final"):
        lift, lift_se = paired_difference(heldout["warm_start"]["task_success"], heldout["final"]["task_success"])
        out["rl_lift"] = {"success": lift, "success_se": finite_or_none(lift_se)}
    return out
