"""The held-out probe (eval.probe_tasks): a fixed subset of the held-out tasks evaluated between the
full evaluations, so the training reward has an independent curve at every step and the divergence
alarm can act while training."""

from __future__ import annotations

import json
import math

import pytest
from conftest import FAST_RUN

from keelrl.alarms import AlarmMonitor
from keelrl.config import TINY_RUN, MonitorConfig, load_config
from keelrl.errors import ConfigError
from keelrl.train.evaluation import probe_figures
from keelrl.train.trainer import Trainer


def test_probe_figures_against_hand_worked_numbers():
    outcomes = {"a": True, "b": False, "c": True, "d": False}
    row = probe_figures(outcomes, ["a", "b", "c", "gone"], start={"a": False, "b": False, "c": True})
    # success over a, b, c (a task the evaluation did not run is left out): 2/3; the sample variance
    # of (1, 0, 1) is 1/3, so the standard error is sqrt(1/3 / 3) = 1/3.
    assert row["probe/tasks"] == 3
    assert row["probe/success"] == pytest.approx(2 / 3) and row["probe/success_se"] == pytest.approx(1 / 3)
    # paired change since the start: differences (1, 0, 0), mean 1/3, variance 1/3, se 1/3
    assert row["probe/lift"] == pytest.approx(1 / 3) and row["probe/lift_se"] == pytest.approx(1 / 3)
    alone = probe_figures(outcomes, ["a"])
    assert alone["probe/success"] == 1.0 and alone["probe/success_se"] is None and "probe/lift" not in alone


@pytest.mark.parametrize("override,field", [("eval.probe_tasks=-1", "probe_tasks"), ("eval.probe_tasks=true", "probe_tasks"),
                                            ("eval.probe_every=0", "probe_every")])
def test_a_bad_probe_setting_names_its_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert field in str(info.value)


def rising_reward_rows(steps=10, probe=0.2, eval_every=8):
    """Training reward 0.1 x step; the probe flat at `probe` every step; the full evaluation
    (also flat) at step 0 and every `eval_every` steps."""
    rows = [{"eval/success": 0.2, "probe/success": probe}]
    for step in range(1, steps + 1):
        row = {"train/reward": 0.1 * step, "probe/success": probe}
        if step % eval_every == 0:
            row["eval/success"] = 0.2
        rows.append(row)
    return rows


def divergence_step(rows, **cfg):
    monitor = AlarmMonitor(MonitorConfig(**cfg))
    for step, row in enumerate(rows):
        events = [event for event in monitor.update(step, row) if event.name == "divergence"]
        if events:
            return step, events[0]
    return None, None


def test_the_divergence_alarm_reads_the_probe_across_a_window_and_acts_before_the_next_evaluation():
    rows = rising_reward_rows()
    # auto reads the probe. Steps 1-3 compare with step 0, whose reward is the first RL step's
    # (0.1: the pre-RL policy sampled it): step 2's window (steps 1-2, 0.15) gains 0.05; step 3's
    # (steps 1-3, 0.2) gains 0.1 >= 0.1 while the probe stays flat.
    step, event = divergence_step(rows)
    assert step == 3
    assert event.values["since_step"] == 0.0
    assert event.values["train_reward_then"] == pytest.approx(0.1) and event.values["train_reward_now"] == pytest.approx(0.2)
    assert "probe/success" in event.message
    # the full evaluation alone fires only when it comes, at step 8
    assert divergence_step(rows, eval_metric="eval/success")[0] == 8
    # a probe that rises with the reward is no divergence
    for step, row in enumerate(rows):
        row["probe/success"] = 0.2 + 0.1 * step
    assert divergence_step(rows)[0] is None


def test_a_rise_split_over_windows_is_seen_against_an_older_evaluation():
    """The weak arm of keel lab reward-hacking, seed 0 on a Zen 5 EPYC (window 2, the probe at steps
    0, 2 and 4): against the latest evaluation a window back, step 2 gains (0.25 + 0.4375) / 2 -
    0.25 = 0.094 and step 4 gains (0.3125 + 0.4375) / 2 - 0.34375 = 0.031, each short of 0.1;
    against step 0, step 4 gains 0.375 - 0.25 = 0.125 while the probe fell 0.34375 -> 0.0625."""
    rewards = {1: 0.25, 2: 0.4375, 3: 0.3125, 4: 0.4375}
    probe = {0: 0.34375, 2: 0.15625, 4: 0.0625}
    rows = [{**({"train/reward": rewards[step]} if step in rewards else {}),
             **({"probe/success": probe[step]} if step in probe else {})} for step in range(5)]
    step, event = divergence_step(rows, window=2)
    assert step == 4 and event.values["since_step"] == 0.0
    assert event.values["train_reward_then"] == pytest.approx(0.25)
    assert event.values["train_reward_now"] == pytest.approx(0.375)
    assert (event.values["eval_then"], event.values["eval_now"]) == (0.34375, 0.0625)
    # the strong arm of the same run: its reward's gain over step 0 is (0.1875 + 0.375) / 2 - 0.1875 = 0.094
    rows = [{**({"train/reward": r} if r is not None else {}), **({"probe/success": p} if p is not None else {})}
            for r, p in [(None, 0.34375), (0.1875, None), (0.375, 0.28125), (0.1875, None), (0.375, 0.21875)]]
    assert divergence_step(rows, window=2)[0] is None


def test_auto_reads_the_full_evaluation_when_the_run_has_no_probe():
    rows = [{key: value for key, value in row.items() if key != "probe/success"} for row in rising_reward_rows()]
    step, event = divergence_step(rows)
    assert step == 8 and "eval/success" in event.message


def test_a_run_logs_the_probe_every_step_reads_it_from_full_evaluations_and_resumes_its_start(tiny_model_dir,
                                                                                            tmp_path):
    overrides = [*TINY_RUN, *FAST_RUN, f"model.path={tiny_model_dir}", "rollout.engine=sync", "train.steps=3",
                 "eval.every=2", "eval.tasks=4", "eval.probe_tasks=3", "output.checkpoint_every=1",
                 "train.minibatch_size=2"]
    run = tmp_path / "run"
    trainer = Trainer(load_config(overrides=[f"run_dir={run}", *overrides]))
    ids = [str(getattr(task, "id", task)) for task in trainer.probe_tasks()]
    assert ids == [str(getattr(task, "id", task)) for task in trainer.heldout_tasks[:3]]
    trainer.run(stop_after=1)
    Trainer(load_config(run / "config.yaml")).run(resume=True)  # the probe's start survives the resume

    rows = {row["step"]: row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    summary = json.loads((run / "summary.json").read_text())
    start, final = summary["heldout"]["warm_start"]["task_success"], summary["heldout"]["final"]["task_success"]

    def success(outcomes):
        return sum(outcomes[task] for task in ids) / len(ids)

    # step 0 and step 3 (the end): read from the full evaluation, at no cost
    assert rows[0]["probe/success"] == pytest.approx(success(start)) and rows[0]["probe/seconds"] == 0.0
    assert rows[3]["probe/success"] == pytest.approx(success(final)) and rows[3]["probe/seconds"] == 0.0
    assert rows[3]["probe/lift"] == pytest.approx(success(final) - success(start))
    # step 1 (before the resume) ran the probe's own episodes; step 2 had a full evaluation
    assert "eval/success" not in rows[1] and rows[1]["probe/tasks"] == 3 and rows[1]["probe/seconds"] > 0
    assert "eval/success" in rows[2] and rows[2]["probe/seconds"] == 0.0
    assert all(0.0 <= rows[step]["probe/success"] <= 1.0 and not math.isnan(rows[step]["probe/lift"])
               for step in range(4))
    assert summary["probe"]["start"] == {task: start[task] for task in ids}
    assert summary["probe"]["success_by_step"] == {str(step): rows[step]["probe/success"] for step in range(4)}
    assert summary["probe"]["seconds"] == pytest.approx(sum(rows[step]["probe/seconds"] for step in range(4)))


@pytest.mark.parametrize("lockstep", [True, False])
def test_evaluation_runs_in_lockstep_unless_told_not_to(tiny_model_dir, tmp_path, monkeypatch, lockstep):
    """eval.lockstep reaches the evaluator's episode limits, whatever rollout.lockstep says; in
    lockstep the evaluation never streams (its decoder's stream refuses work here), and two
    evaluations of the same weights give the same tokens."""
    from keelrl.rollout import agent_loop
    import keelrl.train.evaluation as evaluation

    def actor_that_cannot_stream(*args, **kwargs):
        act = agent_loop.model_actor(*args, **kwargs)
        assert act.stream is not None  # keelrl's decoder streams unless lockstep keeps it out

        def refuse(episodes):
            raise AssertionError("a lockstep evaluation streamed")

        act.stream.submit = refuse
        return act

    monkeypatch.setattr(evaluation, "model_actor", actor_that_cannot_stream)

    overrides = [*TINY_RUN, *FAST_RUN, f"model.path={tiny_model_dir}", "eval.tasks=6", "env.max_turns=3",
                 "rollout.decoder=keel",
                 f"eval.lockstep={str(lockstep).lower()}", f"rollout.lockstep={str(not lockstep).lower()}"]
    trainer = Trainer(load_config(overrides=[f"run_dir={tmp_path}", *overrides]))
    assert trainer.evaluator.rollout.lockstep is lockstep and trainer._limits().lockstep is not lockstep
    if not lockstep:
        return
    runs = []

    def recorded(*args, **kwargs):
        runs.append(agent_loop.run_episodes(*args, **kwargs))
        assert args[4].lockstep  # the limits the evaluation ran under
        return runs[-1]

    monkeypatch.setattr(evaluation, "run_episodes", recorded)
    trainer.evaluate()
    trainer.evaluate()
    assert len(runs) == 2 and sum(len(t.actions) for t in runs[0]) > len(runs[0])  # several turns
    assert [t.token_ids for t in runs[0]] == [t.token_ids for t in runs[1]]


def test_a_full_evaluation_runs_the_probes_tasks_as_the_probe_does(tiny_model_dir, tmp_path, monkeypatch):
    """The evaluation runs the probe's tasks (the first eval.probe_tasks) as a batch of their own,
    then the rest with the seeds they would have in one call: the probe read from a full
    evaluation is the probe run alone, token for token."""
    from keelrl.rollout import agent_loop
    import keelrl.train.evaluation as evaluation

    calls, tokens = [], []

    def recorded(make_env, tasks, *args, **kwargs):
        calls.append(([task.id for task in tasks], kwargs["first_index"], kwargs["seed"]))
        trajectories = agent_loop.run_episodes(make_env, tasks, *args, **kwargs)
        tokens.append([t.token_ids for t in trajectories])
        return trajectories

    monkeypatch.setattr(evaluation, "run_episodes", recorded)
    overrides = [*TINY_RUN, *FAST_RUN, f"model.path={tiny_model_dir}", "eval.tasks=6", "eval.probe_tasks=2",
                 "env.max_turns=3"]
    trainer = Trainer(load_config(overrides=[f"run_dir={tmp_path}", *overrides]))
    ids = [task.id for task in trainer.heldout_tasks[:6]]
    trainer.evaluate()
    full = trainer.last_eval_report
    assert calls == [(ids[:2], 0, trainer.cfg.seed + 7919), (ids[2:], 2, trainer.cfg.seed + 7919)]
    calls.clear()
    _, alone = trainer.evaluator.run(trainer.probe_tasks())
    assert calls == [(ids[:2], 0, trainer.cfg.seed + 7919)]
    assert {task: full["task_success"][task] for task in ids[:2]} == alone["task_success"]
    assert tokens[0] == tokens[2]  # the probe's episodes in the full evaluation and alone
    calls.clear()
    trainer.evaluate(trainer.heldout_tasks[:6])  # tasks given: one batch
    assert calls == [(ids, 0, trainer.cfg.seed + 7919)]


def test_a_run_given_its_start_evaluation_takes_it_as_step_0_without_evaluating(tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    """Trainer.start_evaluation (a lab's arms from one student, `train_variants`' evaluate_start_once): a
    second run from the same weights logs the first's evaluation before RL, and the probe's start
    read from it, at step 0, and evaluates only at its end; a run that warm-starts refuses it
    before any work."""
    from keelrl.labs.common import start_evaluation

    overrides = [*TINY_RUN, *FAST_RUN, f"model.path={tiny_model_dir}", "rollout.engine=sync", "train.steps=1",
                 "eval.every=1", "eval.tasks=4", "eval.probe_tasks=3", "warm_start.demos=0",
                 "train.minibatch_size=2"]

    def read(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    first, second = tmp_path / "first", tmp_path / "second"
    Trainer(load_config(overrides=[f"run_dir={first}", *overrides])).run()
    given = start_evaluation(first, read(first))
    assert given is not None and given[0]["eval/tasks"] == 4 and len(given[1]["task_success"]) == 4

    evaluated = []
    real = Trainer.evaluate
    monkeypatch.setattr(Trainer, "evaluate",
                        lambda self, tasks=None: evaluated.append(self.policy_version) or real(self, tasks))
    trainer = Trainer(load_config(overrides=[f"run_dir={second}", *overrides]))
    trainer.start_evaluation = given
    trainer.run()
    assert evaluated == [1]  # the end's evaluation alone

    def start_row(run):
        return {key: value for key, value in read(run)[0].items() if key.startswith(("eval/", "probe/"))}

    assert read(second)[0]["step"] == 0 and start_row(second) == start_row(first)
    assert start_row(second)["probe/tasks"] == 3 and start_row(second)["probe/seconds"] == 0.0
    summaries = [json.loads((run / "summary.json").read_text()) for run in (first, second)]
    assert summaries[1]["heldout"]["warm_start"] == summaries[0]["heldout"]["warm_start"]
    assert summaries[1]["probe"]["start"] == summaries[0]["probe"]["start"]

    warm = Trainer(load_config(overrides=[f"run_dir={tmp_path / 'warm'}", *overrides, "warm_start.demos=4"]))
    warm.start_evaluation = given
    with pytest.raises(ValueError, match="warm_start.demos=0"):
        warm.run()
    assert not (tmp_path / "warm" / "metrics.jsonl").exists()
