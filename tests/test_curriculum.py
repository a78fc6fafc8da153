"""The success-rate curriculum: weights never decrease (hypothesis), levels rise with success,
the band admits "sometimes solved" tasks at full weight, and every task ends at weight 1."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keelrl.train.curriculum import Curriculum, CurriculumConfig

events = st.lists(st.one_of(st.tuples(st.just("record"), st.integers(0, 1000), st.booleans()),
                            st.tuples(st.just("update"), st.just(0), st.just(False)),
                            st.tuples(st.just("sample"), st.integers(1, 6), st.just(False))), max_size=120)


@settings(max_examples=200, deadline=None)
@given(levels=st.lists(st.integers(0, 3), min_size=1, max_size=12), history=events,
       band=st.tuples(st.floats(0, 1), st.floats(0, 1)).map(sorted),
       probe=st.floats(0.01, 1.0), advance=st.floats(0, 1), attempts=st.integers(1, 4))
def test_weights_never_decrease_and_all_end_at_one(levels, history, band, probe, advance, attempts):
    curriculum = Curriculum(levels, CurriculumConfig(band=tuple(band), probe_weight=probe, advance_at=advance,
                                                     min_attempts=attempts))
    previous, level = list(curriculum.weights), curriculum.level
    assert any(w > 0 for w in previous)  # the easiest level is admitted from the start
    for kind, value, success in history:
        if kind == "record":
            curriculum.record(value % len(levels), success)
        elif kind == "update":
            curriculum.update()
        else:
            chosen = curriculum.sample(value)
            assert len(chosen) == len(set(chosen)) <= value
            assert all(curriculum.weights[task] > 0 for task in chosen)
        assert all(now >= before for now, before in zip(curriculum.weights, previous))
        assert curriculum.level >= level and all(0 <= w <= 1 for w in curriculum.weights)
        assert all(w == 0 for w, lv in zip(curriculum.weights, levels) if lv > curriculum.level)
        previous, level = list(curriculum.weights), curriculum.level
    curriculum.finish()
    assert curriculum.weights == [1.0] * len(levels)


def test_levels_rise_with_success_and_the_band_gets_full_weight():
    cfg = CurriculumConfig(band=(0.2, 0.8), probe_weight=0.25, advance_at=0.6, min_attempts=2)
    curriculum = Curriculum([0, 0, 1, 1, 2], cfg)
    assert curriculum.weights == [0.25, 0.25, 0, 0, 0] and curriculum.level == 0
    for success in (True, False):  # task 0 solved half the time: in the band
        curriculum.record(0, success)
    for _ in range(2):  # task 1 never solved: out of the band, stays a probe
        curriculum.record(1, False)
    curriculum.update()
    assert curriculum.weights[:2] == [1.0, 0.25] and curriculum.level == 0  # level mean 0.25 < 0.6
    for _ in range(6):
        curriculum.record(1, True)  # task 1 now 6/8 = 0.75: in band; level mean (0.5 + 0.75) / 2 >= 0.6
    curriculum.update()
    assert curriculum.level == 1 and curriculum.weights == [1.0, 1.0, 0.25, 0.25, 0]
    for _ in range(4):  # task 0 becomes always solved: above the band, but its weight stays 1
        curriculum.record(0, True)
    curriculum.update()
    assert curriculum.weights[0] == 1.0
    metrics = curriculum.metrics()
    assert metrics["curriculum/level"] == 1 and metrics["curriculum/admitted_frac"] == pytest.approx(0.8)
    assert metrics["curriculum/band_occupancy"] == pytest.approx(0.5)  # task 1 in (6/8), task 0 out (5/6)


def test_sampling_follows_the_weights():
    curriculum = Curriculum([0, 0, 0], CurriculumConfig(min_attempts=1), seed=3)
    curriculum.weights = [1.0, 0.25, 0.0]
    counts = [0, 0, 0]
    for _ in range(4000):
        counts[curriculum.sample(1)[0]] += 1
    assert counts[2] == 0 and counts[0] / counts[1] == pytest.approx(4.0, rel=0.15)
    assert sorted(curriculum.sample(5)) == [0, 1]  # only admitted tasks, each once


def test_bad_curriculum_settings_are_named():
    with pytest.raises(ValueError, match="band"):
        CurriculumConfig(band=(0.9, 0.1))
    with pytest.raises(ValueError, match="probe_weight"):
        CurriculumConfig(probe_weight=0.0)
    with pytest.raises(ValueError, match="at least one task"):
        Curriculum([])
