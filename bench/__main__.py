"""`python -m bench`: run every benchmark and write BENCHMARKS.md.

    python -m bench                      # every benchmark at full size -> BENCHMARKS.md (times: each section's)
    python -m bench --smoke              # every benchmark at smoke size -> bench/out/smoke/BENCHMARKS.md
    python -m bench --only kernel trl    # rerun these; the others' sections are read back from --out

Each benchmark runs in its own process (`python -m bench.<module> --out OUT/<name>`), one after
another, never two at once (on 2 cores a neighbour slows every torch op several-fold). Each
measures keelrl and its baseline side by side in that one process and writes
OUT/<name>/section.json; the report lists every ratio against its target, then each section
with the machine, commit and time it was measured at. A benchmark that fails is reported as
failed, with the tail of its output, and makes this command exit non-zero.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, Section, machine, read_section

BENCHES: dict[str, tuple[str, str]] = {
    "trl": ("bench.bench_trl", "End-to-end GRPO step against TRL's GRPOTrainer"),
    "kernel": ("bench.bench_kernel", "Log-prob and entropy kernel against a full log-softmax"),
    "sampler": ("bench.bench_sampler", "Sampler against HF generate"),
    "engine": ("bench.bench_engine", "Decode engine against HF generate and llama.cpp"),
    "async": ("bench.bench_async", "Sync against async rollouts"),
    "async_heldout": ("bench.bench_async_heldout", "Sync against async on the coding environment, held-out success"),
    "scaling": ("bench.bench_scaling", "Scaling curves"),
    "gpu": ("bench.gpu", "GPU profile"),
    "mismatch": ("bench.bench_mismatch", "Sampler/learner precision mismatch and the rollout corrections"),
    "endpoint": ("bench.bench_endpoint", "Harness sessions through the endpoint against the in-process loop"),
    "vllm": ("bench.bench_vllm", "keel's decoder against vLLM and HF generate"),
    "lora": ("bench.bench_lora", "LoRA against full fine-tuning"),
    "lockstep": ("bench.bench_lockstep", "Lockstep batches against streaming"),
    "proximal": ("bench.bench_proximal", "The first update's proximal log-probs from its own pass"),
    "padding": ("bench.bench_padding", "A group's rows split into passes by length"),
}
"""name -> (module, title), in the order they run and are reported."""


OWN_VENV = {"bench.bench_vllm": ROOT / ".venv-vllm" / "bin" / "python"}
"""Benchmarks that run in a venv of their own (vLLM's pins differ from ours: `bash .ci/vllm` builds it)."""


def python_for(module: str) -> str:
    """The interpreter a benchmark runs in: its own venv's, else this one."""
    own = OWN_VENV.get(module)
    if own is not None and not own.exists():
        raise SystemExit(f"{module} runs in {own.parent.parent}, which is not built: bash .ci/vllm -k nothing")
    return str(own) if own is not None else sys.executable


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every benchmark at its smallest size (minutes)")
    parser.add_argument("--only", nargs="+", choices=list(BENCHES), help="run these; read the others' sections back")
    parser.add_argument("--out", type=Path, help="where sections go (default bench/out/full or bench/out/smoke)")
    parser.add_argument("--report", type=Path, help="the markdown written (default BENCHMARKS.md; OUT/BENCHMARKS.md "
                                                    "with --smoke)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one benchmark may run")
    args = parser.parse_args(argv)
    args.out = args.out or ROOT / "bench" / "out" / ("smoke" if args.smoke else "full")
    args.report = args.report or (args.out / "BENCHMARKS.md" if args.smoke else ROOT / "BENCHMARKS.md")
    return args


def run_one(name: str, args: argparse.Namespace) -> tuple[Section | None, str]:
    """Run benchmark `name` in its own process; (its section, or None and why it failed)."""
    module, _ = BENCHES[name]
    out = args.out / name
    (out / "section.json").unlink(missing_ok=True)
    command = [python_for(module), "-m", module, "--out", str(out)] + (["--smoke"] if args.smoke else [])
    print(f"== {name}: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as error:
        tail = (error.stdout or b"")[-3000:] if isinstance(error.stdout, bytes) else (error.stdout or "")[-3000:]
        return None, f"timed out after {args.timeout:.0f} s\n{tail}"
    (out).mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(done.stdout + done.stderr)
    print(f"   {time.perf_counter() - started:.0f} s, exit {done.returncode}", flush=True)
    if done.returncode != 0 or not (out / "section.json").exists():
        return None, f"exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}"
    return read_section(out / "section.json"), ""


def stamp(section_path: Path) -> str:
    return datetime.datetime.fromtimestamp(section_path.stat().st_mtime, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC")


def report(sections: dict[str, Section | None], failures: dict[str, str], args: argparse.Namespace) -> str:
    info = machine()
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    lines = ["# Benchmarks", "",
             "Written by `python -m bench`" + (" --smoke (smoke sizes: these figures measure nothing)" if args.smoke
                                              else "") + "; do not edit by hand.", "",
             f"- Machine: {info['cpu']}, {info['cores']} cores ({info['cpu_capability']}), "
             f"{info['memory_gib']} GiB, GPU: {info['gpu']}; {info['platform']}, Python {info['python']}",
             f"- Versions: {versions}",
             f"- Commit: {info['commit']}; torch threads {info['torch_threads']}", "",
             "Every ratio compares keelrl with its baseline measured side by side in one process; "
             "spreads are median (min-max, n) over repeats.", "",
             "| benchmark | figure | value | target | met |", "|---|---|---|---|---|"]
    for name, section in sections.items():
        if section is None:
            lines.append(f"| {name} | **failed** (see below) | - | - | no |")
            continue
        for ratio in section.ratios:
            sign = ">=" if ratio.higher_is_better else "<="
            lines.append(f"| {name} | {ratio.name} | {ratio.value:.3g} | {sign} {ratio.target:g} "
                         f"| {'yes' if ratio.met else '**no**'} |")
        if not section.ratios:
            lines.append(f"| {name} | (no ratio: see its section) | - | - | - |")
    for name, section in sections.items():
        lines += ["", f"## {BENCHES[name][1]} (`{name}`)", ""]
        if section is None:
            lines += ["**Failed:**", "", "```", failures.get(name, "").strip(), "```"]
            continue
        path = args.out / name / "section.json"
        lines += [f"_Measured {stamp(path)} in {section.seconds:.0f} s; "
                  f"`python -m {BENCHES[name][0]}`{' --smoke' if section.smoke else ''}._", "",
                  section.markdown.strip()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = args.only or list(BENCHES)
    sections: dict[str, Section | None] = {}
    failures: dict[str, str] = {}
    for name in BENCHES:
        if name in chosen:
            sections[name], failures[name] = run_one(name, args)
        elif (args.out / name / "section.json").exists():
            sections[name] = read_section(args.out / name / "section.json")
        else:
            sections[name], failures[name] = None, "not run yet in this output directory"
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(report(sections, failures, args))
    (args.out / "summary.json").write_text(json.dumps(
        {name: None if s is None else [{"name": r.name, "value": r.value, "target": r.target, "met": r.met}
                                       for r in s.ratios] for name, s in sections.items()}, indent=2) + "\n")
    print(f"wrote {args.report}")
    failed = [name for name in chosen if sections.get(name) is None]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
