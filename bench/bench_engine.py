"""keelrl's decode engine (`rollout.decoder=keel`) against HF generate (`hf`) and llama.cpp, with
this machine's matmul roofline.

Five measurements, in one process, one after another (nothing else of ours runs beside them):

1. Roofline: `torch.nn.functional.linear` at the model's own shapes (q/k/v fused, o, gate/up
   fused, down, the vocabulary head) for 1, 16, 64 and 512 token rows, float32 and bfloat16:
   GFLOP/s each; the peak of a dtype is its best shape.
2. Engine throughput and where a decode step's time goes: the keel decoder alone on B prompts of
   the evaluation (B = 1 ... 64), in
   float32 and bfloat16: prefill tokens/s (a call that samples one token) and decode tokens/s (the
   steps of a call with exactly N new tokens that ran no prompt token, timed inside the decoder),
   with the FLOPs they did (2 x parameters per token through the layers, the head only where a
   token is sampled, attention 4 x heads x head_dim x keys) as a share of that dtype's peak; and at
   the largest B, a decode step's milliseconds by kind of work (weight matmuls, attention
   matmuls, copies and casts, softmax, other: torch.profiler's self CPU time per op).
3. Workloads of the default run, through the real agent loop (`run_episodes`, the coding
   environment, sandboxed grading): the held-out evaluation (one attempt per task, greedy, up to
   `rollout.max_new_tokens`) and one RL step's rollouts (8 tasks x 4 attempts, the run's
   temperature), each with decoder=hf and decoder=keel, same model, tasks, lengths and dtype, in
   each of `--dtypes` (the default run evaluates in `eval.dtype=auto`'s choice and samples its
   rollouts in `rollout.dtype`, float32). The ratio is hf seconds / keel seconds; also reported:
   the decoder's share of the wall time (the rest is environment work and grading) and its
   breakdown (forward, sampling, steps, prefill and decode tokens, mean busy slots), and whether
   both decoders gave the same actions (they must, up to float rounding in near-ties). Each
   workload's compute floor: the FLOPs keel ran at its dtype's peak, plus keel's time outside the
   decoder; HF's seconds over it bound the speed-up any engine of that dtype can reach here.
4. What streaming gives: the float32 rollout workload with keel's scheduler stream (episodes join
   the batch being decoded as they become ready, the default) against one blocking batch at a time.
5. llama.cpp (`bench/llamacpp.py`, the `llama-cpp-python` bench extra) greedy-decoding the same
   prompt token ids from the same weights (an F32 GGUF converted from the float32 model against
   keel in float32; a BF16 GGUF with llama.cpp's F16 KV cache against keel in bfloat16) at the
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
    parser.add_argument("--dtypes", choices=list(DTYPES), nargs="+", default=list(DTYPES),
                        help="the dtypes the engine rows, workloads and llama.cpp rows run in")
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
                gpeak: float, dtype: str = "float32") -> list[dict[str, Any]]:
    from keelrl.inference import KeelDecoder, SamplingParams, draw_uniforms

    out = []
    config = model.config
    for batch in batches:
        rows = [prompts[i % len(prompts)] for i in range(batch)]
        rows = [r + [r[-1]] * (i // len(prompts)) for i, r in enumerate(rows)]  # repeats differ: no shared prompt
        uniforms = draw_uniforms(torch.Generator().manual_seed(0), batch * new).view(batch, new)
        decoder = KeelDecoder(model, tokenizer, max_batch=batch, dtype=DTYPES[dtype])
        one = SamplingParams(temperature=0.0, max_new_tokens=1, stop=())
        full = SamplingParams(temperature=0.0, max_new_tokens=new, min_new_tokens=new, stop=())
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
        out.append({"dtype": dtype, "batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new,
                    "prefill_s": prefill_s, "prefill_tok_s": prompt_tokens / prefill_s,
                    "prefill_gflops": prefill_flops / prefill_s / 1e9, "prefill_peak_share": prefill_flops / prefill_s / 1e9 / gpeak,
                    "decode_s": decode_s, "decode_tokens": decode_tokens, "decode_tok_s": decode_tokens / decode_s,
                    "decode_gflops": decode_flops / decode_s / 1e9, "decode_peak_share": decode_flops / decode_s / 1e9 / gpeak,
                    "noisy": load["noisy"], "other_cpu_share": load["other_cpu_share"]})
        print(f"engine {dtype} batch {batch}: prefill {out[-1]['prefill_tok_s']:.0f} tok/s "
              f"({out[-1]['prefill_peak_share']:.0%} of peak), decode {out[-1]['decode_tok_s']:.0f} tok/s", flush=True)
    return out


STEP_KINDS = {"aten::mm": "weight matmuls", "aten::addmm": "weight matmuls", "aten::bmm": "attention matmuls",
              "aten::copy_": "copies and casts", "aten::_softmax": "softmax", "aten::_log_softmax": "softmax"}
"""torch ops -> the kind of work a decode step's breakdown files them under (the rest: other)."""


def step_breakdown(model: Any, tokenizer: Any, prompts: list[list[int]], batch: int, dtype: str,
                   steps: int = 6) -> dict[str, Any]:
    """Where a decode step's time goes: `batch` rows decoding (no prefill), milliseconds per step
    by kind of work (`STEP_KINDS`, from torch.profiler's self CPU time of each op; the profiler's
    own cost lands in other), and the step's wall time unprofiled."""
    from torch.profiler import ProfilerActivity, profile

    from keelrl.inference import KeelDecoder, SamplingParams, draw_uniforms

    rows = [prompts[i % len(prompts)] + [prompts[i % len(prompts)][-1]] * (i // len(prompts)) for i in range(batch)]
    decoder = KeelDecoder(model, tokenizer, max_batch=batch, dtype=DTYPES[dtype])
    new = 2 * steps + 8 + sum(len(r) for r in rows) // decoder.prefill_tokens  # the first rows decode while others prefill
    uniforms = draw_uniforms(torch.Generator().manual_seed(0), batch * new).view(batch, new)
    decoder.submit(rows, SamplingParams(temperature=0.0, max_new_tokens=new, min_new_tokens=new, stop=()), uniforms,
                   share_prompts=False)
    before = -1.0
    while decoder.stats["prefill_tokens"] != before:  # until a step runs no prompt token
        before = decoder.stats["prefill_tokens"]
        decoder.step()
    tick = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    wall_ms = (time.perf_counter() - tick) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            decoder.step()
    decoder.cancel()
    kinds: dict[str, float] = {}
    for event in prof.key_averages():
        kind = STEP_KINDS.get(event.key, "other")
        kinds[kind] = kinds.get(kind, 0.0) + event.self_cpu_time_total / 1e3 / steps
    return {"dtype": dtype, "batch": batch, "wall_ms": wall_ms, "kinds_ms": kinds,
            "keys": sum(len(r) for r in rows) / batch}


# --------------------------------------------------------------------------- 3. workloads
def workload(cfg: Any, spec: Any, model: Any, tokenizer: Any, tasks: list[Any], decoder: str, *, group: int,
             temperature: float, training: bool, dtype: torch.dtype, stream: bool = True,
             vllm_eager: bool = False) -> dict[str, Any]:
    from keelrl.inference import DecoderOptions, SamplingParams
    from keelrl.rollout.agent_loop import EpisodeLimits, model_actor, run_episodes

    sampling = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=cfg.rollout.max_new_tokens,
                              keep_kv=cfg.rollout.keep_kv)
    options = DecoderOptions(decoder=decoder, dtype=dtype, kv_budget_mb=cfg.rollout.kv_budget_mb, eager=vllm_eager)
    make_env = spec.train_env(cfg) if training else spec.eval_env(cfg)
    limits = EpisodeLimits.of(cfg.rollout, cfg.env.max_turns)
    act = model_actor(model, tokenizer, sampling, options)
    if not stream:
        act.stream = None  # type: ignore[attr-defined]  # one blocking batch at a time
    episodes = [task for task in tasks for _ in range(group)]
    clock = Clock()
    trajectories = run_episodes(make_env, episodes, tokenizer, act, limits, seed=11,
                                group_ids=[i // group for i in range(len(episodes))])
    load = clock.read()
    usage = act.decoder.cache_usage() if hasattr(act, "decoder") else {}
    generate_s = max(t.seconds.get("generate", 0.0) for t in trajectories) if trajectories else 0.0
    return {"decoder": decoder, "stream": stream, "seconds": load["wall_s"], "noisy": load["noisy"],
            "other_cpu_share": load["other_cpu_share"], "episodes": len(trajectories),
            "action_tokens": sum(sum(t.action_mask) for t in trajectories),
            "success": sum(bool(t.success) for t in trajectories), "usage": usage,
            "generate_s_longest_episode": generate_s,
            "actions": [t.actions for t in trajectories]}


def workload_pair(cfg: Any, spec: Any, model: Any, tokenizer: Any, tasks: list[Any], *, group: int,
                  temperature: float, training: bool, dtype: str, label: str,
                  baseline: tuple[str, bool] = ("hf", True)) -> dict[str, Any]:
    """`baseline` (decoder, stream) against keel streaming on the same work; "hf" and "keel" name the two runs."""
    runs = {}
    for name, (decoder, stream) in (("hf", baseline), ("keel", ("keel", True))):
        runs[name] = workload(cfg, spec, model, tokenizer, tasks, decoder, group=group, temperature=temperature,
                              training=training, dtype=DTYPES[dtype], stream=stream)
        print(f"{label} {decoder}{'' if stream else ' (blocking)'}: {runs[name]['seconds']:.1f} s, "
              f"{runs[name]['action_tokens']} action tokens, {runs[name]['success']}/{runs[name]['episodes']} solved",
              flush=True)
    same = sum(a == b for a, b in zip(runs["hf"].pop("actions"), runs["keel"].pop("actions")))
    return {"label": label, "dtype": dtype, "ratio": runs["hf"]["seconds"] / runs["keel"]["seconds"],
            "same_actions": same, "episodes": runs["keel"]["episodes"], **{k: v for k, v in runs.items()}}


def compute_floor(config: Any, pair: dict[str, Any], gpeak: float) -> dict[str, float] | None:
    """The least time an engine needs for `pair`'s work at the measured matmul peak `gpeak`: the
    FLOPs of the prefill and decode tokens keel ran (attention at each phase's mean keys, the
    head once per sampled token), plus the time keel's run spent outside its decoder (environment
    work and grading, which no engine removes). max_ratio: HF generate's seconds over that."""
    keel = pair["keel"]
    usage = keel["usage"]
    if not usage or gpeak <= 0:
        return None
    episodes = max(1, keel["episodes"])
    prefill, decode = usage.get("prefill_tokens", 0.0), usage.get("decode_tokens", 0.0)
    prompt = prefill / episodes
    total = (flops(config, int(prefill), 0, prompt / 2)
             + flops(config, int(decode), int(keel["action_tokens"]), prompt + decode / episodes / 2))
    compute_s = total / (gpeak * 1e9)
    decoder_s = usage.get("forward_s", 0.0) + usage.get("sample_s", 0.0)
    other_s = max(0.0, keel["seconds"] - decoder_s)
    return {"gflop": total / 1e9, "compute_s": compute_s, "decoder_s": decoder_s, "other_s": other_s,
            "max_ratio": pair["hf"]["seconds"] / (compute_s + other_s)}


# --------------------------------------------------------------------------- 4. llama.cpp
def llamacpp_row(model_dir: Path, model: Any, tokenizer: Any, prompts: list[list[int]], new: int, batch: int,
                 threads: int, dtype: str = "float32") -> dict[str, Any]:
    """keel in `dtype` against llama.cpp on the same GGUF weights: F32 (F32 KV cache) for float32,
    BF16 (llama.cpp's usual F16 KV cache) for bfloat16."""
    from bench.llamacpp import gguf_of, llamacpp_generate
    from keelrl.inference import KeelDecoder, SamplingParams, draw_uniforms

    outtype, kv_type = ("f32", "f32") if dtype == "float32" else ("bf16", "f16")
    gguf = gguf_of(model_dir, outtype)
    cfg = SamplingParams(temperature=0.0, max_new_tokens=new, stop=())
    uniforms = draw_uniforms(torch.Generator().manual_seed(0), len(prompts) * new).view(len(prompts), new)
    decoder = KeelDecoder(model, tokenizer, max_batch=batch, dtype=DTYPES[dtype])
    decoder.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=2, stop=()), uniforms[:2])
    ends = list(decoder.end_ids)
    llamacpp_generate(gguf, prompts[:2], 2, min(batch, 2), threads, end_ids=ends, kv_type=kv_type)  # warm-up
    tick = time.perf_counter()
    samples = decoder.generate(prompts, cfg, uniforms, share_prompts=False)
    keel_s = time.perf_counter() - tick
    theirs = llamacpp_generate(gguf, prompts, new, batch, threads, end_ids=ends, kv_type=kv_type)
    keel_tokens = sum(len(s.token_ids) for s in samples)
    theirs_tokens = int(theirs["generated_tokens"])
    prompt_tokens = sum(len(p) for p in prompts)
    same = sum(s.token_ids == list(t) for s, t in zip(samples, theirs["tokens"]))
    return {"dtype": dtype, "gguf": str(gguf), "outtype": outtype, "kv_type": kv_type, "batch": batch, "prompts": len(prompts), "prompt_tokens": prompt_tokens,
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
    from keelrl.envs.registry import resolve_env, settle_env
    from keelrl.policy.download import resolve_model_path
    from keelrl.policy.model import load_policy
    from keelrl.inference.precision import resolve_dtype
    from keelrl.rollout.scheduler import prompt_tokens

    overrides = ["env.name=coding"]
    if args.smoke:
        overrides += ["rollout.max_new_tokens=8"]
    cfg = load_config(overrides=overrides)
    model_dir = Path(resolve_model_path(args.model))
    model, tokenizer = load_policy(str(model_dir), "cpu", torch.float32)
    model.eval()
    eval_auto, eval_why = resolve_dtype("auto", "eval", model, torch.device("cpu"))
    spec = resolve_env(cfg)
    cfg = settle_env(cfg, spec)  # env.max_turns: the environment's own when unset
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
    engine = [row for dtype in args.dtypes
              for row in engine_rows(model, tokenizer, prompts, args.batches, args.decode_tokens, peaks[dtype], dtype)]
    breakdown = [step_breakdown(model, tokenizer, prompts, max(args.batches), dtype) for dtype in args.dtypes]
    rollout_tasks = list(train_tasks)[:cfg.rollout.tasks_per_step]
    workloads = []
    for dtype in args.dtypes:
        workloads.append(workload_pair(cfg, spec, model, tokenizer, heldout, group=1,
                                       temperature=cfg.eval.temperature, training=False, dtype=dtype,
                                       label="evaluation"))
        workloads.append(workload_pair(cfg, spec, model, tokenizer, rollout_tasks, group=cfg.rollout.group_size,
                                       temperature=cfg.rollout.temperature, training=True, dtype=dtype,
                                       label="rollout"))
    for pair in workloads:
        pair["floor"] = compute_floor(model.config, pair, peaks[pair["dtype"]])
    streaming = workload_pair(cfg, spec, model, tokenizer, rollout_tasks, group=cfg.rollout.group_size,
                              temperature=cfg.rollout.temperature, training=True, dtype=args.dtypes[0],
                              label="rollout", baseline=("keel", False))
    llama: list[dict[str, Any]] = []
    llama_error = ""
    if not args.no_llamacpp:
        for dtype in args.dtypes:
            try:
                llama.append(llamacpp_row(model_dir, model, tokenizer, prompts[:16 if args.smoke else 32],
                                          cfg.rollout.max_new_tokens, min(64, max(args.batches)),
                                          torch.get_num_threads(), dtype))
                print(f"llama.cpp {dtype}: {llama[-1]['llamacpp_tok_s']:.0f} tok/s, keel {llama[-1]['keel_tok_s']:.0f} "
                      f"tok/s", flush=True)
            except Exception as error:  # noqa: BLE001 - reported in the section: the extra may be missing
                llama_error = f"{type(error).__name__}: {error}"
                print(f"llama.cpp {dtype}: not measured ({llama_error})", flush=True)
                break
    defaults = {"eval": (str(eval_auto).removeprefix("torch."), eval_why), "rollout": cfg.rollout.dtype}
    section = summarise(args, roof, peaks, engine, workloads, streaming, llama, llama_error, defaults,
                        time.perf_counter() - started, breakdown)
    write_section(args.out, section)


def summarise(args: argparse.Namespace, roof: list[dict[str, Any]], peaks: dict[str, float],
              engine: list[dict[str, Any]], workloads: list[dict[str, Any]], streaming: dict[str, Any],
              llama: list[dict[str, Any]], llama_error: str, defaults: dict[str, Any], seconds: float,
              breakdown: list[dict[str, Any]]) -> Section:
    info = machine()
    lines = [f"Model {args.model}, {info['torch_threads']} torch threads, on {info['cpu']} ({info['cores']} cores, "
             f"{info['cpu_capability']}). The default run evaluates in {defaults['eval'][0]} (eval.dtype=auto: "
             f"{defaults['eval'][1]}) and samples its rollouts in {defaults['rollout']} (rollout.dtype).", "",
             "Matmul roofline (`F.linear` at the model's shapes), GFLOP/s:", "",
             "| matrix | rows | float32 | bfloat16 |", "|---|---|---|---|"]
    for name in linear_shapes_names(roof):
        for m in sorted({r["rows"] for r in roof}):
            cells = {r["dtype"]: r["gflops"] for r in roof if r["matrix"] == name and r["rows"] == m}
            lines.append(f"| {name} | {m} | {cells.get('float32', 0):.0f} | {cells.get('bfloat16', 0):.0f} |")
    lines += ["", f"Peak: float32 {peaks['float32']:.0f} GFLOP/s, bfloat16 {peaks['bfloat16']:.0f} GFLOP/s.", "",
              "Keel decoder throughput (decode with exactly the stated new tokens; shares of the dtype's peak):", "",
              "| dtype | batch | prefill tok/s | prefill % of peak | decode tok/s | decode % of peak | noisy |",
              "|---|---|---|---|---|---|---|"]
    for row in engine:
        lines.append(f"| {row['dtype']} | {row['batch']} | {row['prefill_tok_s']:.0f} | {row['prefill_peak_share']:.0%} | "
                     f"{row['decode_tok_s']:.0f} | {row['decode_peak_share']:.0%} | {row['noisy']} |")
    kinds = ["weight matmuls", "attention matmuls", "copies and casts", "softmax", "other"]
    lines += ["", "Where a decode step's time goes (every row decoding, none prefilling; ms per step by torch op, "
                  "from the profiler's self CPU time, its own cost in other):", "",
              "| dtype | batch | mean keys | wall ms (unprofiled) | " + " | ".join(kinds) + " |",
              "|---|---|---|---|" + "---|" * len(kinds)]
    for b in breakdown:
        lines.append(f"| {b['dtype']} | {b['batch']} | {b['keys']:.0f} | {b['wall_ms']:.0f} | "
                     + " | ".join(f"{b['kinds_ms'].get(kind, 0.0):.0f}" for kind in kinds) + " |")
    lines += ["", "Workloads of the default run through the agent loop (environment and grading included):", "",
              "| workload | dtype | episodes | hf s | keel s | hf / keel | same actions | keel decoder share | "
              "solved hf / keel | noisy hf / keel |", "|---|---|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        usage = w["keel"]["usage"]
        share = (usage.get("forward_s", 0) + usage.get("sample_s", 0)) / max(1e-9, w["keel"]["seconds"])
        lines.append(f"| {w['label']} | {w['dtype']} | {w['episodes']} | {w['hf']['seconds']:.1f} | "
                     f"{w['keel']['seconds']:.1f} | {w['ratio']:.2f}x | {w['same_actions']}/{w['episodes']} | "
                     f"{share:.0%} | {w['hf']['success']} / {w['keel']['success']} | "
                     f"{w['hf']['noisy']} / {w['keel']['noisy']} |")
    for w in workloads:
        u = w["keel"]["usage"]
        if u:
            lines.append("")
            lines.append(f"Keel {w['label']} ({w['dtype']}) breakdown: forward {u.get('forward_s', 0):.1f} s, sampling "
                         f"{u.get('sample_s', 0):.1f} s over {u.get('steps', 0):.0f} steps; "
                         f"{u.get('prefill_tokens', 0):.0f} prefill and {u.get('decode_tokens', 0):.0f} decode tokens; "
                         f"mean busy slots {u.get('busy_slots', 0) / max(1, u.get('steps', 1)):.1f}; "
                         f"{u.get('joined_in_flight', 0):.0f} episodes joined a running batch, "
                         f"{u.get('prefix_hits', 0):.0f} started from a stored prefix.")
            floor = w.get("floor")
            if floor:
                lines.append(f"Its compute floor: {floor['gflop']:.0f} GFLOP at the {w['dtype']} peak is "
                             f"{floor['compute_s']:.1f} s; with keel's {floor['other_s']:.1f} s outside the decoder "
                             f"(environments, grading) no {w['dtype']} engine doing this work beats HF generate by "
                             f"more than {floor['max_ratio']:.2f}x on this CPU (keel: {w['ratio']:.2f}x, "
                             f"{floor['compute_s'] / max(1e-9, floor['decoder_s']):.0%} of the floor's speed in "
                             f"its decoder).")
    blocking, stream = streaming["hf"], streaming["keel"]
    lines += ["", f"Streaming ({streaming['dtype']} rollout workload): keel with one blocking batch at a time "
                  f"{blocking['seconds']:.1f} s ({blocking['usage'].get('steps', 0):.0f} decode steps), streaming "
                  f"{stream['seconds']:.1f} s ({stream['usage'].get('steps', 0):.0f} steps): "
                  f"{streaming['ratio']:.2f}x; same actions {streaming['same_actions']}/{streaming['episodes']}."]
    ratios = []
    for w in workloads:
        ratios.append(Ratio(f"{w['label']} workload, {w['dtype']}: keel decoder speed-up over HF generate", w["ratio"],
                            3.0, detail=f"{w['hf']['seconds']:.1f} s / {w['keel']['seconds']:.1f} s"))
    for dtype in args.dtypes:
        best_prefill = max(row["prefill_peak_share"] for row in engine if row["dtype"] == dtype)
        ratios.append(Ratio(f"keel prefill FLOP/s / measured {dtype} matmul peak (best batch)", best_prefill, 0.5))
    for row in llama:
        ratio = row["keel_tok_s"] / row["llamacpp_tok_s"]
        lines += ["", f"llama.cpp ({row['dtype']}: {row['outtype'].upper()} "
                      f"GGUF of the same weights, {row['kv_type']} KV cache, batch {row['batch']}, {row['prompts']} "
                      f"prompts, greedy, up to the run's max_new_tokens): {row['llamacpp_tok_s']:.0f} tok/s "
                      f"({row['llamacpp_s']:.1f} s); keel in {row['dtype']} {row['keel_tok_s']:.0f} tok/s "
                      f"({row['keel_s']:.1f} s); same greedy rows {row['same_greedy_rows']}/{row['prompts']}."]
        ratios.append(Ratio(f"keel throughput / llama.cpp throughput, {row['dtype']} (same prompts, batch, lengths)",
                            ratio, 0.8, detail=f"{row['keel_tok_s']:.0f} / {row['llamacpp_tok_s']:.0f} tok/s"))
    if not llama:
        lines += ["", f"llama.cpp: not measured ({llama_error or 'skipped'})."]
    return Section(name="engine", title="Decode engine against HF generate and llama.cpp", markdown="\n".join(lines),
                   ratios=ratios, smoke=args.smoke, seconds=seconds,
                   data={"roofline": roof, "peaks": peaks, "engine": engine, "workloads": workloads,
                         "streaming": streaming, "llamacpp": llama, "defaults": defaults, "breakdown": breakdown,
                         "machine": info})


def linear_shapes_names(roof: list[dict[str, Any]]) -> list[str]:
    seen: list[str] = []
    for r in roof:
        if r["matrix"] not in seen:
            seen.append(r["matrix"])
    return seen


if __name__ == "__main__":
    main()
