"""The metrics logger and plots: each step's row to every sink, then PNG charts from metrics.jsonl.

`MetricsLogger.log(step, metrics)` hands one row to each sink `log.sinks` names
(keelrl/sinks.py): by default run_dir/metrics.jsonl (every value, one JSON line a step) and
TensorBoard (every numeric value); Weights & Biases and MLflow when asked for. `plot_run(run_dir)`
reads metrics.jsonl back and draws the run's charts: training reward against independent eval
success on one chart (the lecture's "plot two curves"), entropy, KL, clip fraction and the max
importance weight.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Mapping

from keelrl.runs import last_step, read_metrics
from keelrl.sinks import SINKS, Sink, SinkContext

if TYPE_CHECKING:
    from keelrl.config import LogConfig


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Hands each step's metrics to the sinks `settings.sinks` names (default: metrics.jsonl and
    TensorBoard under run_dir/tb); a context manager that closes them, telling them the error
    that ended the block.

    `config`: the run's resolved config as nested dicts, for the sinks that record it (W&B's run
    config, MLflow's params). `resume_after=k`: a run resumed from its step-k checkpoint.
    metrics.jsonl first loses every line of a later step (and a torn last line a kill left),
    atomically; TensorBoard purges events after step k, so repeated steps are not plotted twice;
    W&B and MLflow reopen their run and skip the steps it already holds (keelrl/sinks.py)."""

    def __init__(self, run_dir: str | Path, settings: LogConfig | None = None, *,
                 config: Mapping[str, Any] | None = None, resume_after: int | None = None) -> None:
        from keelrl.config import LogConfig

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.settings = settings if settings is not None else LogConfig()
        self.path = self.run_dir / "metrics.jsonl"
        context = SinkContext(run_dir=self.run_dir, settings=self.settings, config=dict(config or {}),
                              resume_after=resume_after,
                              logged_through=None if resume_after is None else last_step(self.path))
        self.sinks: list[Sink] = []
        try:
            # jsonl first: it truncates metrics.jsonl before a new remote run is filled from it
            for name in sorted(self.settings.sinks, key=lambda name: name != "jsonl"):
                self.sinks.append(SINKS[name](context))
        except BaseException as error:
            self.close(error)
            raise

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        row = {"step": step, **{key: _plain(value) for key, value in metrics.items()}}
        for sink in self.sinks:
            sink.log(step, row)
        return row

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """A finished run's summary (summary.json's content) to the sinks that keep one."""
        for sink in self.sinks:
            sink.log_summary(summary)

    def close(self, error: BaseException | None = None) -> None:
        """Close every sink (each one even if another's close raises; the first error is raised)."""
        sinks, self.sinks = self.sinks, []
        failure: BaseException | None = None
        for sink in sinks:
            try:
                sink.close(error)
            except BaseException as close_error:
                failure = failure or close_error
        if failure is not None:
            raise failure

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close(error)


CHARTS = {
    "reward_vs_eval": [("train/reward", "training reward"), ("eval/success", "held-out success (strong verifier)"),
                       ("probe/success", "held-out probe (its fixed subset)")],
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
