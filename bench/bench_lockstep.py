"""Lockstep batches (`rollout.lockstep`, `eval.lockstep`) against streaming: what they cost, and
whether the same weights give the same tokens.

Two workloads through the real agent loop (`run_episodes`, the coding environment, sandboxed
tool calls and grading), from one model: the held-out evaluation (one greedy attempt per task,
in the dtype `eval.dtype=auto` picks here) and one RL step's rollouts of the SmolLM2 labs' shape
(tasks x attempts at the rollout temperature, in `rollout.dtype`), each run `--repeats` times in
each mode, the modes alternating: `stream` (episodes join the batch being decoded as their tool
calls return, the default for training rollouts) and `lockstep` (a batch only when no
reset or tool call is pending, every waiting episode at once). Each run starts with the weights
loaded anew, as every evaluation does, so the decoder's stored prefixes and kept histories start
empty; one untimed call of each workload comes first (the sandbox's first start). The model is the
labs' cached student (`keelrl.labs.common.cached_student` with the coding labs' settings, made
once per machine: about 9 minutes on a Zen 5 EPYC when it is not cached yet), so the episodes
are the multi-turn ones the labs run; `--model` takes another.

Figures: each mode's median seconds, the ratio lockstep / stream, and per mode how many
episodes' tokens differ between its repeats (same weights, same seeds: anything but 0 is
rounding that depended on the batch).

    python -m bench.bench_lockstep                # the labs' student, 32 held-out tasks, 3 repeats
    python -m bench.bench_lockstep --smoke        # tiny model, seconds: checks the harness runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import Clock, Ratio, Section, arguments, labs_student, machine, write_section

MODES = ("stream", "lockstep")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="lockstep")
    parser.add_argument("--model", default="", help="a registered model name or a local path (default: the labs' "
                                                    "cached student)")
    parser.add_argument("--eval-tasks", type=int, default=32)
    parser.add_argument("--rollout-tasks", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model = args.model or "tiny"
        args.eval_tasks, args.rollout_tasks, args.group, args.repeats = 4, 2, 2, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    import dataclasses
    import tempfile

    from keelrl.config import load_config
    from keelrl.inference import deliver
    from keelrl.rollout.agent_loop import model_actor, run_episodes
    from keelrl.train.trainer import Trainer

    model = labs_student(args.model)
    small = ["env.show_file=false", "env.max_turns=3", "rollout.max_new_tokens=16", "warm_start.demos=0"] \
        if args.smoke else []
    with tempfile.TemporaryDirectory(prefix="keel-bench-lockstep-") as scratch:
        cfg = load_config(overrides=[f"model.path={model}", f"run_dir={Path(scratch) / 'run'}",
                                     f"eval.tasks={args.eval_tasks}", *small])
        trainer = Trainer(cfg)
        evaluator = trainer.evaluator
        rollout_options, eval_options = trainer.decoder_options(), evaluator.decoder_options()
        dtypes = {"evaluation": str(eval_options.dtype).replace("torch.", ""),
                  "rollout": str(rollout_options.dtype).replace("torch.", "")}
        evaluation = trainer.heldout_tasks[:args.eval_tasks]
        rollout = [task for task in trainer.train_tasks[:args.rollout_tasks] for _ in range(args.group)]
        workloads = {  # each as a run samples it: the evaluator's settings, the rollouts'
            "evaluation": (evaluator.make_env, evaluation, evaluator.rollout, None, evaluator.sampling(), eval_options),
            "rollout": (trainer.train_env_factory(), rollout, trainer._limits(),
                        [i // args.group for i in range(len(rollout))], trainer.rollout_sampling(), rollout_options),
        }
        results: dict[str, dict[str, list[dict[str, Any]]]] = {name: {mode: [] for mode in MODES} for name in workloads}
        for name, (make_env, tasks, limits, groups, sampling, options) in workloads.items():
            act = model_actor(trainer.model, trainer.tokenizer, sampling, options)

            def once(lockstep: bool) -> dict[str, Any]:
                deliver(act.decoder, trainer.model, 0)  # type: ignore[attr-defined]  # as each evaluation does: its stores start empty
                clock = Clock()
                trajectories = run_episodes(make_env, tasks, trainer.tokenizer, act,
                                            dataclasses.replace(limits, lockstep=lockstep), group_ids=groups, seed=11)
                load = clock.read()
                return {"seconds": load["wall_s"], "noisy": load["noisy"],
                        "success": sum(bool(t.success) for t in trajectories),
                        "tokens": [list(map(int, t.token_ids)) for t in trajectories]}

            once(False)  # untimed: the weights snapshot, the sandbox's first start
            for repeat in range(args.repeats):
                for mode in MODES:
                    run = once(mode == "lockstep")
                    results[name][mode].append(run)
                    print(f"{name} {mode} #{repeat}: {run['seconds']:.1f} s, {run['success']} of {len(tasks)} solved",
                          flush=True)
    figures = {name: summary(runs) for name, runs in results.items()}
    ratios = [Ratio(f"{name}: lockstep seconds / stream seconds", f["lockstep"]["median_s"] / f["stream"]["median_s"],
                    1.1, higher_is_better=False, detail=f"median of {args.repeats} each")
              for name, f in figures.items()]
    cpu = machine()["cpu"]
    body = [f"Machine: {cpu}; model: {model_name(args, model)}; evaluation: {args.eval_tasks} held-out tasks, "
            f"greedy, {dtypes['evaluation']} (eval.dtype=auto); rollout: {args.rollout_tasks} tasks x {args.group} "
            f"attempts at temperature {cfg.rollout.temperature}, {dtypes['rollout']} (rollout.dtype); "
            f"{args.repeats} repeats a mode, alternating.", "",
            "| workload | mode | seconds, each repeat | median s | solved, each repeat | episodes whose tokens differ "
            "between repeats |", "|---|---|---|---|---|---|"]
    for name, by_mode in figures.items():
        for mode in MODES:
            f = by_mode[mode]
            body.append(f"| {name} | {mode} | {', '.join(f'{s:.1f}' for s in f['seconds'])} | {f['median_s']:.1f} | "
                        f"{', '.join(map(str, f['success']))} | {f['differ']} of {f['episodes']} |")
    write_section(args.out, Section(name="lockstep", title="Lockstep batches against streaming",
                                    markdown="\n".join(body), ratios=ratios, smoke=args.smoke,
                                    seconds=time.perf_counter() - started,
                                    data={"figures": figures, "model": model, "dtypes": dtypes}))


def model_name(args: argparse.Namespace, model: str) -> str:
    return args.model or f"the labs' cached student ({Path(model).parent.name})"


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per mode: seconds and solved per repeat, their median, and how many episodes' tokens differ
    between any two repeats."""
    out = {}
    for mode, repeats in runs.items():
        first = repeats[0]["tokens"]
        differ = sum(any(r["tokens"][i] != first[i] for r in repeats[1:]) for i in range(len(first)))
        seconds = [r["seconds"] for r in repeats]
        out[mode] = {"seconds": seconds, "median_s": statistics.median(seconds), "success": [r["success"] for r in repeats],
                     "differ": differ, "episodes": len(first), "noisy": any(r["noisy"] for r in repeats)}
    return out


if __name__ == "__main__":
    main()
