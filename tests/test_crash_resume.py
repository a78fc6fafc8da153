"""Crash safety: atomic writes, versioned checkpoints behind one pointer, and a real `keel train`
killed with SIGKILL at random moments (some inside checkpoint writes) that still ends, after
resumes, with exactly the metrics of an uninterrupted run."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST_RUN, keel_cli

from keelrl.config import TINY_RUN, LogConfig
from keelrl.metrics import MetricsLogger
from keelrl.runs import (CheckpointError, atomic_write_text, clear_outputs, drop_steps_after, latest_checkpoint,
                         save_checkpoint, truncate_jsonl)

KEEL = str(Path(sys.executable).parent / "keel")
RUN = [*TINY_RUN, *FAST_RUN, "rollout.engine=sync", "train.steps=6", "output.checkpoint_every=1", "eval.every=3",
       "eval.tasks=3", "train.minibatch_size=2", "output.sample_trajectories=1"]


# ------------------------------------------------------------------ the pieces
def test_atomic_write_leaves_old_or_new_and_no_temporary(tmp_path):
    target = tmp_path / "summary.json"
    atomic_write_text(target, "old")
    atomic_write_text(target, "new")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_checkpoint_is_pointed_at_only_once_whole_and_the_last_good_one_survives_a_failed_write(tmp_path):
    save_checkpoint(tmp_path, 1, lambda folder: (folder / "state.pt").write_text("one"))
    assert latest_checkpoint(tmp_path).name == "step-000001"

    def dies_halfway(folder):
        (folder / "state.pt").write_text("two, half")
        raise KeyboardInterrupt  # as a kill would, after part of the files

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, dies_halfway)
    good = latest_checkpoint(tmp_path)
    assert good.name == "step-000001" and (good / "state.pt").read_text() == "one"
    save_checkpoint(tmp_path, 2, lambda folder: (folder / "state.pt").write_text("two"))
    assert latest_checkpoint(tmp_path).name == "step-000002"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000002"]  # old one and debris gone


def test_a_bad_pointer_is_a_clear_error(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoint.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        latest_checkpoint(tmp_path)
    (tmp_path / "checkpoint.json").write_text(json.dumps({"step": 3, "path": "checkpoints/step-000003"}))
    with pytest.raises(CheckpointError, match="step-000003.*does not exist"):
        latest_checkpoint(tmp_path)


def test_a_torn_last_metrics_line_is_dropped_and_a_corrupt_middle_line_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "train/re')
    truncate_jsonl(path, 2)
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n{"step": 2}\n'
    truncate_jsonl(path, 1)
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
    path.write_text('{"step": 0}\ngarbage\n{"step": 1}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        truncate_jsonl(path, 1)
    path.write_text('{"step": 0}\n{"step": 1}\n')
    logger = MetricsLogger(tmp_path, LogConfig(sinks=["jsonl"]), resume_after=0)
    logger.log(1, {"x": 1.0})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1]


def _step_files(run_dir: Path) -> list[str]:
    """Every file in a run's per-step folders, a write's leftover temporary file too."""
    return sorted(str(p.relative_to(run_dir)) for folder in ("episodes", "samples", "alarms")
                  for p in (run_dir / folder).iterdir() if p.is_file()) if run_dir.exists() else []


def test_a_resume_drops_the_killed_runs_later_step_files_and_a_fresh_start_all_of_an_old_runs(tmp_path):
    files = ["episodes/step_0001.jsonl", "episodes/step_0003.jsonl", "samples/step_0002.txt", "samples/step_0003.txt",
             "alarms/collapse_step_0002.txt", "alarms/reward_divergence_step_0004.txt", "alarms/notes.txt",
             "episodes/.step_0002.jsonl.tmp-123", "metrics.jsonl", "alarms.jsonl", "summary.json", "plots/reward.png",
             "config.yaml", "precision.json"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    gone = drop_steps_after(tmp_path, 2)  # resumed at the step-2 checkpoint; a kill had cut a write short
    assert sorted(str(p.relative_to(tmp_path)) for p in gone) == [
        "alarms/reward_divergence_step_0004.txt", "episodes/.step_0002.jsonl.tmp-123", "episodes/step_0003.jsonl",
        "samples/step_0003.txt"]
    assert _step_files(tmp_path) == ["alarms/collapse_step_0002.txt", "alarms/notes.txt", "episodes/step_0001.jsonl",
                                     "samples/step_0002.txt"]
    clear_outputs(tmp_path)  # a fresh start: nothing of the old run's outputs but what is not its own
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["alarms/notes.txt", "config.yaml", "precision.json"]


# ------------------------------------------------------------------ kill and resume
def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(row: dict) -> dict:
    return {key: value for key, value in row.items()
            if not key.startswith(("time/", "memory/", "engine/")) and isinstance(value, (int, float))}


def _start(run_dir: Path, model_dir: Path) -> subprocess.Popen:
    if (run_dir / "checkpoint.json").exists():
        command = [KEEL, "train", "--resume", str(run_dir)]
    else:
        command = [KEEL, "train", *RUN, f"model.path={model_dir}", f"run_dir={run_dir}"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _in_checkpoint_write(run_dir: Path) -> bool:
    folder = run_dir / "checkpoints"
    try:
        return any(p.name.startswith(".step-") for p in folder.iterdir())
    except FileNotFoundError:
        return False


def _kill_at(process: subprocess.Popen, run_dir: Path, mode: str, delay: float) -> str:
    """SIGKILL `process` during a checkpoint write (mode "write") or `delay` seconds after it
    started ("random"); -> when it died: "write", "random", or "finished" (it ended first)."""
    started = time.monotonic()
    while process.poll() is None:
        if mode == "write" and _in_checkpoint_write(run_dir):
            process.send_signal(signal.SIGKILL)
            process.wait()
            return "write"
        if mode == "random" and time.monotonic() - started >= delay:
            process.send_signal(signal.SIGKILL)
            process.wait()
            return "random"
        if time.monotonic() - started > 600:
            process.kill()
            raise AssertionError("keel train ran for 10 minutes without being killed or finishing")
        time.sleep(0.001 if mode == "write" else 0.01)
    return "finished"


@pytest.mark.parametrize("kills", [3, pytest.param(12, marks=pytest.mark.slow)])
def test_a_run_killed_at_random_moments_ends_like_an_uninterrupted_one(tiny_model_dir, tmp_path, kills):
    whole = tmp_path / "whole"  # uninterrupted, in this process (the killed run's lives are processes)
    done = keel_cli("train", *RUN, f"model.path={tiny_model_dir}", f"run_dir={whole}")
    assert done.returncode == 0, done.stderr[-3000:]

    run_dir = tmp_path / "killed"
    rng = random.Random(kills)
    # A resume with nothing to resume is refused, clearly, and touches nothing.
    refused = keel_cli("train", "--resume", str(run_dir))
    assert refused.returncode == 2 and "nothing to resume" in refused.stderr
    killed = {"write": 0, "random": 0}
    lives = 0
    while sum(killed.values()) < kills:
        lives += 1
        assert lives <= 6 * kills, f"{killed} after {lives} lives: the run keeps finishing before its kill"
        mode = "write" if sum(killed.values()) % 2 == 0 else "random"
        process = _start(run_dir, tiny_model_dir)
        outcome = _kill_at(process, run_dir, mode, delay=rng.uniform(2.0, 12.0))
        if outcome == "finished":
            assert process.returncode == 0, process.stderr.read()[-3000:]
            shutil.rmtree(run_dir)  # it finished before its kill: the remaining kills go to a new run
            continue
        killed[outcome] += 1
        if not (run_dir / "checkpoint.json").exists():  # killed before its step-0 checkpoint: the
            resumed = keel_cli("train", "--resume", str(run_dir))  # refused: the next life starts over
            assert resumed.returncode == 2 and "nothing to resume" in resumed.stderr, resumed.stderr[-2000:]
        else:
            latest_checkpoint(run_dir)  # the pointer always names a whole checkpoint
    for planted in ("samples/step_0099.txt", "alarms/collapse_step_0099.txt"):  # as a killed life's later
        (run_dir / planted).parent.mkdir(parents=True, exist_ok=True)  # steps, which this resume
        (run_dir / planted).write_text("an earlier life's")  # does not write again
    final = _start(run_dir, tiny_model_dir)  # resume, or start over when the last kill came before step 0
    _, errors = final.communicate(timeout=900)
    assert final.returncode == 0, errors[-3000:]
    assert killed["write"] >= 1 and killed["random"] >= 1, killed

    expected, got = _metrics(whole), _metrics(run_dir)
    assert [row["step"] for row in got] == list(range(7))  # no step missing or repeated
    for want, have in zip(expected, got):
        want, have = _comparable(want), _comparable(have)
        assert want.keys() == have.keys()
        for key, value in want.items():
            assert have[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (want["step"], key)
    assert _step_files(run_dir) == _step_files(whole)  # no later step's file of a killed life is left
    summary, reference = (json.loads((folder / "summary.json").read_text()) for folder in (run_dir, whole))
    assert summary["steps"] == 6
    for key in ("success", "partial"):
        assert summary["heldout_final"][key] == pytest.approx(reference["heldout_final"][key], abs=1e-9)
