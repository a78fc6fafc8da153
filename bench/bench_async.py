"""Sync against async rollouts: RL wall-clock on tools with heavy-tailed latency, same budget.

Two runs of the real `Trainer`, one after the other in this process, identical but for
`rollout.engine`: same seed, same warm start, same tasks per step, same group size, same
number of RL steps, so both train on the same number of trajectories. Every training
environment's `step` sleeps a heavy-tailed amount before returning (by default 85% of calls
about 0.05 s, 15% about 1.0 s), standing in for slow tool calls; evaluation environments do
not sleep.

What is timed: the RL phase only, from just before the engine is built (after the warm start
and the evaluation before RL) to the end of the last step, less the time of evaluations
inside it (only the one after the last step: `train.eval_every` is set past the last step,
because an evaluation in the learner's thread lets the async rollout thread run ahead and
would flatter async). The sum of the per-step `time/step_s` is reported beside it.

What is NOT guaranteed:
- the two runs see the same latencies per (task, occurrence of the task, turn), drawn from
  a generator seeded with those, but not per trajectory: within a group the order in which
  attempts reset is up to the thread pool, and once the policies diverge the episodes differ
  in length, so the total sleep differs a little (it is reported);
- equal held-out success: the async run trains on slightly stale data; the numbers are what
  they are, with their binomial standard error on `--eval-tasks` tasks;
- the warm starts are identical only if the machine is deterministic (the pre-RL evaluations
  are compared and the report says whether they agree).

    python bench/bench_async.py               # about 10 minutes on 2 cores
    python bench/bench_async.py --quick       # a smoke run, about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from keelrl.config import load_config
from keelrl.monitor import read_metrics
from keelrl.train.trainer import Trainer

DEFAULTS: dict[str, Any] = {"steps": 8, "tasks_per_step": 4, "group_size": 4, "max_turns": 4, "max_new_tokens": 64,
                            "eval_tasks": 40, "demos": 64, "warm_epochs": 2}
QUICK: dict[str, Any] = {"steps": 2, "tasks_per_step": 2, "group_size": 4, "max_turns": 3, "max_new_tokens": 32,
                         "eval_tasks": 8, "demos": 16, "warm_epochs": 1}
ENGINE_ORDER = ("sync", "async")


# --------------------------------------------------------------------------- slow tools
@dataclass(frozen=True)
class ToolLatency:
    """A two-mode delay per env.step: fast with probability 1 - slow_prob, else slow; log-normal spread."""

    fast_s: float = 0.05
    slow_s: float = 1.0
    slow_prob: float = 0.15
    sigma: float = 0.25
    """Spread of each mode: delay = mode * exp(sigma * N(0, 1))."""

    def draw(self, rng: random.Random) -> float:
        mode = self.slow_s if rng.random() < self.slow_prob else self.fast_s
        return mode * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    @property
    def mean_s(self) -> float:
        spread = math.exp(self.sigma ** 2 / 2)  # E[exp(sigma Z)]
        return ((1 - self.slow_prob) * self.fast_s + self.slow_prob * self.slow_s) * spread


class SlowToolEnv:
    """Wraps an environment; `step` sleeps a drawn delay after the real step, the rest is forwarded."""

    def __init__(self, inner: Any, factory: "SlowToolEnvFactory") -> None:
        self._inner, self._factory = inner, factory
        self._key = ("", 0)
        self._turn = 0

    def reset(self, task: Any) -> str:
        self._key = self._factory.occurrence(str(getattr(task, "id", task)))
        self._turn = 0
        return self._inner.reset(task)

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        result = self._inner.step(action_text)
        delay = self._factory.delay(self._key, self._turn)
        self._turn += 1
        time.sleep(delay)
        return result

    def __getattr__(self, name: str) -> Any:  # grade, close, max_turns, ...
        return getattr(self._inner, name)


class SlowToolEnvFactory:
    """A picklable factory of `SlowToolEnv`s around another factory; records every delay it draws.

    The delay of turn t of the k-th episode on task i is drawn from random.Random(seed, i, k, t),
    so two runs over the same tasks draw the same delays.
    """

    def __init__(self, inner: Callable[[], Any], latency: ToolLatency, seed: int) -> None:
        self.inner, self.latency, self.seed = inner, latency, seed
        self._lock = threading.Lock()
        self._occurrences: dict[str, int] = {}
        self.delays: list[float] = []

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def occurrence(self, task_id: str) -> tuple[str, int]:
        with self._lock:
            count = self._occurrences.get(task_id, 0)
            self._occurrences[task_id] = count + 1
        return task_id, count

    def delay(self, key: tuple[str, int], turn: int) -> float:
        value = self.latency.draw(random.Random(f"{self.seed}:{key[0]}:{key[1]}:{turn}"))
        with self._lock:
            self.delays.append(value)
        return value

    def __call__(self) -> SlowToolEnv:
        return SlowToolEnv(self.inner(), self)


# --------------------------------------------------------------------------- the runs
def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (sandboxed tool calls and gradings)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class BenchTrainer(Trainer):
    """The trainer with slow training tools and timed evaluations."""

    def __init__(self, cfg: Any, latency: ToolLatency, progress: Callable[[str, dict[str, Any]], None]) -> None:
        super().__init__(cfg, progress=progress)
        self.latency = latency
        self.tools: SlowToolEnvFactory | None = None
        self.evaluations: list[tuple[float, float, float]] = []
        """(start wall, wall seconds, CPU seconds) of each evaluation."""

    def train_env_factory(self) -> Callable[[], Any]:
        self.tools = SlowToolEnvFactory(super().train_env_factory(), self.latency, self.cfg.seed)
        return self.tools

    def evaluate(self, tasks: Any = None) -> dict[str, float]:
        start, cpu = time.monotonic(), _cpu_s()
        out = super().evaluate(tasks)
        self.evaluations.append((start, time.monotonic() - start, _cpu_s() - cpu))
        return out


def overrides_for(args: argparse.Namespace, engine: str, run_dir: Path) -> list[str]:
    never = args.steps + 1  # evaluate and checkpoint only after the last step
    return [f"seed={args.seed}", "model.path=tiny", "device=cpu", f"run_dir={run_dir}",
            f"algo.preset={args.preset}",
            f"warm_start.demos={args.demos}", f"warm_start.epochs={args.warm_epochs}",
            f"env.max_turns={args.max_turns}",
            f"rollout.engine={engine}", f"rollout.max_staleness={args.max_staleness}",
            f"rollout.interruptible={str(not args.no_interruptible).lower()}",
            f"rollout.env_threads={args.env_threads}", f"rollout.tasks_per_step={args.tasks_per_step}",
            f"rollout.group_size={args.group_size}", f"rollout.max_new_tokens={args.max_new_tokens}",
            f"train.steps={args.steps}", f"train.eval_tasks={args.eval_tasks}",
            f"train.eval_every={never}", f"train.checkpoint_every={never}", *args.override]


def run_engine(args: argparse.Namespace, engine: str, latency: ToolLatency) -> dict[str, Any]:
    """Train with `engine`; returns its metrics rows, RL-phase clock and tool delays."""
    run_dir = args.out / engine
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cfg = load_config(None, overrides_for(args, engine, run_dir))
    marks: dict[str, tuple[float, float]] = {}

    def progress(event: str, info: dict[str, Any]) -> None:
        now = (time.monotonic(), _cpu_s())
        if event == "warm_start":
            print(f"[{engine}] warm start on {info['demos']} teacher demos", flush=True)
        elif event == "warm_start_epoch":
            print(f"[{engine}] warm start epoch {info['epoch']}: loss {info['loss']:.3f}", flush=True)
        elif event == "eval" and info["step"] == 0:
            marks["rl_start"] = now
            print(f"[{engine}] eval before RL: success {info['eval/success']:.3f}, "
                  f"partial {info['eval/partial']:.3f}; RL starts", flush=True)
        elif event == "step":
            marks["rl_end"] = now
            print(f"[{engine}] step {info['step']}/{info['total']}: {info['time/step_s']:.2f} s "
                  f"(learn {info['time/learn_s']:.2f}, learner wait {info['time/learner_wait_s']:.2f}, "
                  f"rollout idle {info['time/rollout_idle_s']:.2f}), reward {info['train/reward']:.3f}, "
                  f"staleness {info['rollout/staleness_mean']:.2f}", flush=True)
            if "eval/success" in info:
                print(f"[{engine}] eval after RL: success {info['eval/success']:.3f}, "
                      f"partial {info['eval/partial']:.3f}", flush=True)

    started = time.monotonic()
    trainer = BenchTrainer(cfg, latency, progress)
    trainer.run()
    total_s = time.monotonic() - started
    (rl_start, cpu_start), (rl_end, cpu_end) = marks["rl_start"], marks["rl_end"]
    inside = [(wall, cpu) for start, wall, cpu in trainer.evaluations if start >= rl_start]
    rl_wall = rl_end - rl_start - sum(wall for wall, _ in inside)
    rl_cpu = cpu_end - cpu_start - sum(cpu for _, cpu in inside)
    assert trainer.tools is not None
    delays = trainer.tools.delays
    return {"rows": read_metrics(run_dir), "rl_wall_s": rl_wall, "rl_cpu_s": rl_cpu, "total_s": total_s,
            "tool_calls": len(delays), "tool_sleep_s": sum(delays),
            "slow_calls": sum(1 for d in delays if d > math.sqrt(latency.fast_s * latency.slow_s))}


# --------------------------------------------------------------------------- numbers
def summarise(engine: str, run: dict[str, Any], trajectories_per_step: int, cpus: int) -> dict[str, Any]:
    """The numbers of one run from its metrics rows and RL-phase clock."""
    rows = run["rows"]
    steps = [row for row in rows if row["step"] >= 1]
    evals = [row for row in rows if "eval/success" in row]
    before, after = evals[0], evals[-1]

    def total(key: str) -> float:
        return sum(row.get(key, 0.0) for row in steps)

    lags = sorted({int(key.rsplit("_", 1)[1]) for row in steps for key in row if key.startswith("rollout/token_share_lag_")})
    step_s, learn_s = total("time/step_s"), total("time/learn_s")
    return {
        "engine": engine, "steps": len(steps), "trajectories": len(steps) * trajectories_per_step,
        "rl_wall_s": run["rl_wall_s"], "step_s_sum": step_s, "learn_s_sum": learn_s,
        "learner_util": learn_s / max(step_s, 1e-9),
        "learner_wait_s_sum": total("time/learner_wait_s"),
        "rollout_idle_s_sum": total("time/rollout_idle_s"),
        "rollout_generate_s_sum": total("time/rollout_generate_s"),
        "cpu_util": run["rl_cpu_s"] / max(run["rl_wall_s"] * cpus, 1e-9),
        "staleness_mean": sum(row["rollout/staleness_mean"] for row in steps) / len(steps),
        "staleness_max": max(row["rollout/staleness_max"] for row in steps),
        "token_share_by_lag": {lag: sum(row.get(f"rollout/token_share_lag_{lag}", 0.0) for row in steps) / len(steps)
                               for lag in lags},
        "train_reward_mean": sum(row["train/reward"] for row in steps) / len(steps),
        "eval_before": {"success": before["eval/success"], "partial": before["eval/partial"],
                        "tasks": before["eval/tasks"]},
        "eval_after": {"success": after["eval/success"], "partial": after["eval/partial"], "tasks": after["eval/tasks"]},
        "tool_calls": run["tool_calls"], "slow_calls": run["slow_calls"], "tool_sleep_s": run["tool_sleep_s"],
        "total_s": run["total_s"],
        "per_step": [{key: row.get(key) for key in ("step", "time/step_s", "time/learn_s", "time/learner_wait_s",
                                                     "time/rollout_idle_s", "train/reward",
                                                     "rollout/staleness_mean")} for row in steps],
    }


def within_noise(a: float, b: float, tasks: int) -> tuple[float, bool]:
    """(standard error of a - b, |a - b| <= 2 SE) for two means of [0, 1] scores over `tasks` tasks each.

    p(1 - p) bounds the variance of any [0, 1] score of mean p, so for partial credit the error
    is an upper bound. Unpaired, though both runs score the same tasks: conservative again.
    """
    se = math.sqrt((a * (1 - a) + b * (1 - b)) / tasks)
    return se, abs(a - b) <= 2 * se + 1e-12


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    sync, fast = runs["sync"], runs["async"]
    tasks = sync["eval_after"]["tasks"]
    success_se, success_ok = within_noise(sync["eval_after"]["success"], fast["eval_after"]["success"], tasks)
    partial_se, partial_ok = within_noise(sync["eval_after"]["partial"], fast["eval_after"]["partial"], tasks)
    return {"ratio_rl_wall": sync["rl_wall_s"] / fast["rl_wall_s"],
            "ratio_step_s_sum": sync["step_s_sum"] / fast["step_s_sum"],
            "same_warm_start": sync["eval_before"] == fast["eval_before"],
            "success_diff": fast["eval_after"]["success"] - sync["eval_after"]["success"], "success_se": success_se,
            "success_within_noise": success_ok,
            "partial_diff": fast["eval_after"]["partial"] - sync["eval_after"]["partial"], "partial_se": partial_se,
            "partial_within_noise": partial_ok}


def markdown(report: dict[str, Any]) -> str:
    runs, cmp = report["runs"], report["comparison"]
    setup = report["setup"]

    def row(label: str, fmt: Callable[[dict[str, Any]], str]) -> str:
        return f"| {label} | " + " | ".join(fmt(runs[name]) for name in ENGINE_ORDER) + " |"

    lags = sorted({lag for name in ENGINE_ORDER for lag in runs[name]["token_share_by_lag"]})
    lines = [
        f"{setup['steps']} RL steps x {setup['tasks_per_step']} tasks x {setup['group_size']} attempts "
        f"({runs['sync']['trajectories']} trajectories per run), max {setup['max_turns']} turns, "
        f"{setup['max_new_tokens']} new tokens per action, seed {setup['seed']}, preset {setup['preset']}, "
        f"async max_staleness {setup['max_staleness']} "
        f"({'interruptible' if setup['interruptible'] else 'not interruptible'}), "
        f"{setup['env_threads']} env threads, {report['cpus']} CPUs.",
        f"Tool latency per env.step: {setup['latency']['fast_s']:g} s with probability "
        f"{1 - setup['latency']['slow_prob']:g}, else {setup['latency']['slow_s']:g} s, log-normal spread "
        f"sigma {setup['latency']['sigma']:g} (mean {setup['latency']['mean_s']:.3f} s).",
        "",
        "| | sync | async |",
        "|---|---|---|",
        row("RL wall (s), timer around the RL loop", lambda r: f"{r['rl_wall_s']:.1f}"),
        row("sum of time/step_s (s)", lambda r: f"{r['step_s_sum']:.1f}"),
        row("learner utilisation (sum learn_s / sum step_s)", lambda r: f"{r['learner_util']:.3f}"),
        row("learner wait for rollouts (s)", lambda r: f"{r['learner_wait_s_sum']:.1f}"),
        row("rollout generate (s)", lambda r: f"{r['rollout_generate_s_sum']:.1f}"),
        row("rollout idle (s)", lambda r: f"{r['rollout_idle_s_sum']:.1f}"),
        row("CPU use in RL phase (share of all cores)", lambda r: f"{r['cpu_util']:.2f}"),
        row("staleness mean / max", lambda r: f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f}"),
        *[row(f"action-token share at lag {lag}", lambda r, lag=lag: f"{r['token_share_by_lag'].get(lag, 0.0):.3f}")
          for lag in lags],
        row("tool calls (slow) / total sleep (s)",
            lambda r: f"{r['tool_calls']} ({r['slow_calls']}) / {r['tool_sleep_s']:.1f}"),
        row("train reward, mean over steps", lambda r: f"{r['train_reward_mean']:.3f}"),
        row("eval/success before -> after RL",
            lambda r: f"{r['eval_before']['success']:.3f} -> {r['eval_after']['success']:.3f}"),
        row("eval/partial before -> after RL",
            lambda r: f"{r['eval_before']['partial']:.3f} -> {r['eval_after']['partial']:.3f}"),
        "",
        f"sync/async RL wall: **{cmp['ratio_rl_wall']:.2f}x** "
        f"(from the sums of time/step_s: {cmp['ratio_step_s_sum']:.2f}x).",
        f"Held-out success after RL, async - sync: {cmp['success_diff']:+.3f} (2 SE = {2 * cmp['success_se']:.3f}, "
        f"{'within' if cmp['success_within_noise'] else 'OUTSIDE'} noise); partial {cmp['partial_diff']:+.3f} "
        f"(2 SE <= {2 * cmp['partial_se']:.3f}, {'within' if cmp['partial_within_noise'] else 'OUTSIDE'} noise) "
        f"on {runs['sync']['eval_after']['tasks']} held-out tasks.",
        f"Warm starts identical (same pre-RL evaluation): {'yes' if cmp['same_warm_start'] else 'NO'}.",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    figure, ((wall, split), (reward, evals)) = plt.subplots(2, 2, figsize=(11, 7))
    for name in ENGINE_ORDER:
        steps = [row["step"] for row in runs[name]["per_step"]]
        elapsed, clock = [0.0], 0.0
        for row in runs[name]["per_step"]:
            clock += row["time/step_s"]
            elapsed.append(clock)
        wall.plot([0, *steps], elapsed, marker="o", label=name)
        reward.plot(steps, [row["train/reward"] for row in runs[name]["per_step"]], marker="o", label=name)
    wall.set(xlabel="RL step", ylabel="seconds (cumulative time/step_s)", title="RL wall-clock")
    wall.legend()
    reward.set(xlabel="RL step", ylabel="mean reward", title="training reward")
    reward.legend()
    width = 0.4
    for offset, name in ((-width / 2, "sync"), (width / 2, "async")):
        rows = runs[name]["per_step"]
        steps = [row["step"] + offset for row in rows]
        learn = [row["time/learn_s"] for row in rows]
        waited = [row["time/learner_wait_s"] for row in rows]
        split.bar(steps, waited, width, label=f"{name}: learner waits for rollouts",
                  color="tab:blue" if name == "sync" else "tab:orange", alpha=0.5)
        split.bar(steps, learn, width, bottom=waited, label=f"{name}: learner updates",
                  color="tab:blue" if name == "sync" else "tab:orange")
    split.set(xlabel="RL step", ylabel="seconds", title="one step: waiting vs updating")
    split.legend(fontsize=7)
    labels = ["success before", "success after", "partial before", "partial after"]
    for offset, name in ((-width / 2, "sync"), (width / 2, "async")):
        r = runs[name]
        values = [r["eval_before"]["success"], r["eval_after"]["success"],
                  r["eval_before"]["partial"], r["eval_after"]["partial"]]
        evals.bar([i + offset for i in range(4)], values, width, label=name)
    evals.set_xticks(range(4), labels)
    evals.set(ylim=(0, 1), title=f"held-out ({runs['sync']['eval_after']['tasks']} tasks)")
    evals.legend()
    ratio = report["comparison"]["ratio_rl_wall"]
    figure.suptitle(f"sync vs async rollouts, heavy-tailed tool latency: sync/async RL wall {ratio:.2f}x")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# --------------------------------------------------------------------------- entry point
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke-run sizes: {QUICK}")
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default {default} ({QUICK[name]} with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of both runs (default 0)")
    parser.add_argument("--preset", default="grpo", help="algo.preset of both runs (default grpo)")
    parser.add_argument("--max-staleness", type=int, default=1, help="async rollout.max_staleness (default 1)")
    parser.add_argument("--no-interruptible", action="store_true", help="async: rollout.interruptible=false")
    parser.add_argument("--env-threads", type=int, default=32,
                        help="rollout.env_threads of both runs: sleeping tools hold a thread each (default 32)")
    parser.add_argument("--fast-s", type=float, default=0.05, help="typical fast tool delay (default 0.05 s)")
    parser.add_argument("--slow-s", type=float, default=1.0, help="typical slow tool delay (default 1.0 s)")
    parser.add_argument("--slow-prob", type=float, default=0.15, help="share of slow tool calls (default 0.15)")
    parser.add_argument("--latency-sigma", type=float, default=0.25,
                        help="log-normal spread of each delay mode (default 0.25; 0 = fixed delays)")
    parser.add_argument("--async-first", action="store_true", help="run async before sync (order effects)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra dotted config override for both runs (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/async"),
                        help="output directory: report.json, report.md, report.png, one run directory per engine")
    args = parser.parse_args()
    sizes = QUICK if args.quick else DEFAULTS
    for name, default in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def main() -> None:
    args = parse_args()
    latency = ToolLatency(args.fast_s, args.slow_s, args.slow_prob, args.latency_sigma)
    args.out.mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count() or 1
    trajectories_per_step = args.tasks_per_step * args.group_size
    print(f"sync vs async, {args.steps} RL steps x {trajectories_per_step} trajectories each, {cpus} CPUs, "
          f"output in {args.out}", flush=True)
    order = ENGINE_ORDER[::-1] if args.async_first else ENGINE_ORDER
    runs = {engine: summarise(engine, run_engine(args, engine, latency), trajectories_per_step, cpus)
            for engine in order}
    setup = {name: getattr(args, name) for name in (*DEFAULTS, "seed", "preset", "max_staleness", "env_threads")}
    setup.update({"order": list(order), "interruptible": not args.no_interruptible, "quick": args.quick, "overrides": args.override,
                  "latency": {**asdict(latency), "mean_s": latency.mean_s}})
    report = {"setup": setup, "runs": runs, "comparison": compare(runs), "cpus": cpus,
              "machine": platform.platform(), "timed": "RL phase only: engine build to last step, less evaluations"}
    text = markdown(report)
    print()
    print(text, end="")
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "report.md").write_text(text)
    plot(report, args.out / "report.png")
    print(f"wrote {args.out / 'report.json'}, {args.out / 'report.md'}, {args.out / 'report.png'}")


if __name__ == "__main__":
    main()
