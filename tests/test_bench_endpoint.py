"""`python -m bench.bench_endpoint --smoke`: both sides run the same episodes, and the endpoint's
harness sessions are recorded whole (nothing here checks a speed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import read_section  # noqa: E402


def test_endpoint_bench_smoke_runs_the_same_episodes_on_both_sides(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.bench_endpoint", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = read_section(tmp_path / "section.json")
    runs = section.data["runs"]
    inside, served = runs["in_process"][0], runs["endpoint"][0]
    # 8 episodes x 2 turns x exactly 8 tokens, on both sides
    assert inside["completion_tokens"] == served["completion_tokens"] == 8 * 2 * 8
    assert inside["calls"] == served["calls"] == 16
    assert served["recorded_tokens"] == served["completion_tokens"]  # every call recorded, token for token
    assert served["samples_per_session"] == 1.0  # every second call continued its session's tokens
    # every call's prompt is the same context on both sides (the endpoint continued each session's tokens)
    assert served["prompt_tokens"] == inside["prompt_tokens"]
    # kept keys and values: a second turn prefills only its new tokens, so fewer tokens ran than the
    # prompts hold (a group's equal prompts that arrive apart may each prefill: never fewer than in process)
    assert inside["prefill_tokens"] <= served["prefill_tokens"] < served["prompt_tokens"]
    ratio = section.ratios[0]
    assert ratio.target == 0.8 and ratio.value > 0
