"""`python -m bench.bench_padding --smoke`: both plans ran each repeat on the same sampled batch,
the split plan pads no more than the fewest passes, the two updates agree to float rounding,
and the section's figures are the ones its runs recorded (nothing here checks a speed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import read_section  # noqa: E402


def test_padding_bench_smoke_pads_no_more_and_updates_the_same(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.bench_padding", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = read_section(tmp_path / "section.json")
    figures = section.data["figures"]
    fewest, split = figures["fewest passes"], figures["split by length"]
    assert section.data["episodes"] == 8 and len(section.data["lengths"]) == 8  # 2 tasks x 4
    assert 0 < split["padded_tokens"] <= fewest["padded_tokens"]
    assert split["passes"] >= fewest["passes"] >= 2  # at least one pass a group
    assert fewest["padded_tokens"] >= sum(section.data["lengths"]) // 4  # a group's prompt once, its rows padded
    assert split["updates"] == fewest["updates"] == 2
    assert all(len(f["seconds"]) == 2 and all(s > 0 for s in f["seconds"]) for f in figures.values())
    assert section.data["weight_diff"] < 1e-5
    assert section.ratios[0].value == split["median_s"] / fewest["median_s"]
