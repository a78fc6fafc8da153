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
    """Appends metrics to run_dir/metrics.jsonl and TensorBoard (run_dir/tb)."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tb"))

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

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after `step` (a resumed run rewrites them)."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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
