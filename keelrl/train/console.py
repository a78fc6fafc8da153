"""A run's progress on the console: the bar `keel train` shows, and `Trainer.train()` too.

`ConsoleProgress(total)` is a context manager and a `progress(event, info)` callback for the
Trainer: a rich progress bar over the RL steps on a terminal (phase, latest reward and held-out
success, time left), one plain line per event where stderr is not a terminal (a log file, CI),
the "precision: ..." line, and alarms in red.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

_SHOWN = ("phase", "step", "epoch", "loss", "demos", "masked_turns", "train/reward", "train/success", "eval/success",
          "eval/partial", "probe/success", "time/step_s", "memory/peak_rss_gb")
"""The fields of an event's info that a plain log line shows."""


class ConsoleProgress:
    """The Trainer's `progress` callback drawing a bar over `total` RL steps (module docstring)."""

    def __init__(self, total: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[latest]}")]
        self.bar_view = Progress(*columns, console=self.console)
        self.bar = self.bar_view.add_task("RL", total=total, latest="warm start + eval...")
        self.started = time.monotonic()

    def __enter__(self) -> "ConsoleProgress":
        self.bar_view.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar_view.stop()

    def __call__(self, event: str, info: dict[str, Any]) -> None:
        console, update = self.console, self.bar_view.update
        if event == "precision":
            console.print(info["line"], highlight=False)
            return
        if not console.is_terminal:  # logs get one plain line per event
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in info.items() if k in _SHOWN}
            console.print(f"[{time.monotonic() - self.started:7.1f}s {event}] {shown}", highlight=False)
        if event == "step":
            latest = f"reward {info.get('train/reward', 0):.2f}"
            if "eval/success" in info:
                latest += f" | eval {info['eval/success']:.2f}"
            update(self.bar, completed=info["step"], latest=latest)
        elif event == "eval":
            update(self.bar, latest=f"eval before RL {info['eval/success']:.2f}")
        elif event == "phase":
            update(self.bar, description=info["phase"])
        elif event == "eval_base":
            update(self.bar, latest=f"base model eval {info['eval/success']:.2f}")
        elif event == "resumed":
            update(self.bar, completed=info["step"], latest="resumed")
        elif event == "alarm":
            console.print(f"[bold red]ALARM[/] {info['alarm']} at step {info['step']}: {info['message']}")
        else:
            update(self.bar, latest=f"{event}: " + ", ".join(f"{k}={v}" for k, v in info.items()))
