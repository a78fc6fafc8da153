"""Where the coding environment's tasks come from: what `env.tasks`, `keel tasks` and `keel audit --tasks` name.

    bundled   the templated tasks of `coding_tasks.KINDS` (the default run's)
    agent     the opt-in agent kinds (`coding_tasks.AGENT_KINDS`): one look at the file rarely
              suffices, the failing test's message says what to change
    real      the real-code family (`keelrl.envs.real_tasks`): standard-library functions
    PATH      a tasks .jsonl file (`keelrl.envs.tasks.load_tasks`)

Names combine with commas, "bundled,agent,real", in any order, each at most once. Their tasks
are interleaved in proportion to the sources' sizes (`interleave`), each source's in its own
order, so that every stretch of consecutive tasks holds each source in its share: the warm start
plays the first training tasks, and with the sources one after the other it would see only the
first source's. Every task is in the split its family gives it (`task_split`):
`real_split` for the real-code family, which holds out whole source functions, and
`split_of(task.id, seed)` for the rest. A real-code task exported to a file and loaded back
keeps its split, since the split follows the task id. `family_of` names a task's family for the
held-out report: "real", "agent" or "templated" (bundled tasks, and a file's other tasks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from keelrl.envs.tasks import Task, TaskError, load_tasks, split_of

NAMED_SOURCES = ("bundled", "agent", "real")
"""The task sources `env.tasks` names (module docstring); anything else is a path."""


def source_parts(source: str) -> list[str]:
    """The comma-separated names of `source`, or [source] when it is one path. TaskError for an
    empty part, a part named twice, or a comma list mixing names and anything else (a path with
    a comma in its name is read as a path when it exists)."""
    if not isinstance(source, str) or not source.strip():
        raise TaskError(f"a task source must be a non-empty string: {', '.join(NAMED_SOURCES)} (comma-"
                        f"separated) or a tasks .jsonl file, got {source!r}")
    if "," not in source or Path(source).exists():
        return [source]
    parts = [part.strip() for part in source.split(",")]
    unknown = [part for part in parts if part not in NAMED_SOURCES]
    if unknown:
        raise TaskError(f"task source {source!r}: {unknown[0]!r} is not one of {', '.join(NAMED_SOURCES)} "
                        f"(a tasks file cannot be combined with other sources)")
    if len(set(parts)) != len(parts):
        raise TaskError(f"task source {source!r} names a source twice")
    return parts


def is_file_source(source: str) -> bool:
    """Whether `source` is a tasks file rather than named sources (the sandbox hides the file)."""
    parts = source_parts(source)
    return len(parts) == 1 and parts[0] not in NAMED_SOURCES


def load_source(source: str, seed: int = 0) -> list[Task]:
    """Every task of `source` (module docstring), generated with `seed` where generated.

    TaskError for a bad name or a malformed file, OSError for a missing one; a name that is
    neither a source nor an existing file says so and lists the names."""
    from keelrl.envs.coding_tasks import AGENT_KINDS, KINDS, generate_tasks

    parts: list[list[Task]] = []
    for part in source_parts(source):
        tasks: list[Task] = []
        if part == "bundled":
            tasks += generate_tasks(seed)
        elif part == "agent":  # generated after KINDS, so an agent task is the same with or without bundled
            tasks += [task for task in generate_tasks(seed, kinds=KINDS + AGENT_KINDS) if task.kind in AGENT_KINDS]
        elif part == "real":
            from keelrl.envs.real_tasks import real_tasks

            tasks += real_tasks(seed)
        elif not Path(part).exists() and not part.endswith(".jsonl"):
            raise TaskError(f"task source {part!r} is neither one of {', '.join(NAMED_SOURCES)} nor an existing "
                            f"tasks .jsonl file")
        else:
            tasks += load_tasks(part)
        parts.append(tasks)
    return interleave(parts)


def interleave(parts: Sequence[Sequence[Task]]) -> list[Task]:
    """The tasks of `parts` merged in proportion to their lengths, each part's in its own order:
    the i-th of a part of n tasks goes at the fraction (i + 1/2) / n of the whole (ties in the
    order of `parts`). One part comes back unchanged."""
    keyed = [((i + 0.5) / len(part), p, i) for p, part in enumerate(parts) for i in range(len(part))]
    return [parts[p][i] for _, p, i in sorted(keyed)]


def _real_source(task: Any) -> bool:
    from keelrl.envs.real_tasks import source_of

    try:
        source_of(task.id)
    except ValueError:
        return False
    return True


def task_split(task: Any, seed: int = 0) -> str:
    """'train' or 'heldout': `real_split` for a task of the real-code family (by its id), else
    `split_of(task.id, seed)`."""
    if _real_source(task):
        from keelrl.envs.real_tasks import real_split

        return real_split(task, seed)
    return split_of(task.id, seed)


def source_split(source: str, split: str, seed: int = 0) -> list[Task]:
    """The tasks of `source` in `split` ('train', 'heldout' or 'all'), in the source's order."""
    if split not in ("all", "train", "heldout"):
        raise ValueError(f"split must be 'all', 'train' or 'heldout', got {split!r}")
    tasks = load_source(source, seed)
    return tasks if split == "all" else [task for task in tasks if task_split(task, seed) == split]


def family_of(task: Any) -> str:
    """The family a task is reported under: "real" (the real-code family), "agent" (an agent kind)
    or "templated" (everything else)."""
    from keelrl.envs.coding_tasks import AGENT_KINDS

    if _real_source(task):
        return "real"
    return "agent" if getattr(task, "kind", None) in AGENT_KINDS else "templated"


def families(tasks: Sequence[Any]) -> list[str]:
    """`family_of` of each task."""
    return [family_of(task) for task in tasks]
