"""`python -m bench.bench_proximal --smoke`: both modes ran each repeat on the same sampled batch,
the no-grad pass scored every row in one and only the second minibatch's in the other, and the
section's figures are the ones its runs recorded (nothing here checks a speed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import read_section  # noqa: E402


def test_proximal_bench_smoke_scores_only_the_later_minibatch_and_updates_the_same(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.bench_proximal", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = read_section(tmp_path / "section.json")
    figures = section.data["figures"]
    every, later = figures["every row"], figures["later minibatches"]
    assert section.data["episodes"] == 4 and len(section.data["first_update"]) == 2  # 2 tasks x 2; minibatches of 2
    assert every["scored"] == [4] and later["scored"] == [2]
    assert every["updates"] == later["updates"] == 2
    assert all(len(f["seconds"]) == 2 and all(s > 0 for s in f["seconds"]) for f in figures.values())
    assert section.data["weight_diff"] < 1e-5
    assert section.ratios[0].value == later["median_s"] / every["median_s"]
