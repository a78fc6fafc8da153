"""LoRA (`model.lora.rank`) against full fine-tuning: the default run's model and settings, a few
RL steps each, side by side in one invocation.

Two `keel train` runs, one after the other, identical but for the adapter (and the learning rate
an adapter needs: `--lora-lr`): the default config (SmolLM2-135M, the coding agent) with a short
warm start and `--steps` RL steps, no evaluation. From each run's metrics.jsonl and folder:

- learner tokens/s: sequence tokens over the learner's seconds (`time/learn_s`: the no-grad
  passes, the updates and the optimizer) summed over the RL steps;
- the peak resident memory of the run (`memory/peak_rss_gb`, the largest logged);
- the checkpoint's size on disk (its model/ folder and its whole folder);
- seconds per RL step, and the whole run's wall clock.

Held-out success and RL's lift need the full default run (`keel train model.lora.rank=16
optim.lr=...`), not this benchmark.

    python -m bench.bench_lora                # SmolLM2-135M, about 15 minutes on 2 cores
    python -m bench.bench_lora --smoke        # the tiny model, about a minute
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Clock, Ratio, Section, arguments, machine, write_section


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="lora")
    parser.add_argument("--steps", type=int, default=3, help="RL steps per run")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-lr", type=float, default=2e-4, help="optim.lr and warm_start.lr of the LoRA run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps = 2
    return args


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def train(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    keel = shutil.which("keel") or str(Path(sys.executable).parent / "keel")
    clock = Clock()
    tick = time.perf_counter()
    done = subprocess.run([keel, "train", *overrides, f"run_dir={run_dir}"], capture_output=True, text=True)
    wall = time.perf_counter() - tick
    load = clock.read()
    if done.returncode != 0:
        raise RuntimeError(f"keel train {' '.join(overrides)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "time/step_s" in row]
    learned = [row for row in steps if "time/learn_s" in row]  # a step whose groups were all dropped learns nothing
    tokens = sum(row["time/tokens_per_s"] * row["time/step_s"] for row in learned)
    learn_s = sum(row["time/learn_s"] for row in learned)
    checkpoints = sorted((run_dir / "checkpoints").iterdir()) if (run_dir / "checkpoints").is_dir() else []
    last = checkpoints[-1] if checkpoints else None
    return {"wall_s": wall, "noisy": load["noisy"], "steps": len(steps),
            "step_s": sum(row["time/step_s"] for row in steps) / max(1, len(steps)),
            "learner_tokens_per_s": tokens / learn_s if learn_s > 0 else float("nan"), "learn_s": learn_s,
            "updates": len(learned),
            "peak_rss_gb": max((row.get("memory/peak_rss_gb", 0.0) for row in rows), default=0.0),
            "checkpoint_mb": folder_mb(last) if last else 0.0,
            "checkpoint_model_mb": folder_mb(last / "model") if last and (last / "model").is_dir() else 0.0,
            "reward_mean": [row.get("reward/mean") for row in steps]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    common = [f"train.steps={args.steps}", "eval.before_rl=false", f"eval.every={args.steps + 1}", "eval.base=false",
              "warm_start.demos=32", "warm_start.epochs=1", f"output.checkpoint_every={args.steps}"]
    if args.smoke:
        common = ["model.path=tiny", "env.max_turns=2", "rollout.tasks_per_step=2", "rollout.group_size=2",
                  "rollout.max_new_tokens=16", "warm_start.demos=4", "warm_start.batch_size=4",
                  f"train.steps={args.steps}", "eval.before_rl=false", f"eval.every={args.steps + 1}",
                  "eval.base=false", "warm_start.epochs=1", f"output.checkpoint_every={args.steps}"]
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="keel-bench-lora-") as scratch:
        for name, extra in (("full", []), ("lora", [f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}",
                                                    f"optim.lr={args.lora_lr}", f"warm_start.lr={args.lora_lr}"])):
            runs[name] = train(common + extra, Path(scratch) / name)
            r = runs[name]
            print(f"{name}: {r['wall_s']:.0f} s, {r['step_s']:.1f} s/step, learner {r['learner_tokens_per_s']:.0f} "
                  f"tokens/s, peak {r['peak_rss_gb']:.2f} GB, checkpoint {r['checkpoint_mb']:.1f} MB "
                  f"(model/ {r['checkpoint_model_mb']:.1f} MB)", flush=True)
    full, lora = runs["full"], runs["lora"]
    ratios = [
        Ratio("LoRA learner tokens/s / full", lora["learner_tokens_per_s"] / full["learner_tokens_per_s"], 1.0,
              detail=f"rank {args.rank}, {args.steps} RL steps each"),
        Ratio("LoRA peak memory / full", lora["peak_rss_gb"] / max(full["peak_rss_gb"], 1e-9), 1.0,
              higher_is_better=False),
        Ratio("LoRA checkpoint size / full", lora["checkpoint_mb"] / max(full["checkpoint_mb"], 1e-9), 0.5,
              higher_is_better=False),
    ]
    body = [f"Machine: {machine()['cpu']}; the default config, {args.steps} RL steps after a 32-demo warm start, "
            f"no evaluation; LoRA rank {args.rank}, alpha {2 * args.rank}, lr {args.lora_lr}.", "",
            "| run | wall clock s | s per RL step | learner tokens/s | peak RSS GB | checkpoint MB (model/) |",
            "|---|---|---|---|---|---|"]
    for name, r in runs.items():
        body.append(f"| {name} | {r['wall_s']:.0f} | {r['step_s']:.1f} | {r['learner_tokens_per_s']:.0f} | "
                    f"{r['peak_rss_gb']:.2f} | {r['checkpoint_mb']:.1f} ({r['checkpoint_model_mb']:.1f}) |")
    write_section(args.out, Section(name="lora", title="LoRA against full fine-tuning", markdown="\n".join(body),
                                    ratios=ratios, smoke=args.smoke, seconds=time.perf_counter() - started,
                                    data={"runs": runs, "rank": args.rank, "lora_lr": args.lora_lr}))


if __name__ == "__main__":
    main()
