"""Reward hacking, and the alarm that catches it: the same run on a weak verifier and a strong one.

The guessing game's `weak` verifier scores an episode as solved unless the last answer said
"higher" or "lower": it checks for the absence of a failure, not for success, so an episode
that ends on an invalid guess scores 1 without finding the number. GRPO from one warm start on
each verifier; both are evaluated on held-out secrets by the `strong` verifier, and the
divergence alarm watches training reward against that independent figure. Under `weak` the
training reward climbs while held-out success does not follow, invalid turns spread, and the
alarm fires (its trajectories are saved under weak/alarms/ and linked from `keel view`).

    python examples/reward_hacking.py                 # a few minutes on CPU

`keel lab reward-hacking` is the same failure on SmolLM2 as the coding agent.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

import keelrl
from keelrl.runs import read_alarms
from keelrl.runs import read_metrics
from keelrl.labs import lab_settings

def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/example-reward-hacking", help="output directory")
    parser.add_argument("--steps", type=int, default=20, help="RL steps per verifier")
    parser.add_argument("--model", help="a local HF model to use instead of the built-in tiny one")
    parser.add_argument("--smoke", action="store_true", help="the test's tiny size")
    args = parser.parse_args(argv)
    out = Path(args.out)
    # The guessing-game reward-hacking lab's recipe (`keel lab reward-hacking-guess`); --smoke: its --quick size.
    base = [*lab_settings("reward-hacking-guess", [f"model.path={args.model}"] if args.model else [], quick=args.smoke),
            "algo.preset=grpo", "monitor.window=2"]

    warm = out / "warm"
    if not (warm / "config.json").exists():
        keelrl.warm_start(keelrl.configure(None, *base, f"run_dir={out / 'warm-run'}"), warm)

    results: dict[str, dict[str, Any]] = {}
    every = max(1, args.steps // 5)
    for verifier in ("weak", "strong"):
        cfg = keelrl.configure(None, *base, f"env.verifier={verifier}", "warm_start.demos=0",
                               f"train.steps={args.steps}", f"eval.every={every}")
        summary = keelrl.Trainer(cfg, model=warm, run_dir=out / verifier).train()
        rows = read_metrics(out / verifier)
        trained = [row for row in rows if "train/reward" in row]
        alarms = read_alarms(out / verifier)
        results[verifier] = {
            "train_reward_first": trained[0]["train/reward"], "train_reward_last": trained[-1]["train/reward"],
            "heldout_before": summary["eval_success_before_rl"], "heldout_after": summary["eval_success_after_rl"],
            "invalid_turns_last": trained[-1]["train/action_error_frac"],
            "alarms": [f"{a['alarm']} at step {a['step']}" for a in alarms]}

    for verifier, r in results.items():
        print(f"{verifier:>6}: training reward {r['train_reward_first']:.3f} -> {r['train_reward_last']:.3f}, "
              f"held-out success (strong) {r['heldout_before']:.3f} -> {r['heldout_after']:.3f}, "
              f"invalid turns at the end {r['invalid_turns_last']:.2f}, alarms: {', '.join(r['alarms']) or 'none'}")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"read the hack: keel view {out / 'weak'}")
    return results


if __name__ == "__main__":
    main()
