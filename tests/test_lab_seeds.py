"""Labs over seeds (`keel lab NAME --seeds K`) and the cached student every lab starts from."""

from __future__ import annotations

import json
import math

import pytest
from conftest import FAST_RUN

import keelrl.labs as labs
import keelrl.labs.common as common
from keelrl.cli import main
from keelrl.config import TINY_RUN
from keelrl.errors import ConfigError
from keelrl.labs.seeds import numeric_leaves, over_seeds, spread, verdicts


def result(numbers, effects=None):
    return labs.LabResult("fake", numbers, "", [], effects or {})


def test_spread_and_leaves_against_hand_worked_numbers():
    s = spread([0.1, 0.3, 0.5])
    assert s["mean"] == pytest.approx(0.3) and s["sd"] == pytest.approx(0.2)  # sqrt((0.04 + 0 + 0.04) / 2)
    assert (s["min"], s["max"]) == (0.1, 0.5) and spread([2.0])["sd"] is None
    assert numeric_leaves({"a": {"b": 1, "c": [1, 2], "d": "x", "e": float("nan")}, "f": 2.5, "g": True}) == {
        "a.b": 1.0, "f": 2.5}
    table = over_seeds([result({"arm": {"after": 0.2}, "only_here": 1.0}), result({"arm": {"after": 0.4}})])
    assert list(table) == ["arm.after"] and table["arm.after"]["mean"] == pytest.approx(0.3)


def test_an_effect_is_called_within_the_noise_from_the_seeds_spread_and_the_tasks_error():
    # effect +0.10, +0.12, +0.08 (mean 0.10, s.d. 0.02) with paired SEs 0.03, 0.03, 0.03:
    # noise = sqrt(0.02^2 / 3 + 0.03^2) = 0.03215; 0.10 > 2 x 0.03215, so it helped.
    seeds = [result({}, {"remedy - base": (value, 0.03)}) for value in (0.10, 0.12, 0.08)]
    found = verdicts(seeds)["remedy - base"]
    assert found["noise"] == pytest.approx(math.sqrt(0.02 ** 2 / 3 + 0.03 ** 2))
    assert found["verdict"] == "helped" and found["seeds"] == 3
    # the same mean with a wide spread over seeds (-0.2, 0.1, 0.4: s.d. 0.3) is within the noise
    wide = verdicts([result({}, {"remedy - base": (value, 0.03)}) for value in (-0.2, 0.1, 0.4)])["remedy - base"]
    assert wide["sd"] == pytest.approx(0.3) and wide["verdict"] == "within the noise"
    # and a clear loss is called one
    assert verdicts([result({}, {"x": (-0.3, 0.05)}), result({}, {"x": (-0.25, 0.05)})])["x"]["verdict"] == "hurt"


def test_with_each_tasks_difference_the_tasks_error_is_that_of_the_seeds_mean_per_task():
    from keelrl.labs.common import Effect, outcome_effect, task_differences
    from keelrl.labs.seeds import task_mean_se

    assert task_differences({"a": True, "b": False, "c": True}, {"a": False, "b": True, "d": True}) == {"a": -1.0, "b": 1.0}
    # The effect of those outcomes: mean 0 over the two common tasks, SE sqrt((1 + 1) / 1 / 2) = 1;
    # one common task leaves the SE undefined (None).
    effect = outcome_effect({"a": True, "b": False, "c": True}, {"a": False, "b": True, "d": True})
    assert tuple(effect) == (0.0, 1.0) and effect.tasks == {"a": -1.0, "b": 1.0}
    assert tuple(outcome_effect({"a": False}, {"a": True})) == (1.0, None)
    # Two seeds, four tasks: differences 1, 0, 0, 1 and 0, 0, 1, 1 (each seed +0.5, paired SE
    # sqrt((4 x 0.25) / 3 / 4) = 0.2887). Averaged per task: 0.5, 0, 0.5, 1, s.d. sqrt(0.5 / 3),
    # SE 0.2041. The seeds agree (s.d. 0), so the noise is 0.2041 and +0.5 > 2 x 0.2041 helped;
    # the mean paired SE alone (0.2887) would call it within the noise.
    first, second = {"t1": 1.0, "t2": 0.0, "t3": 0.0, "t4": 1.0}, {"t1": 0.0, "t2": 0.0, "t3": 1.0, "t4": 1.0}
    se = math.sqrt(4 * 0.25 / 3 / 4)
    seeds = [result({}, {"x": Effect(0.5, se, first)}), result({}, {"x": Effect(0.5, se, second)})]
    found = verdicts(seeds)["x"]
    assert found["se_over_tasks"] == pytest.approx(math.sqrt(0.5 / 3 / 4)) and found["sd"] == 0
    assert found["noise"] == pytest.approx(0.2041, abs=1e-4) and found["verdict"] == "helped"
    plain = verdicts([result({}, {"x": (0.5, se)}), result({}, {"x": (0.5, se)})])["x"]  # no tasks kept
    assert plain["noise"] == pytest.approx(se) and plain["verdict"] == "within the noise"
    # One seed: the same SE as the seed's own paired SE; tasks not every seed has are left out.
    assert task_mean_se([first]) == pytest.approx(se)
    assert task_mean_se([first, {**second, "t5": 1.0}]) == pytest.approx(math.sqrt(0.5 / 3 / 4))
    assert task_mean_se([first, {}]) is None and task_mean_se([{"t1": 1.0}]) is None


def test_the_noise_against_a_float64_reference_on_simulated_flips():
    """d(t, s) = mu + a(t) + b(s) + e(t, s) drawn many times: the noise's square, averaged over
    draws, is the mean's variance over draws plus var(e) / (T K) (the flips counted twice),
    within sampling error; the mean paired SE's noise stays above it by about (1 - 1/K) var(e) / T."""
    import numpy as np

    from keelrl.labs.common import Effect

    rng = np.random.default_rng(0)
    tasks, seeds, draws = 32, 4, 3000
    sa, sb, se_ = 0.1, 0.05, 0.4
    means, noise2, old2 = [], [], []
    for _ in range(draws):
        d = (0.05 + rng.normal(0, sa, (tasks, 1)) + rng.normal(0, sb, (1, seeds))
             + rng.normal(0, se_, (tasks, seeds)))
        results = []
        for s in range(seeds):
            column = d[:, s]
            paired = float(column.std(ddof=1) / np.sqrt(tasks))
            results.append(result({}, {"x": Effect(float(column.mean()), paired, {f"t{t}": float(column[t])
                                                                                   for t in range(tasks)})}))
        found = verdicts(results)["x"]
        means.append(float(d.mean()))
        noise2.append(found["noise"] ** 2)
        old2.append((found["sd"] ** 2 / seeds) + float(np.mean([r.effects["x"][1] for r in results])) ** 2)
    truth = sa ** 2 / tasks + sb ** 2 / seeds + se_ ** 2 / (tasks * seeds)
    assert np.var(means, ddof=1) == pytest.approx(truth, rel=0.1)
    assert np.mean(noise2) == pytest.approx(truth + se_ ** 2 / (tasks * seeds), rel=0.05)
    assert np.mean(old2) > np.mean(noise2) + 0.5 * se_ ** 2 / tasks


def test_run_lab_repeats_every_arm_at_consecutive_seeds_and_combines_them(tmp_path, monkeypatch):
    seen = []

    def lab(out, settings, quick, progress):  # the variants' settings carry the repetition's seed
        seed = int(common.variant_settings()[-1].split("=")[1])
        seen.append((out.name, common.variant_settings()))
        return labs.LabResult("fake", {"arm": {"after": 0.1 * seed}}, f"seed {seed}", [],
                              {"remedy - base": (0.05 * seed, 0.01)})

    monkeypatch.setitem(labs.LABS, "fake", ("a fake lab", lab, labs.GUESS))
    combined = labs.run_lab("fake", tmp_path, ["seed=4", "optim.lr=1e-4"], seeds=3)
    assert [name for name, _ in seen] == ["seed-4", "seed-5", "seed-6"]
    assert seen[0][1] == ["seed=4", "optim.lr=1e-4", "seed=4"]  # the user's overrides, then the seed
    assert combined.numbers["seeds"] == [4, 5, 6]
    assert combined.numbers["over_seeds"]["arm.after"]["mean"] == pytest.approx(0.5)
    assert combined.numbers["effects"]["remedy - base"]["mean"] == pytest.approx(0.25)
    for seed in (4, 5, 6):
        assert (tmp_path / f"seed-{seed}" / "summary.md").read_text().startswith(f"seed {seed}")
        assert json.loads((tmp_path / f"seed-{seed}" / "results.json").read_text())["arm"]["after"] == pytest.approx(0.1 * seed)
    summary = (tmp_path / "summary.md").read_text()
    assert "3 seeds" in summary and "| remedy - base | +0.250 |" in summary and "a seed)" in summary
    assert json.loads((tmp_path / "results.json").read_text())["per_seed"]["5"]["arm"]["after"] == pytest.approx(0.5)
    assert common.variant_settings() == []  # the seed does not outlive the lab
    with pytest.raises(ValueError, match="seeds"):
        labs.run_lab("fake", tmp_path, seeds=0)


def test_one_seed_says_its_noise_is_the_tasks_alone(tmp_path, monkeypatch):
    def lab(out, settings, quick, progress):
        return labs.LabResult("fake", {}, "one run", [], {"remedy - base": (0.01, 0.02)})

    monkeypatch.setitem(labs.LABS, "fake", ("a fake lab", lab, labs.GUESS))
    summary = labs.run_lab("fake", tmp_path).summary
    assert "within the noise" in summary and "One seed" in summary and "remedy - base" in summary


def test_rl_only_settings_reach_every_arm_and_not_the_warm_start(tmp_path, monkeypatch):
    seen = {}

    def lab(out, settings, quick, progress):  # settings: what the warm start reads
        seen.setdefault("warm start", list(settings))
        seen.setdefault("arms", []).append(common.variant_settings())
        return labs.LabResult("fake", {}, "ran")

    monkeypatch.setitem(labs.LABS, "fake", ("a fake lab", lab, labs.GUESS))
    result = labs.run_lab("fake", tmp_path, ["optim.lr=1e-4"], seeds=2, rl_overrides=["algo.kl_coef=0.04"])
    assert "algo.kl_coef=0.04" not in seen["warm start"] and "optim.lr=1e-4" in seen["warm start"]
    # the user's overrides, then the RL-only settings, then the repetition's seed
    assert seen["arms"] == [["optim.lr=1e-4", "algo.kl_coef=0.04", "seed=0"],
                            ["optim.lr=1e-4", "algo.kl_coef=0.04", "seed=1"]]
    recorded = json.loads((tmp_path / "results.json").read_text())
    assert recorded["overrides"] == ["optim.lr=1e-4"] and recorded["rl_overrides"] == ["algo.kl_coef=0.04"]
    assert "the RL runs alone algo.kl_coef=0.04" in result.summary
    assert common.variant_settings() == []  # nothing outlives the lab
    with pytest.raises(ConfigError, match="algo.kl_cof"):  # a bad one fails before any work
        labs.run_lab("fake", tmp_path / "bad", rl_overrides=["algo.kl_cof=1"])
    assert not (tmp_path / "bad").exists()


def test_keel_lab_rl_reaches_run_lab(monkeypatch, capsys):
    seen = {}

    def fake_run_lab(name, out, overrides, **options):
        seen[name] = (list(overrides), options["rl_overrides"])
        return labs.LabResult(name, {}, "done")

    monkeypatch.setattr(labs, "run_lab", fake_run_lab)
    assert main(["lab", "dynamic-sampling", "optim.lr=1e-5", "--rl", "algo.kl_coef=0.04", "--rl", "train.steps=2"]) == 0
    assert main(["lab", "entropy"]) == 0
    assert seen == {"dynamic-sampling": (["optim.lr=1e-5"], ["algo.kl_coef=0.04", "train.steps=2"]),
                    "entropy": ([], [])}


def test_keel_lab_refuses_fewer_than_one_seed(capsys):
    assert main(["lab", "entropy", "--seeds", "0"]) == 2
    assert "--seeds must be >= 1" in capsys.readouterr().err


def test_the_student_is_made_once_per_config_and_source_and_reused(tiny_model_dir, tmp_path, monkeypatch):
    import keelrl.train.trainer as trainer_module

    monkeypatch.setenv("KEELRL_STUDENT_CACHE", str(tmp_path / "students"))
    made = []
    warm_start = trainer_module.Trainer.warm_start
    monkeypatch.setattr(trainer_module.Trainer, "warm_start", lambda self: made.append(1) or warm_start(self))
    overrides = [*TINY_RUN, *FAST_RUN, f"model.path={tiny_model_dir}"]
    messages = []
    first = common.cached_student(overrides, messages.append)
    again = common.cached_student([*overrides, f"run_dir={tmp_path / 'elsewhere'}"], messages.append)
    assert first == again and len(made) == 1 and "reusing" in messages[-1]
    # settings only RL reads (steps, the algorithm, the evaluation, the batch's shape) share it
    rl_only = ["train.steps=9", "algo.preset=grpo", "optim.lr=1e-3", "eval.tasks=7", "rollout.tasks_per_step=3",
               "rollout.group_size=5", "monitor.window=4", "prm.enabled=true", "rollout.dynamic_max_extra_groups=3",
               "curriculum.enabled=true", "curriculum.levels=off_by_one:1"]
    assert common.cached_student([*overrides, *rl_only], messages.append) == first and len(made) == 1
    record = json.loads((first.parent / "student.json").read_text())
    assert record["key"].startswith(first.parent.name) and "demos: 4" in record["config"]
    assert (first / "config.json").exists() and (first / "tokenizer_config.json").exists()
    assert [p.name for p in (tmp_path / "students").iterdir()] == [first.parent.name]  # nothing half-built left
    # another warm-start setting, or other keelrl source, makes another student
    other = common.cached_student([*overrides, "warm_start.lr=1e-3"])
    monkeypatch.setattr(common, "source_hash", lambda: "other code")
    newer = common.cached_student(overrides)
    assert len({first, other, newer}) == 3 and len(made) == 3


def test_the_source_hash_covers_the_code_a_warm_start_runs_and_not_the_labs(tmp_path, monkeypatch):
    import keelrl

    package = tmp_path / "keelrl"
    for relative in ("__init__.py", "train/warm_start.py", "labs/credit.py", "audit/probes.py", "cli.py"):
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text(f"# {relative}\n")
    monkeypatch.setattr(keelrl, "__file__", str(package / "__init__.py"))

    def digest() -> str:
        common.source_hash.cache_clear()
        return common.source_hash()

    try:
        start = digest()
        for relative in ("labs/credit.py", "audit/probes.py", "cli.py"):  # never run in a warm start
            (package / relative).write_text("# edited\n")
            assert digest() == start, relative
        (package / "train/warm_start.py").write_text("# edited\n")
        assert digest() != start
    finally:
        common.source_hash.cache_clear()
