"""Held-out reports: means and standard errors against a float64 reference, per kind, paired lift."""

from __future__ import annotations

import math

import numpy as np
import pytest

from keelrl.rollout.trajectory import Trajectory
from keelrl.train.evaluation import heldout_report, mean_and_se, paired_difference


def _trajectory(task: str, success: bool, partial: float) -> Trajectory:
    trajectory = Trajectory(task_id=task, group_id=0)
    trajectory.success, trajectory.partial = success, partial
    return trajectory


@pytest.mark.parametrize("seed", range(4))
def test_mean_and_se_match_numpy_float64(seed):
    values = np.random.default_rng(seed).random(37)
    mean, se = mean_and_se(list(values))
    assert mean == pytest.approx(values.mean(), rel=1e-12)
    assert se == pytest.approx(values.std(ddof=1) / math.sqrt(len(values)), rel=1e-12)


def test_success_se_is_the_binomial_one_by_hand():
    # 3 successes of 10: p = 0.3, unbiased variance 10/9 * 0.21 = 0.2333..., se = sqrt(0.02333) = 0.1528
    mean, se = mean_and_se([1.0] * 3 + [0.0] * 7)
    assert mean == pytest.approx(0.3) and se == pytest.approx(0.152753, abs=1e-6)
    assert math.isnan(mean_and_se([1.0])[1]) and math.isnan(mean_and_se([])[0])


def test_report_by_kind_and_paired_lift():
    rows = [_trajectory("a1", True, 1.0), _trajectory("a2", False, 0.5), _trajectory("b1", False, 0.25),
            _trajectory("b2", False, 0.0)]
    report = heldout_report(rows, ["a", "a", "b", "b"])
    assert report["success"] == pytest.approx(0.25) and report["partial"] == pytest.approx(0.4375)
    assert report["by_kind"]["a"]["success"] == pytest.approx(0.5) and report["by_kind"]["b"]["success"] == 0
    assert report["by_kind"]["b"]["partial"] == pytest.approx(0.125) and report["by_kind"]["a"]["tasks"] == 2
    after = {"a1": True, "a2": True, "b1": True, "b2": False}
    lift, lift_se = paired_difference(report["task_success"], after)
    # differences 0, 1, 1, 0: mean 0.5, sample sd sqrt(1/3), se sqrt(1/3)/2
    assert lift == pytest.approx(0.5) and lift_se == pytest.approx(math.sqrt(1 / 3) / 2)
    with pytest.raises(ValueError, match="2 kinds for 4 trajectories"):
        heldout_report(rows, ["a", "b"])


def test_an_undefined_error_is_null_so_the_report_is_valid_json():
    import json

    report = heldout_report([_trajectory("a", True, 1.0), _trajectory("b", False, 0.5)], ["x", "y"])
    assert report["by_kind"]["x"]["success_se"] is None and report["success_se"] is not None
    json.dumps(report, allow_nan=False)  # raises on NaN


def _episode(turns: list[dict], success: bool, termination: str = "submitted", errors: int = 0) -> Trajectory:
    trajectory = Trajectory(task_id="t", group_id=0)
    trajectory.turn_info, trajectory.success, trajectory.termination = turns, success, termination
    trajectory.actions = ["a"] * len(turns)
    trajectory.action_errors = errors
    return trajectory


EDIT, SUBMIT = {"tool": "replace"}, {"tool": "submit"}
PASS, FAIL, BROKEN = ({"tool": "test", "tests_passed": 4, "tests_failed": 0},
                      {"tool": "test", "tests_passed": 3, "tests_failed": 1}, {"tool": "test", "tests_error": True})


def test_agent_report_by_hand():
    from keelrl.train.evaluation import agent_metrics, agent_report, first_test_failed

    rows = [
        _episode([EDIT, FAIL, EDIT, PASS, SUBMIT], True),          # recovered
        _episode([EDIT, BROKEN, EDIT, FAIL, SUBMIT], False),       # first test after the edit: broken -> failed
        _episode([EDIT, PASS, SUBMIT], True),                      # first edit passed
        _episode([EDIT, SUBMIT], False),                           # never tested: unknown
        _episode([{"error": "bad"}, FAIL, EDIT, FAIL], False, "max_turns", errors=1),  # a test before any edit
        _episode([{"tool": "edit", "visible_passed": 2, "visible_total": 4}, EDIT, SUBMIT], True),  # shaping's counts
        _episode([EDIT], False, "context_limit"),
    ]
    assert [first_test_failed(t, ("replace", "edit"), "test") for t in rows] == [True, True, False, None, True, True, None]
    report = agent_report(rows, ("replace", "edit"), "test")
    assert report["episodes"] == 7
    assert report["turns_mean"] == pytest.approx((5 + 5 + 3 + 2 + 4 + 3 + 1) / 7)
    assert report["tested_frac"] == pytest.approx(4 / 7)  # rows 0, 1, 2 and 4
    assert report["first_edit_failed"] == 4 and report["recovery_rate"] == pytest.approx(2 / 4)  # rows 0 and 5
    assert report["success_by_turns"] == {"1": {"episodes": 1, "success": 0.0}, "2": {"episodes": 1, "success": 0.0},
                                          "3": {"episodes": 2, "success": 1.0}, "4": {"episodes": 1, "success": 0.0},
                                          "5": {"episodes": 2, "success": 0.5}}
    assert report["action_error_frac"] == pytest.approx(1 / 23) and report["context_limit_frac"] == pytest.approx(1 / 7)
    metrics = agent_metrics(report, "eval/")
    assert metrics["eval/recovery_rate"] == pytest.approx(0.5) and metrics["eval/success_turns_3"] == 1.0


def test_agent_report_without_a_failed_first_edit_has_no_recovery_rate():
    from keelrl.train.evaluation import agent_report

    report = agent_report([_episode([EDIT, PASS, SUBMIT], True)], ("replace", "edit"), "test")
    assert math.isnan(report["recovery_rate"]) and report["first_edit_failed"] == 0


def test_report_and_lift_by_family_by_hand():
    from keelrl.train.outputs import lift_summary

    ids = ["t1", "t2", "t3", "r1", "r2"]
    before = heldout_report([_trajectory(i, s, 0.0) for i, s in zip(ids, [True, False, False, False, False])],
                            ["k"] * 5, ["templated"] * 3 + ["real"] * 2)
    after = heldout_report([_trajectory(i, s, 0.0) for i, s in zip(ids, [True, True, False, True, True])],
                           ["k"] * 5, ["templated"] * 3 + ["real"] * 2)
    assert before["by_family"]["templated"]["success"] == pytest.approx(1 / 3)
    assert before["by_family"]["real"]["tasks"] == 2 and before["by_family"]["real"]["success"] == 0
    assert after["by_family"]["real"]["task_success"] == {"r1": True, "r2": True}
    summary = lift_summary({"warm_start": before, "final": after})
    # templated: differences 0, 1, 0 (mean 1/3, sd sqrt(1/3), se 1/3); real: 1, 1 (mean 1, se 0); all: 3/5
    assert summary["rl_lift"]["success"] == pytest.approx(0.6)
    assert summary["rl_lift"]["by_family"]["templated"]["success"] == pytest.approx(1 / 3)
    assert summary["rl_lift"]["by_family"]["templated"]["success_se"] == pytest.approx(1 / 3)
    assert summary["rl_lift"]["by_family"]["real"] == {"success": 1.0, "success_se": 0.0}
    assert summary["heldout_final"]["by_family"]["real"]["success"] == 1.0
    assert "task_success" not in summary["heldout_final"]["by_family"]["real"]
    one = heldout_report([_trajectory("t1", True, 0.0)] * 2, ["k"] * 2, ["templated"] * 2)
    assert "by_family" not in lift_summary({"warm_start": one, "final": one})["rl_lift"]
    with pytest.raises(ValueError, match="1 families for 5 trajectories"):
        heldout_report([_trajectory(i, True, 0.0) for i in ids], ["k"] * 5, ["real"])
