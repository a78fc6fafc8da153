"""Every script in examples/ runs end to end at its --smoke size (a tiny model, one RL step),
as a user runs it: `python examples/NAME.py`, in a fresh process. Each test checks what the
script says it produces, with numbers that agree with the run directories it wrote. The three
longest are marked slow (`python -m pytest -q -m slow tests/test_examples.py`)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import keelrl
from keelrl.runs import read_metrics

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(name: str, out: Path, model: Path, *extra: str) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--smoke", "--steps", "1",
                             "--out", str(out), "--model", str(model), *extra],
                            capture_output=True, text=True, timeout=900, cwd=out.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout




def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)


def test_every_example_has_a_test():
    tested = {"coding_ppo_turn_gae", "compare_presets", "reward_hacking", "on_policy_distillation",
              "custom_env_and_advantage"}
    assert {path.stem for path in EXAMPLES.glob("*.py")} == tested


def test_coding_ppo_turn_gae(tiny_model_dir, tmp_path):
    out = tmp_path / "ppo"
    stdout = run("coding_ppo_turn_gae", out, tiny_model_dir)
    config = (out / "config.yaml").read_text()
    assert "level: turn" in config and "advantage: gae" in config and "engine" in config
    step = read_metrics(out)[-1]
    assert step["step"] == 1 and "value/loss" in step  # the critic was trained
    assert f"value loss {step['value/loss']:.4f}" in stdout
    assert (out / "episodes" / "step_0001.jsonl").exists()


@pytest.mark.slow  # three runs, one a preset; tests/test_train.py trains each preset
def test_compare_presets(tiny_model_dir, tmp_path):
    out = tmp_path / "presets"
    stdout = run("compare_presets", out, tiny_model_dir)
    results = json.loads((out / "results.json").read_text())
    assert list(results) == ["grpo", "dapo", "cispo"]
    for preset, numbers in results.items():
        assert f"preset: {preset}" in (out / preset / "config.yaml").read_text()
        summary = json.loads((out / preset / "summary.json").read_text())
        assert numbers["heldout_after"] == summary["eval_success_after_rl"]
        updated = [r for r in read_metrics(out / preset) if "policy/clip_frac" in r]
        assert same(numbers["clip_frac_mean"], updated[-1]["policy/clip_frac"] if updated else math.nan)
        assert f"| {preset} |" in stdout
    # one warm start for all three: each variant starts from its weights, with no demos of its own
    assert (out / "warm" / "config.json").exists()
    for preset in results:
        assert f"path: {out / 'warm'}" in (out / preset / "config.yaml").read_text()
    assert (out / "presets.png").stat().st_size > 5000


@pytest.mark.slow  # three arms; the reward-hacking labs (tests/test_labs.py) run the same verifiers
def test_reward_hacking(tiny_model_dir, tmp_path):
    out = tmp_path / "hack"
    stdout = run("reward_hacking", out, tiny_model_dir)
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"weak", "strong"}
    for verifier, numbers in results.items():
        assert f"verifier: {verifier}" in (out / verifier / "config.yaml").read_text()
        trained = [r for r in read_metrics(out / verifier) if "train/reward" in r]
        assert numbers["train_reward_last"] == trained[-1]["train/reward"]
    # the weak verifier scores the untrained model's invalid guesses as solved; strong does not
    assert results["weak"]["train_reward_last"] > results["strong"]["train_reward_last"]
    assert "weak: training reward" in stdout


@pytest.mark.slow  # a teacher's warm start, then the student's; tests/test_teacher.py runs each mode
def test_on_policy_distillation(tiny_model_dir, tmp_path):
    out = tmp_path / "distill"
    run("on_policy_distillation", out, tiny_model_dir)
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"grpo", "grpo+distill"}
    assert results["grpo"]["teacher_kl"] == []
    kl = results["grpo+distill"]["teacher_kl"]
    assert len(kl) == 1 and kl[0] >= 0
    assert f"teacher: {out / 'teacher'}" in (out / "grpo+distill" / "config.yaml").read_text()


def test_custom_env_and_advantage(tiny_model_dir, tmp_path):
    out = tmp_path / "custom"
    stdout = run("custom_env_and_advantage", out, tiny_model_dir)
    config = (out / "config.yaml").read_text()
    assert "name: vowels" in config and "advantage: median_baseline" in config
    # the user's estimator made the advantages: each episode's reward minus its group's median
    episodes = [json.loads(line) for line in (out / "episodes" / "step_0001.jsonl").read_text().splitlines()]
    groups: dict[int, list[float]] = {}
    for episode in episodes:
        groups.setdefault(episode["group_id"], []).append(episode["reward"])
    for episode in episodes:
        rewards = sorted(groups[episode["group_id"]])
        median = rewards[(len(rewards) - 1) // 2]  # torch.median: the lower of the two middle values
        advantages = [token[1] for turn in episode["turns"] for token in turn["tokens"] or []]
        assert advantages and all(a == pytest.approx(episode["reward"] - median) for a in advantages)
    assert episodes[0]["prompt"].startswith("How many vowels")
    assert "held-out success:" in stdout


def test_the_custom_estimator_by_hand():
    """examples/custom_env_and_advantage.py's median baseline on worked numbers: groups
    (1, 0, 0) -> median 0 and (1, 1, 0) -> median 1."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("custom_example", EXAMPLES / "custom_env_and_advantage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
        keelrl.ADVANTAGES.unregister("median_baseline")  # registered on import; the registry is process-wide
    mask = torch.tensor([[False, True, True]] * 6)
    token_rewards = torch.zeros(6, 3)
    token_rewards[:, 2] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    out = module.median_baseline(token_rewards=token_rewards, mask=mask, group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
                                 values=None, turn_ids=None, cfg=None)
    assert out.advantages[:, 1].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, -1.0]
    assert out.advantages[:, 0].tolist() == [0.0] * 6  # prompt tokens get nothing
