"""Learner passes by shared prompt (`perf.share_prefix`) against plain passes, side by side.

A batch shaped like the default run's (groups of rows that share a prompt, each row's own
short continuation scored) goes through the trainer's two kinds of pass, interleaved in one
run: the no-grad log-prob pass (`chunked_token_logprobs`, the reference and old log-probs) and
the update's forward+backward (micro-batches from `plan_passes`, gradients accumulated), each
plainly and by shared prompt. Prints seconds per pass (median over repetitions), the ratio
plain / shared, the largest log-prob difference between the two, and the machine load.

    python bench/bench_prefix.py                      # SmolLM2, 8 groups x 4 rows, prompts ~185, actions ~25
    python bench/bench_prefix.py --model tiny --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from keelrl.policy.model import load_policy
from keelrl.policy.prefix import chunked_token_logprobs
from keelrl.policy.prefix import micro_logprobs, plan_passes


def make_batch(groups: int, group_size: int, prompt: int, action: int, vocab: int, seed: int = 0):
    """Right-padded rows: each group's prompt (prompt +- 10% tokens) and each row's own
    continuation (action +- 50% tokens), the continuation scored."""
    generator = torch.Generator().manual_seed(seed)
    rows, keys, starts = [], [], []
    for group in range(groups):
        length = int(prompt * (0.9 + 0.2 * torch.rand((), generator=generator)))
        shared = torch.randint(10, vocab - 10, (length,), generator=generator)
        for _ in range(group_size):
            own = int(action * (0.5 + torch.rand((), generator=generator)))
            rows.append(torch.cat([shared, torch.randint(10, vocab - 10, (own,), generator=generator)]))
            keys.append(group)
            starts.append(length)
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    positions = torch.zeros(len(rows), width, dtype=torch.bool)
    for index, row in enumerate(rows):
        ids[index, :len(row)] = row
        attention[index, :len(row)] = 1
        positions[index, starts[index]:len(row)] = True
    return ids, attention, positions, torch.tensor(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=185)
    parser.add_argument("--action-tokens", type=int, default=25)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="bench/out/prefix.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, _ = load_policy(args.model, "cpu")
    vocab = model.get_output_embeddings().weight.shape[0]
    ids, attention, positions, keys = make_batch(args.groups, args.group_size, args.prompt_tokens,
                                                 args.action_tokens, vocab)

    def no_grad(shared: bool) -> tuple[float, torch.Tensor]:
        model.eval()
        started = time.perf_counter()
        logp = chunked_token_logprobs(model, ids, attention, max_tokens=args.micro_batch_tokens, positions=positions,
                                      temperature=args.temperature, keys=keys if shared else None)["logp"]
        return time.perf_counter() - started, logp

    def update(shared: bool) -> tuple[float, torch.Tensor]:
        model.train()
        started = time.perf_counter()
        for micro in plan_passes(ids, attention, args.micro_batch_tokens, keys=keys if shared else None,
                                 positions=positions):
            rows = torch.tensor(micro.rows)
            out = micro_logprobs(model, ids[rows, :micro.width], attention[rows, :micro.width], micro,
                                 with_entropy=True, positions=positions[rows, :micro.width],
                                 temperature=args.temperature)
            (-(out["logp"] * positions[rows, :micro.width]).sum() / positions.sum()).backward()
        seconds = time.perf_counter() - started
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return seconds, grads

    passes = {"no_grad": no_grad, "update": update}
    load_before = os.getloadavg()
    for run in passes.values():  # warm-up, and the outputs to compare
        run(False), run(True)
    results = {}
    for name, run in passes.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        outputs = {}
        for _ in range(args.reps):
            for shared in (False, True):
                seconds, outputs[shared] = run(shared)
                times[shared].append(seconds)
        plain, shared = statistics.median(times[False]), statistics.median(times[True])
        difference = (outputs[False] - outputs[True]).abs().max().item()
        results[name] = {"plain_s": plain, "shared_s": shared, "speedup": plain / shared, "max_abs_diff": difference}
    report = {"model": args.model, "rows": int(ids.shape[0]), "groups": args.groups,
              "tokens": int(attention.sum()), "scored_tokens": int(positions.sum()),
              "micro_batch_tokens": args.micro_batch_tokens, "threads": torch.get_num_threads(),
              "load_before": load_before, "load_after": os.getloadavg(), "passes": results}
    print(f"{args.model}: {report['rows']} rows in {args.groups} groups, {report['tokens']} tokens "
          f"({report['scored_tokens']} scored), {report['threads']} threads, load {load_before[0]:.2f}")
    for name, row in results.items():
        print(f"  {name:8s} plain {row['plain_s']:7.2f} s   shared prompt {row['shared_s']:7.2f} s   "
              f"speedup {row['speedup']:.2f}x   max |diff| {row['max_abs_diff']:.2e}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
