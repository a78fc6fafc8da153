"""Sync against async rollouts on slow tools: wall clock per RL step, and where async starts to win.

The lecture's case for asynchronous RL: when rollouts wait (tool calls that run a
repository's tests take seconds), a synchronous learner waits with them; an asynchronous one
trains on the previous batch meanwhile. This measures that on SmolLM2 with keelrl's own
`Trainer` on the synthetic multi-turn workload of `bench.synthetic` (fixed prompts from the
bundled tasks, K turns, exactly L tokens an action, a fixed observation after each), where
every tool call waits as the latency model says (`ToolLatency`: log-normal around a median, the
same delay for every attempt at a task's t-th call, as its test suite would take).

Two engines per latency, each in a fresh process, one after the other:
- sync: `rollout.engine=sync` in one process on both cores (torch's default threads): sample
  the step's episodes (continuous batching over the episodes that are not waiting on a tool),
  then update;
- async: `rollout.engine=ray` with one rollout worker pinned to core 1 and the learner pinned
  to core 0 (`rollout.worker_cores=[1]`, `perf.learner_cores=[0]`, one torch thread each),
  `max_staleness` steps of lag allowed, episodes interruptible: the worker samples the next
  steps' episodes while the learner updates, and overlaps one step's tool waits with another
  step's generation.

Timed: the sum of `time/step_s` over the steps after the first (the first pays for model
loading in the worker and the engine's start). Both engines train on the same prompts, groups
and token counts; the speed-up is sync's time over async's. The crossover is the latency at
which the speed-up reaches 1, interpolated linearly between measured latencies.

What this does NOT give: held-out success. The synthetic reward has no held-out split, and a
few steps at this learning rate move no held-out figure measurably; instead both engines'
mean training rewards are reported (they train on the same prompts), with the async run's
staleness.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, Clock, Ratio, Section, arguments, machine, run_worker, serve_worker, write_section
from bench.synthetic import ToolLatency, base_overrides, observation_text, scratch_dir, synthetic_trainer

ENGINES = ("sync", "async")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="async")
    parser.add_argument("--model", default="smollm2", help="registered name or model dir")
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.0, 3.0, 10.0],
                        help="median seconds a tool call takes (the curve's x)")
    parser.add_argument("--sigma", type=float, default=0.5, help="log-normal spread of a tool call's delay")
    parser.add_argument("--prompts", type=int, default=2, help="tasks per step")
    parser.add_argument("--group", type=int, default=4, help="attempts per task")
    parser.add_argument("--turns", type=int, default=3, help="turns per episode (each one tool call)")
    parser.add_argument("--completion-tokens", type=int, default=32, help="tokens per action, exactly")
    parser.add_argument("--prompt-tokens", type=int, default=160, help="prompt length, about")
    parser.add_argument("--observation-tokens", type=int, default=32, help="observation length, about")
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is not timed")
    parser.add_argument("--max-staleness", type=int, default=2, help="async: steps of lag allowed")
    parser.add_argument("--headline", type=float, default=10.0,
                        help="the latency whose speed-up is judged against the 1.5x target (one of --latencies)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one run, as a JSON file
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.latencies, args.prompts, args.group, args.turns = "tiny", [0.2], 2, 2, 2
        args.completion_tokens, args.prompt_tokens, args.observation_tokens, args.steps = 4, 32, 8, 3
        args.headline, args.max_staleness = 0.2, 1
    if (os.cpu_count() or 1) < 2:
        parser.error("the async run pins learner and worker to separate cores: this machine has one")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the first is not timed), got {args.steps}")
    if args.headline not in args.latencies:
        parser.error(f"--headline {args.headline} is not one of --latencies {args.latencies}")
    if any(x < 0 for x in args.latencies):
        parser.error(f"--latencies must be >= 0, got {args.latencies}")
    return args


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine at one latency (in a fresh process: pinning is process-wide)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows: list[dict[str, Any]] = []
    latency = ToolLatency(spec["latency"], spec["sigma"], seed=0)
    with scratch_dir() as run_dir:
        overrides = base_overrides(spec["model"], run_dir, prompts=spec["prompts"], group=spec["group"],
                                   completion_tokens=spec["completion_tokens"], steps=spec["steps"],
                                   turns=spec["turns"])
        overrides += ["rollout.env_threads=32"]  # sleeping tools never queue for a thread
        if spec["engine"] == "async":
            overrides += ["rollout.engine=ray", "rollout.workers=1", "rollout.worker_cpus=1",
                          "rollout.worker_cores=[1]", "perf.learner_cores=[0]",
                          f"rollout.max_staleness={spec['max_staleness']}", "rollout.interruptible=true"]
        os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        trainer = synthetic_trainer(overrides, spec["texts"], observation=spec["observation"], latency=latency,
                                    progress=lambda event, info: rows.append(info) if event == "step" else None)
        clock = Clock()
        trainer.run()
        load = clock.read()
    per_step = [{"step_s": r["time/step_s"], "learn_s": r["time/learn_s"], "reward": r["train/reward"],
                 "action_tokens": r["train/action_tokens"], "turns": r["train/turns"],
                 "staleness_mean": r.get("rollout/staleness_mean", 0.0)} for r in rows]
    return {"steps": per_step, "other_cpu_share": load["other_cpu_share"], "own_cpu_share": load["own_cpu_share"]}


def crossover(latencies: list[float], speedups: list[float]) -> float | None:
    """The latency where the speed-up first reaches 1, linear between measured points (None: never)."""
    points = sorted(zip(latencies, speedups))
    if points and points[0][1] >= 1:
        return points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y0 < 1 <= y1:
            return x0 + (1 - y0) * (x1 - x0) / (y1 - y0)
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if serve_worker(args, run_one):
        return
    from bench.bench_trl import prompt_texts
    from keelrl.policy.model import load_policy

    started = time.perf_counter()
    _, tokenizer = load_policy(args.model, "cpu")
    texts = prompt_texts(tokenizer, args.prompts * (args.steps + args.max_staleness + 1), args.prompt_tokens)
    observation = observation_text(tokenizer, args.observation_tokens)
    results: dict[float, dict[str, Any]] = {}
    for latency in args.latencies:
        results[latency] = {}
        for engine in ENGINES:
            spec = {"engine": engine, "latency": latency, "sigma": args.sigma, "model": args.model, "texts": texts,
                    "observation": observation, "prompts": args.prompts, "group": args.group, "turns": args.turns,
                    "completion_tokens": args.completion_tokens, "steps": args.steps,
                    "max_staleness": args.max_staleness}
            run = run_worker("bench.bench_async", spec, f"{engine} at {latency} s")
            for number, step in enumerate(run["steps"], 1):
                if round(step["action_tokens"]) != args.turns * args.completion_tokens:
                    raise RuntimeError(f"{engine} step {number}: {step['action_tokens']} action tokens per "
                                       f"episode, not {args.turns} x {args.completion_tokens}")
            timed = sum(s["step_s"] for s in run["steps"][1:])
            print(f"latency {latency:g} s, {engine}: {timed:.1f} s over {args.steps - 1} steps "
                  f"(other CPU {run['other_cpu_share']:.0%})", flush=True)
            results[latency][engine] = {**run, "timed_s": timed}
    write_section(args.out, summarise(results, args, time.perf_counter() - started))
    print(f"wrote {args.out / 'section.json'}")


def summarise(results: dict[float, dict[str, Any]], args: argparse.Namespace, seconds: float) -> Section:
    latencies = sorted(results)
    speedups = [results[x]["sync"]["timed_s"] / results[x]["async"]["timed_s"] for x in latencies]
    lines = [f"SmolLM2-shaped workload: `{args.model}`, {args.prompts} tasks x {args.group} attempts, {args.turns} turns "
             f"of exactly {args.completion_tokens} tokens, a ~{args.observation_tokens}-token observation, prompts "
             f"~{args.prompt_tokens} tokens; each tool call waits median x exp({args.sigma:g} N(0,1)) s; "
             f"{args.steps - 1} timed steps after the first. async = Ray, 1 worker pinned to core 1, learner "
             f"pinned to core 0, max_staleness {args.max_staleness}.", "",
             "| tool median (s) | sync s | async s | sync / async | async staleness | reward sync / async "
             "| other CPU sync / async |", "|---|---|---|---|---|---|---|"]
    for latency, speedup in zip(latencies, speedups):
        sync, asyn = results[latency]["sync"], results[latency]["async"]
        stale = statistics.mean(s["staleness_mean"] for s in asyn["steps"][1:])
        rewards = [statistics.mean(s["reward"] for s in run["steps"]) for run in (sync, asyn)]
        lines.append(f"| {latency:g} | {sync['timed_s']:.1f} | {asyn['timed_s']:.1f} | {speedup:.2f}x | {stale:.2f} "
                     f"| {rewards[0]:.3f} / {rewards[1]:.3f} | {sync['other_cpu_share']:.0%} / "
                     f"{asyn['other_cpu_share']:.0%} |")
    cross = crossover(latencies, speedups)
    lines += ["", "Crossover (async starts to win): " + ("not reached at the latencies measured" if cross is None
                                                        else f"about {cross:.2f} s median tool latency"), ""]
    png = plot_curve(latencies, speedups, args.out if args.smoke else ROOT / "docs" / "figures", args.smoke)
    if png is not None:
        lines.append(f"![speed-up against tool latency]({png.relative_to(ROOT) if png.is_relative_to(ROOT) else png})")
    headline = speedups[latencies.index(args.headline)]
    ratios = [Ratio(f"async over sync wall clock at {args.headline:g} s tool latency", headline, 1.5,
                    detail="; ".join(f"{x:g} s: {y:.2f}x" for x, y in zip(latencies, speedups)))]
    return Section(name="async", title="Sync against async rollouts", markdown="\n".join(lines), ratios=ratios,
                   smoke=args.smoke, seconds=seconds,
                   data={"results": {str(k): v for k, v in results.items()}, "speedups": speedups,
                         "crossover_s": cross, "machine": machine(),
                         "settings": {k: v for k, v in vars(args).items() if k != "out"}})


def plot_curve(latencies: list[float], speedups: list[float], out: Path, smoke: bool) -> Path | None:
    """The speed-up against latency as a PNG: in the output directory for a smoke run, else in docs/figures/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(latencies, speedups, "o-", label="sync time / async time")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axhline(1.5, color="green", lw=0.8, ls=":", label="target 1.5x")
    ax.set_xlabel("median tool-call latency (s)")
    ax.set_ylabel("speed-up of async")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / ("async_curve.png" if smoke else "bench_async.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
