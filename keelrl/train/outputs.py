"""What a run writes besides its checkpoints: each step's metrics row, samples, episodes and
alarms, the run's resolved precision, and the summary at the end (the files are laid out by
keelrl.runs; precision.json by `PRECISION` here).

- `step_metrics`: the step's row from its trajectories, its updates and its timings;
- `RunOutputs.write_precision`: precision.json (the dtypes eval.dtype and perf.learner_precision
  came to on this machine, and why);
- `RunOutputs.write_step`: samples/ (a few trajectories as text) and episodes/ (the viewer's
  token-level view, `keelrl.train.episodes`);
- `RunOutputs.raise_alarms`: alarms.jsonl and the trajectories sampled around each alarm;
- `RunOutputs.finish`: summary.json (held-out success before and after, RL's lift with its
  paired standard error) and the plots.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from keelrl.alarms import AlarmEvent, distinct_patches
from keelrl.config import KeelConfig
from keelrl.metrics import plot_run
from keelrl.rollout.trajectory import Trajectory
from keelrl.runs import (ALARMS, SUMMARY, alarm_sample_path, append_jsonl, atomic_write_text, read_metrics, sample_path,
                         write_episodes)
from keelrl.train.episodes import TokenRecord, episode_rows
from keelrl.train.evaluation import (action_error_frac, agent_metrics, agent_report, context_limit_frac, finite_or_none,
                                    paired_difference)


PRECISION = "precision.json"
"""The run's resolved dtypes and why, rewritten by every start and resume (the machine may differ)."""


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Process memory in GiB: peak resident set (a high-water mark since the process started),
    current resident set (Linux) and, on CUDA, the peak allocated since the last reset."""
    row: dict[str, float] = {}
    statm = Path("/proc/self/statm")
    if statm.exists():
        resident_pages = int(statm.read_text().split()[1])
        row["memory/rss_gb"] = resident_pages * os.sysconf("SC_PAGE_SIZE") / (1 << 30)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak_gb = peak / (1 << 30) if sys.platform == "darwin" else peak / (1 << 20)
    # The kernel's high-water mark lags the live counters by a few pages; the peak is at least now.
    row["memory/peak_rss_gb"] = max(peak_gb, row.get("memory/rss_gb", 0.0))
    if device.type == "cuda":
        row["memory/cuda_peak_gb"] = torch.cuda.max_memory_allocated(device) / (1 << 30)
    return row


def groups_of(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """The trajectories by group, groups in order of first appearance."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    return list(groups.values())


def episode_metrics(trajectories: Sequence[Trajectory], tokens: int, answer_tools: tuple[str, ...],
                    test_tool: str = "") -> dict[str, Any]:
    """The train/ means over the step's graded episodes (`tokens`: their attended tokens), the
    environment's answer tools and test tool naming what the agent metrics count (`EnvSpec`)."""
    n = len(trajectories)
    return {"train/reward": sum(t.reward for t in trajectories) / n,
            "train/success": sum(t.success for t in trajectories) / n,
            "train/partial": sum(t.partial for t in trajectories) / n,
            "train/episode_tokens": tokens / n,
            "train/action_tokens": sum(t.num_action_tokens for t in trajectories) / n,
            "train/turns": sum(len(t.actions) for t in trajectories) / n,
            "train/action_error_frac": action_error_frac(trajectories),
            "train/context_limit_frac": context_limit_frac(trajectories),
            "train/turn_reward": sum(sum(t.turn_rewards) for t in trajectories) / n,
            "train/distinct_patches": distinct_patches(groups_of(trajectories), answer_tools),
            **{key: value for key, value in agent_metrics(agent_report(trajectories, answer_tools, test_tool), "train/").items()
               if key not in ("train/turns_mean", "train/action_error_frac", "train/context_limit_frac")}}


def lift_summary(heldout: dict[str, Any]) -> dict[str, Any]:
    """Held-out strict success and partial credit (with standard errors) at base, after the warm
    start and at the end of RL, and RL's own lift (final - warm start) with its paired error;
    with more than one task family, each family's figures and lift too (`by_family`)."""
    figures = ("tasks", "success", "success_se", "partial", "partial_se")
    out: dict[str, Any] = {}
    for stage in ("base", "warm_start", "final"):
        report = heldout.get(stage)
        if report:
            out[f"heldout_{stage}"] = {key: report[key] for key in (*figures, "agent") if key in report}
            if len(report.get("by_family", {})) > 1:
                out[f"heldout_{stage}"]["by_family"] = {family: {key: block[key] for key in figures}
                                                        for family, block in report["by_family"].items()}
    if heldout.get("warm_start") and heldout.get("final"):
        before, after = heldout["warm_start"], heldout["final"]
        lift, lift_se = paired_difference(before["task_success"], after["task_success"])
        out["rl_lift"] = {"success": lift, "success_se": finite_or_none(lift_se)}
        families = sorted(set(before.get("by_family", {})) & set(after.get("by_family", {})))
        if len(families) > 1:
            out["rl_lift"]["by_family"] = {}
            for family in families:
                lift, lift_se = paired_difference(before["by_family"][family]["task_success"],
                                                  after["by_family"][family]["task_success"])
                out["rl_lift"]["by_family"][family] = {"success": lift, "success_se": finite_or_none(lift_se)}
    return out


class RunOutputs:
    """The run's per-step and final files (module docstring), in `run_dir`."""

    def __init__(self, cfg: KeelConfig, run_dir: Path, tokenizer: Any, task_kinds: dict[str, str],
                 progress: Callable[[str, dict[str, Any]], None]) -> None:
        self.cfg, self.run_dir, self.tokenizer, self.task_kinds, self.progress = (cfg, run_dir, tokenizer,
                                                                                  task_kinds, progress)

    def write_precision(self, resolved: dict[str, Any]) -> None:
        """precision.json: what the run's dtype settings came to on this machine and why
        (`keelrl.train.trainer.resolve_precision`); config.yaml keeps the settings as given."""
        atomic_write_text(self.run_dir / PRECISION, json.dumps(resolved, indent=2))

    def write_step(self, step: int, trajectories: Sequence[Trajectory], used: Sequence[Trajectory] = (),
                   advantages: torch.Tensor | None = None, record: TokenRecord | None = None) -> None:
        """episodes/ of step `step`: all its `trajectories` (failed episodes too: they show the
        error), with token values for `used`, the rows of the batch the update used; and, for a
        step that trained (`used` not empty), samples/."""
        count = self.cfg.output.sample_trajectories
        if count > 0 and used:
            path = sample_path(self.run_dir, step)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n\n".join(t.to_text(self.tokenizer) for t in trajectories[:count]))
        if self.cfg.output.save_episodes:
            write_episodes(self.run_dir, step, episode_rows(step, trajectories, used, self.tokenizer, advantages,
                                                            record, self.task_kinds,
                                                            limit=self.cfg.output.save_episodes))

    def raise_alarms(self, events: Sequence[AlarmEvent], trajectories: Sequence[Trajectory]) -> str | None:
        """Record, print and sample around each alarm; returns the name of one that stops the run."""
        stop = None
        for event in events:
            append_jsonl(self.run_dir / ALARMS, event.as_dict())
            path = alarm_sample_path(self.run_dir, event.name, event.step)
            path.parent.mkdir(exist_ok=True)
            shown = trajectories[:max(4, self.cfg.output.sample_trajectories)]
            path.write_text(f"# {event.message}\n\n" + "\n\n".join(t.to_text(self.tokenizer) for t in shown))
            self.progress("alarm", event.as_dict())
            if event.name in self.cfg.monitor.stop_on or "any" in self.cfg.monitor.stop_on:
                stop = stop or event.name
        return stop

    def finish(self, summary: dict[str, Any], steps: int, skipped: int) -> dict[str, Any]:
        """The run's summary completed from metrics.jsonl and the held-out reports, written to
        summary.json with the plots; -> the summary."""
        rows = read_metrics(self.run_dir)
        evals = [row["eval/success"] for row in rows if "eval/success" in row]
        summary.update({"eval_success_after_rl": evals[-1] if evals else None, "steps": steps,
                        "skipped_updates": skipped, "preset": self.cfg.algo.preset})
        probes = [row for row in rows if "probe/success" in row]
        if probes:  # the held-out probe's curve, and what it cost
            summary["probe"] = {**summary.get("probe", {}), "tasks": int(probes[-1]["probe/tasks"]),
                                "success_by_step": {str(row["step"]): row["probe/success"] for row in probes},
                                "lift": probes[-1].get("probe/lift"), "lift_se": probes[-1].get("probe/lift_se"),
                                "seconds": sum(row.get("probe/seconds", 0.0) for row in probes)}
        summary.update(lift_summary(summary.get("heldout", {})))
        summary["plots"] = [str(p) for p in plot_run(self.run_dir)]
        atomic_write_text(self.run_dir / SUMMARY, json.dumps(summary, indent=2))
        return summary
