"""The golden runs (tests/golden_runs.py) give the metrics they were recorded with.

Each variant is a seeded tiny-model `keel train`; its metrics.jsonl must have the recorded steps
and keys, and every value equal to the recording to 1e-6 relative (timings and memory
excluded), or to 5e-8 absolute: the runs are in float64 but the value head computes in float32,
which moves the PPO variant's policy loss (about 1e-3, a sum of cancelling terms) between CPU
instruction sets (by 5e-9 on an AVX-512 EPYC, 1.0e-8 on an AMX Xeon, both on one thread), and
an approximate KL of 1e-14 between two passes of the same weights is round-off. No change of
real meaning stays inside either bound.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from golden_runs import GOLDEN_DIR, VARIANTS, run_variant

REL = 1e-6
ABS = 5e-8
ROUNDING_ABS = 1e-6
"""The sampler/learner mismatch metrics of these float64 runs measure nothing but the float32
rounding of the sampler's logits (about 5e-7): their value moves with the CPU's kernels, so they
are compared to this absolute tolerance (a real mismatch, bf16 against float32, is 1e-3 and up)."""
ROUNDING_KEYS = ("mismatch/",)


def differences(expected: list[dict], actual: list[dict]) -> list[str]:
    """Every way `actual` rows differ from `expected` rows, one line each."""
    if len(expected) != len(actual):
        return [f"{len(actual)} rows, recorded {len(expected)}"]
    found = []
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        for key in sorted(set(want) ^ set(got)):
            found.append(f"row {index}: key {key!r} {'missing' if key in want else 'not recorded'}")
        for key in sorted(set(want) & set(got)):
            a, b = want[key], got[key]
            if isinstance(a, float) or isinstance(b, float):
                if a is None or b is None:
                    same = a is b
                elif math.isnan(a) or math.isnan(b):
                    same = math.isnan(a) and math.isnan(b)
                else:
                    tolerance = ROUNDING_ABS if key.startswith(ROUNDING_KEYS) else ABS
                    same = math.isclose(a, b, rel_tol=REL, abs_tol=tolerance)
            else:
                same = a == b
            if not same:
                found.append(f"row {index}: {key} = {b!r}, recorded {a!r}")
    return found


def test_differences_sees_a_changed_value_and_a_missing_key():
    rows = [{"step": 1, "loss": 0.5, "kl": 1e-14, "gone": None}]
    assert differences(rows, [{"step": 1, "loss": 0.5 * (1 + 1e-8), "kl": 3e-14, "gone": None}]) == []
    assert differences(rows, [{"step": 1, "loss": 0.5001, "kl": 1e-14}]) == [
        "row 0: key 'gone' missing", "row 0: loss = 0.5001, recorded 0.5"]
    assert differences(rows, [{"step": 2, "loss": 0.5, "kl": 1e-14, "gone": None}]) == [
        "row 0: step = 2, recorded 1"]


@pytest.fixture(scope="module")
def golden_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("golden")


SLOW = ("grpo", "prm_distill", "teacher_loss")
"""Marked slow (`python -m pytest -q -m slow tests/test_golden.py`): 30-45 s each on a 2-core
machine, and their components have fast tests of their own (tests/test_train.py, test_prm.py,
test_teacher.py). `ppo_critic`, which runs the most of the trainer (a critic, two epochs of
minibatches in micro-batches, a reference KL, a curriculum, a warmup), runs in the fast suite."""


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
                                  for name in sorted(VARIANTS)])
def test_golden_run_matches_its_recording(name, golden_root):
    recorded = json.loads((GOLDEN_DIR / f"{name}.json").read_text())
    rows = run_variant(name, golden_root)
    assert differences(recorded["rows"], rows) == []
