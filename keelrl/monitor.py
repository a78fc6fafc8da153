"""Metrics sinks and plots: metrics.jsonl (one line per step), TensorBoard events, PNG charts.

`MetricsLogger.log(step, metrics)` appends one JSON line and writes every numeric value to
TensorBoard. `plot_run(run_dir)` reads metrics.jsonl back and draws the run's charts:
training reward against independent eval success on one chart (the lecture's "plot two
curves"), entropy, KL, clip fraction and the max importance weight.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends metrics to run_dir/metrics.jsonl and TensorBoard (run_dir/tb).

    `resume_after=k`: a run resumed from its step-k checkpoint. metrics.jsonl first loses every
    line of a later step (and a torn last line a kill left), atomically; TensorBoard purges
    events after step k, so repeated steps are not plotted twice."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_after: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_after is not None:
            truncate_jsonl(self.path, resume_after)
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_after is None else resume_after + 1
            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=purge)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        row = {"step": step, **{key: _plain(value) for key, value in metrics.items()}}
        with self.path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        return row

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def truncate_jsonl(path: str | Path, step: int) -> None:
    """Keep the lines of a JSONL log whose "step" is at most `step`, replacing the file atomically.

    A kill during an append leaves a torn last line: it is dropped. A line that does not parse
    anywhere else is corruption, not a kill, and raises ValueError naming the line."""
    from keelrl.train.checkpoint import atomic_write_text

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
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


CHARTS = {
    "reward_vs_eval": [("train/reward", "training reward"), ("eval/success", "held-out success (strong verifier)")],
    "entropy": [("policy/entropy", "entropy")],
    "kl": [("policy/approx_kl", "approx KL to behaviour"), ("policy/kl_ref", "KL to reference")],
    "clip_fraction": [("policy/clip_frac", "clip fraction")],
    "importance_weight": [("policy/is_weight_max", "max importance weight")],
}


def plot_run(run_dir: str | Path) -> list[Path]:
    """Draw the run's charts into run_dir/plots; returns the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, series in CHARTS.items():
        figure, axes = plt.subplots(figsize=(6, 3.5))
        drawn = False
        for key, label in series:
            points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
            if points:
                steps, values = zip(*points)
                axes.plot(steps, values, marker="o" if len(points) < 30 else None, label=label)
                drawn = True
        axes.set_xlabel("RL step")
        axes.set_title(name.replace("_", " "))
        if drawn:
            axes.legend()
        else:
            axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
        figure.tight_layout()
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written
