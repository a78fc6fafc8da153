"""Each alarm fires on a constructed metric series, once, and stays silent on a healthy run."""

from __future__ import annotations

import json

import pytest

from keelrl.components import check
from keelrl.alarms import AlarmMonitor, distinct_patches
from keelrl.envs.coding import PATCH_TOOLS
from keelrl.config import TINY_RUN, MonitorConfig, load_config
from keelrl.errors import ConfigError
from keelrl.rollout.trajectory import Trajectory
from keelrl.runs import latest_checkpoint


def feed(rows, **cfg):
    """Run rows (step -> metrics) through a monitor; returns {alarm name: firing step}."""
    monitor = AlarmMonitor(MonitorConfig(**cfg))
    fired = {}
    for step, row in enumerate(rows):
        for event in monitor.update(step, row):
            assert event.name not in fired, "an alarm fires once"
            assert event.message and event.values
            fired[event.name] = step
    return fired


def healthy(steps=12):
    """Reward and eval rise together, entropy eases down slowly, groups mixed, weights near 1."""
    rows = [{"eval/success": 0.1}]
    for step in range(1, steps + 1):
        row = {"train/reward": 0.1 + 0.04 * step, "policy/entropy": 1.0 - 0.02 * step,
               "train/zero_advantage_frac": 0.3, "policy/is_weight_max": 1.3, "train/distinct_patches": 3.0}
        if step % 4 == 0:
            row["eval/success"] = 0.1 + 0.04 * step
        rows.append(row)
    return rows


def test_a_healthy_run_raises_no_alarm():
    assert feed(healthy()) == {}


def test_divergence_fires_when_reward_rises_and_eval_is_flat():
    rows = healthy()
    for step, row in enumerate(rows):
        if "eval/success" in row:
            row["eval/success"] = 0.1  # eval flat while the training reward climbs
    # At step 4 the reward windows (steps 1-3 vs 2-4) gain only 0.04; by step 8, 0.16.
    assert feed(rows) == {"divergence": 8}
    falling = healthy()
    for step, row in enumerate(falling):
        if "eval/success" in row:
            row["eval/success"] = 0.1 - 0.005 * step
    assert feed(falling)["divergence"] == 8


def test_divergence_stays_silent_when_reward_is_flat():
    rows = healthy()
    for row in rows[1:]:
        row["train/reward"] = 0.4
        if "eval/success" in row:
            row["eval/success"] = 0.1
    assert "divergence" not in feed(rows)


def test_entropy_collapse_fires_on_floor_and_on_fast_fall():
    rows = healthy()
    rows[7]["policy/entropy"] = 0.01
    assert feed(rows) == {"entropy_collapse": 7}
    rows = healthy()
    for step in range(5, 13):
        rows[step]["policy/entropy"] = 0.9 * 0.7 ** (step - 4)  # well above the floor, falling fast
    # Step 6: 0.44 against 0.94 at step 3, a fall of more than half.
    assert feed(rows, entropy_floor=0.01)["entropy_collapse"] == 6


def test_zero_advantage_fires_after_window_consecutive_steps():
    rows = healthy()
    for step in (3, 4, 6, 7, 8):
        rows[step]["train/zero_advantage_frac"] = 0.95
    assert feed(rows, window=3) == {"zero_advantage": 8}  # 3-4 is only two steps in a row
    rows = healthy()  # with dynamic sampling, the before-filter fraction is what counts
    for step, row in enumerate(rows[1:], start=1):
        row["train/zero_advantage_frac"] = 0.0
        row["dynamic/zero_adv_frac_before"] = 0.95 if step >= 2 else 0.2
    assert feed(rows, window=3) == {"zero_advantage": 4}


@pytest.mark.parametrize("key", ["policy/is_weight_max", "rollout/arrival_is_weight_max",
                                 "policy/behaviour_weight_max"])
def test_importance_weight_fires_on_any_weight_metric(key):
    rows = healthy()
    rows[5][key] = 132.0  # the lecture's 1.05 ** 100
    assert feed(rows) == {"importance_weight": 5}


def test_patch_collapse_fires_when_groups_stop_exploring():
    rows = healthy()
    for step in range(6, 13):
        rows[step]["train/distinct_patches"] = 1.0
    assert feed(rows, window=3) == {"patch_collapse": 8}


def test_distinct_patches_counts_edit_sequences_per_group():
    def traj(*actions):
        t = Trajectory("t", 0)
        t.actions = list(actions)
        t.turn_info = [{"tool": a.removeprefix("<call>").split("<")[0].split()[0]} for a in actions]
        return t

    same = [traj("<call>read</call>", "<call>replace 2\nx\n</call>"), traj("<call>replace 2\nx\n</call>", "<call>test</call>")]
    different = [traj("<call>replace 2\nx\n</call>"), traj("<call>edit\na\n>>>\nb\n</call>"), traj("<call>submit</call>")]
    assert distinct_patches([same], PATCH_TOOLS) == 1.0
    assert distinct_patches([different], PATCH_TOOLS) == 3.0
    assert distinct_patches([same, different], PATCH_TOOLS) == 2.0
    rejected = traj("<call>replace 2\ny\n</call>")
    rejected.turn_info = [{"error": "line 2 is out of range"}]  # an edit the environment refused changes nothing
    assert distinct_patches([[same[0], rejected]], PATCH_TOOLS) == 2.0
    assert distinct_patches([[traj("<call>submit</call>"), rejected]], PATCH_TOOLS) == 1.0


def test_stop_on_names_are_checked():
    with pytest.raises(ConfigError, match="monitor.stop_on"):
        check(load_config(overrides=["monitor.stop_on=[entropy]"]))


def test_a_run_stops_on_its_alarm_and_writes_samples_around_it(tiny_model_dir, tmp_path_factory):
    from keelrl.train.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config(overrides=[*TINY_RUN, 
        f"run_dir={run_dir}", f"model.path={tiny_model_dir}", "rollout.engine=sync", "train.steps=4",
        "monitor.is_weight_max=1e-6", "monitor.stop_on=[importance_weight]", "eval.tasks=2",
        "warm_start.demos=4", "warm_start.epochs=1", "rollout.tasks_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=16", "env.max_turns=2", "train.minibatch_size=4"])
    summary = Trainer(cfg).run()
    assert summary["stopped_by_alarm"] == "importance_weight" and summary["steps"] == 1
    [event] = [json.loads(line) for line in (run_dir / "alarms.jsonl").read_text().splitlines()]
    assert event["alarm"] == "importance_weight" and event["step"] == 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["alarm/importance_weight"] == 1.0 and rows[-1]["step"] == 1
    sample = (run_dir / "alarms" / "importance_weight_step_0001.txt").read_text()
    assert "exceeds" in sample and "ACTION:" in sample
    assert latest_checkpoint(run_dir).name == "step-000001"  # the stopped run can be looked at and resumed


def test_distinct_answers_of_the_guessing_game_are_guess_sequences():
    def traj(*actions):
        t = Trajectory("t", 0)
        t.actions = list(actions)
        t.turn_info = [{"tool": "guess"} for _ in actions]
        return t

    group = [traj("<call>guess 8</call>", "<call>guess 4</call>"), traj("<call>guess 8</call>", "<call>guess 4</call> "),
             traj("<call>guess 8</call>", "<call>guess 12</call>"), traj("<call>guess 0</call>")]
    assert distinct_patches([group], ("guess",)) == 3.0
    assert distinct_patches([group], PATCH_TOOLS) == 1.0  # no edits: every coding patch is empty
