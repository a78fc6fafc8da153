"""Held-out evaluation reports: success and partial credit with standard errors, per bug kind.

An evaluation runs one attempt per held-out task (greedy, or at a fixed seed), so each task
contributes one Bernoulli outcome (strict success) and one number in [0, 1] (partial credit).
The standard error of a mean over n tasks is the sample standard deviation over sqrt(n) (for
success that is sqrt(p (1 - p) / (n - 1)) with the unbiased variance). Comparing two
evaluations on the same tasks, the paired standard error of the difference is smaller than
either alone; `paired_difference` gives it.

`Evaluator.evaluate` runs the held-out episodes with the policy's current weights, handed to the
evaluation's decoder through the weights seam (`keelrl.inference.weights`) and sampled in
`eval.dtype`, and the strong verifier, and reports them, with the process reward model's
accuracy on their labelled turns when a run has one. With eval.lockstep (the default) the
episodes' decode batches do not depend on the order their tool calls finish in
(`EpisodeLimits.lockstep`), so the same weights give the same evaluation every time on one machine.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

from keelrl.envs.formats import format_of
from keelrl.inference import DecoderOptions, SamplingParams, deliver
from keelrl.config import KeelConfig
from keelrl.inference.precision import resolve_dtype
from keelrl.policy.prefix import chunked_token_logprobs
from keelrl.rollout.agent_loop import EpisodeLimits, model_actor, run_episodes
from keelrl.rollout.trajectory import Trajectory, collate
from keelrl.train.prm import ProcessRewardModel, classification_metrics, labelled_turns


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean); the error is nan for fewer than two values."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN: an undefined error (one task) is written as null."""
    return value if math.isfinite(value) else None


def heldout_report(trajectories: Sequence[Trajectory], kinds: Sequence[str],
                   families: Sequence[str] | None = None) -> dict[str, Any]:
    """Success and partial credit (mean, se) overall, per kind and, given `families`, per family
    (`by_family`, each with its own `task_success`); `kinds[i]` and `families[i]` are trajectory i's."""
    if len(kinds) != len(trajectories):
        raise ValueError(f"{len(kinds)} kinds for {len(trajectories)} trajectories")
    if families is not None and len(families) != len(trajectories):
        raise ValueError(f"{len(families)} families for {len(trajectories)} trajectories")

    def block(rows: Sequence[Trajectory]) -> dict[str, float | None]:
        # An episode whose environment failed (ungraded, reward NaN) counts as a failed task with
        # no partial credit, and is counted: the figure is never inflated by dropping it.
        success, success_se = mean_and_se([float(t.success) for t in rows])
        partial, partial_se = mean_and_se([0.0 if t.termination == "env_error" else float(t.partial) for t in rows])
        return {"tasks": len(rows), "success": success, "success_se": finite_or_none(success_se),
                "partial": partial, "partial_se": finite_or_none(partial_se),
                "env_errors": sum(t.termination == "env_error" for t in rows)}

    by_kind: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory, kind in zip(trajectories, kinds):
        by_kind[kind].append(trajectory)
    report: dict[str, Any] = block(trajectories)
    report["by_kind"] = {kind: block(rows) for kind, rows in sorted(by_kind.items())}
    report["task_success"] = {t.task_id: bool(t.success) for t in trajectories}
    if families is not None:
        by_family: dict[str, list[Trajectory]] = defaultdict(list)
        for trajectory, family in zip(trajectories, families):
            by_family[family].append(trajectory)
        report["by_family"] = {family: {**block(rows), "task_success": {t.task_id: bool(t.success) for t in rows}}
                               for family, rows in sorted(by_family.items())}
    return report


def paired_difference(before: dict[str, bool], after: dict[str, bool]) -> tuple[float, float]:
    """(after - before success rate, its paired standard error) over the tasks both evaluated."""
    common = sorted(set(before) & set(after))
    return mean_and_se([float(after[task]) - float(before[task]) for task in common])


def probe_figures(task_success: dict[str, bool], ids: Sequence[str],
                  start: dict[str, bool] | None = None) -> dict[str, float | None]:
    """The held-out probe's figures from one evaluation's per-task outcomes: strict success over
    the probe's task `ids` (probe/success and its standard error) and, given the outcomes of the
    probe as RL started (`start`), the paired change since then over the same tasks (probe/lift,
    probe/lift_se: `paired_difference`). An undefined standard error is None."""
    now = {task: task_success[task] for task in ids if task in task_success}
    success, success_se = mean_and_se([float(outcome) for outcome in now.values()])
    row: dict[str, float | None] = {"probe/success": success, "probe/success_se": finite_or_none(success_se),
                                    "probe/tasks": float(len(now))}
    if start is not None:
        lift, lift_se = paired_difference(start, now)
        row.update({"probe/lift": lift, "probe/lift_se": finite_or_none(lift_se)})
    return row


def context_limit_frac(trajectories: Sequence[Trajectory]) -> float:
    """Share of episodes ended because the next turn could not fit `rollout.max_context_tokens`."""
    return sum(t.termination == "context_limit" for t in trajectories) / max(1, len(trajectories))


def action_error_frac(trajectories: Sequence[Trajectory]) -> float:
    """Share of turns whose action the environment rejected."""
    return sum(t.action_errors for t in trajectories) / max(1, sum(len(t.actions) for t in trajectories))


def first_test_failed(trajectory: Trajectory, edit_tools: Sequence[str], test_tool: str) -> bool | None:
    """Whether the episode's first accepted edit (a call to one of `edit_tools`) failed a visible
    test: the visible-test counts the edit's own turn records (`info["visible_passed"]` of shaping)
    when present, else the first `test_tool` run after it (`tests_failed` or `tests_error`); None
    when no edit was made or no test ran after it (unknown)."""
    edited = False
    for info in trajectory.turn_info:
        if not edited:
            if info.get("tool") in edit_tools and not info.get("error"):
                edited = True
                if "visible_passed" in info:
                    return bool(info["visible_passed"] < info.get("visible_total", 0))
            continue
        if test_tool and info.get("tool") == test_tool and not info.get("error"):
            return bool(info.get("tests_error") or info.get("tests_failed", 0) > 0)
    return None


def agent_report(trajectories: Sequence[Trajectory], edit_tools: Sequence[str], test_tool: str = "") -> dict[str, Any]:
    """How the episodes behaved as an agent's, given the environment's answer tools (`edit_tools`)
    and its tool that runs the visible tests (`test_tool`, "" when it has none; `EnvSpec`): turns
    per episode, the share that ran the visible tests before ending (`tested_frac`), the recovery rate (of the episodes whose first edit
    failed a visible test, as `first_test_failed` knows it, the share that ended solved), strict
    success by number of turns, the malformed-action share (of turns) and the context-limit share
    (of episodes). Episodes whose environment failed are left out."""
    rows = [t for t in trajectories if t.termination != "env_error"]
    n = max(1, len(rows))
    failed_first = [t for t in rows if first_test_failed(t, edit_tools, test_tool)]
    by_turns: dict[int, list[Trajectory]] = defaultdict(list)
    for t in rows:
        by_turns[len(t.actions)].append(t)
    tested = sum(bool(test_tool) and any(info.get("tool") == test_tool and not info.get("error")
                                         for info in t.turn_info) for t in rows)
    return {"episodes": len(rows), "turns_mean": sum(len(t.actions) for t in rows) / n, "tested_frac": tested / n,
            "first_edit_failed": len(failed_first),
            "recovery_rate": (sum(t.success for t in failed_first) / len(failed_first)) if failed_first else math.nan,
            "success_by_turns": {str(turns): {"episodes": len(group),
                                              "success": sum(t.success for t in group) / len(group)}
                                 for turns, group in sorted(by_turns.items())},  # str keys, as JSON has them
            "action_error_frac": action_error_frac(rows), "context_limit_frac": context_limit_frac(rows)}


def agent_metrics(report: dict[str, Any], prefix: str) -> dict[str, float]:
    """`agent_report`'s figures as metric keys under `prefix` (success by turns as success_turns_N)."""
    row = {f"{prefix}{key}": float(report[key]) for key in ("turns_mean", "tested_frac", "recovery_rate",
                                                             "first_edit_failed", "action_error_frac",
                                                             "context_limit_frac")}
    row.update({f"{prefix}success_turns_{turns}": block["success"]
                for turns, block in report["success_by_turns"].items()})
    return row


class Evaluator:
    """Held-out evaluation of the run's policy (module docstring). `make_env` builds the
    evaluation environments (strong verifier), `rollout` (one attempt per task) how episodes run,
    in lockstep when eval.lockstep (whatever `rollout.lockstep` says)."""

    def __init__(self, cfg: KeelConfig, model: Any, tokenizer: Any, device: torch.device, make_env: Callable[[], Any],
                 rollout: EpisodeLimits, prm: ProcessRewardModel | None, autocast: Callable[[], Any],
                 edit_tools: Sequence[str] = (), family: Callable[[Any], str] | None = None,
                 test_tool: str = "") -> None:
        self.cfg, self.model, self.tokenizer, self.device = cfg, model, tokenizer, device
        self.edit_tools, self.test_tool, self.family = tuple(edit_tools), test_tool, family
        self.make_env, self.prm, self.autocast = make_env, prm, autocast
        self.rollout = dataclasses.replace(rollout, lockstep=cfg.eval.lockstep)
        self.last_report: dict[str, Any] | None = None
        """The latest evaluation's full report (per kind, per task), for summary.json."""
        self._actor: tuple[Any, Any] | None = None
        """(its sampling and decoder options, the actor) of the last evaluation, reused while they hold."""

    def eval_dtype(self) -> torch.dtype:
        """The dtype evaluation samples in: `eval.dtype` (auto: the faster of bf16 and float32 at
        decoding, as measured on this machine and model: `keelrl.inference.precision.resolve_dtype`);
        the evaluation needs no behaviour log-probs to match the learner's."""
        wanted, _ = resolve_dtype(self.cfg.eval.dtype, "eval", self.model, self.device)
        return wanted

    def sampling(self) -> SamplingParams:
        """How the evaluation samples actions: at eval.temperature, stopping as the rollouts stop."""
        return SamplingParams(temperature=self.cfg.eval.temperature, top_p=1.0,
                              max_new_tokens=self.cfg.rollout.max_new_tokens, keep_kv=self.cfg.rollout.keep_kv,
                              stop=format_of(self.cfg.env.tool_format).stop)

    def decoder_options(self) -> DecoderOptions:
        """The evaluation's decoder: the rollouts' (rollout.decoder, kv_budget_mb, eager) in `eval_dtype`."""
        return DecoderOptions(decoder=self.cfg.rollout.decoder, dtype=self.eval_dtype(),
                              kv_budget_mb=self.cfg.rollout.kv_budget_mb, eager=self.cfg.rollout.eager)

    def evaluate(self, tasks: Sequence[Any], version: int = 0, apart: int = 0) -> dict[str, float]:
        """Held-out success with the strong verifier, one attempt per task of `tasks`, under the
        policy's current weights (policy `version`); its full report becomes `last_report`.
        `apart` as in `run`."""
        metrics, self.last_report = self.run(tasks, version, apart)
        return metrics

    def run(self, tasks: Sequence[Any], version: int = 0, apart: int = 0) -> tuple[dict[str, float], dict[str, Any]]:
        """`evaluate` without keeping the report: (the metrics row's eval/* figures, the full
        report of `heldout_report`, with the agent's figures under "agent").

        The first `apart` tasks (the probe's, when the trainer evaluates) run as a batch of their
        own before the rest, with the seeds they have in one call: their episodes are then the ones
        `run(tasks[:apart])` gives under the same weights, token for token in lockstep, so the probe
        read from this evaluation and the probe run alone agree."""
        tasks = list(tasks)
        sampling, options = self.sampling(), self.decoder_options()
        self.model.eval()
        if self._actor is None or self._actor[0] != (sampling, options):
            # one decoder for every evaluation of the run (an engine like vLLM starts once), new weights each time
            self._actor = ((sampling, options), model_actor(self.model, self.tokenizer, sampling, options))
        act = self._actor[1]
        deliver(act.decoder, self.model, version)  # type: ignore[union-attr]
        parts = [(0, tasks[:apart]), (apart, tasks[apart:])] if 0 < apart < len(tasks) else [(0, tasks)]
        trajectories = [trajectory for first, part in parts
                        for trajectory in run_episodes(self.make_env, part, self.tokenizer, act, self.rollout,
                                                       seed=self.cfg.seed + 7919, first_index=first)]
        report = heldout_report(trajectories, [getattr(task, "kind", "all") for task in tasks],
                                None if self.family is None else [self.family(task) for task in tasks])
        agent = agent_report(trajectories, self.edit_tools, self.test_tool)
        report["agent"] = {**agent, "recovery_rate": finite_or_none(agent["recovery_rate"])}
        by_family = report.get("by_family", {})
        return {"eval/success": report["success"], "eval/success_se": report["success_se"],
                "eval/partial": report["partial"], "eval/partial_se": report["partial_se"],
                **({f"eval/success_{family}": block["success"] for family, block in by_family.items()}
                   if len(by_family) > 1 else {}),
                **agent_metrics(agent, "eval/"),
                "eval/tasks": len(trajectories), **self.heldout_prm(trajectories)}, report

    @torch.no_grad()
    def heldout_prm(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """The process reward model's accuracy on the held-out episodes' labelled turns."""
        graded = [t for t in trajectories if t.termination != "env_error" and t.step_labels]
        if self.prm is None or not graded:
            return {}
        batch = collate(graded, self.tokenizer.pad_token_id).to(self.device)
        where, labels = labelled_turns(batch)
        with self.autocast():
            features = chunked_token_logprobs(self.model, batch.input_ids, batch.attention_mask,
                                              max_tokens=self.cfg.perf.micro_batch_tokens, positions=where,
                                              hidden_at=where)["hidden_at"]
        return classification_metrics(self.prm.scores(features), labels, "eval/prm_")
