"""Scaling curves: one keelrl RL step's time against completion length, turns and group size.

Every point is timed on keelrl's own `Trainer`, driven on a synthetic workload by
`bench.synthetic` (read its docstring): the configured library, with GRPO without KL
(`algo.kl_coef=0`, as in the TRL comparison), one update a step on the whole batch, and the sync
rollout engine. A step is `--tasks` prompts (bundled held-out tasks as user messages of about
`--prompt-tokens` tokens in the chat template: `bench.bench_sampler.build_prompts`, through
`bench.bench_trl.prompt_texts`; the same prompts every step, with new seeds), G attempts at
each, K turns of exactly L new tokens (no stop strings; end tokens held back until L), every
turn but the last answered with the same test report of about `--observation-tokens` tokens.
The engine's scheduler samples each turn's actions from the episodes' whole histories
(`keelrl.inference.sample`, in one batch when the environment answers at once); then
the trainer runs `Trainer.rl_step`. From each step's metrics row:

- step_s: `time/step_s`, the whole step: the engine's rollouts, then `rl_step`;
- learn_s: `time/learn_s`, `rl_step` from collating the batch to the optimiser step: GRPO
  advantages, then forward+backward by shared prompt in micro-batches of at most
  `perf.micro_batch_tokens` tokens, gradient clipping and one AdamW step. No reference pass
  (no KL) and no separate no-grad proximal pass: with one update a step, the update's own
  pass gives the proximal log-probs (`AdvantageStage.prox_from_update`). Both are read off each
  point's trainer and recorded (`reference_pass`, `proximal_pass`), and the section says what
  they were;
- sample_s = step_s - learn_s: the rollouts, of which generate_s (`time/rollout_generate_s`) is
  the sampler itself; the rest is the scheduler's loop and the environment's replies and
  gradings (instant here) in its thread pool.

A point is one training run of 1 + `--reps` steps on a fresh Trainer (its model loaded before
the steps, so outside the times). The first step is a warm-up (first calls, the optimiser's
state) and is not counted. Every step is checked against what it was asked for, and a step
that differs raises: its actions, the trainer's `train/action_tokens` (per trajectory) x rows,
must be rows x K x L tokens; its turns K; its episodes' mean length (`train/episode_tokens`)
the one computed below; and it must have made its one update.

Counts, computed from the same inputs (each prompt's length as the scheduler renders it,
`keelrl.rollout.scheduler.prompt_tokens`, and the observation's, `observation_tokens`), per step
with P_t task t's prompt, O the observation and rows = tasks x G:
- episode tokens: P_t + K x L + (K - 1) x O for each of task t's G rows (checked, as above);
- tokens generated: rows x K x L (checked, as above);
- context tokens prefilled by the sampler: each task's prompt once (a group's rows share its
  prefill), then at each turn k >= 2 every row's whole history, P_t + (k - 1)(L + O), as the
  sampler keeps no cache between turns. This assumes each turn is sampled in one batch and
  no two rows wrote the same action; nothing in the trainer's metrics counts it;
- learner tokens per pass: each group's prompt once, cut before its last token (P_t - 1), plus
  each row's rest (episode - P_t + 1); without padding, which is exact when the prompts have one
  length (the micro-batches pad each unit's prompt to the longest cut);
- micro-batches: the trainer's own count (`train/micro_batches`).

Sweeps: L over `--lengths` at (K, G) = (base turns, base group); K over `--turns` at (base
length, base group); G over `--groups` at (base length, base turns). The base point is
measured once and shared by the sweeps. Points run one after another in sweep order (a point's
steps are one training run, so repeats cannot be interleaved across points, and drift over the
run is not spread evenly across them). Budget: a point that starts after `--budget-s` since the
start gets one timed step instead of `--reps`; the repeats skipped are reported. Each timed
step records the CPU share other processes used meanwhile (`bench.common.Clock`); one above
`NOISY` is marked; `--wait-quiet` waits between steps (outside the times) for a quiet moment.

Analysis, per sweep, over the medians: a least-squares line step_s = a + b x, and the growth
exponent between the two largest x, log(t2 / t1) / log(x2 / x1): above 1.1 is called faster
than linear, below 0.9 sub-linear. Which part grew faster than linear, and the reason
offered, follow from the measured times and from the counts above, never from the sweep's
name.

Full size (the defaults): SmolLM2-135M-Instruct, 2 tasks, prompts of ~200 tokens, a 48-token
observation, L in 32/64/128/256 (K=1, G=4), K in 1/2/4 (L=64, G=4), G in 2/4/8 (L=64, K=1), a
warm-up and 1 timed step at each of the 8 distinct points (`--reps 2` for a spread). Estimated
before measuring (from ~50 generated tokens/s at batch 8 and ~175 learner tokens/s
forward+backward on 2 cores): one step at every point takes about 260 s in all, K=4 the
dearest (~80 s) and L=256 next (~55 s), so two steps a point come to about 9 minutes with a
few seconds a point for loading the model and ending the run; `--budget-s` caps the repeats of
points that start late. `--smoke`: the tiny model, 2 points per sweep of 4-8 tokens, 1
torch thread, seconds.

What this does NOT measure: a real environment (tool calls, sandboxed tests, grading), stop
strings, actions that end early, ragged groups, asynchronous rollouts, a KL term or several
updates a step (which add the reference and proximal passes), or absolute speed worth quoting
on a shared machine.

    python -m bench.bench_scaling                     # SmolLM2-135M, about 9 minutes (estimated)
    python -m bench.bench_scaling --smoke --out /tmp/scaling   # tiny model, seconds
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import torch

from bench.bench_trl import prompt_texts
from bench.common import NOISY, ROOT, Clock, Section, arguments, fmt_spread, machine, wait_quiet, write_section
from bench.synthetic import base_overrides, observation_text, scratch_dir, synthetic_trainer
from keelrl.rollout.scheduler import observation_tokens, prompt_tokens

SWEEPS = ("length", "turns", "group")
"""The swept quantity of each panel, in order: completion length L, turns K, group size G."""
SYMBOL = {"length": "L", "turns": "K", "group": "G"}
AXIS = {"length": "completion length L (new tokens per turn)", "turns": "turns K", "group": "group size G"}

FASTER = 1.1
"""A growth exponent above this is called faster than linear."""
SLOWER = 0.9
"""A growth exponent below this is called sub-linear."""

FIGURE = ROOT / "docs" / "figures" / "bench_scaling.png"
"""Where a full-size run copies its PNG (smoke runs never write it)."""

"""The observation answering each turn but the last: a test run's report (cut to --observation-tokens)."""

TIMES = ("sample_s", "generate_s", "learn_s", "step_s")
"""The seconds recorded per timed step (see the module docstring)."""
COUNTS = ("generated_tokens", "prefill_tokens", "learner_tokens", "micro_batches", "rows")
"""The counts per step of a point (see the module docstring)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="scaling")
    parser.add_argument("--model", default="smollm2",
                        help="registered name ('smollm2', 'tiny') or local model directory")
    parser.add_argument("--tasks", type=int, default=2, help="tasks (groups) per step")
    parser.add_argument("--prompt-tokens", type=int, default=200,
                        help="prompt length per task, about (chat template included)")
    parser.add_argument("--observation-tokens", type=int, default=48,
                        help="tokens of the observation answering each turn but the last, at most")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256], help="completion lengths L swept")
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4], help="turns K swept")
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8], help="group sizes G swept")
    parser.add_argument("--base-length", type=int, default=64, help="L while K or G is swept")
    parser.add_argument("--base-turns", type=int, default=1, help="K while L or G is swept")
    parser.add_argument("--base-group", type=int, default=4, help="G while L or K is swept")
    parser.add_argument("--reps", type=int, default=1, help="timed steps per point, after one warm-up step")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="a point that starts after this many seconds since start gets one timed step")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default, as keelrl runs; --smoke: 1, since on a busy 2-core "
                             "box a 2-thread op waits on a descheduled thread, 50x slower for the tiny model)")
    parser.add_argument("--wait-quiet", type=float, default=5.0,
                        help="before each timed step wait up to this many seconds for a 1 s window in which other "
                             "processes use under 10%% of the CPUs (0: never wait)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.tasks, args.prompt_tokens, args.observation_tokens = "tiny", 2, 48, 16
        args.lengths, args.turns, args.groups = [4, 8], [1, 2], [2, 4]
        args.base_length, args.base_turns, args.base_group = 8, 1, 2
        args.reps, args.wait_quiet, args.budget_s, args.threads = 2, 0.0, 600.0, 1
    sizes = args.lengths + args.turns + args.groups + [args.base_length, args.base_turns, args.base_group]
    if min(sizes) < 1 or args.tasks < 1 or args.reps < 1 or args.threads < 0:
        parser.error("--lengths, --turns, --groups, the base values, --tasks and --reps must be >= 1, --threads >= 0")
    if min(args.groups + [args.base_group]) < 2:
        parser.error("--groups and --base-group must be >= 2 (a group baseline needs two attempts)")
    if args.prompt_tokens < 8:
        parser.error("--prompt-tokens must be >= 8")
    for flag in ("lengths", "turns", "groups"):
        if len(set(getattr(args, flag))) < 2:
            parser.error(f"--{flag} needs two distinct values at least (a sweep fits a line), "
                         f"got {getattr(args, flag)}")
    return args


# --------------------------------------------------------------------------- the analysis
def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x over the points -> (a, b); needs two distinct x."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"a line needs two distinct x and one y each, got x={list(xs)}, y={list(ys)}")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
    variance = sum((x - mean_x) ** 2 for x in xs)
    slope = covariance / variance
    return mean_y - slope * mean_x, slope


def growth_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """log(y2 / y1) / log(x2 / x1) between the two largest x: 1 for y proportional to x, 2 for x^2.

    NaN when a y there is not positive (no power law fits it)."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"an exponent needs two distinct x and one y each, got x={list(xs)}, y={list(ys)}")
    (x1, y1), (x2, y2) = sorted(zip(xs, ys))[-2:]
    if y1 <= 0 or y2 <= 0:
        return math.nan
    return math.log(y2 / y1) / math.log(x2 / x1)


def growth(exponent: float) -> str:
    """The word for a growth exponent: faster than linear (> FASTER), about linear, sub-linear
    (< SLOWER), falling (< 0: the time went down), not measurable (NaN)."""
    if not math.isfinite(exponent):
        return "not measurable"
    if exponent > FASTER:
        return "faster than linear"
    if exponent < 0:
        return "falling"
    if exponent < SLOWER:
        return "sub-linear"
    return "about linear"


def grew(exponent: float) -> str:
    """`growth` as a verb phrase: 'grew faster than linearly (exponent 1.52)'."""
    phrase = {"faster than linear": "grew faster than linearly", "about linear": "grew about linearly",
              "sub-linear": "grew sub-linearly", "falling": "fell", "not measurable": "could not be measured"}
    return f"{phrase[growth(exponent)]} (exponent {exponent:.2f})"


# --------------------------------------------------------------------------- one point
@dataclass(frozen=True)
class Point:
    """One measured configuration: L new tokens per turn, K turns, G attempts per task."""

    length: int
    turns: int
    group: int


def step_counts(point: Point, prompt_lengths: Sequence[int], observation_length: int) -> dict[str, int]:
    """The tokens one step at `point` runs, from the prompts' and the observation's lengths
    (the module docstring's formulas): episode_tokens (summed over rows), generated_tokens,
    prefill_tokens, learner_tokens, rows."""
    L, K, G, O = point.length, point.turns, point.group, observation_length
    episodes = {prompt: prompt + K * L + (K - 1) * O for prompt in prompt_lengths}
    prefill = 0
    for prompt in prompt_lengths:
        prefill += prompt  # turn 1: the group's G rows share one prefill of the prompt
        for turn in range(2, K + 1):  # later turns: each row's whole history, run again
            prefill += G * (prompt + (turn - 1) * (L + O))
    learner = sum((prompt - 1) + G * (episodes[prompt] - (prompt - 1)) for prompt in prompt_lengths)
    rows = len(prompt_lengths) * G
    return {"episode_tokens": sum(G * episodes[prompt] for prompt in prompt_lengths),
            "generated_tokens": rows * K * L, "prefill_tokens": prefill, "learner_tokens": learner, "rows": rows}


def timed_steps(elapsed_s: float, budget_s: float, reps: int) -> int:
    """Timed steps for a point starting `elapsed_s` into the run: `reps`, or 1 once the budget is spent."""
    return reps if elapsed_s <= budget_s else 1


class StepLog:
    """The trainer's progress callback: each step's metrics row, with the CPU share other
    processes used while it ran (`Clock`, restarted between steps). After every step but the
    last it waits up to `quiet_s` for a quiet moment: between steps, so outside the next step's
    `time/step_s`, which starts inside the training loop."""

    def __init__(self, steps: int, quiet_s: float) -> None:
        self.steps, self.quiet_s = steps, quiet_s
        self.rows: list[dict[str, Any]] = []
        self.clock = Clock()
        self.waited = 0.0

    def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event == "phase" and info.get("phase") == "RL":
            self.clock = Clock()
        elif event == "step":
            self.rows.append({**info, **self.clock.read(), "waited_s": self.waited})
            last = info["step"] >= self.steps
            self.waited = wait_quiet(self.quiet_s) if self.quiet_s > 0 and not last else 0.0
            self.clock = Clock()


def check_step(point: Point, row: dict[str, Any], counts: dict[str, int]) -> None:
    """Raise unless the trainer's step at `point` ran what was asked (see the module docstring)."""
    rows = counts["rows"]
    step = row.get("step")
    actions = round(row["train/action_tokens"] * rows)
    if actions != counts["generated_tokens"]:
        raise RuntimeError(f"{point} step {step}: the trainer's actions were {row['train/action_tokens']} tokens per "
                           f"trajectory, {actions} in all, not {rows} rows x {point.turns} x {point.length} = "
                           f"{counts['generated_tokens']}")
    if row["train/turns"] != point.turns:
        raise RuntimeError(f"{point} step {step}: {row['train/turns']} turns per trajectory, not {point.turns}")
    episodes = round(row["train/episode_tokens"] * rows)
    if episodes != counts["episode_tokens"]:
        raise RuntimeError(f"{point} step {step}: episodes of {episodes} tokens in all, not the "
                           f"{counts['episode_tokens']} computed from the prompts and the observation, so the "
                           "prefill and learner counts would be wrong")
    if row["train/updates"] != 1 or row["train/skipped_updates"] != 0:
        raise RuntimeError(f"{point} step {step}: {row['train/updates']} updates, {row['train/skipped_updates']} "
                           "skipped: not the one update a step times")


def measurement(row: dict[str, Any]) -> dict[str, Any]:
    """The figures kept of one step's metrics row."""
    step_s, learn_s = row["time/step_s"], row["time/learn_s"]
    return {"step": row["step"], "step_s": step_s, "learn_s": learn_s, "sample_s": step_s - learn_s,
            "generate_s": row["time/rollout_generate_s"], "micro_batches": row["train/micro_batches"],
            "action_tokens": row["train/action_tokens"], "episode_tokens": row["train/episode_tokens"],
            "turns": row["train/turns"], "other_cpu_share": row["other_cpu_share"], "noisy": row["noisy"],
            "waited_s": row["waited_s"]}


def run_point(args: argparse.Namespace, point: Point, texts: Sequence[str], observation: str,
              steps: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One training run of `steps` steps at `point` -> (every step's metrics row, the trainer's settings)."""
    log = StepLog(steps, args.wait_quiet)
    with scratch_dir() as run_dir:
        overrides = base_overrides(args.model, run_dir, prompts=len(texts), group=point.group,
                                   completion_tokens=point.length, steps=steps, turns=point.turns)
        loading = time.perf_counter()
        trainer = synthetic_trainer(overrides, list(texts) * steps, observation=observation, progress=log)
        cfg = trainer.cfg
        rows = len(texts) * point.group
        # the trainer's own rule; it reads the batch's row count alone
        proximal_pass = not trainer.advantages.prox_from_update(SimpleNamespace(input_ids=torch.empty(rows, 0)))
        settings = {"load_s": time.perf_counter() - loading, "algo_preset": cfg.algo.preset,
                    "kl_coef": cfg.algo.kl_coef, "reference_pass": trainer.reference is not None,
                    "proximal_pass": proximal_pass,
                    "engine": cfg.rollout.engine, "epochs": cfg.train.epochs,
                    "minibatch_size": cfg.train.minibatch_size, "micro_batch_tokens": cfg.perf.micro_batch_tokens,
                    "share_prefix": cfg.perf.share_prefix, "learner_precision": cfg.perf.learner_precision,
                    "lr": cfg.optim.lr, "temperature": cfg.rollout.temperature}
        trainer.run()
    if len(log.rows) != steps:
        raise RuntimeError(f"{point}: the trainer reported {len(log.rows)} steps, not {steps}")
    return log.rows, settings


def sweep_points(args: argparse.Namespace) -> dict[str, list[Point]]:
    """Each sweep's points, the other two quantities at their base values."""
    return {
        "length": [Point(length, args.base_turns, args.base_group) for length in args.lengths],
        "turns": [Point(args.base_length, turns, args.base_group) for turns in args.turns],
        "group": [Point(args.base_length, args.base_turns, group) for group in args.groups],
    }


def measure(args: argparse.Namespace, started: float) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from keelrl.policy.model import ensure_model_dir

    tokenizer = AutoTokenizer.from_pretrained(ensure_model_dir(args.model))
    texts = prompt_texts(tokenizer, args.tasks, args.prompt_tokens)
    prompt_lengths = [len(prompt_tokens(tokenizer, text)) for text in texts]
    observation = observation_text(tokenizer, args.observation_tokens)
    observation_length = len(observation_tokens(tokenizer, observation))  # after an action that did not end its turn
    sweeps = sweep_points(args)
    points = list(dict.fromkeys(point for sweep in SWEEPS for point in sweeps[sweep]))  # the base point once
    point_rows: list[dict[str, Any]] = []
    for point in points:
        timed = timed_steps(time.perf_counter() - started, args.budget_s, args.reps)
        counts = step_counts(point, prompt_lengths, observation_length)
        rows, settings = run_point(args, point, texts, observation, 1 + timed)
        for row in rows:
            check_step(point, row, counts)
        warmup, measured = measurement(rows[0]), [measurement(row) for row in rows[1:]]
        counts["micro_batches"] = measured[0]["micro_batches"]  # the trainer's count (each step's is kept too)
        point_rows.append({**asdict(point), "rows": counts["rows"], "counts": counts, "warmup": warmup,
                           "measurements": measured, "skipped_reps": args.reps - timed, "trainer": settings})
        for m in measured:
            print(f"L={point.length:<4} K={point.turns} G={point.group} step {m['step']}: "
                  f"sample {m['sample_s']:7.2f} s (generating {m['generate_s']:.2f}) learn {m['learn_s']:7.2f} s  "
                  f"other processes {m['other_cpu_share']:.0%}{'  NOISY' if m['noisy'] else ''}", flush=True)
        if timed < args.reps:
            print(f"L={point.length} K={point.turns} G={point.group}: {args.reps - timed} repeats skipped "
                  f"(started past --budget-s {args.budget_s:.0f})", flush=True)
    index = {point: i for i, point in enumerate(points)}
    analysis = {name: summarize(name, [point_rows[index[point]] for point in sweeps[name]]) for name in SWEEPS}
    for name in SWEEPS:
        analysis[name]["points"] = [index[point] for point in sweeps[name]]
    own = ("load_s", "minibatch_size")  # each point's own
    trainer = {key: value for key, value in point_rows[0]["trainer"].items() if key not in own}
    for row in point_rows:  # the section describes every point's step by one trainer setting
        differs = [key for key, value in trainer.items() if row["trainer"][key] != value]
        if differs:
            raise RuntimeError(f"the trainer's {differs} differ between points: {trainer} and {row['trainer']}")
    return {"points": point_rows, "sweeps": analysis, "prompt_tokens": prompt_lengths,
            "observation_tokens": observation_length, "observation_text": observation, "trainer": trainer}


def summarize(name: str, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One sweep's medians, fit, exponents (times and counts) and verdicts."""
    xs = [row[name] for row in rows]
    medians = {key: [statistics.median(m[key] for m in row["measurements"]) for row in rows] for key in TIMES}
    counts = {key: [row["counts"][key] for row in rows] for key in COUNTS}
    a, b = fit_line(xs, medians["step_s"])
    exponents = {key.removesuffix("_s"): growth_exponent(xs, values) for key, values in medians.items()}
    exponents.update({key: growth_exponent(xs, values) for key, values in counts.items() if key != "micro_batches"})
    top = sorted(range(len(xs)), key=lambda i: xs[i])[-2:]
    noisy_top = any(m["noisy"] for i in top for m in rows[i]["measurements"])
    return {"x": xs, "median": medians, "counts": counts, "fit": {"a": a, "b": b}, "exponent": exponents,
            "verdict": {key: growth(exponents[key]) for key in ("step", "sample", "learn")},
            "noisy_top": noisy_top}


# --------------------------------------------------------------------------- the report
def _ms(seconds: float, tokens: float) -> float:
    return 1000.0 * seconds / tokens


def time_against_work(what: str, seconds: Sequence[float], work: Sequence[float], unit: str,
                      xs: Sequence[float], symbol: str, why_more: str) -> str:
    """A sentence comparing how a time grew with how the work behind it grew (between the two largest x)."""
    time_exp, work_exp = growth_exponent(xs, seconds), growth_exponent(xs, work)
    i1, i2 = sorted(range(len(xs)), key=lambda i: xs[i])[-2:]
    per = (f"{_ms(seconds[i1], work[i1]):.2f} ms per {unit} at {symbol}={xs[i1]}, "
           f"{_ms(seconds[i2], work[i2]):.2f} at {symbol}={xs[i2]}")
    if time_exp > work_exp + (FASTER - 1):
        return (f"{what} grew faster (exponent {time_exp:.2f}) than the {unit}s behind it ({work_exp:.2f}): each "
                f"cost more ({per}){why_more}")
    if time_exp < work_exp - (1 - SLOWER):
        return (f"{what} grew slower (exponent {time_exp:.2f}) than the {unit}s behind it ({work_exp:.2f}): each "
                f"cost less ({per}), as bigger passes use the cores better")
    return f"{what} followed the {unit}s behind it (exponents {time_exp:.2f} and {work_exp:.2f}; {per})"


def reasons(name: str, sweep: dict[str, Any], micro_batch_tokens: int) -> list[str]:
    """Why sampling and learning grew as they did in one sweep, read off this run's times and counts."""
    xs, med, counts, exp = sweep["x"], sweep["median"], sweep["counts"], sweep["exponent"]
    symbol = SYMBOL[name]
    i1, i2 = sorted(range(len(xs)), key=lambda i: xs[i])[-2:]
    at = f"at {symbol}={xs[i1]} and {symbol}={xs[i2]}"
    lines = []
    if name == "length":
        per_token = [_ms(med["sample_s"][i], counts["generated_tokens"][i]) for i in (i1, i2)]
        line = (f"Sampling {grew(exp['sample'])} in L: {per_token[0]:.2f} and {per_token[1]:.2f} ms per generated "
                f"token {at}")
        if exp["sample"] > FASTER:
            line += (", so later tokens cost more: each new token attends over the prompt and every token before "
                     "it, and the KV cache grows by one token a step")
        elif exp["sample"] < SLOWER:
            line += ", so the prompt's prefill, a fixed cost, still weighs: it is spread over more tokens as L grows"
        lines.append(line + ".")
    elif name == "turns":
        line = (f"Each turn re-prefills its whole history (the sampler keeps no cache between turns): the context "
                f"tokens prefilled grew from {counts['prefill_tokens'][i1]} to {counts['prefill_tokens'][i2]} {at}, "
                f"{grew(exp['prefill_tokens']).removeprefix('grew ')}")
        if exp["prefill_tokens"] > FASTER:
            line += ", as K turns prefill about K^2/2 turns' worth of history"
        line += f", while the tokens generated grew linearly (K x L). Sampling {grew(exp['sample'])}"
        if exp["sample"] > FASTER:
            line += (": the growing history is why, prefilled again every turn, and attended over by every new "
                     "token")
        else:
            line += ": decoding the K x L tokens outweighs the re-prefill at these sizes"
        lines.append(line + ".")
    else:
        per_row = [med["sample_s"][i] / counts["rows"][i] for i in (i1, i2)]
        line = (f"The sampler prefills each task's prompt once for its G rows ({counts['prefill_tokens'][i1]} and "
                f"{counts['prefill_tokens'][i2]} context tokens {at}) and decodes all rows as one batch: "
                f"{per_row[0]:.3g} and {per_row[1]:.3g} s of sampling per row. Sampling {grew(exp['sample'])}")
        if exp["sample"] < SLOWER:
            line += ": a shared prompt and a wider decoding batch make each row cheaper"
        elif exp["sample"] > FASTER:
            line += ": each row cost more in the bigger batch"
        else:
            line += ": a wider decoding batch did not make a row cheaper here"
        lines.append(line + ".")
    shared = ""
    if exp["learner_tokens"] < SLOWER:  # the work grew sub-linearly: name the part that does not grow
        shared = {"length": ": the prompts, run once per group, do not grow with L",
                  "group": ": each group's prompt runs once, whatever G",
                  "turns": ": the prompts, run once per group, do not grow with K"}[name]
    batches = counts["micro_batches"]
    lines.append(f"Learning {grew(exp['learn'])}; the tokens its pass runs {grew(exp['learner_tokens'])}{shared}; "
                 f"the trainer ran {batches[i1]} and {batches[i2]} micro-batches of <= {micro_batch_tokens} tokens "
                 f"{at}.")
    why_more = "" if name == "group" else ", as longer rows attend over more tokens"  # G adds rows, not length
    lines.append(time_against_work("Learning", med["learn_s"], counts["learner_tokens"], "learner token", xs, symbol,
                                   why_more) + ".")
    return lines


def held(name: str, args: argparse.Namespace) -> str:
    """The base values a sweep holds the other two quantities at: 'K=1, G=4'."""
    base = {"length": args.base_length, "turns": args.base_turns, "group": args.base_group}
    return ", ".join(f"{SYMBOL[other]}={base[other]}" for other in SWEEPS if other != name)


def markdown(args: argparse.Namespace, data: dict[str, Any], link: str) -> str:
    sweeps, points, trainer = data["sweeps"], data["points"], data["trainer"]
    prompts = data["prompt_tokens"]
    budget = trainer["micro_batch_tokens"]
    passes = ("a no-grad reference pass" if trainer["reference_pass"] else "no reference pass") + ", and " + (
        "a no-grad proximal pass before the update" if trainer["proximal_pass"]
        else "the proximal log-probs from the update's own pass")
    lines = [
        f"One RL step of keelrl's own `Trainer` (`bench.synthetic`: GRPO, kl_coef {trainer['kl_coef']:g}, one "
        f"update a step, the {trainer['engine']} rollout engine) on `{args.model}`: {args.tasks} bundled held-out "
        f"tasks of {min(prompts)}-{max(prompts)} prompt tokens, G attempts each, exactly L new tokens per turn, "
        f"every turn but the last answered with a {data['observation_tokens']}-token test report, each turn "
        f"sampled from the whole history (re-prefilled). Base point L={args.base_length}, K={args.base_turns}, "
        f"G={args.base_group}; each sweep varies one. **step** is the trainer's `time/step_s`; **learn** its "
        f"`time/learn_s` (`rl_step` from collating: advantages, forward+backward by shared prompt in micro-batches "
        f"of <= {budget} tokens, clipping, one AdamW step; {passes}); **sample** = step - learn, the rollouts; "
        f"**of it generating**: the sampler's own time in them (`time/rollout_generate_s`, median). Seconds are "
        f"median (min-max, n) over the timed steps of one training run per point, after its untimed warm-up "
        f"step; `*` marks a point with a step measured while other processes used more than {NOISY:.0%} of the "
        f"CPUs. Token counts are computed from the prompts' and the observation's lengths (the trainer's episode "
        f"lengths checked against them); micro-batches are the trainer's.", "",
        f"![step time against L, K and G]({link})", "",
    ]
    faster: list[str] = []
    for name in SWEEPS:
        sweep = sweeps[name]
        symbol = SYMBOL[name]
        lines += [f"**{AXIS[name]}** ({held(name, args)})", "",
                  f"| {symbol} | sample s | of it generating s | learn s | step s | tokens generated | context "
                  "tokens prefilled | learner tokens per pass | micro-batches |", "|---" * 9 + "|"]
        for index in sweep["points"]:
            row = points[index]
            ms, counts = row["measurements"], row["counts"]
            noisy = "*" if any(m["noisy"] for m in ms) else ""
            skipped = f" ({row['skipped_reps']} skipped)" if row["skipped_reps"] else ""
            generating = statistics.median(m["generate_s"] for m in ms)
            lines.append(f"| {row[name]}{noisy} | {fmt_spread([m['sample_s'] for m in ms])} | {generating:.2f} "
                         f"| {fmt_spread([m['learn_s'] for m in ms])} "
                         f"| {fmt_spread([m['step_s'] for m in ms])}{skipped} | {counts['generated_tokens']} "
                         f"| {counts['prefill_tokens']} | {counts['learner_tokens']} | {counts['micro_batches']} |")
        exp, fit = sweep["exponent"], sweep["fit"]
        top = sorted(sweep["x"])[-2:]
        caution = " (measured while other processes were busy: not worth quoting)" if sweep["noisy_top"] else ""
        lines += ["", f"Least squares: step = {fit['a']:.2f} s + {fit['b']:.4g} s x {symbol}. Growth exponent "
                      f"between {symbol}={top[0]} and {symbol}={top[1]}: step {exp['step']:.2f} "
                      f"({sweep['verdict']['step']}), sample {exp['sample']:.2f}, learn {exp['learn']:.2f}{caution}.",
                  ""]
        lines += [" ".join(reasons(name, sweep, budget)), ""]
        for part in ("step", "sample", "learn"):
            if sweep["verdict"][part] == "faster than linear":
                faster.append(f"{'step time' if part == 'step' else part + '_s'} in {symbol} ({exp[part]:.2f})")
    if faster:
        lines.append(f"Faster than linear (exponent > {FASTER} between the two largest points): {', '.join(faster)}.")
    else:
        lines.append(f"Nothing grew faster than linear (exponent > {FASTER} between the two largest points) at "
                     "these sizes.")
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    """Three panels (L, K, G): sample, learn and step seconds (median, min-max bars), the fitted line, noisy marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    colours = {"sample_s": "tab:blue", "learn_s": "tab:orange", "step_s": "black"}
    names = {"sample_s": "sample (step - learn)", "learn_s": "learn", "step_s": "step"}
    noisy_shown = False
    for axis, name in zip(axes, SWEEPS):
        sweep = data["sweeps"][name]
        xs = sweep["x"]
        rows = [data["points"][i] for i in sweep["points"]]
        for key, colour in colours.items():
            values = [[m[key] for m in row["measurements"]] for row in rows]
            medians = sweep["median"][key]
            low = [m - min(v) for m, v in zip(medians, values)]
            high = [max(v) - m for m, v in zip(medians, values)]
            axis.errorbar(xs, medians, yerr=[low, high], color=colour, marker="o", capsize=3, label=names[key])
        fit = sweep["fit"]
        line_x = [min(xs), max(xs)]
        axis.plot(line_x, [fit["a"] + fit["b"] * x for x in line_x], color="grey", linestyle=":",
                  label="least-squares line (step)")
        for x, row in zip(xs, rows):
            for m in row["measurements"]:
                if m["noisy"]:
                    axis.plot([x], [m["step_s"]], marker="x", color="red", markersize=9, linestyle="none",
                              label=None if noisy_shown else f"other processes > {NOISY:.0%} CPU")
                    noisy_shown = True
        exp = sweep["exponent"]
        axis.set_title(f"{AXIS[name]} at {held(name, args)}\ngrowth exponent, two largest {SYMBOL[name]}: "
                       f"step {exp['step']:.2f}, sample {exp['sample']:.2f}, "
                       f"learn {exp['learn']:.2f}", fontsize=9)
        axis.set_xlabel(SYMBOL[name])
        axis.set_xticks(xs)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("seconds per RL step (keelrl Trainer)")
    handles, labels = [], []
    for axis in axes:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    axes[0].legend(handles, labels, fontsize=8, loc="upper left")
    figure.suptitle(f"One keelrl Trainer step (GRPO, no KL) on {args.model}: {args.tasks} tasks x G attempts, base "
                    f"L={args.base_length}, K={args.base_turns}, G={args.base_group}"
                    + (" (smoke: measures nothing)" if args.smoke else ""), fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _link(path: Path) -> str:
    """`path` relative to the repository root when inside it (how BENCHMARKS.md links it), else absolute."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.resolve().as_posix()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    data = measure(args, started)
    png = args.out / "scaling.png"
    plot(data, args, png)
    link = _link(png)
    if not args.smoke:
        FIGURE.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, FIGURE)
        link = _link(FIGURE)
    setup = {key: getattr(args, key) for key in ("model", "tasks", "prompt_tokens", "observation_tokens", "lengths",
                                                 "turns", "groups", "base_length", "base_turns", "base_group", "reps",
                                                 "budget_s", "wait_quiet", "threads")}
    setup.update({"noisy_above": NOISY, "torch_threads": torch.get_num_threads(),
                  "faster_above": FASTER, "slower_below": SLOWER})
    data.update({"setup": setup, "png": str(png), "figure": link, "machine": machine(),
                 "exponents": {name: data["sweeps"][name]["exponent"] for name in SWEEPS}})
    section = Section(name="scaling",
                      title="Scaling curves: one RL step against completion length, turns and group size",
                      markdown=markdown(args, data, link), ratios=[], smoke=args.smoke,
                      seconds=time.perf_counter() - started, data=data)
    path = write_section(args.out, section)
    print(section.markdown)
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
