"""Labs: the registry and CLI, a bad override failing first, and smoke runs at the quick budget."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from keelrl.cli import main
from keelrl.errors import ConfigError
from keelrl.labs import LABS, lab_settings, run_lab
from keelrl.labs.common import student_cache_dir


def test_lab_list_and_unknown_names(capsys):
    assert main(["lab", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("stale-ratios", "dynamic-sampling", "entropy", "reward-hacking",
                                           "reward-hacking-guess", "credit"))
    assert main(["lab", "no-such-lab"]) == 2
    assert "valid names" in capsys.readouterr().err


def test_a_bad_override_fails_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="rollout.engine"):
        run_lab("stale-ratios", tmp_path, ["rollout.engine=nope"], quick=True)
    assert not any(tmp_path.iterdir())


def test_user_overrides_win_over_every_lab_default(tmp_path):
    from keelrl.config import load_config

    for name in LABS:
        for quick in (False, True):
            cfg = load_config(overrides=lab_settings(name, ["rollout.tasks_per_step=3", "optim.lr=7e-4"], quick))
            assert (cfg.rollout.tasks_per_step, cfg.optim.lr) == (3, 7e-4), (name, quick)
    assert load_config(overrides=lab_settings("reward-hacking-guess")).env.name == "guess"
    assert load_config(overrides=lab_settings("reward-hacking-guess", quick=True)).env.max_turns == 5
    assert load_config(overrides=lab_settings("reward-hacking")).model.path == "smollm2"
    assert load_config(overrides=lab_settings("reward-hacking", quick=True)).model.path == "tiny"


def test_user_overrides_win_over_each_variants_own_settings(tmp_path, monkeypatch):
    import keelrl.labs as labs
    import keelrl.labs.common as common
    import keelrl.train.trainer as trainer_module

    seen = {}

    class Recorder:
        def __init__(self, cfg):
            seen[cfg.run_dir] = cfg

        def run(self):
            return {}

    monkeypatch.setattr(common, "warm_model", lambda out, overrides, progress=None: tmp_path / "warm")
    monkeypatch.setattr(trainer_module, "Trainer", Recorder)

    def lab(out, settings, quick, progress):  # a lab whose variant pins train.steps and the verifier
        common.train_variants(out, {"v": ["train.steps=20", "env.verifier=weak"]}, settings, progress)
        return labs.LabResult("fake", {}, "")

    monkeypatch.setitem(labs.LABS, "fake", ("a fake lab", lab, labs.GUESS))
    labs.run_lab("fake", tmp_path, ["train.steps=3"])
    [cfg] = seen.values()
    assert cfg.train.steps == 3 and cfg.env.verifier == "weak" and cfg.warm_start.demos == 0
    assert cfg.model.path == str(tmp_path / "warm")


def test_a_stopped_lab_keeps_its_finished_variants_and_retrains_a_changed_one(tmp_path, monkeypatch):
    import keelrl.labs.common as common
    import keelrl.train.trainer as trainer_module

    trained = []

    class Recorder:
        def __init__(self, cfg):
            self.cfg = cfg

        def run(self):
            trained.append(Path(self.cfg.run_dir).name)
            Path(self.cfg.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.cfg.run_dir) / "summary.json").write_text("{}")
            (Path(self.cfg.run_dir) / "metrics.jsonl").write_text('{"step": 1, "train/reward": 0.5}\n')

    monkeypatch.setattr(common, "warm_model", lambda out, overrides, progress=None: tmp_path / "warm")
    monkeypatch.setattr(trainer_module, "Trainer", Recorder)
    variants = {"a": ["train.steps=2"], "b": ["train.steps=3"]}
    messages = []
    first = common.train_variants(tmp_path, variants, [], messages.append)
    again = common.train_variants(tmp_path, variants, [], messages.append)
    assert trained == ["a", "b"] and first == again and first["a"] == [{"step": 1, "train/reward": 0.5}]
    assert sum("finished before" in message for message in messages) == 2
    record = common.variant_record(tmp_path / "a")
    assert "steps: 2" in record["config"] and record["seconds"] >= 0
    common.train_variants(tmp_path, {**variants, "b": ["train.steps=4"]}, [], messages.append)
    assert trained == ["a", "b", "b"]
    (tmp_path / "a" / "summary.json").unlink()  # stopped before it finished: trained again
    common.train_variants(tmp_path, variants, [], messages.append)
    assert trained == ["a", "b", "b", "a", "b"]


def test_stale_ratios_lab_measures_weights_on_real_rollouts(tmp_path):
    result = run_lab("stale-ratios", tmp_path, quick=True)
    numbers = json.loads((tmp_path / "results.json").read_text())
    ratios = numbers["ratios"]
    assert set(ratios) == {"token", "sequence", "cumulative", "ctpo"}
    for data in ratios.values():
        assert len(data["max_weight_by_staleness"]) == len(numbers["staleness"])
        assert all(math.isfinite(w) and w > 0 for w in data["max_weight_by_staleness"])
    # Fresh data: every weight within a hair of 1 (only the never-sampled pad token's mass differs).
    assert all(abs(d["max_weight_by_staleness"][0] - 1) < 0.05 for n, d in ratios.items() if n != "cumulative")
    # Two real updates move the learner: the per-token ratio leaves 1 and the product compounds it.
    assert ratios["token"]["max_weight_by_staleness"][-1] > 1.05
    assert ratios["cumulative"]["max_weight_by_staleness"][-1] > ratios["sequence"]["max_weight_by_staleness"][-1]
    assert (tmp_path / "stale_ratios.png").stat().st_size > 1000
    assert "| cumulative |" in (tmp_path / "summary.md").read_text() and result.name == "stale-ratios"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dynamic-sampling", "entropy", "reward-hacking-guess"])
def test_training_labs_run_at_the_quick_budget(tmp_path, name):
    result = run_lab(name, tmp_path, quick=True)
    variants = {"dynamic-sampling": {"dapo", "dapo-no-dynamic"}, "entropy": {"no-bonus", "bonus-0.005", "bonus-0.05"},
                "reward-hacking-guess": {"weak", "strong"}}
    assert set(result.numbers) - {"lab_seconds"} == variants[name]
    assert result.numbers["lab_seconds"] > 0 and "Lab wall time" in result.summary
    assert all(path.exists() for path in result.files)
    student = json.loads((tmp_path / "warm" / "student.json").read_text())["model"]
    assert (Path(student) / "config.json").exists()
    assert LABS[name][0]


@pytest.mark.slow
def test_coding_reward_hacking_lab_trains_three_verifiers_and_replays_their_episodes(tmp_path):
    """--quick swaps SmolLM2 for the tiny model: weak, brittle and strong from one student, the
    strong verifier's probe at every step, and every saved episode of every arm replayed and put
    in the audit's families (the tiny model's code is never right: no family is `correct`)."""
    from keelrl.audit.trajectories import run_episodes

    assert "model.path=smollm2" in lab_settings("reward-hacking")
    result = run_lab("reward-hacking", tmp_path, quick=True)
    assert set(result.numbers) - {"lab_seconds"} == {"weak", "brittle", "strong"}
    census = json.loads((tmp_path / "census.json").read_text())
    for arm in ("weak", "brittle", "strong"):
        rows = [json.loads(line) for line in (tmp_path / arm / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows if "probe/success" in row] == [0, 1, 2]
        episodes = run_episodes(tmp_path / arm)
        counted = census[arm]
        assert episodes and sum(counted["paid"].values()) + sum(counted["refused"].values()) == len(episodes)
        assert counted["paid"].get("correct", 0) + counted["refused"].get("correct", 0) == 0
        assert result.numbers[arm]["census"] == counted
    assert set(result.effects) == {"strong - weak", "strong - brittle"}
    assert (tmp_path / "reward_hacking.png").stat().st_size > 1000 and "| brittle |" in result.summary


@pytest.mark.slow
def test_credit_lab_runs_its_three_variants_on_the_quick_budget_and_measures_trajectory_b(tmp_path):
    """--quick swaps SmolLM2 for the tiny model: one warm start, then GRPO, PPO + value head with
    turn-level GAE and GRPO + process reward model; every variant labels its turns, so each step
    logs how many good turns of failed episodes there were, and the lab pools them."""
    from keelrl.labs import lab_settings
    from keelrl.labs.credit import good_turn_share

    assert "model.path=smollm2" in lab_settings("credit") and "prm.enabled=true" in lab_settings("credit")
    result = run_lab("credit", tmp_path, quick=True)
    assert set(result.numbers) - {"lab_seconds"} == {"grpo", "ppo-turn-gae", "grpo-prm"}
    for variant in ("grpo", "ppo-turn-gae", "grpo-prm"):
        rows = [json.loads(line) for line in (tmp_path / variant / "metrics.jsonl").read_text().splitlines()]
        assert sum(1 for row in rows if "credit/good_turns" in row) >= 1  # a step with a labelled turn measured it
        assert result.numbers[variant]["good_turns"] == good_turn_share(rows)[0]
    student = json.loads((tmp_path / "warm" / "student.json").read_text())["model"]
    assert (Path(student) / "config.json").exists() and (tmp_path / "credit.png").stat().st_size > 1000
    assert set(result.effects) == {"ppo-turn-gae - grpo", "grpo-prm - grpo"}
    assert "| grpo-prm |" in (tmp_path / "summary.md").read_text()


def test_good_turn_share_pools_the_steps_by_count():
    from keelrl.labs.credit import good_turn_share

    rows = [{"step": 1, "credit/good_turns": 4.0, "credit/good_turn_positive_frac": 0.25},
            {"step": 2, "credit/good_turns": 0.0},
            {"step": 3, "credit/good_turns": 6.0, "credit/good_turn_positive_frac": 0.5}]
    assert good_turn_share(rows) == (10, (1 + 3) / 10)
    assert good_turn_share([{"step": 1, "credit/good_turns": 0.0}])[0] == 0


@pytest.mark.slow
def test_distill_lab_runs_its_three_variants_on_the_quick_budget(tmp_path):
    """--quick swaps SmolLM2 for the tiny model; the lab makes its own teacher (the student
    warm-started), runs GRPO, on-policy distillation and self-distillation from the same start."""
    from keelrl.labs import lab_settings

    assert "model.path=smollm2" in lab_settings("distill") and "model.path=tiny" not in lab_settings("distill")
    assert lab_settings("distill", quick=True).index("model.path=tiny") > lab_settings("distill").index("model.path=smollm2")
    result = run_lab("distill", tmp_path, quick=True)
    assert {"grpo", "on-policy", "self"} <= set(result.numbers)
    teacher = Path(result.numbers["teacher"])
    assert teacher.parent.parent == student_cache_dir() and (teacher / "config.json").exists()
    # A teacher given on the command line goes to the on-policy variant alone (self has none).
    given = tmp_path / "given-teacher"
    shutil.copytree(teacher, given)
    again = run_lab("distill", tmp_path / "given", quick=True, overrides=[f"distill.teacher={given}"])
    assert again.numbers["teacher"] == str(given)
    assert set(result.effects) == {"on-policy - grpo", "self - grpo"}
    for variant in ("grpo", "on-policy", "self"):
        numbers = result.numbers[variant]
        assert len(numbers["eval_curve"]) == 3 and numbers["change"] == numbers["change"]  # before RL and 2 steps
        # One evaluation of the shared start, in grpo's run; the others begin from its figure.
        assert numbers["eval_curve"][0] == result.numbers["grpo"]["eval_curve"][0] and numbers["eval_curve"][0][0] == 0
        own = [json.loads(line) for line in (tmp_path / variant / "metrics.jsonl").read_text().splitlines()]
        assert any(row["step"] == 0 and "eval/success" in row for row in own) == (variant == "grpo")
    assert result.numbers["on-policy"]["kl_last"] > 0 and result.numbers["self"]["kl_last"] >= 0
    assert result.numbers["grpo"]["kl_last"] != result.numbers["grpo"]["kl_last"]  # no teacher: NaN
    summary = (tmp_path / "summary.md").read_text()
    assert "| on-policy |" in summary and ("Helped, more than" in summary or "No variant helped" in summary)
    assert result.numbers["grpo"]["versus_grpo"] == 0 and all(
        -1 <= result.numbers[variant]["versus_grpo"] <= 1 for variant in ("on-policy", "self"))
    assert (tmp_path / "distill.png").stat().st_size > 1000
