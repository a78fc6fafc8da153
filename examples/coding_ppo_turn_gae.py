"""A coding agent trained with PPO: a learned critic and GAE over turns.

SmolLM2 gets a buggy file and up to three turns to fix it (read, edit, run the visible tests,
submit); only the end of the episode is graded by hidden checks. A group baseline (GRPO) gives
every token of an episode the same credit. PPO here learns a value head on the policy's own
hidden states (stop-gradient into the policy) and computes GAE with one step per turn
(`algo.level=turn`), so a turn that moved the episode toward a pass is credited more than one
that did not. Held-out success is printed before and after RL, with the critic's value loss and
mean value each step.

    python examples/coding_ppo_turn_gae.py                 # SmolLM2 on CPU, about ten minutes
    python examples/coding_ppo_turn_gae.py --steps 8 --out runs/ppo
"""

from __future__ import annotations

import argparse
from typing import Sequence

import keelrl
from keelrl.runs import read_metrics

SMOKE = ["warm_start.demos=4", "warm_start.epochs=1", "warm_start.batch_size=4",
         "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "eval.tasks=3",
         "train.minibatch_size=4", "eval.base=false", "perf.learner_precision=float32",
         "eval.dtype=float32"]
"""The test's size: the built-in tiny model, a handful of tasks, one step. It checks that the
example runs end to end, not that it learns."""


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/example-ppo-turn-gae", help="run directory")
    parser.add_argument("--model", help="a registered name or a local HF model (default smollm2; --smoke: tiny)")
    parser.add_argument("--steps", type=int, default=4, help="RL steps")
    parser.add_argument("--smoke", action="store_true", help="the test's tiny size (does not learn)")
    args = parser.parse_args(argv)

    cfg = keelrl.configure(None,
                        "algo.preset=ppo",      # critic + GAE, KL to the reference as a reward penalty
                        "algo.level=turn",      # one GAE step per turn, not per token
                        "algo.gamma=1.0", "algo.lam=0.9",
                        "model.critic=head",    # value head on the policy's hidden states
                        "env.max_turns=3",
                        "eval.tasks=60", f"eval.every={max(1, args.steps)}",
                        "eval.base=false",
                        f"train.steps={args.steps}",
                        *(SMOKE if args.smoke else []))
    model = args.model or ("tiny" if args.smoke else "smollm2")
    summary = keelrl.Trainer(cfg, model=model, run_dir=args.out).train()

    rows = read_metrics(args.out)
    steps = [row for row in rows if row["step"] > 0]
    print(f"held-out success: {summary['eval_success_before_rl']:.3f} after the warm start, "
          f"{summary['eval_success_after_rl']:.3f} after {len(steps)} PPO steps")
    for row in steps:
        print(f"step {row['step']}: reward {row['train/reward']:.3f}, value loss {row['value/loss']:.4f}, "
              f"mean value {row['value/mean']:.3f}")
    print(f"read the trajectories: keel view {args.out}")
    return summary


if __name__ == "__main__":
    main()
