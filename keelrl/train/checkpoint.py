"""Crash-safe files: atomic writes and versioned checkpoints behind one pointer.

A run can be killed at any instant (SIGKILL, OOM killer, power loss). Everything a resume reads
is written so that the kill leaves either the old state or the new one, never a mixture:

- `atomic_write_text(path, text)`: the text goes to a temporary file in the same directory,
  is fsynced, renamed over `path` (one atomic rename) and the directory fsynced.
- `save_checkpoint(run_dir, step, write)`: `write(folder)` fills a fresh temporary folder
  under `run_dir/checkpoints/`; every file and folder in it is fsynced, it is renamed to
  `checkpoints/step-NNNNNN`, and only then is the pointer `run_dir/checkpoint.json` atomically
  replaced to name it. Older checkpoint folders are removed after that, so the last good
  checkpoint stays until the next one is whole.
- `latest_checkpoint(run_dir)`: the folder the pointer names; None when there is no pointer,
  `CheckpointError` when the pointer is unreadable or names a folder that is gone.

What this does not guarantee: a disk that lies about fsync, or someone editing the folder by
hand. Files a resume does not read (samples/, plots/, TensorBoard events) are plain writes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable


POINTER = "checkpoint.json"
FOLDER = "checkpoints"


class CheckpointError(RuntimeError):
    """A checkpoint that a resume needs is missing or unreadable."""


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
    root = run_dir / FOLDER
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
    atomic_write_text(run_dir / POINTER, json.dumps({"step": step, "path": f"{FOLDER}/{final.name}"}) + "\n")
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
    shutil.rmtree(run_dir / FOLDER, ignore_errors=True)
