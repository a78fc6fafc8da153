"""A success-rate curriculum over training tasks whose sampling weights never decrease.

The lecture's recipe: learn from solutions first (the warm start), then practise the tasks the
model sometimes solves, raising difficulty as it improves, without dropping earlier tasks. The
formal side is Bengio et al. (2009): a curriculum is a sequence of reweighted training
distributions in which no example's weight ever decreases and every example ends at weight 1.

Here each task has a difficulty level (0 = easiest) and a weight in [0, 1]:

- tasks above the current level have weight 0 (not admitted yet);
- an admitted task never measured gets `probe_weight`, so it is tried and measured;
- a measured task whose success rate sits in the band [low, high] ("sometimes solved") gets 1;
  one outside it (always or never solved so far) keeps at least `probe_weight`;
- the level rises when the mean success rate of the current level's measured tasks reaches
  `advance_at`, admitting the next level's tasks;
- once the last level is mastered too (its mean measured success reaches `advance_at`),
  `update` calls `finish()`, which sets every weight to 1: the curriculum's last distribution
  is the plain one.

A weight is only ever raised (each update takes the maximum of the old weight and the new
target), which is the invariant the property tests check. Progress is measured on the fixed
held-out set by the trainer, never on these tasks' own rates.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Sequence

from keelrl.config import CurriculumSettings


@dataclass
class Curriculum:
    """Weights over tasks 0..n-1 with the given difficulty levels (see the module docstring)."""

    levels: Sequence[int]
    cfg: CurriculumSettings = field(default_factory=CurriculumSettings)
    """The band, probe weight, advance threshold and attempts (`enabled` and `levels` are the trainer's)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("a curriculum needs at least one task")
        if min(self.levels) < 0:
            raise ValueError(f"difficulty levels must be >= 0, got {min(self.levels)}")
        self.level = min(self.levels)
        self.top = max(self.levels)
        self.attempts = [0] * len(self.levels)
        self.successes = [0] * len(self.levels)
        self.weights = [0.0] * len(self.levels)
        self._rng = random.Random(f"{self.seed}:curriculum")
        self._retarget()

    def rate(self, task: int) -> float | None:
        """The task's success rate, or None before min_attempts attempts."""
        if self.attempts[task] < self.cfg.min_attempts:
            return None
        return self.successes[task] / self.attempts[task]

    def record(self, task: int, success: bool) -> None:
        """One attempt's outcome; weights and level follow at the next `update`."""
        self.attempts[task] += 1
        self.successes[task] += int(success)

    def _mastered(self) -> bool:
        """Whether the current level's measured tasks' mean success reaches advance_at."""
        rates = [r for t, level in enumerate(self.levels) if level == self.level
                 for r in [self.rate(t)] if r is not None]
        return bool(rates) and sum(rates) / len(rates) >= self.cfg.advance_at

    def update(self) -> None:
        """Raise the level while the current one is mastered, then raise weights to their
        targets; once the last level is mastered, `finish`."""
        while self.level < self.top and self._mastered():
            self.level = min(level for level in self.levels if level > self.level)
        if self.level == self.top and self._mastered():
            self.finish()
            return
        self._retarget()

    def _retarget(self) -> None:
        low, high = self.cfg.band_low, self.cfg.band_high
        for task, level in enumerate(self.levels):
            if level > self.level:
                continue
            rate = self.rate(task)
            target = 1.0 if rate is not None and low <= rate <= high else self.cfg.probe_weight
            self.weights[task] = max(self.weights[task], target)

    def finish(self) -> None:
        """The last distribution: every task at weight 1."""
        self.level = self.top
        self.weights = [1.0] * len(self.levels)

    def sample(self, count: int, rng: random.Random | None = None) -> list[int]:
        """`count` distinct tasks (fewer if fewer are admitted), drawn in proportion to weight
        (from `rng`, else the curriculum's own generator)."""
        return weighted_sample(self.weights, count, rng or self._rng)

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint keeps: the level, the counts and the weights."""
        return {"level": self.level, "attempts": list(self.attempts), "successes": list(self.successes),
                "weights": list(self.weights)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        attempts, successes, weights = state["attempts"], state["successes"], state["weights"]
        assert isinstance(attempts, list) and isinstance(successes, list) and isinstance(weights, list)
        if not len(attempts) == len(successes) == len(weights) == len(self.levels):
            raise ValueError(f"curriculum state for {len(weights)} tasks; this curriculum has {len(self.levels)}")
        level = state["level"]
        assert isinstance(level, int)
        self.level, self.attempts, self.successes, self.weights = level, list(attempts), list(successes), list(weights)

    def metrics(self) -> dict[str, float]:
        """curriculum/level, admitted share, band occupancy (admitted measured tasks in the band),
        the entropy of the normalised weights and the attempts recorded so far."""
        low, high = self.cfg.band_low, self.cfg.band_high
        admitted = [t for t, w in enumerate(self.weights) if w > 0]
        measured = [r for t in admitted for r in [self.rate(t)] if r is not None]
        total = sum(self.weights)
        entropy = -sum(w / total * math.log(w / total) for w in self.weights if w > 0) if total else 0.0
        return {"curriculum/level": float(self.level),
                "curriculum/admitted_frac": len(admitted) / len(self.weights),
                "curriculum/band_occupancy": (sum(low <= r <= high for r in measured) / len(measured)
                                              if measured else 0.0),
                "curriculum/weight_entropy": entropy,
                "curriculum/attempts": float(sum(self.attempts))}


def weighted_sample(weights: Sequence[float], count: int, rng: random.Random) -> list[int]:
    """`count` distinct indices (fewer if fewer have weight > 0), each draw in proportion to the
    weights of those not yet drawn."""
    pool = [(index, weight) for index, weight in enumerate(weights) if weight > 0]
    chosen: list[int] = []
    while pool and len(chosen) < count:
        point = rng.random() * sum(weight for _, weight in pool)
        for position, (index, weight) in enumerate(pool):
            point -= weight
            if point < 0 or position == len(pool) - 1:
                chosen.append(index)
                del pool[position]
                break
    return chosen
