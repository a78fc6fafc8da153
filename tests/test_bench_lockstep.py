"""`python -m bench.bench_lockstep --smoke`: both workloads ran in both modes, each repeat, and the
section's figures are the ones its runs recorded (nothing here checks a speed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import read_section  # noqa: E402


def test_lockstep_bench_smoke_runs_both_modes_of_both_workloads(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.bench_lockstep", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = read_section(tmp_path / "section.json")
    figures = section.data["figures"]
    assert set(figures) == {"evaluation", "rollout"}
    for name, by_mode in figures.items():
        assert set(by_mode) == {"stream", "lockstep"}
        for mode in by_mode.values():
            assert len(mode["seconds"]) == len(mode["success"]) == 2 and all(s > 0 for s in mode["seconds"])
            assert 0 <= mode["differ"] <= mode["episodes"] == 4  # 4 held-out tasks; 2 tasks x 2 attempts
        ratio = next(r for r in section.ratios if r.name.startswith(name))
        assert ratio.value == by_mode["lockstep"]["median_s"] / by_mode["stream"]["median_s"]
    # greedy evaluation of one set of weights in lockstep: the same tokens every repeat
    assert figures["evaluation"]["lockstep"]["differ"] == 0
