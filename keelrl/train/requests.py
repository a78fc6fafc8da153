"""The request streams: which tasks each RL step asks the rollout engine for, with which seeds.

Every stream is a function of (seed, step) alone, or with a curriculum of (seed, step, the
curriculum's state when the engine asks), so a resumed run repeats what an uninterrupted one
would have done. Tasks are drawn uniformly, or, given the environment's sampling weights
(`EnvSpec.weights`: a mix of environments), in proportion to them (times the curriculum's
weights, with one):
- `for_step(step)`: the step's `rollout.tasks_per_step` groups of `rollout.group_size`;
- `extra(step, start, count)`: dynamic sampling's extra groups (`dynamic_fill`), indexed
  apart from the step stream (from `EXTRA_INDEX_BASE`);
- `teacher_samples(step)`: whether GKD has the teacher sample the step's histories.
"""

from __future__ import annotations

import itertools
import math
import random
import threading
from typing import Any, Sequence

from keelrl.config import KeelConfig
from keelrl.rollout.engines import RolloutEngine, StepRollouts
from keelrl.rollout.scheduler import GroupRequest
from keelrl.rollout.trajectory import Trajectory
from keelrl.train.curriculum import Curriculum, weighted_sample
from keelrl.train.dynamic import fill_batch

EXTRA_INDEX_BASE = 1 << 40
"""Request indices of dynamic sampling's extra groups start here (apart from the step stream)."""


class RequestStream:
    """The run's request streams over its training tasks (module docstring). The curriculum, if
    any, is read when the engine asks (its rollout thread, for an async engine) and updated
    after each step (`record`), under one lock."""

    def __init__(self, cfg: KeelConfig, train_tasks: Sequence[Any], curriculum: Curriculum | None,
                 has_teacher: bool, weights: Sequence[float] | None = None) -> None:
        self.cfg, self.train_tasks, self.curriculum, self.has_teacher = cfg, list(train_tasks), curriculum, has_teacher
        self._lock = threading.Lock()
        self._index = {task.id: i for i, task in enumerate(self.train_tasks)}
        self.weights = None if weights is None else [float(weight) for weight in weights]
        """Each train task's sampling weight (`EnvSpec.weights`); None: uniform."""
        if self.weights is not None:
            if len(self.weights) != len(self.train_tasks):
                raise ValueError(f"{len(self.weights)} sampling weights for {len(self.train_tasks)} train tasks")
            bad = [weight for weight in self.weights if not (math.isfinite(weight) and weight > 0)]
            if bad:
                raise ValueError(f"sampling weights must be finite and > 0, got {bad[0]!r}")
            self._cumulative = list(itertools.accumulate(self.weights))

    def for_step(self, step: int) -> list[GroupRequest]:
        """The group requests of RL step `step`."""
        r = self.cfg.rollout
        rng = random.Random(f"{self.cfg.seed}:step:{step}")
        if self.curriculum is not None and self.weights is not None:  # both, multiplied
            with self._lock:
                weights = [level * weight for level, weight in zip(self.curriculum.weights, self.weights)]
            chosen = [self.train_tasks[i] for i in weighted_sample(weights, r.tasks_per_step, rng)]
        elif self.curriculum is not None:  # from the curriculum's weights as they are now (and the same step seed)
            with self._lock:
                chosen = [self.train_tasks[i] for i in self.curriculum.sample(r.tasks_per_step, rng)]
        elif self.weights is not None:
            chosen = [self.train_tasks[i] for i in weighted_sample(self.weights, r.tasks_per_step, rng)]
        else:
            chosen = rng.sample(self.train_tasks, min(r.tasks_per_step, len(self.train_tasks)))
        return [GroupRequest(index=(step - 1) * r.tasks_per_step + i, task=task, group_size=r.group_size,
                             seed=(self.cfg.seed * 1_000_003 + step) * 1009 + i, group_id=i)
                for i, task in enumerate(chosen)]

    def extra(self, step: int, start: int, count: int) -> list[GroupRequest]:
        """Dynamic sampling's extra groups `start..start+count-1` of step `step`."""
        r = self.cfg.rollout
        rng = random.Random(f"{self.cfg.seed}:step:{step}:extra")
        if self.weights is None:
            tasks = [rng.choice(self.train_tasks) for _ in range(start + count)][start:]
        else:  # one draw per group, with replacement as above: the first groups do not depend on `count`
            tasks = rng.choices(self.train_tasks, cum_weights=self._cumulative, k=start + count)[start:]
        return [GroupRequest(index=EXTRA_INDEX_BASE + step * 100_000 + start + j, task=task, group_size=r.group_size,
                             seed=(self.cfg.seed * 1_000_003 + step) * 1009 + 500_000 + start + j,
                             group_id=r.tasks_per_step + start + j)
                for j, task in enumerate(tasks)]

    def dynamic_fill(self, engine: RolloutEngine, step: int, rollouts: StepRollouts) -> StepRollouts:
        """DAPO dynamic sampling over the engine's batch (see keelrl.train.dynamic): groups with
        all-equal rewards are replaced by extra groups the engine runs now."""
        groups: list[list[Trajectory]] = []
        for trajectory in rollouts.trajectories:  # a group's rows are consecutive (an episode may give several)
            if groups and groups[-1][0].group_id == trajectory.group_id:
                groups[-1].append(trajectory)
            else:
                groups.append([trajectory])
        drawn = [0]

        def draw(count: int) -> list[list[Trajectory]]:
            results = engine.more(step, self.extra(step, drawn[0], count))
            drawn[0] += count
            return [result.trajectories for result in results]

        filled = fill_batch(groups, draw, target=len(groups), max_extra=self.cfg.rollout.dynamic_max_extra_groups)
        return StepRollouts([t for group in filled.groups for t in group], {**rollouts.metrics, **filled.metrics})

    def teacher_samples(self, step: int) -> bool:
        """Whether step `step` trains on teacher-sampled histories (GKD's 1 - lambda of the steps,
        chosen by the seed and the step alone)."""
        share = self.cfg.distill.student_share
        return self.has_teacher and share < 1.0 and random.Random(f"{self.cfg.seed}:gkd:{step}").random() >= share

    def record(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Each graded attempt's outcome into the curriculum, then its update; -> its metrics
        ({} without a curriculum). The curriculum finishes once its last level is done."""
        if self.curriculum is None:
            return {}
        with self._lock:
            for trajectory in trajectories:
                if trajectory.task_id in self._index:  # dynamic sampling's extra groups are training tasks too
                    self.curriculum.record(self._index[trajectory.task_id], trajectory.success)
            self.curriculum.update()
            return self.curriculum.metrics()

