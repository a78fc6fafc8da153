"""Golden runs: seeded tiny-model `keel train` runs whose metrics.jsonl is recorded in tests/golden/.

`tests/test_golden.py` runs each variant and compares its metrics.jsonl with the recording:
the same steps, the same keys, the same values (timings, memory and the engine's batching
counters excluded) to 1e-6 relative. The runs load the models in float64, so that neither the
CPU's instruction set nor which episodes happened to share a decode batch (the scheduler
batches whatever environment work has returned) moves a number by that much; in float32 both
move the loss by about 1e-5. The recordings were made before the trainer's restructure (issue 24), so a
restructure that changes a number fails. Re-record only for a change that means to change a
run's numbers, and say so in the commit:

    python tests/golden_runs.py record
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from keelrl.config import TINY_RUN
from keelrl.policy.tiny import TinyModelSpec, save_tiny_default

GOLDEN_DIR = Path(__file__).parent / "golden"

SMALL = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_positions=2048)
TEACHER = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_positions=2048, seed=1)

COMMON = ("rollout.engine=sync", "train.steps=3", "eval.every=2", "eval.tasks=4",
          "eval.base=true", "warm_start.demos=8", "warm_start.epochs=2", "warm_start.batch_size=4",
          "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=24", "env.max_turns=3",
          "output.sample_trajectories=1", "output.save_episodes=8", "seed=3",
          "rollout.dtype=float64", "eval.dtype=float64")
"""Every variant: a few synchronous steps of 2 tasks x 4 attempts, with a warm start and
evaluations before it, after it and after RL; sampled in the float64 model's own dtype."""

VARIANTS: dict[str, tuple[str, ...]] = {
    # One update per step, the proximal log-probs from the update's own pass; the entropy bonus
    # gives a gradient although the tiny model's rewards are equal within a group.
    "grpo": ("train.minibatch_size=8", "algo.entropy_coef=0.01"),
    # A process reward model whose scores shape the advantages; self-distillation as a dense
    # per-token reward, and the observation loss.
    "prm_distill": ("train.minibatch_size=8", "prm.enabled=true", "prm.weight=0.5", "prm.fit_steps=5",
                    "distill.mode=self", "distill.form=advantage", "distill.coef=0.5",
                    "distill.observation_coef=0.1"),
    # A second model as teacher, the divergence in the loss, half the steps on teacher-sampled
    # histories (GKD).
    "teacher_loss": ("train.minibatch_size=8", "distill.mode=on_policy", "distill.teacher={teacher}",
                     "distill.form=loss", "distill.divergence=jsd", "distill.student_share=0.5"),
    # A critic (value head), two epochs of two minibatches with micro-batches, a frozen reference
    # with its KL, a curriculum and a learning-rate warmup. (Not dynamic sampling: the tiny model's
    # rewards are equal within every group, so it would keep none.)
    "ppo_critic": ("algo.preset=ppo", "train.epochs=2", "train.minibatch_size=4", "perf.micro_batch_tokens=512",
                   "algo.kl_coef=0.05",
                   "curriculum.enabled=true", "optim.warmup_steps=2"),
}

EXCLUDED_PREFIXES = ("time/", "memory/", "engine/")
"""Keys whose values are timings, memory, or how the engine happened to batch the episodes
(which depends on when their environment steps returned), not functions of the seed."""


def overrides(name: str, model_dir: Path, teacher_dir: Path, run_dir: Path) -> list[str]:
    """The `keel train` arguments of variant `name`."""
    extra = [item.format(teacher=teacher_dir) for item in VARIANTS[name]]
    return [*TINY_RUN, *COMMON, *extra, f"model.path={model_dir}", f"run_dir={run_dir}"]


def comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """metrics.jsonl rows without the timing and memory keys."""
    return [{key: value for key, value in row.items() if not key.startswith(EXCLUDED_PREFIXES)} for row in rows]


def run_variant(name: str, root: Path) -> list[dict[str, Any]]:
    """Run variant `name` through `keel train` under `root`; -> its comparable metrics rows."""
    from unittest import mock

    import torch

    from keelrl.cli import main

    model_dir = root / "model"
    teacher_dir = root / "teacher"
    if not model_dir.exists():
        save_tiny_default(model_dir, SMALL)
        save_tiny_default(teacher_dir, TEACHER)
    run_dir = root / name
    with mock.patch("keelrl.policy.model.default_dtype", lambda device: torch.float64):
        code = main(["train", *overrides(name, model_dir, teacher_dir, run_dir)])
    if code != 0:
        raise RuntimeError(f"keel train of golden variant {name!r} exited {code}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return comparable(rows)


def record(names: list[str]) -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rows = run_variant(name, Path(tmp))
            payload = {"variant": name, "overrides": [*COMMON, *VARIANTS[name]], "rows": rows}
            (GOLDEN_DIR / f"{name}.json").write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
            print(f"recorded {name}: {len(rows)} rows")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "record":
        sys.exit(__doc__)
    import torch

    torch.set_num_threads(1)  # as tests/conftest.py
    record(sys.argv[2:] or list(VARIANTS))
