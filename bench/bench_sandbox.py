"""Sandboxed gradings per second against a plain subprocess, on the same small grading.

The grading is what an RL coding task runs per sample: a candidate function called on four
inputs, the four outcomes printed as JSON. The baseline is
``subprocess.run([sys.executable, "-I", "-S", script])`` with no isolation at all; the
sandbox run is `keelrl.sandbox.Sandbox.run` with the strongest isolation the machine allows
(or weaker, with --no-namespaces / --no-uid-drop). Every run's output is checked, so a
broken sandbox cannot look fast.

    python bench/bench_sandbox.py --runs 200 --out sandbox_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from keelrl.sandbox import Sandbox, SandboxLimits

GRADER = '''\
import json


def candidate(n):
    """The policy's answer: the n-th triangular number."""
    return n * (n + 1) // 2


CASES = [(0, 0), (1, 1), (4, 10), (100, 5050)]
outcomes = []
for argument, expected in CASES:
    try:
        outcomes.append(candidate(argument) == expected)
    except Exception:
        outcomes.append(False)
print(json.dumps({"passed": sum(outcomes), "outcomes": outcomes}))
'''
EXPECTED = {"passed": 4, "outcomes": [True, True, True, True]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="gradings per method (default 200)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed gradings per method first")
    parser.add_argument("--workers", type=int, default=1,
                        help="gradings in flight at once, from threads (default 1: one after another)")
    parser.add_argument("--no-namespaces", action="store_true", help="Sandbox(use_namespaces=False)")
    parser.add_argument("--no-uid-drop", action="store_true", help="Sandbox(use_uid_drop=False)")
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    return parser.parse_args()


def plain_grading(script: Path) -> Callable[[], None]:
    def grade() -> None:
        done = subprocess.run([sys.executable, "-I", "-S", str(script)], capture_output=True, timeout=30)
        if done.returncode != 0 or json.loads(done.stdout) != EXPECTED:
            raise RuntimeError(f"plain grading went wrong: {done!r}")
    return grade


def sandboxed_grading(sandbox: Sandbox) -> Callable[[], None]:
    def grade() -> None:
        result = sandbox.run({"grader.py": GRADER}, ["grader.py"])
        if not result.ok or json.loads(result.stdout) != EXPECTED:
            raise RuntimeError(f"sandboxed grading went wrong: {result.verdict()} {result.stdout!r}")
    return grade


def measure(grade: Callable[[], None], runs: int, warmup: int, workers: int) -> dict:
    for _ in range(warmup):
        grade()
    latencies: list[float] = []

    def timed(_: int) -> None:
        start = time.perf_counter()
        grade()
        latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(timed, range(runs)))
    elapsed = time.perf_counter() - start
    ordered = sorted(latencies)
    return {"runs": runs, "seconds": elapsed, "per_s": runs / elapsed,
            "mean_ms": 1000 * statistics.fmean(ordered), "p50_ms": 1000 * ordered[len(ordered) // 2],
            "p95_ms": 1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]}


def main() -> None:
    args = parse_args()
    sandbox = Sandbox(SandboxLimits(), use_namespaces=not args.no_namespaces, use_uid_drop=not args.no_uid_drop)
    with tempfile.TemporaryDirectory(prefix="keel-bench-") as tmp:
        script = Path(tmp) / "grader.py"
        script.write_text(GRADER)
        plain = measure(plain_grading(script), args.runs, args.warmup, args.workers)
    sandboxed = measure(sandboxed_grading(sandbox), args.runs, args.warmup, args.workers)
    report = {
        "plain": plain, "sandbox": sandboxed,
        "slowdown": plain["per_s"] / sandboxed["per_s"],
        "isolation": list(sandbox.report.mechanisms()), "missing": list(sandbox.report.missing),
        "plain_interpreter": sys.executable, "sandbox_interpreter": sandbox.report.interpreter,
        "workers": args.workers, "cpus": os.cpu_count(), "machine": platform.platform(),
    }
    print(f"{args.runs} gradings each, {args.workers} at a time, {os.cpu_count()} CPUs")
    print(f"{'method':<10} {'gradings/s':>10} {'mean ms':>8} {'p50 ms':>7} {'p95 ms':>7}")
    for name, row in (("plain", plain), ("sandbox", sandboxed)):
        print(f"{name:<10} {row['per_s']:>10.1f} {row['mean_ms']:>8.1f} {row['p50_ms']:>7.1f} {row['p95_ms']:>7.1f}")
    print(f"sandbox is {report['slowdown']:.2f}x slower; isolation in force: {', '.join(report['isolation'])}")
    for item in sandbox.report.missing:
        print(f"missing: {item}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
