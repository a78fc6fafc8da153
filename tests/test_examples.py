"""Every script in examples/ runs end to end at its --smoke size (a tiny model, one RL step),
as a user runs it: `python examples/NAME.py`, in a fresh process. Each test checks what the
script says it produces, with numbers that agree with the run directories it wrote."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from keelrl.policy.tiny import TinyModelSpec, save_tiny_default

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SMALL = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_positions=2048)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_default(tmp_path_factory.mktemp("model"), SMALL)


def run(name: str, out: Path, model: Path, *extra: str) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--smoke", "--steps", "1",
                             "--out", str(out), "--model", str(model), *extra],
                            capture_output=True, text=True, timeout=900, cwd=out.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)


def test_every_example_has_a_test():
    tested = {"coding_ppo_turn_gae", "compare_presets", "reward_hacking", "on_policy_distillation"}
    assert {path.stem for path in EXAMPLES.glob("*.py")} == tested


def test_coding_ppo_turn_gae(model, tmp_path):
    out = tmp_path / "ppo"
    stdout = run("coding_ppo_turn_gae", out, model)
    config = (out / "config.yaml").read_text()
    assert "level: turn" in config and "advantage: gae" in config and "engine" in config
    step = rows(out)[-1]
    assert step["step"] == 1 and "value/loss" in step  # the critic was trained
    assert f"value loss {step['value/loss']:.4f}" in stdout
    assert (out / "episodes" / "step_0001.jsonl").exists()


def test_compare_presets(model, tmp_path):
    out = tmp_path / "presets"
    stdout = run("compare_presets", out, model)
    results = json.loads((out / "results.json").read_text())
    assert list(results) == ["grpo", "dapo", "cispo"]
    for preset, numbers in results.items():
        assert f"preset: {preset}" in (out / preset / "config.yaml").read_text()
        summary = json.loads((out / preset / "summary.json").read_text())
        assert numbers["heldout_after"] == summary["eval_success_after_rl"]
        updated = [r for r in rows(out / preset) if "policy/clip_frac" in r]
        assert same(numbers["clip_frac_mean"], updated[-1]["policy/clip_frac"] if updated else math.nan)
        assert f"| {preset} |" in stdout
    # one warm start for all three: each variant starts from its weights, with no demos of its own
    assert (out / "warm" / "config.json").exists()
    for preset in results:
        assert f"path: {out / 'warm'}" in (out / preset / "config.yaml").read_text()
    assert (out / "presets.png").stat().st_size > 5000


def test_reward_hacking(model, tmp_path):
    out = tmp_path / "hack"
    stdout = run("reward_hacking", out, model)
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"weak", "strong"}
    for verifier, numbers in results.items():
        assert f"verifier: {verifier}" in (out / verifier / "config.yaml").read_text()
        trained = [r for r in rows(out / verifier) if "train/reward" in r]
        assert numbers["train_reward_last"] == trained[-1]["train/reward"]
    # the weak verifier scores the untrained model's invalid guesses as solved; strong does not
    assert results["weak"]["train_reward_last"] > results["strong"]["train_reward_last"]
    assert "weak: training reward" in stdout


def test_on_policy_distillation(model, tmp_path):
    out = tmp_path / "distill"
    run("on_policy_distillation", out, model)
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"grpo", "grpo+distill"}
    assert results["grpo"]["teacher_kl"] == []
    kl = results["grpo+distill"]["teacher_kl"]
    assert len(kl) == 1 and kl[0] >= 0
    assert f"teacher: {out / 'teacher'}" in (out / "grpo+distill" / "config.yaml").read_text()
