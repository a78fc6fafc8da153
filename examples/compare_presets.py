"""GRPO vs DAPO vs CISPO on one task set, from one warm start.

The guessing game (find a secret in 1..16 within five guesses, told "higher" or "lower"), the
built-in tiny model warm-started once on a scripted teacher that errs, then three RL runs that
differ only in the preset: GRPO (group-standardised advantages, PPO clip, a k3 KL to the
reference), DAPO (clip-higher, token-mean loss, dynamic sampling of groups with a signal) and
CISPO (a clipped, stop-gradient importance weight on every token's log-prob, so no token loses
its gradient). The same seed draws the same tasks for each. Prints held-out success (greedy,
strong verifier) and what each limit did (clip fraction, max importance weight), and writes a
chart and a markdown table into the output directory.

    python examples/compare_presets.py                # a few minutes on CPU
    python examples/compare_presets.py --presets grpo dr_grpo rloo --steps 12
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import keelrl
from keelrl.runs import read_metrics
from keelrl.labs import lab_settings

def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/example-presets", help="output directory")
    parser.add_argument("--presets", nargs="+", default=["grpo", "dapo", "cispo"], help="presets to compare")
    parser.add_argument("--steps", type=int, default=8, help="RL steps per preset")
    parser.add_argument("--model", help="a local HF model to use instead of the built-in tiny one")
    parser.add_argument("--smoke", action="store_true", help="the test's tiny size (does not learn)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    # The guessing-game labs' recipe (`keel lab dynamic-sampling-guess`); --smoke: their --quick size.
    base = lab_settings("dynamic-sampling-guess", [f"model.path={args.model}"] if args.model else [], quick=args.smoke)
    if args.smoke:
        base.append("rollout.dynamic_max_extra_groups=2")

    # One warm start for all: the variants then differ in the preset alone.
    warm = out / "warm"
    if not (warm / "config.json").exists():
        keelrl.warm_start(keelrl.configure(None, *base, f"run_dir={out / 'warm-run'}"), warm)

    results: dict[str, dict[str, float]] = {}
    for preset in args.presets:
        cfg = keelrl.configure(None, *base, f"algo.preset={preset}", "warm_start.demos=0",
                            f"train.steps={args.steps}", f"eval.every={args.steps}")
        summary = keelrl.Trainer(cfg, model=warm, run_dir=out / preset).train()
        rows = read_metrics(out / preset)
        updated = [row for row in rows if row["step"] > 0 and "policy/clip_frac" in row]  # a step with an update
        results[preset] = {
            "heldout_before": summary["eval_success_before_rl"], "heldout_after": summary["eval_success_after_rl"],
            "train_reward_last": updated[-1]["train/reward"] if updated else float("nan"),
            "clip_frac_mean": sum(r["policy/clip_frac"] for r in updated) / len(updated) if updated else float("nan"),
            "is_weight_max": max((r["policy/is_weight_max"] for r in updated), default=float("nan"))}

    lines = ["| preset | held-out before | held-out after | last train reward | mean clip fraction | max IS weight |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {r['heldout_before']:.3f} | {r['heldout_after']:.3f} | {r['train_reward_last']:.3f} | "
              f"{r['clip_frac_mean']:.3f} | {r['is_weight_max']:.3f} |" for name, r in results.items()]
    table = "\n".join(lines)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    _chart(out, args.presets)
    print(table)
    print(f"chart: {out / 'presets.png'}; trajectories: keel view {out / args.presets[0]}")
    return results


def _chart(out: Path, presets: Sequence[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for preset in presets:
        rows = read_metrics(out / preset)
        steps = [row for row in rows if row["step"] > 0 and "policy/clip_frac" in row]
        axes[0].plot([r["step"] for r in steps], [r["train/reward"] for r in steps], marker="o", label=preset)
        axes[1].plot([r["step"] for r in steps], [r["policy/clip_frac"] for r in steps], marker="o", label=preset)
    axes[0].set_title("training reward")
    axes[1].set_title("clip fraction")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.legend()
    figure.tight_layout()
    figure.savefig(out / "presets.png", dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
