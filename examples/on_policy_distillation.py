"""On-policy distillation: a student that rarely succeeds learns from a teacher's per-token judgement.

When almost every group fails, a group baseline gives RL nothing to follow. A teacher that
scores the tokens the student itself sampled gives a dense signal anyway: here the loss adds
the reverse KL from the student's next-token distribution to the teacher's at every action
token (`distill.mode=on_policy`, `distill.form=loss`). The guessing game and the built-in tiny
model: the teacher is warm-started on many demonstrations, the student on a few; then GRPO
alone and GRPO with the distillation loss run from the same student with the same seed.
Prints held-out success (strong verifier) and the student-teacher KL before and after.

    python examples/on_policy_distillation.py           # a few minutes on CPU
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

import keelrl
from keelrl.runs import read_metrics
from keelrl.labs import lab_settings

TEACHER = ["warm_start.demos=384", "warm_start.mistake_rate=0.1"]
STUDENT = ["warm_start.demos=48", "warm_start.mistake_rate=0.6", "warm_start.epochs=2"]
QUICK = ["warm_start.demos=16", "warm_start.epochs=1"]
"""--smoke: a short warm start for both (the test's size: it runs, it does not learn)."""


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/example-distill", help="output directory")
    parser.add_argument("--steps", type=int, default=10, help="RL steps per variant")
    parser.add_argument("--model", help="a local HF model to start both from instead of the built-in tiny one")
    parser.add_argument("--smoke", action="store_true", help="the test's tiny size")
    args = parser.parse_args(argv)
    out = Path(args.out)
    # The credit lab's recipe (`keel lab credit`), the warm starts' first round only; --smoke: its
    # --quick size.
    base = [*lab_settings("credit", [f"model.path={args.model}"] if args.model else [], quick=args.smoke),
            "algo.preset=grpo", "warm_start.own_mistakes=0"]
    smoke = QUICK if args.smoke else []

    models = {}
    for role, settings in (("teacher", TEACHER), ("student", STUDENT)):
        models[role] = out / role
        if not (models[role] / "config.json").exists():
            keelrl.warm_start(keelrl.configure(None, *base, *settings, *smoke, f"run_dir={out / (role + '-run')}"),
                              models[role])

    variants = {"grpo": [], "grpo+distill": ["distill.mode=on_policy", "distill.form=loss",
                                             "distill.divergence=reverse_kl", f"distill.teacher={models['teacher']}"]}
    results: dict[str, dict[str, Any]] = {}
    for name, extra in variants.items():
        cfg = keelrl.configure(None, *base, *smoke, *extra, "warm_start.demos=0", f"train.steps={args.steps}",
                               f"eval.every={args.steps}")
        summary = keelrl.Trainer(cfg, model=models["student"], run_dir=out / name).train()
        rows = read_metrics(out / name)
        trained = [row for row in rows if "train/reward" in row]
        results[name] = {"heldout_before": summary["eval_success_before_rl"],
                         "heldout_after": summary["eval_success_after_rl"],
                         "train_reward_last": trained[-1]["train/reward"],
                         "teacher_kl": [row["distill/kl"] for row in trained if "distill/kl" in row]}
    for name, r in results.items():
        kl = r["teacher_kl"]
        said = f", KL to the teacher {kl[0]:.3f} -> {kl[-1]:.3f}" if kl else ""
        print(f"{name:>13}: held-out success {r['heldout_before']:.3f} -> {r['heldout_after']:.3f}, "
              f"last training reward {r['train_reward_last']:.3f}{said}")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
