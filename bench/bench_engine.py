"""keelrl's decode engine (`rollout.decoder=keel`) against HF generate (`hf`) and llama.cpp, with
this machine's matmul roofline.

Four measurements, in one process, one after another (nothing else of ours runs beside them):

1. Roofline: `torch.nn.functional.linear` at the model's own shapes (q/k/v fused, o, gate/up
   fused, down, the vocabulary head) for 1, 16, 64 and 512 token rows, float32 and bfloat16:
   GFLOP/s each; the peak of a dtype is its best shape.
2. Engine throughput: the keel decoder alone on B prompts of the evaluation (B = 1 ... 64):
   prefill tokens/s (a call that samples one token) and decode tokens/s (the steps of a call
   with exactly N new tokens that ran no prompt token, timed inside the decoder), with the FLOPs they did (2 x parameters per token through the
   layers, the head only where a token is sampled, attention 4 x heads x head_dim x keys) as a
   share of the measured peak.
3. Workloads of the default run, through the real agent loop (`run_episodes`, the coding
   environment, sandboxed grading): the held-out evaluation (one attempt per task, greedy, up to
   `rollout.max_new_tokens`) and one RL step's rollouts (8 tasks x 4 attempts, the run's
   temperature), each with decoder=hf and decoder=keel, same model, tasks, lengths and dtype.
   The ratio is hf seconds / keel seconds; also reported: the decoder's share of the wall time
   (the rest is environment work and grading) and its breakdown (forward, sampling, steps,
   prefill and decode tokens, mean busy slots), and whether both decoders gave the same
   actions (they must, up to float rounding in near-ties).
4. llama.cpp (`bench/llamacpp.py`, the `llama-cpp-python` bench extra) greedy-decoding the same
   prompt token ids from the same weights (an F32 GGUF converted from the float32 model) at the
   same batch and the same lengths (each row runs as many tokens as keel's row did), tokens/s
   against keel's on that same work.

    python -m bench.bench_engine                 # SmolLM2-135M, this machine's threads
    python -m bench.bench_engine --smoke         # tiny model, seconds: checks the harness runs

What this does NOT measure: GPU decoding (bench/gpu.py), a loaded machine (calls during which
other processes used over 10% of the CPUs are flagged noisy), or multi-turn continuation.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import Clock, Ratio, Section, arguments, machine, write_section

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="engine")
    parser.add_argument("--model", default="smollm2", help="a registered model name or a local path")
    parser.add_argument("--eval-tasks", type=int, default=96, help="held-out tasks in the evaluation workload")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the workloads' dtype")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--no-llamacpp", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.eval_tasks, args.batches, args.decode_tokens = "tiny", 6, [1, 4], 4
    return args


# --------------------------------------------------------------------------- 1. roofline
def linear_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of each matrix a decode step multiplies by, as the keel decoder fuses them."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or hidden // heads
    return {"qkv": (hidden, (heads + 2 * kv) * d), "o": (heads * d, hidden), "gate_up": (hidden, 2 * inter),
            "down": (inter, hidden), "head": (hidden, config.vocab_size)}


def time_call(fn: Any, min_s: float = 0.3) -> float:
    """Median seconds of `fn()` over repeats filling about `min_s` (after one warm-up call)."""
    fn()
    times: list[float] = []
    spent = 0.0
    while spent < min_s or len(times) < 3:
        tick = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tick)
        spent += times[-1]
    times.sort()
    return times[len(times) // 2]


def roofline(config: Any, rows: list[int], min_s: float) -> list[dict[str, Any]]:
    out = []
    for dtype_name, dtype in DTYPES.items():
        for name, (fan_in, fan_out) in linear_shapes(config).items():
            weight = torch.randn(fan_out, fan_in, dtype=dtype)
            for m in rows:
                x = torch.randn(m, fan_in, dtype=dtype)
                seconds = time_call(lambda: torch.nn.functional.linear(x, weight), min_s)
                out.append({"dtype": dtype_name, "matrix": name, "rows": m, "seconds": seconds,
                            "gflops": 2 * m * fan_in * fan_out / seconds / 1e9})
    return out


def peak(rows: list[dict[str, Any]], dtype: str) -> float:
    return max(r["gflops"] for r in rows if r["dtype"] == dtype)


# --------------------------------------------------------------------------- FLOPs of a pass
def flops(config: Any, tokens: int, sampled: int, keys: float) -> float:
    """FLOPs of running `tokens` tokens through the layers (each attending to `keys` keys on
    average) and the head over the `sampled` positions that draw a token."""
    shapes = linear_shapes(config)
    per_token = 2 * config.num_hidden_layers * sum(a * b for name, (a, b) in shapes.items() if name != "head")
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = 4 * config.num_hidden_layers * heads * d * keys
    head_in, head_out = shapes["head"]
    return tokens * (per_token + attention) + sampled * 2 * head_in * head_out


# --------------------------------------------------------------------------- 2. engine throughput
def engine_rows(model: Any, tokenizer: Any, prompts: list[list[int]], batches: list[int], new: int,
                gpeak: float) -> list[dict[str, Any]]:
    from keelrl.policy.decode import KeelDecoder
    from keelrl.policy.sampling import SamplingConfig, draw_uniforms

    out = []
    config = model.config
    for batch in batches:
        rows = [prompts[i % len(prompts)] for i in range(batch)]
        rows = [r + [r[-1]] * (i // len(prompts)) for i, r in enumerate(rows)]  # repeats differ: no shared prompt
        uniforms = draw_uniforms(torch.Generator().manual_seed(0), batch * new).view(batch, new)
        decoder = KeelDecoder(model, tokenizer, max_batch=batch)
        one = SamplingConfig(temperature=0.0, max_new_tokens=1, stop=())
        full = SamplingConfig(temperature=0.0, max_new_tokens=new, min_new_tokens=new, stop=())
        decoder.generate(rows[:2], one, uniforms[:2])  # warm-up: the weight snapshot
        clock = Clock()
        tick = time.perf_counter()
        decoder.generate(rows, one, uniforms, share_prompts=False)
        prefill_s = time.perf_counter() - tick
        before = dict(decoder.stats)
        decoder.generate(rows, full, uniforms, share_prompts=False)
        load = clock.read()
        decode_tokens = decoder.stats["decode_only_tokens"] - before["decode_only_tokens"]
        decode_s = max(1e-9, decoder.stats["decode_only_s"] - before["decode_only_s"])
        prompt_tokens = sum(len(r) for r in rows)
        mean_prompt = prompt_tokens / batch
        prefill_flops = flops(config, prompt_tokens, batch, mean_prompt / 2)
        decode_flops = flops(config, decode_tokens, decode_tokens, mean_prompt + new / 2)
        out.append({"batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new,
                    "prefill_s": prefill_s, "prefill_tok_s": prompt_tokens / prefill_s,
                    "prefill_gflops": prefill_flops / prefill_s / 1e9, "prefill_peak_share": prefill_flops / prefill_s / 1e9 / gpeak,
                    "decode_s": decode_s, "decode_tokens": decode_tokens, "decode_tok_s": decode_tokens / decode_s,
                    "decode_gflops": decode_flops / decode_s / 1e9, "decode_peak_share": decode_flops / decode_s / 1e9 / gpeak,
                    "noisy": load["noisy"], "other_cpu_share": load["other_cpu_share"]})
        print(f"engine batch {batch}: prefill {out[-1]['prefill_tok_s']:.0f} tok/s "
              f"({out[-1]['prefill_peak_share']:.0%} of peak), decode {out[-1]['decode_tok_s']:.0f} tok/s", flush=True)
    return out


# --------------------------------------------------------------------------- 3. workloads
def workload(cfg: Any, spec: Any, model: Any, tokenizer: Any, tasks: list[Any], decoder: str, *, group: int,
             temperature: float, training: bool, dtype: torch.dtype) -> dict[str, Any]:
    from keelrl.rollout.agent_loop import EpisodeLimits, model_actor, run_episodes
    from keelrl.policy.sampling import SamplingConfig

    sampling = SamplingConfig(temperature=temperature, top_p=1.0, max_new_tokens=cfg.rollout.max_new_tokens,
                              keep_kv=cfg.rollout.keep_kv, decoder=decoder, dtype=dtype,
                              kv_budget_mb=cfg.rollout.kv_budget_mb)
    make_env = spec.train_env(cfg) if training else spec.eval_env(cfg)
    limits = EpisodeLimits.of(cfg.rollout, cfg.env.max_turns)
    act = model_actor(model, tokenizer, sampling)
    episodes = [task for task in tasks for _ in range(group)]
    clock = Clock()
    trajectories = run_episodes(make_env, episodes, tokenizer, act, limits, seed=11,
                                group_ids=[i // group for i in range(len(episodes))])
    load = clock.read()
    usage = act.decoder.cache_usage() if hasattr(act, "decoder") else {}
    generate_s = max(t.seconds.get("generate", 0.0) for t in trajectories) if trajectories else 0.0
    return {"decoder": decoder, "seconds": load["wall_s"], "noisy": load["noisy"],
            "other_cpu_share": load["other_cpu_share"], "episodes": len(trajectories),
            "action_tokens": sum(sum(t.action_mask) for t in trajectories),
            "success": sum(bool(t.success) for t in trajectories), "usage": usage,
            "generate_s_longest_episode": generate_s,
            "actions": [t.actions for t in trajectories]}


def workload_pair(cfg: Any, spec: Any, model: Any, tokenizer: Any, tasks: list[Any], *, group: int,
                  temperature: float, training: bool, dtype: torch.dtype, label: str) -> dict[str, Any]:
    runs = {}
    for decoder in ("hf", "keel"):
        runs[decoder] = workload(cfg, spec, model, tokenizer, tasks, decoder, group=group, temperature=temperature,
                                 training=training, dtype=dtype)
        print(f"{label} {decoder}: {runs[decoder]['seconds']:.1f} s, {runs[decoder]['action_tokens']} action tokens, "
              f"{runs[decoder]['success']}/{runs[decoder]['episodes']} solved", flush=True)
    same = sum(a == b for a, b in zip(runs["hf"].pop("actions"), runs["keel"].pop("actions")))
    return {"label": label, "ratio": runs["hf"]["seconds"] / runs["keel"]["seconds"], "same_actions": same,
            "episodes": runs["keel"]["episodes"], **{k: v for k, v in runs.items()}}


# --------------------------------------------------------------------------- 4. llama.cpp
def llamacpp_row(model_dir: Path, model: Any, tokenizer: Any, prompts: list[list[int]], new: int, batch: int,
                 threads: int) -> dict[str, Any]:
    from bench.llamacpp import gguf_of, llamacpp_generate
    from keelrl.policy.decode import KeelDecoder
    from keelrl.policy.sampling import SamplingConfig, draw_uniforms

    gguf = gguf_of(model_dir, "f32")
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=new, stop=())
    uniforms = draw_uniforms(torch.Generator().manual_seed(0), len(prompts) * new).view(len(prompts), new)
    decoder = KeelDecoder(model, tokenizer, max_batch=batch)
    decoder.generate(prompts[:2], SamplingConfig(temperature=0.0, max_new_tokens=2, stop=()), uniforms[:2])
    ends = list(decoder.end_ids)
    llamacpp_generate(gguf, prompts[:2], 2, min(batch, 2), threads, end_ids=ends)  # warm-up
    tick = time.perf_counter()
    samples = decoder.generate(prompts, cfg, uniforms, share_prompts=False)
    keel_s = time.perf_counter() - tick
    theirs = llamacpp_generate(gguf, prompts, new, batch, threads, end_ids=ends)
    keel_tokens = sum(len(s.token_ids) for s in samples)
    theirs_tokens = int(theirs["generated_tokens"])
    prompt_tokens = sum(len(p) for p in prompts)
    same = sum(s.token_ids == list(t) for s, t in zip(samples, theirs["tokens"]))
    return {"gguf": str(gguf), "batch": batch, "prompts": len(prompts), "prompt_tokens": prompt_tokens,
            "keel_s": keel_s, "keel_generated": keel_tokens, "llamacpp_s": theirs["wall_s"],
            "llamacpp_generated": theirs_tokens,
            "keel_tok_s": (prompt_tokens + keel_tokens) / keel_s,
            "llamacpp_tok_s": (prompt_tokens + theirs_tokens) / theirs["wall_s"],
            "same_greedy_rows": same}


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    from keelrl.config import load_config
    from keelrl.envs.registry import resolve_env
    from keelrl.policy.download import resolve_model_path
    from keelrl.policy.model import load_policy
    from keelrl.rollout.scheduler import prompt_tokens

    overrides = ["env.name=coding"]
    if args.smoke:
        overrides += ["rollout.max_new_tokens=8"]
    cfg = load_config(overrides=overrides)
    model_dir = Path(resolve_model_path(args.model))
    dtype = DTYPES[args.dtype]
    model, tokenizer = load_policy(str(model_dir), "cpu", torch.float32)
    model.eval()
    spec = resolve_env(cfg)
    train_tasks, heldout = spec.tasks(cfg)
    heldout = list(heldout)[:args.eval_tasks]
    make_env = spec.eval_env(cfg)
    prompts = []
    for task in heldout[:64]:
        env = make_env()
        prompts.append(prompt_tokens(tokenizer, env.reset(task)))
        if hasattr(env, "close"):
            env.close()

    roof = roofline(model.config, [1, 16, 64, 512] if not args.smoke else [1, 16], 0.05 if args.smoke else 0.3)
    peaks = {name: peak(roof, name) for name in DTYPES}
    print(f"matmul peak: {peaks}", flush=True)
    engine = engine_rows(model, tokenizer, prompts, args.batches, args.decode_tokens, peaks["float32"])
    evaluation = workload_pair(cfg, spec, model, tokenizer, heldout, group=1, temperature=cfg.eval.temperature,
                               training=False, dtype=dtype, label="evaluation")
    rollout_tasks = list(train_tasks)[:cfg.rollout.tasks_per_step]
    rollout = workload_pair(cfg, spec, model, tokenizer, rollout_tasks, group=cfg.rollout.group_size,
                            temperature=cfg.rollout.temperature, training=True, dtype=dtype, label="rollout")
    llama: dict[str, Any] | None = None
    llama_error = ""
    if not args.no_llamacpp:
        try:
            llama = llamacpp_row(model_dir, model, tokenizer, prompts[:16 if args.smoke else 32],
                                 cfg.rollout.max_new_tokens, min(64, max(args.batches)), torch.get_num_threads())
            print(f"llama.cpp: {llama['llamacpp_tok_s']:.0f} tok/s, keel {llama['keel_tok_s']:.0f} tok/s", flush=True)
        except Exception as error:  # noqa: BLE001 - reported in the section: the extra may be missing
            llama_error = f"{type(error).__name__}: {error}"
            print(f"llama.cpp: not measured ({llama_error})", flush=True)
    section = summarise(args, roof, peaks, engine, evaluation, rollout, llama, llama_error,
                        time.perf_counter() - started)
    write_section(args.out, section)


def summarise(args: argparse.Namespace, roof: list[dict[str, Any]], peaks: dict[str, float],
              engine: list[dict[str, Any]], evaluation: dict[str, Any], rollout: dict[str, Any],
              llama: dict[str, Any] | None, llama_error: str, seconds: float) -> Section:
    info = machine()
    lines = [f"Model {args.model}, workloads in {args.dtype}, {info['torch_threads']} torch threads, "
             f"on {info['cpu']} ({info['cores']} cores, {info['cpu_capability']}).", "",
             "Matmul roofline (`F.linear` at the model's shapes), GFLOP/s:", "",
             "| matrix | rows | float32 | bfloat16 |", "|---|---|---|---|"]
    for name in linear_shapes_names(roof):
        for m in sorted({r["rows"] for r in roof}):
            cells = {r["dtype"]: r["gflops"] for r in roof if r["matrix"] == name and r["rows"] == m}
            lines.append(f"| {name} | {m} | {cells.get('float32', 0):.0f} | {cells.get('bfloat16', 0):.0f} |")
    lines += ["", f"Peak: float32 {peaks['float32']:.0f} GFLOP/s, bfloat16 {peaks['bfloat16']:.0f} GFLOP/s.", "",
              "Keel decoder throughput (float32; decode with exactly the stated new tokens):", "",
              "| batch | prefill tok/s | prefill % of fp32 peak | decode tok/s | decode % of peak | noisy |",
              "|---|---|---|---|---|---|"]
    for row in engine:
        lines.append(f"| {row['batch']} | {row['prefill_tok_s']:.0f} | {row['prefill_peak_share']:.0%} | "
                     f"{row['decode_tok_s']:.0f} | {row['decode_peak_share']:.0%} | {row['noisy']} |")
    lines += ["", "Workloads of the default run through the agent loop (environment and grading included):", "",
              "| workload | episodes | hf s | keel s | hf / keel | same actions | keel decoder share | solved hf / keel |",
              "|---|---|---|---|---|---|---|---|"]
    for w in (evaluation, rollout):
        usage = w["keel"]["usage"]
        share = (usage.get("forward_s", 0) + usage.get("sample_s", 0)) / max(1e-9, w["keel"]["seconds"])
        lines.append(f"| {w['label']} | {w['episodes']} | {w['hf']['seconds']:.1f} | {w['keel']['seconds']:.1f} | "
                     f"{w['ratio']:.2f}x | {w['same_actions']}/{w['episodes']} | {share:.0%} | "
                     f"{w['hf']['success']} / {w['keel']['success']} |")
    for w in (evaluation, rollout):
        u = w["keel"]["usage"]
        if u:
            lines.append("")
            lines.append(f"Keel {w['label']} breakdown: forward {u.get('forward_s', 0):.1f} s, sampling "
                         f"{u.get('sample_s', 0):.1f} s over {u.get('steps', 0):.0f} steps; "
                         f"{u.get('prefill_tokens', 0):.0f} prefill and {u.get('decode_tokens', 0):.0f} decode tokens; "
                         f"mean busy slots {u.get('busy_slots', 0) / max(1, u.get('steps', 1)):.1f}.")
    ratios = [Ratio("evaluation workload: keel decoder speed-up over HF generate", evaluation["ratio"], 3.0,
                    detail=f"{evaluation['hf']['seconds']:.1f} s / {evaluation['keel']['seconds']:.1f} s"),
              Ratio("rollout workload: keel decoder speed-up over HF generate", rollout["ratio"], 3.0,
                    detail=f"{rollout['hf']['seconds']:.1f} s / {rollout['keel']['seconds']:.1f} s")]
    best_prefill = max(row["prefill_peak_share"] for row in engine)
    ratios.append(Ratio("keel prefill FLOP/s / measured float32 matmul peak (best batch)", best_prefill, 0.5))
    if llama is not None:
        ratio = llama["keel_tok_s"] / llama["llamacpp_tok_s"]
        lines += ["", f"llama.cpp (F32 GGUF of the same weights, batch {llama['batch']}, {llama['prompts']} prompts, "
                      f"greedy, up to the run's max_new_tokens): {llama['llamacpp_tok_s']:.0f} tok/s "
                      f"({llama['llamacpp_s']:.1f} s); keel {llama['keel_tok_s']:.0f} tok/s ({llama['keel_s']:.1f} s); "
                      f"same greedy rows {llama['same_greedy_rows']}/{llama['prompts']}."]
        ratios.append(Ratio("keel throughput / llama.cpp throughput (same prompts, batch, lengths)", ratio, 0.8,
                            detail=f"{llama['keel_tok_s']:.0f} / {llama['llamacpp_tok_s']:.0f} tok/s"))
    else:
        lines += ["", f"llama.cpp: not measured ({llama_error or 'skipped'})."]
    return Section(name="engine", title="Decode engine against HF generate and llama.cpp", markdown="\n".join(lines),
                   ratios=ratios, smoke=args.smoke, seconds=seconds,
                   data={"roofline": roof, "peaks": peaks, "engine": engine, "evaluation": evaluation,
                         "rollout": rollout, "llamacpp": llama, "machine": info})


def linear_shapes_names(roof: list[dict[str, Any]]) -> list[str]:
    seen: list[str] = []
    for r in roof:
        if r["matrix"] not in seen:
            seen.append(r["matrix"])
    return seen


if __name__ == "__main__":
    main()
