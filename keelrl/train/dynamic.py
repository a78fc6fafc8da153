"""DAPO dynamic sampling: train only on groups whose rewards differ, and draw more to fill the batch.

A group whose G attempts all earned the same reward has zero group-relative advantage: it
costs a forward and backward pass and teaches nothing (Yu et al. 2025). `fill_batch` keeps
the groups with mixed rewards, each kept whole, and draws extra groups until `target` groups
are kept or `max_extra` extra groups have been drawn. Surplus mixed groups of the last draw
are not used (the batch stays its configured size); when the cap is reached first, the batch
is simply smaller and `dynamic/cap_reached` says so.

A group is judged by its episodes' outcome rewards only. With per-turn rewards (env.shaping) and
a turn-level estimator (turn_rloo), a group whose outcomes are all equal can still give its
turns non-zero advantages (one failed episode's edit passed more visible tests than another's);
such a group is dropped too. The default run measured both ways in docs/multi-turn.md.

Metrics: the zero-advantage fraction among all groups drawn, before filtering; groups drawn
per kept group (NaN when none was kept); seconds spent filling; kept and extra counts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from keelrl.rollout.trajectory import Trajectory

Group = list[Trajectory]


def is_mixed(group: Sequence[Trajectory], tolerance: float = 1e-9) -> bool:
    """True when the group's rewards are not all equal (so some advantage is non-zero). A group
    with an episode whose environment failed (reward NaN) is not: it has no baseline to learn from."""
    rewards = [t.reward for t in group]
    if any(math.isnan(reward) for reward in rewards):
        return False
    return bool(rewards) and max(rewards) - min(rewards) > tolerance


@dataclass
class FilledBatch:
    """The kept groups, in draw order, and the filling's metrics."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)


def fill_batch(first: Sequence[Group], draw: Callable[[int], list[Group]], target: int,
               max_extra: int) -> FilledBatch:
    """Keep mixed groups of `first`, then call `draw(count)` for more until `target` are kept.

    `draw(count)` returns `count` new groups (drawn concurrently, e.g. by the rollout engine).
    At most `max_extra` groups are drawn beyond `first`.
    """
    if target < 1 or max_extra < 0:
        raise ValueError(f"target must be >= 1 and max_extra >= 0, got {target} and {max_extra}")
    tick = time.monotonic()
    drawn = list(first)
    kept = [g for g in first if is_mixed(g)][:target]
    extra = 0
    while len(kept) < target and extra < max_extra:
        count = min(target - len(kept), max_extra - extra)
        more = draw(count)
        if len(more) != count:
            raise RuntimeError(f"draw({count}) returned {len(more)} groups")
        extra += count
        drawn += more
        kept += [g for g in more if is_mixed(g)][:target - len(kept)]
    uniform = sum(1 for g in drawn if not is_mixed(g))
    return FilledBatch(kept, {
        "dynamic/zero_adv_frac_before": uniform / max(1, len(drawn)),
        "dynamic/groups_drawn": float(len(drawn)),
        "dynamic/extra_groups": float(extra),
        "dynamic/kept_groups": float(len(kept)),
        "dynamic/draws_per_kept_group": len(drawn) / len(kept) if kept else math.nan,
        "dynamic/cap_reached": float(len(kept) < target),
        "time/dynamic_fill_s": time.monotonic() - tick,
    })
