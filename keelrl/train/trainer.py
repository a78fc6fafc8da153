"""The trainer: warm start, then RL steps with any preset, with independent evaluation.

One RL step (`Trainer.rl_step`) reads top to bottom:

    1. rollouts   the engine's batch of the step's groups (keelrl.rollout.engines), groups with
                  a failed environment left out whole
    2. batch      collated onto the device
    3. advantages the no-grad passes, rewards, estimator and shaping (keelrl.train.advantage)
    4. updates    epochs x minibatches of micro-batched passes and AdamW steps
                  (keelrl.train.learner)
    5. publish    the new weights to the engine (`run`, after the step)
    6. log        the step's metrics row, samples and episodes (keelrl.train.outputs)

The reference model of the KL term is the policy as RL starts (after the warm start), frozen:
the anchor is what RL began from, not the untrained initialisation. It is saved in the run
directory (reference/) so a resumed run anchors to the same weights. A LoRA policy
(`model.lora.rank` > 0) keeps no second model for it: its reference is its own base with the
adapter off, or with a frozen copy of the adapter as RL started when a warm start trained it
(`keelrl.policy.lora.AdapterReference`; reference/ then holds that adapter).

Every `eval.every` steps (and before RL, after the warm start) the policy is evaluated on
held-out tasks it never trains on, with the strong verifier, whatever the training verifier
is; every `eval.probe_every` step between, a small fixed subset of them (the probe,
`eval.probe_tasks`) is evaluated the same way, so the held-out curve has a point at each step
for the plots and the divergence alarm (at a full evaluation's step the probe's figure is read
from it). A step whose loss or gradient is not finite is skipped and counted. Task sampling and
sampling seeds are functions of (seed, step) (keelrl.train.requests), so a resumed run repeats
exactly what an uninterrupted one would have done. Every step logs memory/peak_rss_gb (a
high-water mark of the process), memory/rss_gb and, on CUDA, memory/cuda_peak_gb (peak since
the previous step's row).

What eval.dtype and perf.learner_precision come to on this machine (auto: measured once per
machine, thread count and model shape, keelrl.inference.precision) is resolved when the Trainer is
built, printed as one "precision: ..." line and written to precision.json at every start and
resume; config.yaml keeps the settings as given, so a run resumed elsewhere measures there.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from keelrl.alarms import AlarmMonitor
from keelrl.algos.distill import sampled_reverse_kl
from keelrl.components import check
from keelrl.config import KeelConfig, dump_config, to_dict, with_paths
from keelrl.envs.formats import format_of
from keelrl.envs.registry import EnvSpec, resolve_env, settle_env
from keelrl.inference import DecoderOptions, SamplingParams
from keelrl.metrics import MetricsLogger
from keelrl.policy import lora
from keelrl.policy.critic import build_critic
from keelrl.policy.model import base_name, load_policy, pin_to_cores, resolve_device
from keelrl.inference.precision import measurement, resolve_dtype
from keelrl.rollout.agent_loop import EpisodeLimits, model_actor, run_episodes
from keelrl.rollout.build import build_engine
from keelrl.rollout.engines import RolloutEngine, StepRollouts
from keelrl.rollout.scheduler import GroupRequest
from keelrl.rollout.trajectory import collate
from keelrl.serve.sessions import UNFINISHED
from keelrl.runs import (ALARMS, CONFIG, SUMMARY, atomic_write_text, clear_outputs, drop_steps_after, forget_checkpoints,
                         read_metrics, truncate_jsonl)
from keelrl.sinks import check_sinks
from keelrl.train import state
from keelrl.train.advantage import AdvantageStage, arrival_stats
from keelrl.train.console import ConsoleProgress
from keelrl.train.curriculum import Curriculum
from keelrl.train.distill import Teacher
from keelrl.train.episodes import TokenRecord
from keelrl.train.evaluation import Evaluator, probe_figures
from keelrl.train.learner import Learner, enable_gradient_checkpointing
from keelrl.train.outputs import RunOutputs, episode_metrics, memory_metrics
from keelrl.train.prm import ProcessRewardModel
from keelrl.train.requests import RequestStream
from keelrl.train.warm_start import warm_start

UNGRADED = ("env_error", UNFINISHED)
"""Terminations of episodes without a grade (reward NaN): their groups are left out of the update."""


def resolve_precision(cfg: KeelConfig, model: Any, device: torch.device) -> dict[str, Any]:
    """{"eval": ..., "rollout": ..., "learner": ...}, each {"setting", "dtype", "why"}: eval.dtype,
    rollout.dtype and perf.learner_precision resolved for `model` on `device` (auto: measured on first use and cached,
    keelrl.inference.precision), with the measurement's timings when one was used."""
    settings = {"eval": cfg.eval.dtype, "rollout": cfg.rollout.dtype, "learner": cfg.perf.learner_precision}
    resolved: dict[str, Any] = {}
    record = measurement(model, device) if device.type == "cpu" and "auto" in settings.values() else None
    for use, setting in settings.items():
        if setting == "auto" and record is not None:  # the same record resolve_dtype would read, read once
            choice = record["choices"][use]
            resolved[use] = {"setting": setting, "dtype": choice["dtype"], "why": choice["why"]}
        else:
            dtype, why = resolve_dtype(setting, use, model, device)
            resolved[use] = {"setting": setting, "dtype": str(dtype).removeprefix("torch."), "why": why}
    if record is not None:
        resolved["measurement"] = {name: record.get(name) for name in ("path", "measured_at", "load_average",
                                                                      "load_before", "disturbed", "threads",
                                                                      "timings_s", "skipped")}
    return resolved


def precision_line(resolved: dict[str, Any]) -> str:
    """One line for the console: "precision: eval bfloat16 (why), learner float32 (why)"."""
    return "precision: " + ", ".join(f"{use} {resolved[use]['dtype']} ({resolved[use]['why']})"
                                     for use in ("eval", "learner"))


def _silent(event: str, info: dict[str, Any]) -> None:
    """The progress callback of a Trainer given none (outside `train()`)."""


def load_task_splits(cfg: KeelConfig, env: EnvSpec | None = None) -> tuple[list[Any], list[Any]]:
    """(train, heldout) tasks of the run's environment (`env`, else the one registered as env.name)."""
    spec = resolve_env(cfg, env)
    train, heldout = spec.tasks(cfg)
    return list(train), list(heldout)


class Trainer:
    """Runs one training job into cfg.run_dir (see the module docstring).

    `env`: the environment to train on, overriding the one registered as `cfg.env.name` (which is
    set to `env.name`): a user's `EnvSpec` plugs in here without registering a name. `model`,
    `tasks` and `run_dir`, where given, replace model.path (a local HF causal LM, a .gguf file or
    a registered name), env.tasks (a task .jsonl file) and run_dir in `cfg`
    (`keelrl.config.with_paths`). The environment is resolved and checked against the config
    first, before any model loads. `progress(event, info)` hears of phases, evaluations, steps and
    alarms as they happen. Stable public API: `Trainer(cfg, progress=None, env=None, *, model=None,
    tasks=None, run_dir=None)`.
    """

    def __init__(self, cfg: KeelConfig, progress: Callable[[str, dict[str, Any]], None] | None = None,
                 env: EnvSpec | None = None, *, model: str | Path | None = None, tasks: str | Path | None = None,
                 run_dir: str | Path | None = None) -> None:
        cfg = with_paths(cfg, model=model, tasks=tasks, run_dir=run_dir,
                         env_name=env.name if isinstance(env, EnvSpec) else None)
        self.env_spec = check(cfg, env)  # every component the config names, before any model loads
        """The run's environment kind (keelrl.envs.registry)."""
        cfg = settle_env(cfg, self.env_spec)  # env.max_turns: the environment's own where unset
        self.cfg = cfg
        train, heldout = self.env_spec.tasks(cfg)  # a bad task file fails now
        self.train_tasks, self.heldout_tasks = list(train), list(heldout)
        self.run_dir = Path(cfg.run_dir)
        check_sinks(cfg.log, self.run_dir)  # a missing wandb/mlflow fails now, before the model loads
        self.progress = progress or _silent
        self._own_progress = progress is not None
        self.device = resolve_device(cfg.device)
        if cfg.perf.learner_cores:  # before the first torch op starts its thread pool
            pin_to_cores(cfg.perf.learner_cores)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.model, self.tokenizer = load_policy(cfg.model.path, self.device)
        # model.lora: a LoRA adapter on the policy, its base frozen (keelrl.policy.lora); the model stays
        # the transformers model, peft's layers inside it
        self.model = lora.settle(self.model, cfg.model.lora, path=cfg.model.path,
                                 base=base_name(cfg.model.path) if cfg.model.lora.rank > 0 else "")
        if cfg.perf.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.pad_id = self.tokenizer.pad_token_id
        self.value_head = None
        if cfg.algo.uses_critic:
            self.value_head = build_critic(cfg.model.critic, self.model, self.tokenizer, model_path=cfg.model.path,
                                           device=self.device, stop_gradient=cfg.model.value_stop_gradient)
        self.reference: Any = None
        """The frozen KL reference: a model, or for a LoRA policy an `AdapterReference` (no second model)."""
        if cfg.algo.kl_coef > 0 and lora.is_lora(self.model):
            self.reference = lora.AdapterReference(self.model)
        elif cfg.algo.kl_coef > 0:
            self.reference, _ = load_policy(cfg.model.path, self.device)
            if lora.is_lora(self.reference):  # model.path holds an adapter; the run trains the merged model
                self.reference = lora.merged_model(self.reference)
            self.reference.eval().requires_grad_(False)
        self.teacher: Teacher | None = None
        if cfg.distill.mode != "none":
            self.teacher = Teacher(cfg.distill, self.model, self.tokenizer, student_name=cfg.model.path,
                                   device=self.device, tasks=self.train_tasks, temperature=cfg.rollout.temperature,
                                   max_tokens=cfg.perf.micro_batch_tokens)
        self.prm: ProcessRewardModel | None = None
        if cfg.prm.enabled and cfg.prm.scorer:  # prm.scorer=false: the rollouts' labels alone
            self.prm = ProcessRewardModel(self.model.config.hidden_size, self.device, lr=cfg.prm.lr,
                                          fit_steps=cfg.prm.fit_steps, buffer=cfg.prm.buffer)
        self.curriculum: Curriculum | None = None
        if cfg.curriculum.enabled:
            c = cfg.curriculum
            levels = c.level_of()
            self.curriculum = Curriculum([levels.get(getattr(task, "kind", ""), 0) for task in self.train_tasks],
                                         cfg.curriculum, seed=cfg.seed)
        weights = None if self.env_spec.weights is None else self.env_spec.weights(self.train_tasks)
        self.requests = RequestStream(cfg, self.train_tasks, self.curriculum, has_teacher=self.teacher is not None,
                                      weights=weights)  # a mix of environments: in proportion to their weights
        self.precision = resolve_precision(cfg, self.model, self.device)
        """What eval.dtype and perf.learner_precision came to on this machine, and why (precision.json)."""
        learner_cfg = dataclasses.replace(cfg, perf=dataclasses.replace(
            cfg.perf, learner_precision=self.precision["learner"]["dtype"]))  # learner_autocast takes no auto
        self.learner = Learner(learner_cfg, self.model, self.value_head, self.teacher, self.device)
        self.advantages = AdvantageStage(cfg, self.model, self.value_head, self.reference, self.prm, self.teacher,
                                         self.learner.autocast)
        self.run_dir.mkdir(parents=True, exist_ok=True)  # exists before a sandbox hides it
        # Built once: the warm start, evaluations and teacher rollouts share each factory (a coding
        # factory builds its sandbox and verifier once, on first use).
        self._local_envs = {True: self.env_spec.train_env(cfg), False: self.env_spec.eval_env(cfg)}
        self.evaluator = Evaluator(cfg, self.model, self.tokenizer, self.device, self._local_envs[False],
                                   self._limits(), self.prm, self.learner.autocast, self._answer_tools,
                                   family=self.env_spec.family, test_tool=self.env_spec.test_tool)
        self.outputs = RunOutputs(cfg, self.run_dir, self.tokenizer,
                                  {task.id: getattr(task, "kind", "") for task in self.train_tasks},
                                  lambda event, info: self.progress(event, info))  # train() may swap it
        self.step = 0
        self.policy_version = 0
        """The policy version the model holds (updates done): ahead of `step` between a step's
        update and the end of its logging (its evaluation runs then)."""
        self.skipped_steps = 0
        self.summary: dict[str, Any] = {}
        self.start_evaluation: tuple[dict[str, float], dict[str, Any]] | None = None
        """(metrics, report) of an evaluation of these same starting weights made elsewhere, as
        `evaluate` and `last_eval_report` give them: when set, a fresh run without a warm start
        takes it as its evaluation before RL instead of running that evaluation (a lab's arms from
        one student: `keelrl.labs.common.train_variants`' evaluate_start_once)."""

    # ----------------------------------------------------------------- parts
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.learner.optimizer

    def hidden_paths(self) -> list[str]:
        """What the environment's sandbox hides from the code it runs (`EnvSpec.hidden_paths`; none
        for an environment that runs no code)."""
        return [] if self.env_spec.hidden_paths is None else self.env_spec.hidden_paths(self.cfg)

    def _env(self, training: bool) -> Callable[[], Any]:
        """This process's environments: graded by the training verifier (warm start, teacher
        rollouts), or by `strong` for the held-out eval."""
        return self._local_envs[training]

    @property
    def _answer_tools(self) -> tuple[str, ...]:
        """The tools whose calls are an episode's answer, for the distinct-answers metric."""
        return self.env_spec.answer_tools

    def _limits(self) -> EpisodeLimits:
        """The scheduler's episode limits: the rollout section's (rollout.lockstep among them),
        env.max_turns, and process labels when the run has a process reward model."""
        assert self.cfg.env.max_turns is not None  # settled in __init__
        return EpisodeLimits.of(self.cfg.rollout, self.cfg.env.max_turns, label_steps=self.cfg.prm.enabled)

    def requests_for(self, step: int) -> list[GroupRequest]:
        """The group requests of RL step `step` (`RequestStream.for_step`)."""
        return self.requests.for_step(step)

    def train_env_factory(self) -> Callable[[], Any]:
        """A picklable factory of training environments, a fresh one per call, for the rollout
        engine (override to wrap them, e.g. in bench/)."""
        return self.env_spec.train_env(self.cfg)

    def rollout_sampling(self) -> SamplingParams:
        """How training rollouts sample actions (override for other stop strings, as bench/ does)."""
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                              keep_kv=r.keep_kv, stop=format_of(self.cfg.env.tool_format).stop)

    def decoder_options(self) -> DecoderOptions:
        """The rollout decoder (rollout.decoder, its dtype as resolved, rollout.kv_budget_mb)."""
        r = self.cfg.rollout
        return DecoderOptions(decoder=r.decoder, dtype=getattr(torch, self.precision["rollout"]["dtype"]),
                              kv_budget_mb=r.kv_budget_mb, eager=r.eager)

    def make_engine(self, last_step: int | None = None) -> RolloutEngine:
        """The configured rollout engine over this trainer's policy and training environment; it
        sends no requests ahead past `last_step` (default: train.steps)."""
        engine = build_engine(self.cfg.rollout, self.requests_for, model=self.model, model_path=self.cfg.model.path,
                              tokenizer=self.tokenizer, make_env=self.train_env_factory(),
                              sampling=self.rollout_sampling(), decoder_options=self.decoder_options(),
                              rollout=self._limits(), seed=self.cfg.seed)
        engine.last_step = self.cfg.train.steps if last_step is None else last_step
        return engine

    def warm_start(self) -> dict[str, float]:
        """SFT on the scripted teacher's successful trajectories over training tasks (keelrl.train.warm_start)."""
        return warm_start(self.cfg, self.env_spec, self.train_tasks, self._env(training=True), self._limits(),
                          self.tokenizer, self.learner, self.progress,
                          student=lambda: model_actor(self.model, self.tokenizer, self.rollout_sampling(),
                                                      self.decoder_options()))

    def evaluate(self, tasks: Sequence[Any] | None = None) -> dict[str, float]:
        """Held-out success with the strong verifier, one attempt per task (keelrl.train.evaluation),
        under the current weights (`policy_version`): `tasks`, or the first eval.tasks held-out
        tasks, the probe's leading as a batch of their own in lockstep (`Evaluator.run`'s `apart`)."""
        if tasks is not None:
            return self.evaluator.evaluate(tasks, version=self.policy_version)
        # the probe's tasks lead the held-out list: in lockstep a batch of their own, as when the
        # probe runs alone (streamed, their batches follow timing anyway)
        return self.evaluator.evaluate(self.heldout_tasks[: self.cfg.eval.tasks], version=self.policy_version,
                                       apart=len(self.probe_tasks()) if self.cfg.eval.lockstep else 0)

    def probe_tasks(self) -> list[Any]:
        """The held-out probe's tasks: the first `eval.probe_tasks` of the evaluation's (all of them
        when the evaluation has fewer; none when the probe is off)."""
        return self.heldout_tasks[: min(self.cfg.eval.probe_tasks, self.cfg.eval.tasks)]

    def probe(self, report: dict[str, Any] | None = None) -> dict[str, Any]:
        """The held-out probe's metrics row (probe/*: `keelrl.train.evaluation.probe_figures`, and
        probe/seconds, what it cost). Given an evaluation's `report` (a full evaluation at this step,
        whose tasks include the probe's), its outcomes on the probe's tasks, at no cost; else the
        probe's own episodes, under the current weights, as an evaluation runs them. The run's first
        probe (step 0's, unless eval.before_rl=false) is the start that probe/lift is paired against."""
        tasks = self.probe_tasks()
        if not tasks:
            return {}
        started, seconds = time.monotonic(), 0.0
        if report is None:
            _, report = self.evaluator.run(tasks, version=self.policy_version)
            seconds = time.monotonic() - started
        ids = [str(getattr(task, "id", task)) for task in tasks]
        record = self.summary.setdefault("probe", {})
        if "start" not in record:  # the first probe: the start, its lift 0
            record["start"] = {task: report["task_success"][task] for task in ids if task in report["task_success"]}
        return {**probe_figures(report["task_success"], ids, record["start"]), "probe/seconds": seconds}

    @property
    def last_eval_report(self) -> dict[str, Any] | None:
        """The latest `evaluate`'s full report (per kind, per task), for summary.json."""
        return self.evaluator.last_report

    def teacher_rollouts(self, step: int) -> StepRollouts:
        """The step's groups (the same tasks, seeds and group ids as the student's), sampled by
        the teacher at the rollout temperature."""
        assert self.teacher is not None and self.teacher.model is not None
        requests = self.requests_for(step)
        tasks = [request.task for request in requests for _ in range(request.group_size)]
        groups = [request.group_id for request in requests for _ in range(request.group_size)]
        trajectories = run_episodes(self._env(training=True), tasks, self.tokenizer,
                                    model_actor(self.teacher.model, self.tokenizer, self.rollout_sampling(),
                                                self.decoder_options()),
                                    self._limits(), group_ids=groups, seed=requests[0].seed if requests else 0)
        return StepRollouts(trajectories, {"distill/teacher_histories": 1.0}, sampled_by_teacher=True)

    def step_rollouts(self, engine: RolloutEngine, step: int) -> StepRollouts:
        """Step `step`'s rollouts: the teacher's (GKD's share of the steps), else the engine's batch,
        dynamically filled when algo.dynamic_sampling."""
        if self.requests.teacher_samples(step):
            engine.skip(step)
            return self.teacher_rollouts(step)
        rollouts = engine.batch(step)
        return self.requests.dynamic_fill(engine, step, rollouts) if self.cfg.algo.dynamic_sampling else rollouts

    # ----------------------------------------------------------------- one RL step
    def rl_step(self, step: int, rollouts: StepRollouts, started: float | None = None) -> dict[str, Any]:
        """One update from `rollouts` (the engine's batch for `step`); returns the step's metrics row.

        Rollouts `sampled_by_teacher` (`teacher_rollouts`) get no RL term (advantages 0, old
        log-probs the student's own): the distillation loss alone."""
        started = time.monotonic() if started is None else started
        # 1. rollouts: a group with an episode whose environment failed, or that a harness left
        # unfinished (ungraded, reward NaN), has no baseline, so it is left out whole, and counted.
        failed_groups = {t.group_id for t in rollouts.trajectories if t.termination in UNGRADED}
        trajectories = [t for t in rollouts.trajectories if t.group_id not in failed_groups]
        row: dict[str, Any] = {**rollouts.metrics,
                               "train/env_error_frac": sum(t.termination == "env_error" for t in rollouts.trajectories)
                               / max(1, len(rollouts.trajectories)),
                               "train/env_error_groups_dropped": len(failed_groups)}
        if not trajectories:  # dynamic sampling kept no group, or every group failed: nothing to learn from
            self.outputs.write_step(step, rollouts.trajectories)
            return {**row, "train/updates": 0, "train/skipped_updates": 0, "time/step_s": time.monotonic() - started}
        learn_started = time.monotonic()
        # 2. batch
        batch = collate(trajectories, self.pad_id).to(self.device)
        view = None if self.teacher is None else self.teacher.view(batch, trajectories, self.pad_id)
        # 3. advantages
        group_ids = [t.group_id for t in trajectories]
        estimated = self.advantages(batch, view, sampled_by_teacher=rollouts.sampled_by_teacher,
                                    first_update=self.learner.first_update_rows(group_ids, step))
        # 4. updates
        record = TokenRecord.like(batch.behaviour_logprobs) if self.cfg.output.save_episodes else None
        update = self.learner.update(estimated.inputs, group_ids, step, record)
        self.skipped_steps += update.skipped
        if estimated.inputs.prox_logp is None or estimated.inputs.prox_own is not None:  # updates' passes gave pi_prox
            estimated.stats.update(arrival_stats(update.prox_logp, estimated.inputs.batch, self.cfg.algo))
        if update.teacher_logp is not None and update.teacher_scored is not None and not rollouts.sampled_by_teacher:
            # a loss-form teacher's sampled reverse KL: pi_prox against the teacher's logits in the update
            scored = update.teacher_scored
            sampled_kl = sampled_reverse_kl(update.prox_logp, update.teacher_logp).masked_fill(~scored, 0.0)
            estimated.stats["distill/sampled_kl"] = sampled_kl.sum().item() / max(1, int(scored.sum()))
        # 6. log (5, publishing, follows in `run`)
        seconds = time.monotonic() - started
        learn_seconds = time.monotonic() - learn_started
        tokens = int(batch.attention_mask.sum())
        row = {**update.metrics, **estimated.stats, **row,
               **episode_metrics(trajectories, tokens, self._answer_tools, self.env_spec.test_tool),
               "train/updates": update.updates, "train/skipped_updates": update.skipped, "train/lr": update.lr,
               "train/micro_batches": update.micro_batches, "time/step_s": seconds, "time/learn_s": learn_seconds,
               "time/learner_util": learn_seconds / max(seconds, 1e-9),
               "time/tokens_per_s": tokens / max(seconds, 1e-9), **memory_metrics(self.device)}
        if self.device.type == "cuda":  # the next row's peak covers the next step only
            torch.cuda.reset_peak_memory_stats(self.device)
        self.outputs.write_step(step, rollouts.trajectories, trajectories, estimated.inputs.advantages, record)
        row.update(self.requests.record(trajectories))
        return row

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Checkpoint the current step (crash-safe: keelrl.runs); -> its folder."""
        return state.save(self)

    def load_checkpoint(self) -> None:
        """Load the checkpoint run_dir/checkpoint.json names; CheckpointError when there is none."""
        state.load(self)

    # ----------------------------------------------------------------- the job
    def train(self) -> dict[str, Any]:
        """The whole job, from the start: `run()`. -> summary.json's content. Without a `progress`
        callback of its own, it shows the run's progress as `keel train` does (keelrl.train.console)."""
        if self._own_progress:
            return self.run()
        console = ConsoleProgress(self.cfg.train.steps)
        self.progress = console
        try:
            with console:
                return self.run()
        finally:
            self.progress = _silent

    def _start(self, logger: MetricsLogger, monitor: AlarmMonitor) -> None:
        """A fresh run up to RL: base evaluation, warm start, frozen reference, evaluation before
        RL, and the step-0 checkpoint."""
        if self.start_evaluation is not None and self.cfg.warm_start.demos > 0:  # it would move the weights
            raise ValueError("Trainer.start_evaluation is an evaluation of the run's starting weights: it needs "
                             f"warm_start.demos=0 (this run's is {self.cfg.warm_start.demos})")
        clear_outputs(self.run_dir)
        heldout: dict[str, Any] = {}
        if self.cfg.eval.base and self.cfg.warm_start.demos > 0:
            self.progress("phase", {"phase": "eval (base model)"})
            base = self.evaluate()
            heldout["base"] = self.last_eval_report
            self.progress("eval_base", base)
        self.progress("phase", {"phase": "warm start"})
        warm = self.warm_start()
        state.freeze_reference(self)
        before: dict[str, float] = {}
        report = None
        if self.cfg.eval.before_rl and self.start_evaluation is not None:
            before, report = dict(self.start_evaluation[0]), self.start_evaluation[1]
        elif self.cfg.eval.before_rl:
            self.progress("phase", {"phase": "eval (before RL)"})
            before, report = self.evaluate(), self.last_eval_report
        if before:
            heldout["warm_start"] = report
        self.summary = {"eval_success_before_rl": before.get("eval/success"), **warm, "heldout": heldout}
        if before:
            before.update(self.probe(report))
        if warm or before:
            logger.log(0, {**warm, **before})
        monitor.update(0, before)
        if before:
            self.progress("eval", {"step": 0, **before})
        self.save_checkpoint()  # step 0: a kill from here on resumes without redoing the warm start

    def _resume(self, monitor: AlarmMonitor) -> None:
        state.load_reference(self)
        truncate_jsonl(self.run_dir / ALARMS, self.step)
        drop_steps_after(self.run_dir, self.step)  # the killed run's later steps are written again, or not at all
        for old in read_metrics(self.run_dir):  # replay: alarms that fired before stay fired
            monitor.update(int(old["step"]), old)
        if self.step < self.cfg.train.steps:  # resumed to go further: the old end is not the end
            self.summary.get("heldout", {}).pop("final", None)
            (self.run_dir / SUMMARY).unlink(missing_ok=True)  # nor its summary, till this run's end writes one
        self.progress("resumed", {"step": self.step})

    def run(self, resume: bool = False, stop_after: int | None = None) -> dict[str, Any]:
        """Warm start (unless resuming), then RL to cfg.train.steps; returns summary.json's content."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self.load_checkpoint()  # before anything is written: a failed resume changes nothing
        else:
            forget_checkpoints(self.run_dir)  # first: no later resume may mix the old run's files with ours
        atomic_write_text(self.run_dir / CONFIG, dump_config(self.cfg))
        self.outputs.write_precision(self.precision)
        self.progress("precision", {**self.precision, "line": precision_line(self.precision)})
        logger = MetricsLogger(self.run_dir, self.cfg.log, config=to_dict(self.cfg),
                               resume_after=self.step if resume else None)
        with logger:  # closes every sink, telling W&B and MLflow whether the run failed
            monitor = AlarmMonitor(self.cfg.monitor)
            self._resume(monitor) if resume else self._start(logger, monitor)
            total = self.cfg.train.steps
            engine = self.make_engine(last_step=total if stop_after is None else min(total, stop_after))
            try:
                self.policy_version = self.step
                engine.publish_model(self.model, self.step)
                engine.start(self.step)
                self.progress("phase", {"phase": "RL"})
                while self.step < total and (stop_after is None or self.step < stop_after):
                    step, started = self.step + 1, time.monotonic()
                    rollouts = self.step_rollouts(engine, step)
                    row = self.rl_step(step, rollouts, started)
                    self.policy_version = step
                    engine.publish_model(self.model, step)
                    if step % self.cfg.eval.every == 0 or step == total:
                        row.update(self.evaluate())
                        row.update(self.probe(self.last_eval_report))
                        if step == total:  # kept in the checkpoint with the summary
                            self.summary.setdefault("heldout", {})["final"] = self.last_eval_report
                    elif step % self.cfg.eval.probe_every == 0:
                        row.update(self.probe())
                    self.step = step
                    events = monitor.update(step, row)
                    row.update({f"alarm/{event.name}": 1.0 for event in events})
                    logger.log(step, row)
                    self.progress("step", {"step": step, "total": total, **row})
                    stop = self.outputs.raise_alarms(events, rollouts.trajectories)
                    if stop or step % self.cfg.output.checkpoint_every == 0 or step == total:
                        self.save_checkpoint()
                    if stop:
                        self.summary["stopped_by_alarm"] = stop
                        break
            finally:
                engine.close()
            if self.step >= total or "stopped_by_alarm" in self.summary:
                self.summary = self.outputs.finish(self.summary, self.step, self.skipped_steps)
                logger.log_summary(self.summary)
        return self.summary
