"""Sync against async rollouts: RL wall-clock on tools with heavy-tailed latency, same budget.

Two runs of the real `Trainer`, one after the other in this process, identical but for
`rollout.engine`: same seed, same warm-started weights, same tasks per step, group size and
number of RL steps, so both train on the same number of trajectories. Every training
environment's `step` sleeps a heavy-tailed amount before returning (by default 85% of calls
about 0.05 s, 15% about 1.0 s), standing in for slow tool calls; evaluation environments do
not sleep. The warm start runs once, before both, and is saved (`OUT/warm_start/model`); both
runs load it with `model.path` and skip their own.

What is timed: the RL phase only, from just before the engine is built (after the evaluation
before RL) to the end of the last step, less the evaluation after the last step
(`train.eval_every` is set past the last step: an evaluation in the learner's thread in
mid-run would let the async rollout thread work ahead for free). The sum of the per-step
`time/step_s` is reported beside it. So is the CPU other processes used meanwhile: on a
shared 2-core machine that, not the engine, can decide the result.

What is NOT guaranteed:
- the two runs see the same latencies per (task, occurrence of the task, turn), drawn from
  a generator seeded with those, but not per trajectory: within a group the order in which
  attempts reset is up to the thread pool, and once the policies diverge the episodes differ
  in length; the async engine also runs the episodes of `max_staleness` steps past the last
  one, which nobody trains on; the total sleep is reported;
- equal held-out success: the async run trains on stale data; the numbers are what they are,
  with a (conservative) binomial standard error over `--eval-tasks` tasks;
- the same held-out numbers on another checkout: the warm start and the evaluation depend on
  the bundled tasks; within one invocation the report says whether the two pre-RL
  evaluations agree.

    python bench/bench_async.py                      # warm start (~5-14 min), then ~5 min of runs
    python bench/bench_async.py --reuse-warm-start   # reuse OUT/warm_start: ~5 min
    python bench/bench_async.py --quick              # smoke run, about 1 minute on a quiet machine
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

import torch

from keelrl.config import TINY_RUN, load_config
from keelrl.monitor import read_metrics
from keelrl.train.trainer import Trainer

DEFAULTS: dict[str, Any] = {"steps": 8, "tasks_per_step": 4, "group_size": 4, "max_turns": 4, "max_new_tokens": 64,
                            "eval_tasks": 40, "demos": 448, "warm_epochs": 6}
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
        if name.startswith("_"):  # not yet set (unpickling): no recursion through self._inner
            raise AttributeError(name)
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
def _clock() -> tuple[float, float, float]:
    """(wall s, CPU s of this process and its reaped children, busy CPU s of the whole machine).

    The machine's busy time, from /proc/stat, less this process's own shows whether something
    else (another job on a shared box) took CPU during the measurement: on 2 cores a second
    busy process makes every 2-thread torch op wait on a descheduled thread, and timings are
    then worth little. NaN where /proc/stat does not exist.
    """
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user .. steal; guest is inside user
    except (OSError, ValueError, IndexError):
        busy = math.nan
    return time.monotonic(), cpu, busy


def _since(start: tuple[float, float, float]) -> tuple[float, float, float]:
    return tuple(now - then for now, then in zip(_clock(), start))  # type: ignore[return-value]


class BenchTrainer(Trainer):
    """The trainer with slow training tools and timed evaluations."""

    def __init__(self, cfg: Any, latency: ToolLatency, progress: Callable[[str, dict[str, Any]], None]) -> None:
        super().__init__(cfg, progress=progress)
        self.latency = latency
        self.tools: SlowToolEnvFactory | None = None
        self.evaluations: list[tuple[float, tuple[float, float, float]]] = []
        """(start, (wall, own CPU, machine busy) seconds) of each evaluation."""

    def train_env_factory(self) -> Callable[[], Any]:
        self.tools = SlowToolEnvFactory(super().train_env_factory(), self.latency, self.cfg.seed)
        return self.tools

    def evaluate(self, tasks: Any = None) -> dict[str, float]:
        start = _clock()
        out = super().evaluate(tasks)
        self.evaluations.append((start[0], _since(start)))
        return out


def overrides_for(args: argparse.Namespace, engine: str, run_dir: Path, model_path: str) -> list[str]:
    never = args.steps + 1  # evaluate and checkpoint only after the last step
    return [*TINY_RUN, f"seed={args.seed}", f"model.path={model_path}", "device=cpu", f"run_dir={run_dir}",
            f"algo.preset={args.preset}", "warm_start.demos=0",
            f"env.max_turns={args.max_turns}",
            f"rollout.engine={engine}", f"rollout.max_staleness={args.max_staleness}",
            f"rollout.interruptible={str(not args.no_interruptible).lower()}",
            f"rollout.env_threads={args.env_threads}", f"rollout.tasks_per_step={args.tasks_per_step}",
            f"rollout.group_size={args.group_size}", f"rollout.max_new_tokens={args.max_new_tokens}",
            f"train.steps={args.steps}", f"train.eval_tasks={args.eval_tasks}",
            f"train.eval_every={never}", f"train.checkpoint_every={never}", *args.override]


def warm_start_once(args: argparse.Namespace) -> Path:
    """Warm-start the tiny model once and save it; both runs start RL from these weights.

    With --reuse-warm-start an earlier one of the same settings is used as it is.
    """
    folder = args.out / "warm_start"
    model_dir = folder / "model"
    settings = {"seed": args.seed, "demos": args.demos, "epochs": args.warm_epochs, "max_turns": args.max_turns,
                "overrides": args.override}
    recorded = folder / "settings.json"
    if args.reuse_warm_start and recorded.exists() and json.loads(recorded.read_text()) == settings:
        print(f"[warm start] reusing {model_dir}", flush=True)
        return model_dir
    if folder.exists():
        shutil.rmtree(folder)
    cfg = load_config(None, [*TINY_RUN, f"seed={args.seed}", "model.path=tiny", "device=cpu", f"run_dir={folder}",
                             f"warm_start.demos={args.demos}", f"warm_start.epochs={args.warm_epochs}",
                             f"env.max_turns={args.max_turns}", *args.override])

    def progress(event: str, info: dict[str, Any]) -> None:
        if event == "warm_start":
            print(f"[warm start] {info['demos']} successful teacher demos of {args.demos}", flush=True)
        elif event == "warm_start_epoch":
            print(f"[warm start] epoch {info['epoch']}/{args.warm_epochs}: loss {info['loss']:.3f}", flush=True)

    started = time.monotonic()
    trainer = Trainer(cfg, progress=progress)
    trainer.warm_start()
    trainer.model.save_pretrained(model_dir)
    trainer.tokenizer.save_pretrained(model_dir)
    recorded.write_text(json.dumps(settings) + "\n")
    print(f"[warm start] done in {time.monotonic() - started:.0f} s; saved {model_dir}", flush=True)
    return model_dir


def run_engine(args: argparse.Namespace, engine: str, latency: ToolLatency, model_dir: Path) -> dict[str, Any]:
    """Train with `engine`; returns its metrics rows, RL-phase clock and tool delays."""
    run_dir = args.out / engine
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cfg = load_config(None, overrides_for(args, engine, run_dir, str(model_dir)))
    marks: dict[str, tuple[float, float, float]] = {}

    def progress(event: str, info: dict[str, Any]) -> None:
        now = _clock()
        if event == "eval" and info["step"] == 0:
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
    # RL phase = last step's end - start, less the evaluations inside it: (wall, own CPU, machine busy) s
    phase = [end - start for end, start in zip(marks["rl_end"], marks["rl_start"])]
    for started_at, spent in trainer.evaluations:
        if started_at >= marks["rl_start"][0]:
            phase = [value - inside for value, inside in zip(phase, spent)]
    rl_wall, rl_cpu, machine_busy = phase
    assert trainer.tools is not None
    delays = trainer.tools.delays
    return {"rows": read_metrics(run_dir), "rl_wall_s": rl_wall, "rl_cpu_s": rl_cpu,
            "other_cpu_s": machine_busy - rl_cpu, "total_s": total_s,
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

    lags = sorted({int(key.rsplit("_", 1)[1]) for row in steps for key in row
                   if key.startswith("rollout/token_share_lag_")})
    step_s, learn_s = total("time/step_s"), total("time/learn_s")
    return {
        "engine": engine, "steps": len(steps), "trajectories": len(steps) * trajectories_per_step,
        "rl_wall_s": run["rl_wall_s"], "step_s_sum": step_s, "learn_s_sum": learn_s,
        "learner_util": learn_s / max(step_s, 1e-9),
        "learner_wait_s_sum": total("time/learner_wait_s"),
        "rollout_idle_s_sum": total("time/rollout_idle_s"),
        "rollout_generate_s_sum": total("time/rollout_generate_s"),
        "cpu_util": run["rl_cpu_s"] / max(run["rl_wall_s"] * cpus, 1e-9),
        "other_cpu_util": run["other_cpu_s"] / max(run["rl_wall_s"] * cpus, 1e-9),
        "staleness_mean": sum(row["rollout/staleness_mean"] for row in steps) / len(steps),
        "staleness_max": max(row["rollout/staleness_max"] for row in steps),
        "token_share_by_lag": {lag: sum(row.get(f"rollout/token_share_lag_{lag}", 0.0) for row in steps) / len(steps)
                               for lag in lags},
        "train_reward_mean": sum(row["train/reward"] for row in steps) / len(steps),
        "eval_before": {"success": before["eval/success"], "partial": before["eval/partial"],
                        "tasks": before["eval/tasks"]},
        "eval_after": {"success": after["eval/success"], "partial": after["eval/partial"],
                       "tasks": after["eval/tasks"]},
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


def _token_share(lag: int) -> Callable[[dict[str, Any]], str]:
    return lambda run: f"{run['token_share_by_lag'].get(lag, 0.0):.3f}"


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
        f"{setup['env_threads']} env threads, {report['cpus']} CPUs, {setup['torch_threads']} torch threads, "
        f"run order {' then '.join(setup['order'])}.",
        f"Tool latency per env.step: {setup['latency']['fast_s']:g} s with probability "
        f"{1 - setup['latency']['slow_prob']:g}, else {setup['latency']['slow_s']:g} s, log-normal spread "
        f"sigma {setup['latency']['sigma']:g} (mean {setup['latency']['mean_s']:.3f} s).",
        f"Both runs start from one warm start ({setup['demos']} teacher demos x {setup['warm_epochs']} epochs); "
        f"timed: {report['timed']}.",
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
        row("CPU used by OTHER processes meanwhile (share)", lambda r: f"{r['other_cpu_util']:.2f}"),
        row("staleness mean / max", lambda r: f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f}"),
        *[row(f"action-token share at lag {lag}", _token_share(lag)) for lag in lags],
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
    busy = [name for name in ENGINE_ORDER if runs[name]["other_cpu_util"] > 0.1]
    if busy:
        lines.append(f"WARNING: other processes used > 10% of the CPUs during the {' and '.join(busy)} run; "
                     f"their timings are inflated by contention, not by the engine.")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

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
    for axes in (wall, split, reward):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
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
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch.set_num_threads for both runs (default 0: torch's default, one per core)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="before each run, wait up to this long for other processes to use < 10%% of the CPUs")
    parser.add_argument("--reuse-warm-start", action="store_true",
                        help="reuse OUT/warm_start/model when it was made with the same settings")
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


def wait_quiet(limit_s: float, cpus: int) -> float:
    """Wait (up to `limit_s`) for a 3 s window in which other processes use < 10% of the CPUs; returns that share."""
    deadline = time.monotonic() + limit_s
    while True:
        start = _clock()
        time.sleep(3.0)
        wall, own, busy = _since(start)
        other = (busy - own) / (wall * cpus)
        if not other >= 0.1 or time.monotonic() >= deadline:  # NaN (no /proc/stat) counts as quiet
            return other
        print(f"other processes use {other:.0%} of the CPUs; waiting for a quiet machine", flush=True)


def main() -> None:
    args = parse_args()
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    latency = ToolLatency(args.fast_s, args.slow_s, args.slow_prob, args.latency_sigma)
    args.out.mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count() or 1
    trajectories_per_step = args.tasks_per_step * args.group_size
    print(f"sync vs async, {args.steps} RL steps x {trajectories_per_step} trajectories each, {cpus} CPUs, "
          f"output in {args.out}", flush=True)
    order = ENGINE_ORDER[::-1] if args.async_first else ENGINE_ORDER
    model_dir = warm_start_once(args)
    runs = {}
    for engine in order:
        if args.wait_quiet > 0:
            wait_quiet(args.wait_quiet, cpus)
        runs[engine] = summarise(engine, run_engine(args, engine, latency, model_dir), trajectories_per_step, cpus)
    setup = {name: getattr(args, name) for name in (*DEFAULTS, "seed", "preset", "max_staleness", "env_threads")}
    setup.update({"torch_threads": torch.get_num_threads(), "order": list(order),
                  "interruptible": not args.no_interruptible, "quick": args.quick, "overrides": args.override,
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
