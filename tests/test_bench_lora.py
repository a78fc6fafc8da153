"""`python -m bench.bench_lora --smoke`: both runs train, and the LoRA run's checkpoint holds the
adapter alone (nothing here checks a speed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import read_section  # noqa: E402


@pytest.mark.slow  # two keel train runs, about 90 s beside two CPU hogs
def test_lora_bench_smoke_trains_both_runs_and_the_adapter_checkpoint_is_smaller(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.bench_lora", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = read_section(tmp_path / "section.json")
    full, lora = section.data["runs"]["full"], section.data["runs"]["lora"]
    assert full["steps"] == lora["steps"] == 2
    assert 0 < lora["checkpoint_model_mb"] < full["checkpoint_model_mb"]
    for run in (full, lora):  # the tiny model may solve nothing, so a step may drop every group and learn nothing
        assert run["learner_tokens_per_s"] > 0 if run["updates"] else run["learner_tokens_per_s"] != run["learner_tokens_per_s"]
    assert [r.name for r in section.ratios][-1] == "LoRA checkpoint size / full"
