"""Learner throughput: forward+backward of a policy on agent-shaped batches, by precision.

Compares, interleaved in one run, float32 against bf16 autocast (`perf.learner_precision`),
each with the vocabulary head over every position or only over the action tokens
(`token_logprobs(positions=...)`). Prints tokens/s (padded tokens through the body per second)
as medians over repetitions, and the machine load, so a busy machine shows as such.

    python bench/bench_learner.py                    # SmolLM2, 8 rows x 260 tokens, 30 action tokens each
    python bench/bench_learner.py --model tiny --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from keelrl.policy.model import learner_autocast, load_policy, token_logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=260)
    parser.add_argument("--action-tokens", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="bench/out/learner.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, _ = load_policy(args.model, "cpu")
    model.train()
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(10, vocab - 10, (args.rows, args.tokens))
    attention = torch.ones_like(ids)
    positions = torch.zeros(args.rows, args.tokens, dtype=torch.bool)
    positions[:, -args.action_tokens:] = True

    def once(precision: str, only_actions: bool) -> float:
        started = time.perf_counter()
        with learner_autocast(torch.device("cpu"), precision):
            logp = token_logprobs(model, ids, attention, positions=positions if only_actions else None)["logp"]
        (-(logp * positions).sum()).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    configs = [(p, a) for p in ("float32", "bfloat16") for a in (False, True)]
    load_before = os.getloadavg()
    for config in configs:  # warm-up
        once(*config)
    times: dict[tuple[str, bool], list[float]] = {c: [] for c in configs}
    for _ in range(args.reps):
        for config in configs:
            times[config].append(once(*config))
    rows = []
    for (precision, only_actions), values in times.items():
        median = sorted(values)[len(values) // 2]
        rows.append({"precision": precision, "head": "action tokens" if only_actions else "all positions",
                     "median_s": median, "tokens_per_s": args.rows * args.tokens / median})
    base = rows[0]["median_s"]
    print(f"{'precision':10} {'head over':15} {'s/pass':>8} {'tok/s':>8} {'vs fp32 full':>12}")
    for row in rows:
        print(f"{row['precision']:10} {row['head']:15} {row['median_s']:8.2f} {row['tokens_per_s']:8.0f} "
              f"{base / row['median_s']:11.2f}x")
    report = {"setup": vars(args), "rows": rows, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "torch_threads": torch.get_num_threads()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"load average before {load_before[0]:.2f}, after {report['loadavg_after'][0]:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
