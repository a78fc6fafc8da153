"""Sync against async on the real coding environment with slow tools: wall clock at equal held-out success.

`bench_async` measures the speed-up on a synthetic workload; this checks the other half of the
claim on the real thing: the bundled coding tasks, sandboxed test runs, SmolLM2 warm-started on
the teacher's fixes (the base model writes no valid tool call, so it has no held-out success
to keep). Every training tool call (`env.step`) additionally waits as `bench.synthetic.ToolLatency`
says (log-normal around `--latency` seconds, the same for every attempt at a task's t-th call),
standing in for a real repository's test run; evaluation does not wait.

One warm start (saved once, `OUT/warm_start`), one held-out evaluation of it on `--eval-tasks`
tasks, then two RL runs from those weights with the same seed, tasks and budget, each in a fresh
process: `rollout.engine=sync` (both cores) and `rollout.engine=ray` (one worker pinned to core
1, the learner to core 0, `max_staleness` steps of lag). Each run ends with a held-out
evaluation on the same tasks, greedy. Timed: the sum of `time/step_s` over the steps after the
first. Held-out: each run's success before and after, and async's final success less sync's,
paired over the same tasks with its standard error; "equal" means within 2 standard errors.

Both runs use the default preset's loss (GRPO's clip and k3 KL) without dynamic sampling (the
same rollouts for both; the warm start's first round only), with `algo.kl_is_weight=true`: its
k3 reference-KL term is then
weighted by pi / mu. Without it, k3 on samples one update stale can explode and take held-out
success with it, as it did in the first async run here
(docs/measurements.md#kl-to-the-reference-on-stale-samples). For the sync run the weight is 1 up
to float rounding (fresh samples, one update a step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bench.common import Clock, Ratio, Section, arguments, machine, run_worker, serve_worker, write_section
from bench.synthetic import ToolLatency


@dataclass
class SlowTools:
    """An environment whose `step` first waits as the latency model says; the rest is forwarded."""

    inner: Any
    latency: ToolLatency
    task_id: str = ""
    turn: int = 0

    def reset(self, task: Any) -> str:
        self.task_id, self.turn = str(getattr(task, "id", task)), 0
        return self.inner.reset(task)

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        time.sleep(self.latency.delay(self.task_id, self.turn))
        self.turn += 1
        return self.inner.step(action_text)

    def __getattr__(self, name: str) -> Any:  # grade, close, max_turns
        if name in ("inner", "latency", "task_id", "turn"):
            raise AttributeError(name)
        return getattr(self.inner, name)


@dataclass(frozen=True)
class SlowToolsFactory:
    """Picklable (Ray ships it to its worker): wraps each environment of `inner` in SlowTools."""

    inner: Callable[[], Any]
    latency: ToolLatency

    def __call__(self) -> SlowTools:
        return SlowTools(self.inner(), self.latency)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="async_heldout")
    parser.add_argument("--latency", type=float, default=10.0, help="median seconds a training tool call waits")
    parser.add_argument("--sigma", type=float, default=0.5, help="log-normal spread of a tool call's delay")
    parser.add_argument("--demos", type=int, default=128, help="teacher fixes in the warm start")
    parser.add_argument("--steps", type=int, default=4, help="RL steps per run; the first is not timed")
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--eval-tasks", type=int, default=64, help="held-out tasks evaluated (the same each time)")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--reuse-warm-start", action="store_true", help="reuse OUT/warm_start if its settings match")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one run, as a JSON file
    args = parser.parse_args(argv)
    if args.smoke:
        args.latency, args.demos, args.steps, args.tasks_per_step, args.group, args.eval_tasks = 0.05, 4, 2, 2, 2, 3
        args.max_staleness = 1
    if (os.cpu_count() or 1) < 2:
        parser.error("the async run pins learner and worker to separate cores: this machine has one")
    return args


def common_overrides(args: argparse.Namespace, model: str, run_dir: Path) -> list[str]:
    tiny = ["rollout.max_new_tokens=16", "env.max_turns=2", "warm_start.epochs=1", "warm_start.batch_size=4"]
    return [f"model.path={model}", "device=cpu", f"run_dir={run_dir}", "seed=0",
            f"train.steps={args.steps}", f"rollout.tasks_per_step={args.tasks_per_step}",
            f"rollout.group_size={args.group}", f"train.minibatch_size={args.tasks_per_step * args.group}",
            f"eval.tasks={args.eval_tasks}", "eval.every=1000", "eval.base=false",
            "algo.kl_is_weight=true", "algo.dynamic_sampling=false", "warm_start.own_mistakes=0",
            "output.checkpoint_every=1000", "rollout.env_threads=32", *(tiny if args.smoke else [])]


def warm_start_once(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The warm-started model (saved) and its held-out evaluation."""
    from keelrl.config import load_config
    from keelrl.train.trainer import Trainer

    folder = args.out / "warm_start"
    settings = {"demos": args.demos, "eval_tasks": args.eval_tasks, "smoke": args.smoke}
    recorded = folder / "settings.json"
    if args.reuse_warm_start and recorded.exists() and json.loads(recorded.read_text())["settings"] == settings:
        return folder / "model", json.loads(recorded.read_text())["eval"]
    model = "tiny" if args.smoke else "smollm2"
    cfg = load_config(None, [*common_overrides(args, model, folder / "run"), f"warm_start.demos={args.demos}"])
    trainer = Trainer(cfg)
    trainer.warm_start()
    metrics = trainer.evaluate()
    report = {"success": metrics["eval/success"], "task_success": trainer.last_eval_report["task_success"]}
    trainer.model.save_pretrained(folder / "model")
    trainer.tokenizer.save_pretrained(folder / "model")
    recorded.write_text(json.dumps({"settings": settings, "eval": report}) + "\n")
    return folder / "model", report


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine from the warm-started weights (a fresh process: pinning is process-wide)."""
    from keelrl.config import load_config
    from keelrl.train.trainer import Trainer

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    args = argparse.Namespace(**spec["args"])
    latency = ToolLatency(args.latency, args.sigma, seed=0)

    class SlowTrainer(Trainer):
        def train_env_factory(self) -> Any:
            return SlowToolsFactory(super().train_env_factory(), latency)

    overrides = [*common_overrides(args, spec["model"], Path(spec["run_dir"])), "warm_start.demos=0",
                 "eval.before_rl=false"]
    if spec["engine"] == "async":
        overrides += ["rollout.engine=ray", "rollout.workers=1", "rollout.worker_cpus=1", "rollout.worker_cores=[1]",
                      "perf.learner_cores=[0]", f"rollout.max_staleness={args.max_staleness}"]
    rows: list[dict[str, Any]] = []
    trainer = SlowTrainer(load_config(None, overrides),
                          progress=lambda event, info: rows.append(info) if event == "step" else None)
    clock = Clock()
    trainer.run()
    load = clock.read()
    return {"steps": [{"step_s": r["time/step_s"], "reward": r["train/reward"],
                       "staleness_mean": r.get("rollout/staleness_mean", 0.0)} for r in rows],
            "final_success": rows[-1]["eval/success"], "task_success": trainer.last_eval_report["task_success"],
            "other_cpu_share": load["other_cpu_share"]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if serve_worker(args, run_one):
        return
    from keelrl.train.evaluation import paired_difference

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, before = warm_start_once(args)
    print(f"warm start: held-out success {before['success']:.3f} on {len(before['task_success'])} tasks", flush=True)
    runs = {}
    for engine in ("sync", "async"):
        spec = {"engine": engine, "model": str(model_dir), "run_dir": str(args.out / engine),
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
        runs[engine] = run_worker("bench.bench_async_heldout", spec, engine)
        runs[engine]["timed_s"] = sum(s["step_s"] for s in runs[engine]["steps"][1:])
        print(f"{engine}: {runs[engine]['timed_s']:.1f} s, held-out {runs[engine]['final_success']:.3f}", flush=True)
    gap, gap_se = paired_difference(runs["sync"]["task_success"], runs["async"]["task_success"])
    speedup = runs["sync"]["timed_s"] / runs["async"]["timed_s"]
    equal = abs(gap) <= 2 * gap_se if math.isfinite(gap_se) and gap_se > 0 else gap == 0
    lines = [f"Coding environment, `{'tiny' if args.smoke else 'smollm2'}` warm-started on {args.demos} teacher fixes; "
             f"{args.tasks_per_step} tasks x {args.group} attempts a step, {args.steps} steps ({args.steps - 1} timed); "
             f"every training tool call waits {args.latency:g} x exp({args.sigma:g} N(0,1)) s; async = Ray, worker on "
             f"core 1, learner on core 0, max_staleness {args.max_staleness}; held-out: {args.eval_tasks} tasks, greedy.",
             "", "| engine | RL steps s | held-out success before -> after | mean train reward | other CPU |",
             "|---|---|---|---|---|"]
    for engine, run in runs.items():
        reward = sum(s["reward"] for s in run["steps"]) / len(run["steps"])
        lines.append(f"| {engine} | {run['timed_s']:.1f} | {before['success']:.3f} -> {run['final_success']:.3f} "
                     f"| {reward:.3f} | {run['other_cpu_share']:.0%} |")
    lines += ["", f"sync / async wall clock: **{speedup:.2f}x**; async's final held-out success less sync's, paired: "
              f"{gap:+.3f} +- {gap_se:.3f} ({'equal within 2 SE' if equal else 'NOT equal within 2 SE'})."]
    section = Section(name="async_heldout", title="Sync against async on the coding environment",
                      markdown="\n".join(lines),
                      ratios=[Ratio(f"async over sync wall clock at {args.latency:g} s tools, held-out "
                                    f"{'equal' if equal else 'NOT equal'}", speedup if equal else math.nan, 1.5,
                                    detail=f"held-out gap {gap:+.3f} +- {gap_se:.3f}")],
                      smoke=args.smoke, seconds=time.perf_counter() - started,
                      data={"runs": runs, "before": before, "gap": gap, "gap_se": gap_se, "machine": machine(),
                            "settings": {k: v for k, v in vars(args).items() if k != "out"}})
    write_section(args.out, section)
    print(f"wrote {args.out / 'section.json'}")


if __name__ == "__main__":
    main()
