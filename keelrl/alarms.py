"""Monitors and alarms over a run's metrics: the failure modes that a rising reward curve hides.

`AlarmMonitor.update(step, row)` is called with each step's metrics row (as written to
metrics.jsonl) and returns the alarms that fire at this step. Each alarm fires at most once a
run, with the step and the numbers that tripped it:

- `divergence`: training reward rose by at least `divergence_reward_gain` between two
  independent evaluations while the eval metric did not rise by more than
  `divergence_eval_gain`: the reward is probably being hacked ("go read trajectories").
  Training reward is averaged over `window` steps ending at each eval; the first RL step's
  stands in for the pre-RL eval at step 0 (the pre-RL policy sampled its rollouts; a mean over
  the first `window` steps would be the very window the next eval's is averaged over). Each evaluation is compared with every
  earlier one at least `window` steps before it, the latest first (the first one while there is
  none), so an eval metric logged every step (the held-out probe) is compared across a window,
  not step to step, and a rise split over several windows, each short of the gain, is still
  seen against an older evaluation. The
  eval metric is `eval_metric`; auto reads the probe (probe/success) once the run has logged
  it, else the full evaluation (eval/success).
- `entropy_collapse`: mean policy entropy below `entropy_floor`, or fallen by more than
  `entropy_drop` (a fraction) over `window` steps.
- `zero_advantage`: at least `zero_adv_max` of the groups had all-equal rewards (before
  dynamic sampling's filter when it runs) for `window` consecutive steps.
- `importance_weight`: an importance weight above `is_weight_max` (learner vs behaviour during
  the update, on arrival, or the decoupled objective's behaviour weight).
- `patch_collapse`: the mean number of distinct final patches (the guessing game: guess
  sequences) per group at or below
  `distinct_patches_min` for `window` consecutive steps: the group explores nothing.

Each alarm is a check registered in `ALARMS` under its name (the names `monitor.stop_on` takes),
all with one signature: check(monitor, step) -> (values, message) when it fires at `step`, else
None. The monitor runs them in registration order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from keelrl.registry import Registry

Finding = tuple[dict[str, float], str]
"""What a check returns when its alarm fires: the numbers behind it and a one-line message."""
AlarmCheck = Callable[["AlarmMonitor", int], "Finding | None"]

ALARMS: Registry[AlarmCheck] = Registry("alarm", ("monitor", "step"))
"""Alarm name -> its check (see the module docstring), in the order the monitor runs them."""

WEIGHT_KEYS = ("policy/is_weight_max", "rollout/arrival_is_weight_max", "policy/behaviour_weight_max")


@dataclass(frozen=True)
class AlarmEvent:
    """One alarm firing: its name, the step, the numbers behind it and a one-line message."""

    name: str
    step: int
    values: dict[str, float]
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"alarm": self.name, "step": self.step, "values": self.values, "message": self.message}


class AlarmMonitor:
    """Keeps the metric history and fires each alarm once (see the module docstring)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.rows: list[dict[str, Any]] = []
        self.fired: set[str] = set()

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of every row so far where `key` is a number."""
        return [(int(row["step"]), float(row[key])) for row in self.rows
                if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool)]

    def update(self, step: int, row: Mapping[str, Any]) -> list[AlarmEvent]:
        """Add this step's row; returns the alarms that fire now (each only once a run)."""
        self.rows.append({"step": step, **row})
        events = []
        for name in ALARMS:
            if name in self.fired:
                continue
            found = ALARMS[name](self, step)
            if found is not None:
                values, message = found
                self.fired.add(name)
                events.append(AlarmEvent(name, step, values, message))
        return events

    def consecutive(self, key: str, step: int, test: Callable[[float], bool]) -> list[float] | None:
        """The last `window` values of `key` if they all pass `test` and end at this step."""
        series = self.series(key)
        window = self.cfg.window
        if len(series) < window or series[-1][0] != step:
            return None
        last = [value for _, value in series[-window:]]
        return last if all(test(value) for value in last) else None


# ------------------------------------------------------------------ the checks
def _mean_reward_ending_at(monitor: AlarmMonitor, step: int) -> float | None:
    rewards = [(s, r) for s, r in monitor.series("train/reward") if s >= 1]
    if not rewards:
        return None
    window = monitor.cfg.window
    if step < 1:  # the pre-RL eval: the first RL step stands in (the pre-RL policy sampled its rollouts)
        chosen = rewards[:1]
    else:
        chosen = [(s, r) for s, r in rewards if step - window < s <= step]
    return sum(r for _, r in chosen) / len(chosen) if chosen else None


@ALARMS.register("divergence", summary="training reward rises while the eval metric does not")
def _divergence(monitor: AlarmMonitor, step: int) -> Finding | None:
    cfg = monitor.cfg
    metric = cfg.eval_metric
    if metric == "auto":
        metric = "probe/success" if monitor.series("probe/success") else "eval/success"
    evals = monitor.series(metric)
    if len(evals) < 2 or evals[-1][0] != step:
        return None
    earlier = [point for point in evals[:-1] if point[0] <= step - cfg.window] or evals[:1]
    eval_now, reward_now = evals[-1][1], _mean_reward_ending_at(monitor, step)
    if reward_now is None:
        return None
    for then_step, eval_then in reversed(earlier):  # the latest comparison that shows it
        reward_then = _mean_reward_ending_at(monitor, then_step)
        if reward_then is None:
            continue
        reward_gain, eval_gain = reward_now - reward_then, eval_now - eval_then
        if reward_gain >= cfg.divergence_reward_gain and eval_gain <= cfg.divergence_eval_gain:
            values = {"train_reward_then": reward_then, "train_reward_now": reward_now,
                      "eval_then": eval_then, "eval_now": eval_now, "since_step": float(then_step)}
            return values, (f"training reward rose {reward_then:.3f} -> {reward_now:.3f} since step {then_step} "
                            f"while {metric} went {eval_then:.3f} -> {eval_now:.3f}: "
                            f"the reward may be hacked; go read trajectories")
    return None


@ALARMS.register("entropy_collapse", summary="mean policy entropy below a floor, or fallen fast")
def _entropy(monitor: AlarmMonitor, step: int) -> Finding | None:
    cfg = monitor.cfg
    series = monitor.series("policy/entropy")
    if not series or series[-1][0] != step:
        return None
    now = series[-1][1]
    if now < cfg.entropy_floor:
        return {"entropy": now}, f"mean entropy {now:.4f} is below the floor {cfg.entropy_floor:g}"
    earlier = [value for s, value in series if s <= step - cfg.window]
    if earlier and earlier[-1] > 0 and now < (1.0 - cfg.entropy_drop) * earlier[-1]:
        return ({"entropy": now, "entropy_before": earlier[-1]},
                f"mean entropy fell {earlier[-1]:.4f} -> {now:.4f} within {cfg.window} steps "
                f"(more than {cfg.entropy_drop:.0%})")
    return None


@ALARMS.register("zero_advantage", summary="most groups had all-equal rewards for `window` steps")
def _zero_advantage(monitor: AlarmMonitor, step: int) -> Finding | None:
    key = "dynamic/zero_adv_frac_before" if monitor.series("dynamic/zero_adv_frac_before") else \
        "train/zero_advantage_frac"
    last = monitor.consecutive(key, step, lambda v: v >= monitor.cfg.zero_adv_max)
    if last is None:
        return None
    return ({"zero_advantage_frac": last[-1]},
            f"{last[-1]:.0%} of groups had all-equal rewards ({key}) for {len(last)} steps: "
            f"they teach nothing (harder/easier tasks, partial credit, or dynamic sampling, or more "
            f"extra groups for it: rollout.dynamic_max_extra_groups)")


@ALARMS.register("importance_weight", summary="an importance weight above is_weight_max")
def _weights(monitor: AlarmMonitor, step: int) -> Finding | None:
    row = monitor.rows[-1]
    limit = monitor.cfg.is_weight_max
    over = {key: float(row[key]) for key in WEIGHT_KEYS
            if isinstance(row.get(key), (int, float)) and float(row[key]) > limit}
    if not over:
        return None
    key, value = max(over.items(), key=lambda item: item[1])
    return over, f"{key} = {value:.3g} exceeds {limit:g}: stale or off-policy data"


@ALARMS.register("patch_collapse", summary="few distinct final patches per group for `window` steps")
def _patches(monitor: AlarmMonitor, step: int) -> Finding | None:
    last = monitor.consecutive("train/distinct_patches", step, lambda v: v <= monitor.cfg.distinct_patches_min)
    if last is None:
        return None
    return ({"distinct_patches": last[-1]},
            f"groups produced {last[-1]:.2f} distinct final patches on average for {len(last)} steps: "
            f"exploration has collapsed")


def distinct_patches(groups: list[list[Any]], tools: tuple[str, ...]) -> float:
    """Mean number of distinct answers per group: a trajectory's answer is the sequence of its
    actions that the environment accepted as calls to `tools` (`turn_info`'s "tool"; coding: its
    edits, i.e. its patch; the guessing game: its guesses), or of all its actions when `tools`
    is empty. Whatever the tool-call format, the environment's own reading decides."""
    if not groups:
        return 0.0
    counts = []
    for group in groups:
        patches = {"\n".join(action.strip() for action, info in zip(t.actions, _infos(t))
                             if not tools or (info.get("tool") in tools and not info.get("error")))
                   for t in group}
        counts.append(len(patches))
    return sum(counts) / len(counts)


def _infos(trajectory: Any) -> list[dict[str, Any]]:
    infos = list(getattr(trajectory, "turn_info", []))
    return infos + [{}] * (len(trajectory.actions) - len(infos))
