"""Labs: the registry and CLI, a bad override failing first, and smoke runs at the quick budget."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from keelrl.cli import main
from keelrl.errors import ConfigError
from keelrl.labs import LABS, lab_settings, run_lab
from keelrl.labs.common import student_cache_dir, variant_record


def test_lab_list_and_unknown_names(capsys):
    assert main(["lab", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("stale-ratios", "dynamic-sampling", "dynamic-sampling-guess", "entropy",
                                           "entropy-guess", "curriculum", "reward-hacking",
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


def test_a_finished_arm_loses_its_checkpoint_unless_kept_and_still_resumes(tmp_path, monkeypatch):
    import keelrl.labs.common as common
    import keelrl.train.trainer as trainer_module
    from keelrl.runs import latest_checkpoint

    trained = []

    class Recorder:  # a finished run: its summary, metrics and a checkpoint with its pointer
        def __init__(self, cfg):
            self.run_dir = Path(cfg.run_dir)

        def run(self):
            trained.append(self.run_dir.name)
            folder = self.run_dir / "checkpoints" / "step-000002"
            folder.mkdir(parents=True)
            (folder / "state.pt").write_bytes(b"x" * 1000)
            (folder / "model.safetensors").write_bytes(b"y" * 500)
            (self.run_dir / "checkpoint.json").write_text('{"step": 2, "path": "checkpoints/step-000002"}')
            (self.run_dir / "summary.json").write_text("{}")
            (self.run_dir / "metrics.jsonl").write_text('{"step": 2, "train/reward": 0.5}\n')

    monkeypatch.setattr(common, "warm_model", lambda out, overrides, progress=None: tmp_path / "warm")
    monkeypatch.setattr(trainer_module, "Trainer", Recorder)
    messages: list[str] = []
    common.train_variants(tmp_path / "dropped", {"a": ["train.steps=2"]}, [], messages.append)
    arm = tmp_path / "dropped" / "a"
    assert not (arm / "checkpoints").exists() and not (arm / "checkpoint.json").exists()
    assert latest_checkpoint(arm) is None and (arm / "summary.json").exists() and (arm / "metrics.jsonl").exists()
    assert any("removed a's checkpoint (0.00 GB" in message for message in messages)
    common.train_variants(tmp_path / "dropped", {"a": ["train.steps=2"]}, [], messages.append)
    assert trained == ["a"]  # resumed: the finished arm is known by its summary, not its checkpoint
    token = common.KEEP_CHECKPOINTS.set(True)
    try:
        common.train_variants(tmp_path / "kept", {"a": ["train.steps=2"]}, [], messages.append)
    finally:
        common.KEEP_CHECKPOINTS.reset(token)
    assert latest_checkpoint(tmp_path / "kept" / "a") == tmp_path / "kept" / "a" / "checkpoints" / "step-000002"
    assert common.drop_checkpoint(tmp_path / "kept" / "a", messages.append) == 1500
    assert common.drop_checkpoint(tmp_path / "kept" / "a", messages.append) == 0  # nothing left to remove


def test_release_memory_hands_freed_heap_pages_back():
    import os

    from keelrl.labs.common import _malloc_trim, release_memory

    if _malloc_trim() is None:
        pytest.skip("no glibc malloc_trim on this platform: release_memory only collects garbage")

    def rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    release_memory()  # free pages earlier tests left in this process's heap would take the blocks unseen
    base = rss()
    blocks = [bytes(2000) for _ in range(150_000)]  # about 300 MB on the C heap, below the mmap threshold
    kept = blocks[::100]  # every 100th stays: the freed pages lie between live blocks, not at the heap's top
    del blocks
    freed_not_returned = rss() - base
    release_memory()
    assert freed_not_returned > 200e6 and rss() - base < 0.25 * freed_not_returned and len(kept) == 1500


def test_keel_lab_keep_checkpoints_reaches_the_lab(monkeypatch, capsys):
    import keelrl.labs as labs

    seen = {}

    def fake_run_lab(name, out, overrides, **options):
        seen[name] = options["keep_checkpoints"]
        return labs.LabResult(name, {}, "done")

    monkeypatch.setattr(labs, "run_lab", fake_run_lab)
    assert main(["lab", "credit", "--quick"]) == 0 and main(["lab", "entropy", "--keep-checkpoints"]) == 0
    assert seen == {"credit": False, "entropy": True}


def test_stale_ratios_lab_measures_weights_on_real_rollouts(tmp_path):
    import gc
    import weakref

    from keelrl.train.trainer import Trainer

    gc.collect()  # trainers other tests in this process still hold are not the lab's
    earlier = weakref.WeakSet(thing for thing in gc.get_objects() if isinstance(thing, Trainer))
    alive: dict[str, int] = {}

    def count_trainers(message: str) -> None:  # before the training part and each of its arms
        if message.startswith(("sampling 2 batches", "training ")):
            gc.collect()
            alive[message] = sum(isinstance(thing, Trainer) and thing not in earlier for thing in gc.get_objects())

    # an importance-weight alarm threshold every stale update passes: each objective's arm raises it
    result = run_lab("stale-ratios", tmp_path, ["monitor.is_weight_max=1.0001"], quick=True, progress=count_trainers)
    # No earlier trainer (the measurement's, held by its engine, or an arm's) outlives its part:
    # the training part's sampler is the one trainer alive while it samples, and none as each arm starts.
    assert len(alive) == 7 and [alive[message] for message in alive] == [1, 0, 0, 0, 0, 0, 0], alive
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
    # Each effect keeps every held-out task's difference (every arm grades the same tasks as
    # fresh's run): their mean is the effect. Kept as a list, they are no numbers over seeds.
    graded = set(json.loads((tmp_path / "fresh" / "summary.json").read_text())["heldout"]["final"]["task_success"])
    for name, effect in result.effects.items():
        assert set(effect.tasks) == graded and len(graded) >= 2
        assert set(effect.tasks.values()) <= {-1.0, 0.0, 1.0}
        assert sum(effect.tasks.values()) / len(effect.tasks) == pytest.approx(effect[0])
    from keelrl.labs.seeds import numeric_leaves

    assert not any("tasks_vs" in path for path in numeric_leaves(numbers))
    # The training part's updates go through the run's alarms: every objective on the stale batches
    # weighs some token above 1.0001 (its own ratio, or the decoupled objective's behaviour weight)
    # and raises `importance_weight` once, no later than the first update whose ratio passed it.
    for name, arm in numbers["training"]["arms"].items():
        if name == "fresh":
            continue
        fired = [event for event in arm["alarms"] if event["alarm"] == "importance_weight"]
        assert len(fired) == 1, (name, arm["alarms"])
        step, values = fired[0]["step"], fired[0]["values"]
        assert 1 <= step <= numbers["training"]["updates"] and values and min(values.values()) > 1.0001
        passed = [k for k, weight in enumerate(arm["is_weight_max"], start=1) if weight > 1.0001]
        assert not passed or step <= passed[0], (name, step, arm["is_weight_max"])
        assert f"- {name}, update {step}: `importance_weight`" in (tmp_path / "summary.md").read_text()
        # ... and are the arm's own run files, as a run's: a metrics row per update (the held-out
        # success on the last), the alarm flagged on its row, alarms.jsonl and the sampled episodes.
        run_dir = tmp_path / f"train-{name.lower().replace(' ', '-')}"
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(1, numbers["training"]["updates"] + 1))
        assert rows[-1]["eval/success"] == arm["heldout"] and "eval/success" not in rows[0]
        assert [row["policy/is_weight_max"] for row in rows] == arm["is_weight_max"]
        assert [row["step"] for row in rows if row.get("alarm/importance_weight") == 1.0] == [step]
        assert [json.loads(line)["alarm"] for line in (run_dir / "alarms.jsonl").read_text().splitlines()] == [
            "importance_weight"]
        assert (run_dir / "alarms" / f"importance_weight_step_{step:04d}.txt").read_text().startswith("# ")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dynamic-sampling-guess", "entropy-guess", "reward-hacking-guess"])
def test_training_labs_run_at_the_quick_budget(tmp_path, name):
    result = run_lab(name, tmp_path, quick=True)
    variants = {"dynamic-sampling-guess": {"dapo", "dapo-no-dynamic"}, "entropy-guess": {"no-bonus", "bonus-0.005", "bonus-0.05"},
                "reward-hacking-guess": {"weak", "strong"}}
    assert set(result.numbers) - {"lab_seconds"} == variants[name]
    assert result.numbers["lab_seconds"] > 0 and "Lab wall time" in result.summary
    if name == "entropy-guess":  # the arms' own settings drop the KL: the summary says so
        assert "with no KL anchor" in result.summary and "reference KL" not in result.summary
    assert all(path.exists() for path in result.files)
    student = json.loads((tmp_path / "warm" / "student.json").read_text())["model"]
    assert (Path(student) / "config.json").exists()
    assert LABS[name][0]


@pytest.mark.slow
def test_coding_reward_hacking_lab_trains_three_verifiers_and_replays_their_episodes(tmp_path, monkeypatch):
    """--quick swaps SmolLM2 for the tiny model: weak, brittle and strong from one student, the
    strong verifier's probe at every step (its start evaluated once, by the first arm), and every
    saved episode of every arm replayed and put in the audit's families (the tiny model's code is
    never right: no family is `correct`)."""
    from keelrl.audit.trajectories import run_episodes
    from keelrl.train.trainer import Trainer

    evaluated = []
    real = Trainer.evaluate
    monkeypatch.setattr(Trainer, "evaluate", lambda self, tasks=None: evaluated.append(
        (self.run_dir.name, self.policy_version)) or real(self, tasks))
    assert "model.path=smollm2" in lab_settings("reward-hacking")
    result = run_lab("reward-hacking", tmp_path, quick=True)
    # the start once (the first arm's), then each arm's end (eval.every=2, 2 steps of one update)
    assert [version for arm, version in evaluated if arm == "weak"][0] == 0
    assert sorted(arm for arm, version in evaluated if version == 0) == ["weak"]
    assert sorted(arm for arm, version in evaluated if version > 0) == ["brittle", "strong", "weak"]
    starts = [json.loads((tmp_path / arm / "metrics.jsonl").read_text().splitlines()[0])
              for arm in ("weak", "brittle", "strong")]
    assert all(row["step"] == 0 and row == starts[0] for row in starts)
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
        # only grpo-prm trains the scorer; the others keep the labels alone (prm.scorer=false)
        assert any("prm/turns" in row for row in rows) == (variant == "grpo-prm")
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
    assert not list(tmp_path.rglob("checkpoints"))  # each arm's checkpoint dropped once it finished
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
    preset = yaml.safe_load((tmp_path / "grpo" / "config.yaml").read_text())["algo"]["preset"]
    assert f"RL steps of `{preset}` each, plain (`grpo`)" in summary  # what the arms ran, not a name
    assert "| on-policy |" in summary and ("Helped, more than" in summary or "No variant helped" in summary)
    start_malformed = result.numbers["start_malformed"]  # the shared start's malformed share, read from grpo's run
    assert start_malformed == next(row for row in (json.loads(line) for line in (
        tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()) if row["step"] == 0)["eval/action_error_frac"]
    assert ("does not write the tool format" in summary) == (start_malformed >= 0.5)
    assert result.numbers["grpo"]["versus_grpo"] == 0 and all(
        -1 <= result.numbers[variant]["versus_grpo"] <= 1 for variant in ("on-policy", "self"))
    assert (tmp_path / "distill.png").stat().st_size > 1000
    # Each arm is a lab arm like the other labs': its wall clock recorded, and a lab run again in
    # the same place (a stopped one, resumed) keeps every finished arm instead of training it again.
    assert all(variant_record(tmp_path / variant)["seconds"] > 0 for variant in ("grpo", "on-policy", "self"))
    messages: list[str] = []
    resumed = run_lab("distill", tmp_path, quick=True, progress=messages.append)
    assert sum("finished before with this config, kept" in message for message in messages) == 3, messages
    assert not any(message.startswith("training variant") for message in messages)
    assert resumed.effects == result.effects
    assert all(resumed.effects[name].tasks == effect.tasks and effect.tasks for name, effect in result.effects.items())


def test_dominance_measures_how_evenly_weights_spread():
    from keelrl.labs.stale_ratios import dominance

    assert dominance([1, 1, 1, 1]) == {"ess_frac": 1.0, "top1pct_share": 0.25}
    # (3 + 1)^2 / (9 + 1) = 1.6 of 2; the heaviest (ceil(2 / 100) = 1) carries 3 of 4.
    assert dominance([1, 3]) == pytest.approx({"ess_frac": 0.8, "top1pct_share": 0.75})
    many = dominance([100.0] + [1.0] * 199)  # one in 200 carries 100 / 299; its top 1% are 2 weights
    assert many["top1pct_share"] == pytest.approx(101 / 299)
    assert many["ess_frac"] == pytest.approx(299 ** 2 / (100 ** 2 + 199) / 200)
    assert math.isnan(dominance([])["ess_frac"]) and math.isnan(dominance([0.0, 0.0])["top1pct_share"])


def test_each_objective_weighs_a_stale_batch_as_worked_by_hand():
    import torch

    from keelrl.labs.stale_ratios import OBJECTIVES, objective_weights

    ratios = torch.tensor([[0.5, 1.1, 1.5, 3.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    behaviour = torch.full_like(ratios, -2.0)
    logp = behaviour + ratios.log()
    expected = {  # the first row's weights and limited tokens; the second row (ratio 1) is never limited
        "token PPO": ([0.8, 1.1, 1.2, 1.2], [True, False, True, True]),  # clip to [0.8, 1.2]
        "CISPO": ([0.5, 1.1, 1.28, 1.28], [False, False, True, True]),  # eps_low 1: only the top, at 1.28
        "decoupled": ([0.5, 1.1, 1.5, 2.0], [False, False, False, True]),  # behaviour weight truncated at 2
        "truncated IS": ([0.5, 1.1, 1.5, 2.0], [False, False, False, True]),  # min(r, 2)
        # GSPO: (0.5 x 1.1 x 1.5 x 3)^(1/4) = 1.2543 for the whole row, clipped to 1 + 4e-4
        "GSPO": ([1.0004] * 4, [True] * 4),
    }
    assert set(expected) == set(OBJECTIVES)
    for name, (weights, limited) in expected.items():
        weight, cut = objective_weights(name, logp, behaviour, mask)
        assert weight[0].tolist() == pytest.approx(weights, rel=1e-6), name
        assert cut[0].tolist() == limited and not cut[1].any(), name
        assert weight[1].tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0]), name


def test_the_no_dynamic_arm_matches_the_dynamic_arms_sampled_rollouts():
    from keelrl.config import load_config
    from keelrl.labs.dynamic_sampling import format_sentences, groups_with_signal, matching_steps, rl_steps, rollouts_sampled

    cfg = load_config(overrides=lab_settings("dynamic-sampling"))
    assert (cfg.model.path, cfg.algo.preset, cfg.rollout.tasks_per_step, cfg.rollout.group_size) == ("smollm2", "grpo", 2, 4)
    dynamic = [{"step": 1, "train/reward": 0.5, "dynamic/groups_drawn": 5.0},
               {"step": 2, "train/reward": 0.4, "dynamic/groups_drawn": 2.0}, {"step": 2, "eval/success": 0.3}]
    assert rollouts_sampled(dynamic, cfg) == 28  # 7 groups of 4
    kept_none = [{"step": 0, "eval/success": 0.2}, {"step": 1, "dynamic/groups_drawn": 8.0},
                 {"step": 2, "train/reward": 0.5, "dynamic/groups_drawn": 3.0}]
    assert rl_steps(kept_none) == [1, 2] and rollouts_sampled(kept_none, cfg) == 44
    plain = [{"step": 1, "train/reward": 0.5}, {"step": 2, "train/reward": 0.25}, {"step": 3, "train/reward": 0.0}]
    assert rollouts_sampled(plain, cfg) == 24  # 3 steps of 2 tasks x 4
    assert [matching_steps(n, 8) for n in (28, 27, 3, 0, 44)] == [4, 3, 1, 1, 6]  # 3.5 rounds up, 3.375 down
    # Groups learned from: kept groups (all mixed) with dynamic sampling; the batch's 2 tasks times
    # the non-zero share without (1 + 0 + 2); an evaluation row or a step that kept none adds nothing.
    kept = [{"step": 1, "train/zero_advantage_frac": 0.0, "dynamic/kept_groups": 3.0}, {"step": 2, "dynamic/groups_drawn": 8.0},
            {"step": 3, "train/zero_advantage_frac": 0.0, "dynamic/kept_groups": 2.0}, {"step": 3, "eval/success": 0.3}]
    assert groups_with_signal(kept, cfg) == 5
    zeros = [{"step": k, "train/zero_advantage_frac": frac} for k, frac in ((1, 0.5), (2, 1.0), (3, 0.0))]
    assert groups_with_signal(zeros, cfg) == 3
    # The summaries name the reference KL the arms ran with, the user's override included.
    from keelrl.labs.common import kl_anchor

    assert kl_anchor(cfg) == "no KL anchor"
    assert kl_anchor(load_config(overrides=[*lab_settings("dynamic-sampling"), "algo.kl_coef=0.04"])) == (
        "a reference KL of 0.04 (k3)")
    # The format: an arm that went from a well-formed start to 47% malformed broke it; 30% is the line.
    arms = {"dynamic": {"malformed_before": 0.014, "malformed_after": 0.472},
            "no-dynamic": {"malformed_before": 0.014, "malformed_after": 0.299}}
    assert format_sentences(arms) == ["`dynamic`'s tool-call format broke: 47% of its held-out actions were "
                                      "malformed after training (1% at the start)."]
    arms["no-dynamic"]["malformed_after"] = 0.3
    assert len(format_sentences(arms)) == 2
    never = {label: {"malformed_before": 0.9, "malformed_after": 1.0} for label in arms}
    assert format_sentences(never) == ["The start itself does not write the tool-call format (90% of its held-out "
                                       "actions malformed)."]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dynamic-sampling", "stale-ratios", "entropy", "curriculum"])
def test_smollm2_labs_run_on_the_tiny_model_with_quick(tmp_path, name):
    """--quick swaps SmolLM2 for the tiny model."""
    assert "model.path=smollm2" in lab_settings(name) and "model.path=tiny" in lab_settings(name, quick=True)
    result = run_lab(name, tmp_path, quick=True)
    assert not list(tmp_path.rglob("checkpoint.json")) and not list(tmp_path.rglob("checkpoints"))  # dropped
    if name in ("entropy", "curriculum"):
        arms = {"entropy": ("cold", "bonus", "warm"), "curriculum": ("uniform", "curriculum")}[name]
        assert set(result.numbers) - {"lab_seconds"} == set(arms)
        assert result.numbers[arms[0]]["eval_before"] == result.numbers[arms[1]]["eval_before"]  # one shared start
        second = [json.loads(line) for line in (tmp_path / arms[1] / "metrics.jsonl").read_text().splitlines()]
        assert not any(row["step"] == 0 and "eval/success" in row for row in second)
        assert (tmp_path / f"{name}.png").stat().st_size > 1000 and f"| {arms[1]} |" in result.summary
        assert len(result.effects) == len(arms) - 1
        if name == "entropy":
            numbers = result.numbers
            assert [(numbers[arm]["temperature"], numbers[arm]["entropy_coef"]) for arm in arms] == [
                (0.3, 0.0), (0.3, 0.05), (1.0, 0.0)]  # warm keeps the quick recipe's temperature
            assert all(math.isfinite(numbers[arm]["entropy_first"]) for arm in arms)
            # The learner scores at each arm's temperature: the cold arms' first batch is sharper.
            assert numbers["cold"]["entropy_first"] < numbers["warm"]["entropy_first"]
            assert set(result.effects) == {"bonus - cold", "warm - cold"}
        else:
            shares = {arm: result.numbers[arm]["episode_share_by_level"] for arm in arms}
            # The curriculum admits level 0 alone at first (the tiny model masters nothing): all its episodes there.
            assert shares["curriculum"] == {0: 1.0} and sum(shares["uniform"].values()) == pytest.approx(1)
            rows = [json.loads(line) for line in (tmp_path / "curriculum" / "metrics.jsonl").read_text().splitlines()]
            assert [row["curriculum/level"] for row in rows if "curriculum/level" in row] == [0.0, 0.0]
        return
    if name == "stale-ratios":
        objectives = result.numbers["objectives"]
        assert set(objectives) == {"token PPO", "GSPO", "CISPO", "decoupled", "truncated IS"}
        for data in objectives.values():  # fresh weights are 1: every token counts the same
            assert data["ess_frac_by_staleness"][0] == pytest.approx(1, abs=1e-4)
            assert data["limited_frac_by_staleness"][0] == 0 or data is objectives["GSPO"]
        trajectory = result.numbers["unlimited"]["trajectory_ess_frac"]
        assert trajectory[0] == pytest.approx(1, abs=1e-3) and trajectory[-1] < trajectory[0]
        arms = result.numbers["training"]["arms"]
        assert set(arms) == {*objectives, "fresh"}
        for name, arm in arms.items():  # update k trains on data the student sampled, k - 1 updates stale
            assert arm["staleness"] == ([0.0, 0.0] if name == "fresh" else [0.0, 1.0]), name
            assert 0 <= arm["heldout"] <= 1 and len(arm["clip_frac"]) == 2
        assert set(result.effects) == {f"{name} - token PPO" for name in arms if name != "token PPO"}
        models = {arm: yaml.safe_load((tmp_path / arm / "config.yaml").read_text())["model"]["path"]
                  for arm in ("train-token-ppo", "train-gspo", "fresh")}
        assert len(set(models.values())) == 1, models  # every arm starts from the one student
        assert "ratio: sequence\n" in (tmp_path / "train-gspo" / "config.yaml").read_text()
        assert "clip: tis\n" in (tmp_path / "train-truncated-is" / "config.yaml").read_text()
        assert "## Training on stale batches" in result.summary
        return
    dynamic, plain = result.numbers["dynamic"], result.numbers["no-dynamic"]
    # The no-dynamic arm ran the steps that sample the dynamic arm's rollouts, to the nearest step.
    assert abs(plain["rollouts_sampled"] - dynamic["rollouts_sampled"]) <= 2  # 2 tasks x 2 a step
    assert plain["steps"] >= dynamic["steps"] == 2 and plain["trained_steps"] == plain["steps"]
    # Every group the dynamic arm trained on was mixed; the tiny model's groups seldom are, and a
    # step whose draws kept none trains nothing (its zero-advantage share is then NaN).
    assert dynamic["zero_adv_frac_trained"] == 0 or (dynamic["trained_steps"] == 0
                                                     and math.isnan(dynamic["zero_adv_frac_trained"]))
    assert 0 <= dynamic["zero_adv_frac_sampled"] <= 1
    assert dynamic["eval_before"] == plain["eval_before"]  # one evaluation of the shared start
    rows = [json.loads(line) for line in (tmp_path / "no-dynamic" / "metrics.jsonl").read_text().splitlines()]
    assert not any(row["step"] == 0 and "eval/success" in row for row in rows)
    assert set(result.effects) == {"dynamic sampling (dynamic - no-dynamic)"}
    assert (tmp_path / "dynamic_sampling.png").stat().st_size > 1000 and "| no-dynamic |" in result.summary
    # What the updates learned from, and whether the format held: no-dynamic's batch is its 2 tasks a
    # step, so its groups with signal are 2 x (1 - the zero-advantage share) summed over its steps.
    assert plain["groups_with_signal"] == pytest.approx(sum(2 * (1 - row["train/zero_advantage_frac"])
                                                            for row in rows if "train/zero_advantage_frac" in row))
    assert 0 <= dynamic["malformed_after"] <= 1 and 0 <= plain["malformed_after"] <= 1
    # The malformed turns its updates trained on (the tiny model writes many), pooled over its steps.
    assert plain["rejected_turns"] == sum(row.get("credit/rejected_turns", 0) for row in rows) > 0
    assert 0 <= plain["rejected_turns_credited"] <= plain["rejected_turns"]
    assert f"{plain['rejected_turns_credited']} of {plain['rejected_turns']} without" in result.summary
    assert "GRPO (no KL anchor)" in result.summary and "groups with signal against" in result.summary
    start_malformed = dynamic["malformed_before"]  # the tiny start seldom writes the format at all
    assert plain["malformed_before"] == start_malformed and 0 <= start_malformed <= 1
    assert ("The start itself does not write the tool-call format" in result.summary) == (start_malformed >= 0.3)
    assert ("tool-call format broke" in result.summary) == (
        start_malformed < 0.3 <= max(dynamic["malformed_after"], plain["malformed_after"]))


def test_curriculum_levels_read_as_the_trainer_reads_them(tmp_path):
    from keelrl.config import load_config
    from keelrl.labs.curriculum import EASY_KINDS, HARD_KINDS, heldout_by_level, level_of

    cfg = load_config(overrides=lab_settings("curriculum"))
    assert cfg.curriculum.enabled is False  # on in the curriculum arm alone
    assert {level_of(kind, cfg) for kind in EASY_KINDS} == {0} and {level_of(kind, cfg) for kind in HARD_KINDS} == {1}
    assert level_of("not_a_kind", cfg) == 0  # unnamed kinds are level 0, as in keelrl.train.trainer
    (tmp_path / "summary.json").write_text(json.dumps({"heldout": {"final": {"by_kind": {
        "off_by_one": {"tasks": 3, "success": 1 / 3}, "flipped_comparison": {"tasks": 1, "success": 1.0},
        "wrong_default": {"tasks": 4, "success": 0.25}}}}}))
    assert heldout_by_level(tmp_path, cfg, "final") == pytest.approx({0: 0.5, 1: 0.25})  # (1 + 1) / 4 and 1 / 4
    assert heldout_by_level(tmp_path, cfg, "warm_start") == {}


def test_effect_sentence_says_when_one_seed_does_not_show_the_remedy_helped():
    from keelrl.labs.common import effect_sentence

    assert effect_sentence("X", (0.1875, 0.0703), 32, "it") == \
        "X: +0.188 (paired standard error 0.070 over the 32 tasks)."  # 0.1875 > 2 x 0.0703
    assert effect_sentence("X", (-0.09375, 0.0625), 32, "the bonus") == (
        "X: -0.094 (paired standard error 0.062 over the 32 tasks); within twice its standard error: this run "
        "does not show that the bonus helped.")
    assert effect_sentence("X", (0.0, None), 32, "it").endswith("does not show that it helped.")
