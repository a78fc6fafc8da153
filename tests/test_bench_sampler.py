"""bench/bench_sampler.py runs end to end, as a user runs it, on the tiny model."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_sampler_quick_reports_both_engines_with_exact_token_counts(tmp_path):
    out = tmp_path / "sampler.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_sampler.py", "--quick", "--wait-quiet", "0", "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    rows = [row for row in report["configs"] if "dtype" in row]
    assert {row["dtype"] for row in rows} == {"float32", "bfloat16"}
    for row in rows:
        for engine in ("keelrl", "hf"):
            calls = row[engine]["calls"]
            assert len(calls) == report["setup"]["reps"]
            # --quick: batch 4 x 16 new tokens, and the script refuses a call that made fewer
            assert all(call["tokens"] == 4 * 16 and call["tokens_per_s"] > 0 for call in calls)
        assert row["keelrl_over_hf_wall"] > 0
    assert report["torch_threads"] >= 1 and len(report["loadavg_before"]) == 3
