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
