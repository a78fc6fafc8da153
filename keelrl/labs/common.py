"""What the labs share: their settings, `LabResult`, the shared warm start and the helpers that
train variants from it, read their metrics and draw and tabulate the results."""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

LAB_FAST = ["rollout.tasks_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=64", "env.max_turns=4",
            "eval.tasks=40", "output.sample_trajectories=2", "output.checkpoint_every=1000",
            "warm_start.demos=128", "warm_start.epochs=3", "rollout.engine=sync"]
"""Budget shared by the labs' training runs (one warm start, short RL, a 40-task held-out eval)."""

GUESS = ["env.name=guess", "env.partial_credit=false", "env.show_file=true", "env.max_turns=5", "rollout.max_new_tokens=24", "rollout.tasks_per_step=8",
         "warm_start.demos=256", "warm_start.mistake_rate=0.6", "eval.tasks=100"]
"""The guessing-game labs (credit, dynamic-sampling): find 1..16 in 5 guesses, after a warm start
on a teacher that errs. The tiny recipe's coding settings (partial credit, the file not shown) go
back to their defaults: the guessing game reads neither."""


HACK = [*GUESS, "warm_start.mistake_rate=0.3", "rollout.tasks_per_step=16", "eval.tasks=200"]
"""The reward-hacking lab: a steadier teacher than the other guessing-game labs' (so the policy starts
out mostly well-formed), 64 episodes a step and a 200-task held-out eval."""

ENTROPY = [*GUESS, "warm_start.mistake_rate=0.3", "rollout.tasks_per_step=16", "optim.lr=5e-4"]
"""The entropy lab: the reward-hacking lab's warm start and batch, and a faster learning rate."""

QUICK = ["rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "env.max_turns=2",
         "eval.tasks=4", "warm_start.demos=8", "warm_start.epochs=1", "train.minibatch_size=4"]

QUICK_GUESS = ["rollout.tasks_per_step=2", "rollout.group_size=2", "eval.tasks=4", "warm_start.demos=16",
               "warm_start.epochs=1", "train.minibatch_size=4"]
"""--quick on a guessing-game lab (5 turns kept: the teacher's demonstrations must still succeed)."""


@dataclass
class LabResult:
    """What a lab reports: headline numbers, the markdown summary and the files it wrote."""

    name: str
    numbers: dict[str, Any]
    summary: str
    files: list[Path] = field(default_factory=list)


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def config(out: Path, overrides: Sequence[str]) -> Any:
    from keelrl.config import load_config

    return load_config(overrides=[f"run_dir={out}", *overrides])


def warm_model(out: Path, overrides: Sequence[str]) -> Path:
    """Warm-start once into out/warm/model (reused when already there); returns the model dir."""
    from keelrl.train.trainer import Trainer

    target = out / "warm" / "model"
    if (target / "config.json").exists():
        return target
    trainer = Trainer(config(out / "warm", overrides))
    trainer.warm_start()
    trainer.model.save_pretrained(target)
    trainer.tokenizer.save_pretrained(target)
    return target


def warm_tokenizer(out: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out / "warm" / "model")


USER_OVERRIDES: ContextVar[tuple[str, ...]] = ContextVar("keel_lab_user_overrides", default=())
"""The overrides the user gave `run_lab`: they win over every setting a lab makes, its variants' too."""


def train_variants(out: Path, variants: dict[str, list[str]], overrides: Sequence[str],
                   progress: Callable[[str], None], trainers: dict[str, Any] | None = None
                   ) -> dict[str, list[dict[str, Any]]]:
    """Run each variant from the shared warm start; returns each variant's metrics rows.

    Pass `trainers` to get each variant's trained `Trainer` back in it. The user's overrides
    (`run_lab`'s) are applied again after each variant's own settings, so they win there too.
    """
    from keelrl.runs import read_metrics
    from keelrl.train.trainer import Trainer

    model = warm_model(out, overrides)
    runs = {}
    for label, extra in variants.items():
        progress(f"training variant {label!r}")
        run_dir = out / label
        trainer = Trainer(config(run_dir, [*overrides, *extra, *USER_OVERRIDES.get(),
                                           f"model.path={model}", "warm_start.demos=0"]))
        trainer.run()
        runs[label] = read_metrics(run_dir)
        if trainers is not None:
            trainers[label] = trainer
    return runs


def steps_run(runs: dict[str, list[dict[str, Any]]]) -> int:
    """RL steps the variants ran (what a summary reports, whatever the overrides set)."""
    return max((int(row["step"]) for rows in runs.values() for row in rows), default=0)


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def last(rows: list[dict[str, Any]], key: str) -> float:
    points = series(rows, key)
    return points[-1][1] if points else math.nan


def first(rows: list[dict[str, Any]], key: str) -> float:
    points = series(rows, key)
    return points[0][1] if points else math.nan


def alarm_events(out: Path) -> list[dict[str, Any]]:
    """The alarms a run fired (alarms.jsonl), in order."""
    from keelrl.runs import read_alarms

    return read_alarms(out)


def alarms(out: Path) -> list[str]:
    return [event["alarm"] for event in alarm_events(out)]


def plot_variants(path: Path, runs: dict[str, list[dict[str, Any]]], panels: list[tuple[str, str]],
                  title: str, marks: dict[str, list[tuple[int, str]]] | None = None) -> Path:
    """One panel per metric, one line per variant; `marks` draws each variant's (step, label) events
    (alarms) as dashed vertical lines in the variant's colour."""
    plt = pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    axes = list(axes) if len(panels) > 1 else [axes]
    for ax, (key, label) in zip(axes, panels):
        for index, (variant, rows) in enumerate(runs.items()):
            points = series(rows, key)
            if points:  # a variant keeps its colour in every panel, also where another has no points
                steps, values = zip(*points)
                line = ax.plot(steps, values, marker="o", label=variant, color=f"C{index}")[0]
                for step, name in (marks or {}).get(variant, []):
                    ax.axvline(step, color=line.get_color(), linestyle="--", linewidth=1,
                               label=f"{variant}: {name} alarm")
        ax.set_title(label)
        ax.set_xlabel("RL step")
        if ax.get_legend_handles_labels()[0]:  # a metric no variant logged leaves an empty panel
            ax.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
