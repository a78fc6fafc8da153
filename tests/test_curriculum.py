"""The success-rate curriculum: weights never decrease (hypothesis), levels rise with success,
the band admits "sometimes solved" tasks at full weight, and every task ends at weight 1."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keelrl.config import CurriculumSettings
from keelrl.errors import ConfigError
from keelrl.train.curriculum import Curriculum

events = st.lists(st.one_of(st.tuples(st.just("record"), st.integers(0, 1000), st.booleans()),
                            st.tuples(st.just("update"), st.just(0), st.just(False)),
                            st.tuples(st.just("sample"), st.integers(1, 6), st.just(False))), max_size=120)


@settings(max_examples=200, deadline=None)
@given(levels=st.lists(st.integers(0, 3), min_size=1, max_size=12), history=events,
       band=st.tuples(st.floats(0, 1), st.floats(0, 1)).map(sorted),
       probe=st.floats(0.01, 1.0), advance=st.floats(0, 1), attempts=st.integers(1, 4))
def test_weights_never_decrease_and_all_end_at_one(levels, history, band, probe, advance, attempts):
    curriculum = Curriculum(levels, CurriculumSettings(band_low=band[0], band_high=band[1], probe_weight=probe,
                                                       advance_at=advance, min_attempts=attempts))
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
    cfg = CurriculumSettings(band_low=0.2, band_high=0.8, probe_weight=0.25, advance_at=0.6, min_attempts=2)
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


def test_mastering_the_last_level_finishes_with_every_weight_one():
    cfg = CurriculumSettings(band_low=0.2, band_high=0.8, probe_weight=0.25, advance_at=0.6, min_attempts=2)
    curriculum = Curriculum([0, 0, 1], cfg)
    for task in (0, 1):
        curriculum.record(task, True)
        curriculum.record(task, True)
    curriculum.update()  # level 0 mastered (mean 1.0): level 1 admitted, not yet measured
    assert curriculum.level == 1 and curriculum.weights == [0.25, 0.25, 0.25]
    curriculum.record(2, True)
    curriculum.record(2, False)  # level 1 at 0.5 < 0.6: not mastered, in the band
    curriculum.update()
    assert curriculum.weights == [0.25, 0.25, 1.0]
    curriculum.record(2, True)  # 2/3 >= 0.6: the last level mastered
    curriculum.update()
    assert curriculum.weights == [1.0, 1.0, 1.0] and curriculum.level == 1


def test_sampling_follows_the_weights():
    curriculum = Curriculum([0, 0, 0], CurriculumSettings(min_attempts=1), seed=3)
    curriculum.weights = [1.0, 0.25, 0.0]
    counts = [0, 0, 0]
    for _ in range(4000):
        counts[curriculum.sample(1)[0]] += 1
    assert counts[2] == 0 and counts[0] / counts[1] == pytest.approx(4.0, rel=0.15)
    assert sorted(curriculum.sample(5)) == [0, 1]  # only admitted tasks, each once


def test_bad_curriculum_settings_are_named():
    with pytest.raises(ConfigError, match="band") as info:
        CurriculumSettings(band_low=0.9, band_high=0.1)
    assert info.value.field == "band_low"
    with pytest.raises(ConfigError, match="probe_weight"):
        CurriculumSettings(probe_weight=0.0)
    with pytest.raises(ValueError, match="at least one task"):
        Curriculum([])


def test_a_run_draws_only_admitted_tasks_logs_the_curriculum_and_resumes_it(tiny_model_dir, tmp_path):
    import json

    from keelrl.config import TINY_RUN, load_config
    from keelrl.train.trainer import Trainer, load_task_splits

    base = [*TINY_RUN, f"model.path={tiny_model_dir}", "rollout.engine=sync", "eval.every=3",
            "eval.tasks=2", "warm_start.demos=4", "rollout.tasks_per_step=3", "rollout.group_size=2",
            "rollout.max_new_tokens=16", "env.max_turns=2", "train.steps=3", "output.checkpoint_every=1",
            "curriculum.enabled=true", "curriculum.min_attempts=1"]
    train_tasks, _ = load_task_splits(load_config(overrides=base))
    kinds = sorted({task.kind for task in train_tasks})
    easy = kinds[0]
    base.append("curriculum.levels=" + ",".join(f"{kind}:1" for kind in kinds[1:]))
    full = tmp_path / "full"
    trainer = Trainer(load_config(overrides=[*base, f"run_dir={full}"]))
    drawn = []
    original = trainer.requests_for
    trainer.requests_for = lambda step: drawn.append(original(step)) or drawn[-1]  # type: ignore[method-assign]
    trainer.run()
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()][1:]
    first_step_kinds = {request.task.kind for request in drawn[0]}
    assert first_step_kinds == {easy}  # level 1 is not admitted before level 0 is mastered
    assert all(0 <= row["curriculum/band_occupancy"] <= 1 and row["curriculum/level"] in (0, 1) for row in rows)
    assert [row["curriculum/attempts"] for row in rows] == [6, 12, 18]  # 3 tasks x 2 attempts a step
    assert rows[0]["curriculum/admitted_frac"] == pytest.approx(sum(t.kind == easy for t in train_tasks)
                                                               / len(train_tasks))
    # Killed after step 1 and resumed: the curriculum's counts come back, so steps 2-3 draw the same tasks.
    part = tmp_path / "part"
    Trainer(load_config(overrides=[*base, f"run_dir={part}"])).run(stop_after=1)
    Trainer(load_config(part / "config.yaml")).run(resume=True)
    resumed = [json.loads(line) for line in (part / "metrics.jsonl").read_text().splitlines()][1:]
    for want, got in zip(rows, resumed):
        for key in ("curriculum/level", "curriculum/admitted_frac", "curriculum/weight_entropy", "curriculum/attempts",
                    "train/reward"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), key
