"""keelrl's chunked log-prob and entropy kernel against a naive full log-softmax: peak memory and time.

The learner needs, for every scored position t, log pi(token_t | prefix) and the entropy of that
distribution, with gradients. Naively that is `log_softmax(head(hidden))` over the whole
sequence: a float32 [T, V] tensor (5 GB at T = 8k, V = 152k), kept for the backward pass with
its softmax and the entropy's product beside it. keelrl's `logprobs_from_hidden`
(keelrl/policy/model.py) runs the head over chunks of 256 positions, gathers each chunk's
log-prob and entropy, and checkpoints the chunk, so the backward pass recomputes one chunk's
logits at a time: autograd keeps the hidden states and the [T] results, not the [T, V] logits.

What is measured, per (vocabulary V, sequence length T), each implementation in a fresh
process: forward and backward of `sum(logp) + 0.01 * sum(entropy)` with respect to the hidden
states [1, T, H] and the head weight [V, H] (float32, as the learner's head runs), then
- peak memory: on CUDA `torch.cuda.max_memory_allocated` less what was allocated before the
  pass; on CPU the process's peak resident set (ru_maxrss) less its resident set just before
  the pass (inputs, weights and their gradient buffers already touched), so both count only
  what the pass itself needed;
- wall time of the pass (the fastest of `--reps` after one warm-up when the naive pass is small
  enough to repeat);
- agreement: sums of logp and entropy and the gradient norms of both implementations.
H is the model's hidden size for that vocabulary (576 for SmolLM2's 49,152, 896 for Qwen2's
151,936). A naive pass whose estimated peak (from its smaller-T measurement, linear in T)
exceeds `--memory-budget-gib` is not run: the section says so and gives the estimate, and
that configuration's ratio is left out of the target.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, Clock, Ratio, Section, arguments, machine, write_section

SHAPES = {49152: 576, 151936: 896}
"""vocabulary -> hidden size: SmolLM2-135M and Qwen2-0.5B."""


def parse_args(argv: list[str] | None = None) -> Any:
    parser = arguments(__doc__.split("\n\n")[0], out="kernel")
    parser.add_argument("--vocab", type=int, nargs="+", default=list(SHAPES), help="vocabulary sizes")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192], help="sequence lengths")
    parser.add_argument("--reps", type=int, default=3, help="timed passes per small configuration")
    parser.add_argument("--memory-budget-gib", type=float, default=14.0,
                        help="skip a naive pass whose estimated peak exceeds this (24 GiB machine)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--worker", type=str, help=argparse.SUPPRESS)  # internal: one pass, as JSON
    args = parser.parse_args(argv)
    if args.smoke:
        args.vocab, args.lengths, args.reps = [8192], [256, 512], 1
    for name in ("vocab", "lengths"):
        bad = [v for v in getattr(args, name) if v < 2]
        if bad:
            parser.error(f"--{name} must be >= 2, got {bad}")
    if args.memory_budget_gib <= 0:
        parser.error(f"--memory-budget-gib must be > 0, got {args.memory_budget_gib}")
    return args


# --------------------------------------------------------------------------- the two implementations
def naive_logprobs(head: Any, hidden: Any, input_ids: Any) -> tuple[Any, Any]:
    """hidden [B, T, H], input_ids [B, T] -> (logp, entropy) [B, T-1]: one full float32 log-softmax."""
    import torch

    logits = head(hidden[:, :-1]).float()  # [B, T-1, V]
    log_probs = torch.log_softmax(logits, dim=-1)  # [B, T-1, V]
    logp = log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # [B, T-1]
    return logp, entropy


def keelrl_logprobs(head: Any, hidden: Any, input_ids: Any) -> tuple[Any, Any]:
    """The same through keelrl's `logprobs_from_hidden` (chunks of 256, checkpointed)."""
    import torch

    from keelrl.policy.model import logprobs_from_hidden

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = head

        def get_output_embeddings(self) -> Any:
            return self.head

    logp, entropy = logprobs_from_hidden(Holder(), hidden, input_ids, positions=None, with_entropy=True,
                                         temperature=1.0)
    assert entropy is not None
    return logp[:, 1:], entropy[:, 1:]


IMPLEMENTATIONS = {"naive": naive_logprobs, "keelrl": keelrl_logprobs}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One implementation at one shape, in this (fresh) process: peak memory, time, checksums."""
    import torch

    device = torch.device(spec["device"])
    torch.manual_seed(0)
    vocab, length, hidden_size = spec["vocab"], spec["length"], spec["hidden"]
    head = torch.nn.Linear(hidden_size, vocab, bias=False, device=device)
    torch.nn.init.normal_(head.weight, std=0.02)
    hidden = (torch.randn(1, length, hidden_size, device=device) * 2.0).requires_grad_(True)
    input_ids = torch.randint(vocab, (1, length), device=device)
    head.weight.grad = torch.zeros_like(head.weight)  # both implementations touch the same gradient buffers
    hidden.grad = torch.zeros_like(hidden)
    fn = IMPLEMENTATIONS[spec["impl"]]
    warm = min(64, length)  # imports, thread pools and kernels set up before anything is measured
    fn(head, hidden[:, :warm].detach().requires_grad_(True), input_ids[:, :warm])[0].sum().backward()
    times = []
    peak = 0
    result: dict[str, Any] = {}
    for rep in range(spec["reps"]):
        head.weight.grad.zero_()
        hidden.grad.zero_()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = _rss_bytes()
        clock = Clock()
        logp, entropy = fn(head, hidden, input_ids)
        loss = logp.sum() + 0.01 * entropy.sum()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - before)
        else:
            peak = max(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
        reading = clock.read()
        times.append(reading["wall_s"])
        result = {"logp_sum": float(logp.double().sum()), "entropy_sum": float(entropy.double().sum()),
                  "grad_hidden_norm": float(hidden.grad.double().norm()),
                  "grad_weight_norm": float(head.weight.grad.double().norm()),
                  "other_cpu_share": reading["other_cpu_share"], "noisy": reading["noisy"]}
        del logp, entropy, loss
    return {**spec, **result, "peak_bytes": peak, "times_s": times}


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "bench.bench_kernel", "--worker", json.dumps(spec)], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"kernel worker {spec} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def relative_gap(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for vocab in args.vocab:
        hidden = SHAPES.get(vocab, 64 if args.smoke else 576)
        bytes_per_token: float | None = None  # the naive pass's measured peak per position, for the estimate
        for length in sorted(args.lengths):
            row: dict[str, Any] = {"vocab": vocab, "length": length, "hidden": hidden}
            for impl in ("keelrl", "naive"):
                # the large passes take a minute each on 2 cores: time those once
                reps = args.reps if length * vocab <= 2048 * 49152 else 1
                spec = {"impl": impl, "vocab": vocab, "length": length, "hidden": hidden, "device": device,
                        "reps": reps}
                if impl == "naive" and bytes_per_token is not None:
                    estimate = bytes_per_token * length
                    row["naive_estimate_bytes"] = estimate
                    if estimate > args.memory_budget_gib * 2**30:
                        row["naive"] = None
                        print(f"V={vocab} T={length} naive: skipped, estimated {estimate / 2**30:.1f} GiB", flush=True)
                        continue
                row[impl] = run_worker(spec)
                print(f"V={vocab} T={length} {impl:<6} peak {row[impl]['peak_bytes'] / 2**30:6.2f} GiB, "
                      f"{min(row[impl]['times_s']):6.2f} s", flush=True)
            if row.get("naive"):
                bytes_per_token = row["naive"]["peak_bytes"] / length
                row["memory_ratio"] = row["keelrl"]["peak_bytes"] / max(1, row["naive"]["peak_bytes"])
                row["time_ratio"] = min(row["naive"]["times_s"]) / max(1e-9, min(row["keelrl"]["times_s"]))
                row["max_relative_gap"] = max(relative_gap(row["keelrl"][k], row["naive"][k]) for k in
                                              ("logp_sum", "entropy_sum", "grad_hidden_norm", "grad_weight_norm"))
            rows.append(row)
    write_section(args.out, summarise(rows, args, device, time.perf_counter() - started))
    print(f"wrote {args.out / 'section.json'}")


def summarise(rows: list[dict[str, Any]], args: Any, device: str, seconds: float) -> Section:
    gib = 2**30
    lines = [f"Forward + backward of `sum(logp) + 0.01 sum(entropy)` over one sequence, float32, on {device}; "
             "each pass in a fresh process; peak = memory the pass itself added "
             "(CPU: peak resident set less the resident set before it).", "",
             "| V | H | T | keelrl peak (GiB) | naive peak (GiB) | keelrl/naive memory | keelrl s | naive s "
             "| naive/keelrl time | max relative gap |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    compared = []
    for row in rows:
        keel = row["keelrl"]
        naive = row.get("naive")
        if naive:
            compared.append(row)
            lines.append(f"| {row['vocab']} | {row['hidden']} | {row['length']} | {keel['peak_bytes'] / gib:.3f} "
                         f"| {naive['peak_bytes'] / gib:.3f} | {row['memory_ratio']:.3f} | {min(keel['times_s']):.2f} "
                         f"| {min(naive['times_s']):.2f} | {row['time_ratio']:.2f}x | {row['max_relative_gap']:.1e} |")
        else:
            estimate = row.get("naive_estimate_bytes", float("nan")) / gib
            lines.append(f"| {row['vocab']} | {row['hidden']} | {row['length']} | {keel['peak_bytes'] / gib:.3f} "
                         f"| not run (estimated {estimate:.1f}) | ~{keel['peak_bytes'] / gib / estimate:.3f} (est.) "
                         f"| {min(keel['times_s']):.2f} | - | - | - |")
    noisy = sum(1 for row in rows for impl in ("keelrl", "naive") if row.get(impl) and row[impl]["noisy"])
    lines += ["", f"Naive passes estimated above {args.memory_budget_gib:g} GiB (of this machine's memory) are not run; "
              "their estimate is the naive peak per position measured at the shorter length, times T.",
              f"Passes with other processes above 10% of the CPUs: {noisy} (times from those are not worth quoting; "
              "memory is not affected)."]
    ratios = []
    if compared:
        worst = max(compared, key=lambda r: r["memory_ratio"])
        ratios.append(Ratio("kernel peak memory / naive (worst measured shape)", worst["memory_ratio"], 0.25,
                            higher_is_better=False,
                            detail=f"V={worst['vocab']}, T={worst['length']}; all: " +
                                   ", ".join(f"{r['memory_ratio']:.3f}" for r in compared)))
        slowest = min(compared, key=lambda r: r["time_ratio"])
        ratios.append(Ratio("kernel time speed-up over naive (worst measured shape)", slowest["time_ratio"], 0.5,
                            detail="recomputing each chunk's logits in backward costs time; target: no worse than 2x"))
        gap = max(r["max_relative_gap"] for r in compared)
        lines.append(f"Largest relative difference of the checksums (logp, entropy, both gradient norms): {gap:.1e}.")
    return Section(name="kernel", title="Log-prob and entropy kernel", markdown="\n".join(lines), ratios=ratios,
                   smoke=args.smoke, seconds=seconds, data={"rows": rows, "machine": machine()})


if __name__ == "__main__":
    main()
