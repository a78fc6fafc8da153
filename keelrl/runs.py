"""A run directory: its layout, and the crash-safe writes and reads of its files.

Every module that writes or reads a run (the trainer, the metrics logger and its sinks, the
viewer, the labs, examples) names its files through here:

    run_dir/
      config.yaml            the resolved config (atomic write)
      metrics.jsonl          one row per step (appended; truncated to a checkpoint on resume)
      alarms.jsonl           one line per alarm fired (appended; truncated likewise)
      alarms/NAME_step_NNNN.txt   trajectories sampled around an alarm
      samples/step_NNNN.txt  a few trajectories of each step, as text
      episodes/step_NNNN.jsonl    the viewer's episodes of a step (atomic write)
      summary.json           the run's summary (atomic write)
      plots/*.png            charts of metrics.jsonl
      reference/             the frozen reference model (renamed into place whole)
      checkpoint.json        the pointer to the last whole checkpoint (atomic write)
      checkpoints/step-NNNNNN/    a checkpoint (filled in a temporary folder, then renamed)

A run can be killed at any instant (SIGKILL, OOM killer, power loss). Everything a resume reads
is written so that the kill leaves either the old state or the new one, never a mixture:
- `atomic_write_text(path, text)`: the text goes to a temporary file in the same directory,
  is fsynced, renamed over `path` (one atomic rename) and the directory fsynced.
- `save_checkpoint(run_dir, step, write)`: `write(folder)` fills a fresh temporary folder
  under `checkpoints/`; every file and folder in it is fsynced, it is renamed to
  `checkpoints/step-NNNNNN`, and only then is the pointer `checkpoint.json` atomically
  replaced to name it. Older checkpoint folders are removed after that, so the last good
  checkpoint stays until the next one is whole.
- `latest_checkpoint(run_dir)`: the folder the pointer names; None when there is no pointer,
  `CheckpointError` when the pointer is unreadable or names a folder that is gone.
- `truncate_jsonl(path, step)`: a resumed run's logs keep the lines up to its checkpoint.
- `drop_steps_after(run_dir, step)`: a resumed run's per-step files after its checkpoint go.

What this does not guarantee: a disk that lies about fsync, or someone editing the folder by
hand. Files a resume does not read (samples/, plots/, TensorBoard events) are plain writes.
This module imports nothing of keelrl: every layer may use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
ALARMS = "alarms.jsonl"
ALARM_SAMPLES = "alarms"
SAMPLES = "samples"
EPISODES = "episodes"
SUMMARY = "summary.json"
PLOTS = "plots"
REFERENCE = "reference"
POINTER = "checkpoint.json"
CHECKPOINTS = "checkpoints"


class CheckpointError(RuntimeError):
    """A checkpoint that a resume needs is missing or unreadable."""


# ----------------------------------------------------------------- crash-safe writes
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (and `root` itself)."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(folder))


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace `path` with `text` in one rename: a kill leaves the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def replace_folder(run_dir: str | Path, name: str, write: Callable[[Path], Any]) -> Path:
    """run_dir/name replaced by what `write(folder)` puts in a temporary folder, made durable
    first: a kill leaves the old folder or the whole new one (the reference model)."""
    run_dir = Path(run_dir)
    folder, tmp = run_dir / name, run_dir / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    fsync_tree(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


# ----------------------------------------------------------------- JSONL logs
def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file ([] when it does not exist)."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def append_jsonl(path: str | Path, row: Mapping[str, Any]) -> None:
    with Path(path).open("a") as handle:
        handle.write(json.dumps(row) + "\n")


def last_step(path: str | Path) -> int | None:
    """The "step" of a JSONL log's last complete line (a torn last line is skipped); None if none."""
    path = Path(path)
    if not path.exists():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for line in reversed(lines[-2:]):
        try:
            return int(json.loads(line)["step"])
        except ValueError:
            continue
    return None


def truncate_jsonl(path: str | Path, step: int) -> None:
    """Keep the lines of a JSONL log whose "step" is at most `step`, replacing the file atomically.

    A kill during an append leaves a torn last line: it is dropped. A line that does not parse
    anywhere else is corruption, not a kill, and raises ValueError naming the line."""
    path = Path(path)
    if not path.exists():
        return
    text = path.read_text()
    lines = text.split("\n")
    kept = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            torn = number == len(lines) and not text.endswith("\n")
            if torn:
                continue
            raise ValueError(f"{path}:{number}: not a JSON line ({error})") from error
        if row["step"] <= step:
            kept.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl rows, in order."""
    return read_jsonl(Path(run_dir) / METRICS)


def read_alarms(run_dir: str | Path) -> list[dict[str, Any]]:
    """The alarms a run fired (alarms.jsonl, `AlarmEvent.as_dict()` each), in order."""
    return read_jsonl(Path(run_dir) / ALARMS)


def alarm_sample_path(run_dir: str | Path, name: str, step: int) -> Path:
    """Where a run keeps the trajectories sampled around alarm `name` at `step`."""
    return Path(run_dir) / ALARM_SAMPLES / f"{name}_step_{int(step):04d}.txt"


def sample_path(run_dir: str | Path, step: int) -> Path:
    """samples/step_NNNN.txt: a few of step `step`'s trajectories as text."""
    return Path(run_dir) / SAMPLES / f"step_{step:04d}.txt"


def clear_outputs(run_dir: str | Path) -> None:
    """A fresh start in an old run directory: an earlier run's logs, summary, plots and every
    step's files go (its checkpoints go first, by `forget_checkpoints`), so nothing of it can
    pass for the new run's, in `keel view` or in a lab that reads summary.json."""
    run_dir = Path(run_dir)
    for stale in (METRICS, ALARMS, SUMMARY):
        (run_dir / stale).unlink(missing_ok=True)
    for plot in (run_dir / PLOTS).glob("*.png"):
        plot.unlink()
    drop_steps_after(run_dir, -1)


def drop_steps_after(run_dir: str | Path, step: int) -> list[Path]:
    """Remove the per-step files of every step after `step`: episodes/step_NNNN.jsonl,
    samples/step_NNNN.txt and alarms/NAME_step_NNNN.txt, and in those folders the temporary
    file of an `atomic_write_text` a kill cut short. A run resumed at its step-`step`
    checkpoint writes those steps again, but an alarm that does not fire again, or a step that
    no longer samples, would leave the killed run's file behind. -> the files removed."""
    run_dir = Path(run_dir)
    patterns = ((EPISODES, "step_*.jsonl"), (SAMPLES, "step_*.txt"), (ALARM_SAMPLES, "*_step_*.txt"))
    gone = []
    for folder, pattern in patterns:
        for path in sorted((run_dir / folder).glob(pattern)):
            number = path.stem.rpartition("step_")[2]
            if number.isdigit() and int(number) > step:
                path.unlink()
                gone.append(path)
        for debris in sorted((run_dir / folder).glob(".*.tmp-*")):
            debris.unlink()
            gone.append(debris)
    return gone


# ----------------------------------------------------------------- episodes
def write_episodes(run_dir: str | Path, step: int, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write episodes/step_NNNN.jsonl (replacing a resumed run's old one); -> its path."""
    folder = Path(run_dir) / EPISODES
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:04d}.jsonl"
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_episodes(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """{step: its episode lines} of every episodes/step_NNNN.jsonl under run_dir."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((Path(run_dir) / EPISODES).glob("step_*.jsonl")):
        out[int(path.stem.removeprefix("step_"))] = read_jsonl(path)
    return out


# ----------------------------------------------------------------- checkpoints
def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The folder `run_dir/checkpoint.json` points at; None when there is no pointer."""
    run_dir = Path(run_dir)
    pointer = run_dir / POINTER
    if not pointer.exists():
        return None
    try:
        record = json.loads(pointer.read_text())
        folder = run_dir / record["path"]
        step = int(record["step"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{pointer} is unreadable ({error}); it should be a JSON object with "
                              f"'step' and 'path'") from error
    if not (folder / "state.pt").is_file():
        raise CheckpointError(f"{pointer} names checkpoint {record['path']!r} (step {step}), but "
                              f"{folder / 'state.pt'} does not exist")
    return folder


def save_checkpoint(run_dir: str | Path, step: int, write: Callable[[Path], Any]) -> Path:
    """Write checkpoint `step` with `write(folder)`, make it durable, then point at it; -> its folder."""
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".{checkpoint_name(step)}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write(tmp)
    fsync_tree(tmp)
    current = latest_checkpoint(run_dir)
    if final.exists():  # a whole folder from a life killed before it moved the pointer
        if current is not None and current.resolve() == final.resolve():
            raise CheckpointError(f"refusing to replace {final}: the pointer names it")
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    atomic_write_text(run_dir / POINTER, json.dumps({"step": step, "path": f"{CHECKPOINTS}/{final.name}"}) + "\n")
    for other in root.iterdir():  # the new checkpoint is whole and named: the old ones can go
        if other != final:
            shutil.rmtree(other, ignore_errors=True) if other.is_dir() else other.unlink(missing_ok=True)
    return final


def forget_checkpoints(run_dir: str | Path) -> None:
    """A fresh start in an old run directory: drop the pointer first (so no later resume mixes the
    old run's checkpoint with this run's files), then the old folders."""
    run_dir = Path(run_dir)
    pointer = run_dir / POINTER
    if pointer.exists():
        pointer.unlink()
        _fsync_dir(run_dir)
    shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created with its folder): another process
    asking for it waits until this one is done (building a cached directory, measuring once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
