"""What every benchmark shares: the section it writes, spreads over repeats, the machine, load.

A benchmark is a module `bench.<name>` run as `python -m bench.<name> --out DIR [--smoke]`. It
measures keelrl side by side with a baseline in the same invocation and writes
`DIR/section.json` (`write_section`): a title, a markdown body, and its ratios, each with the
target it is judged against. `python -m bench` runs them all and assembles `BENCHMARKS.md`
from those files. Nothing here asserts a time: tests run each benchmark at `--smoke` size and
check that it measured what it says, never how fast.

Load: on a 2-core box a neighbour makes every 2-thread torch op wait on a descheduled thread,
so each measurement records the CPU share OTHER processes used while it ran (`Clock`), and a
figure measured above `NOISY` is flagged in its section.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent

NOISY = 0.10
"""A measurement during which other processes used more than this share of the CPUs is flagged."""


@dataclass
class Ratio:
    """One headline figure: keelrl against its baseline, and the target it is judged by."""

    name: str
    value: float
    target: float
    higher_is_better: bool = True
    """True: value >= target meets it (a speed-up); False: value <= target does (a memory share)."""
    detail: str = ""
    """min / median / max over repeats, or what the value is the ratio of."""

    @property
    def met(self) -> bool:
        if not math.isfinite(self.value):
            return False
        return self.value >= self.target if self.higher_is_better else self.value <= self.target


@dataclass
class Section:
    """What one benchmark reports."""

    name: str
    title: str
    markdown: str
    ratios: list[Ratio] = field(default_factory=list)
    smoke: bool = False
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)
    """Everything measured, for the JSON; the markdown is what people read."""


def write_section(out: Path, section: Section) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    payload = asdict(section)
    for ratio, raw in zip(section.ratios, payload["ratios"]):
        raw["met"] = ratio.met
    path = out / "section.json"
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    return path


def read_section(path: Path) -> Section:
    raw = json.loads(path.read_text())
    ratios = [Ratio(**{k: v for k, v in r.items() if k != "met"}) for r in raw.pop("ratios")]
    return Section(ratios=ratios, **raw)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def arguments(description: str, *, out: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes: --out (where section.json goes) and --smoke."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / out, help="directory for section.json")
    parser.add_argument("--smoke", action="store_true", help="smallest size: checks the benchmark runs, measures nothing")
    return parser


def labs_student(model: str = "") -> str:
    """`model` (a registered name or a local path) when given, else the SmolLM2 labs' cached student
    (`keelrl.labs.common.cached_student` with the coding labs' settings; made once per machine
    when it is not cached yet), so a benchmark's episodes are the multi-turn ones the labs run."""
    if model:
        return model
    from keelrl.labs.common import CODING_LAB, cached_student

    return str(cached_student(CODING_LAB, progress=lambda message: print(message, flush=True)))


def step_arguments(parser: argparse.ArgumentParser, *, minibatch: int) -> None:
    """The flags of a benchmark that reruns one sampled RL step's learner (`sampled_step`)."""
    parser.add_argument("--model", default="", help="a registered model name or a local path (default: the labs' "
                                                    "cached student)")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--minibatch", type=int, default=minibatch, help="train.minibatch_size (rows an update)")
    parser.add_argument("--repeats", type=int, default=3)


@dataclass
class SampledStep:
    """One RL step's rollouts, sampled once, and what reruns its learner from the same start."""

    model: str
    trainer: Any
    trajectories: list[Any]
    batch: Any
    group_ids: list[int]
    first: list[int]
    """The rows of the step's first minibatch (`Learner.first_update_rows`)."""
    weights: dict[str, Any]
    optimiser: dict[str, Any]
    tokens: int

    def reset(self) -> None:
        """The policy's weights and optimiser state as the step started."""
        self.trainer.model.load_state_dict(self.weights)
        self.trainer.learner.optimizer.load_state_dict(self.optimiser)


def sampled_step(args: argparse.Namespace, run_dir: Path, overrides: Sequence[str] = ()) -> SampledStep:
    """Sample step 1's rollouts of the coding labs' shape (`args.tasks` x `args.group`, five
    turns, the sync engine in lockstep, no dynamic sampling) from `labs_student(args.model)` with
    `train.minibatch_size=args.minibatch` and `overrides`; `args.smoke` shortens the episodes."""
    import copy

    from keelrl.config import load_config
    from keelrl.rollout.trajectory import collate
    from keelrl.train.trainer import Trainer

    model = labs_student(args.model)
    small = ["env.show_file=false", "env.max_turns=3", "rollout.max_new_tokens=16"] if args.smoke else []
    cfg = load_config(overrides=[f"model.path={model}", f"run_dir={run_dir}", "warm_start.demos=0",
                                 f"rollout.tasks_per_step={args.tasks}", f"rollout.group_size={args.group}",
                                 f"train.minibatch_size={args.minibatch}", "algo.dynamic_sampling=false",
                                 "rollout.engine=sync", "rollout.lockstep=true", *overrides, *small])
    trainer = Trainer(cfg)
    engine = trainer.make_engine()
    engine.start(0)
    trajectories = engine.batch(1).trajectories
    engine.close()
    group_ids = [t.group_id for t in trajectories]
    batch = collate(trajectories, trainer.pad_id).to(trainer.device)
    return SampledStep(model, trainer, trajectories, batch, group_ids, trainer.learner.first_update_rows(group_ids, 1),
                       copy.deepcopy(trainer.model.state_dict()), copy.deepcopy(trainer.learner.optimizer.state_dict()),
                       int(batch.attention_mask.sum()))


# --------------------------------------------------------------------------- worker processes
def run_worker(module: str, spec: dict[str, Any], what: str) -> dict[str, Any]:
    """Run `python -m MODULE --worker SPEC.json` in a fresh process (pinning, threads and memory
    are process-wide); its last stdout line is the JSON result. `what` names it in an error."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle, default=_jsonable)
    try:
        done = subprocess.run([sys.executable, "-m", module, "--worker", handle.name], cwd=ROOT,
                              capture_output=True, text=True)
    finally:
        Path(handle.name).unlink(missing_ok=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def read_worker_spec(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def serve_worker(args: argparse.Namespace, run: Any) -> bool:
    """In a worker process (`--worker SPEC`): print `run(spec)` as the JSON result line; True if so."""
    if not getattr(args, "worker", None):
        return False
    print(json.dumps(run(read_worker_spec(args.worker)), default=_jsonable))
    return True


# --------------------------------------------------------------------------- statistics
def spread(values: Sequence[float]) -> dict[str, float]:
    """min / median / max (and n) of repeated measurements."""
    if not values:
        raise ValueError("spread of no values")
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def fmt_spread(values: Sequence[float], digits: int = 2) -> str:
    """'median (min-max, n)' of repeated measurements."""
    s = spread(values)
    if s["n"] == 1:
        return f"{s['median']:.{digits}f} (n=1)"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f}, n={s['n']})"


# --------------------------------------------------------------------------- load
class Clock:
    """Wall time, this process's CPU time (children included) and the machine's busy CPU time."""

    def __init__(self) -> None:
        self.start = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
        except (OSError, ValueError, IndexError):
            busy = math.nan
        cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
        return time.perf_counter(), cpu, busy

    def read(self) -> dict[str, float]:
        """Since construction: wall_s, own_cpu_share, other_cpu_share (of all CPUs), noisy."""
        wall, own, busy = (now - then for now, then in zip(self._now(), self.start))
        cpus = os.cpu_count() or 1
        other = (busy - own) / (max(wall, 1e-9) * cpus)
        return {"wall_s": wall, "own_cpu_share": own / (max(wall, 1e-9) * cpus),
                "other_cpu_share": other, "noisy": bool(other > NOISY)}


def wait_quiet(limit_s: float) -> float:
    """Wait up to `limit_s` for a 1 s window with other processes under NOISY; the seconds waited."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        clock = Clock()
        time.sleep(1.0)
        if not clock.read()["other_cpu_share"] >= NOISY:  # NaN (no /proc/stat) counts as quiet
            break
    return time.perf_counter() - started


# --------------------------------------------------------------------------- the machine
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return math.nan


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": round(_memory_gib(), 1),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "gpu": gpu,
        "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
        "python": sys.version.split()[0], "commit": _commit(),
        "versions": {name: _version(name) for name in ("keelrl", "torch", "transformers", "trl", "accelerate", "ray")},
    }
