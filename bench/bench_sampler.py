"""keelrl's sampler against plain Hugging Face sampling, in float32 and bfloat16 weights.

keelrl samples actions with `keelrl.inference.sample` (the HF path): HF `generate` run greedily over
the choices of a logits processor (`keelrl.inference.sampler.InverseCdfProcessor`) that draws each row's token from that
row's own uniforms and records its behaviour log-prob. The baseline is plain
`model.generate(do_sample=True, temperature=T, top_p=1.0, top_k=0)`: HF's own multinomial
draw, no log-probs recorded. Both continue the same left-padded batch of chat prompts (the
bundled held-out coding tasks, each cut or extended to about `--prompt-tokens`), with the same
end tokens (`end_token_ids`), no stop strings, and exactly `--new-tokens` new tokens per row:
`min_new_tokens = max_new_tokens` for HF, and for keelrl, whose `sample` takes no
`min_new_tokens`, the same value set on the model's `generation_config` (HF applies it before
keelrl's processor, so end tokens get probability 0 until then). Generated tokens are counted
from each engine's output (a row ends at its first end token), so a run that stopped early
could not look fast.

Timing: every (dtype, engine) pair gets one warm-up call (same batch and prompts,
`--warmup-tokens` new tokens: the first calls pay for allocation and kernel set-up), then
`--reps` timed calls, interleaved: rep r runs every pair once, in reverse order on odd reps so drift on a shared
machine hits both engines alike. The keelrl/HF ratio is the median of the per-rep ratios of
calls that ran next to each other; the medians of wall time and tokens/s are reported too.
Also recorded: the load average before and after, and per call the share of the machine's CPU
that OTHER processes used (/proc/stat busy time less this process's own), since on a busy
2-core box a 2-thread torch op waits on a descheduled thread and slows several-fold. Also the
time spent inside keelrl's logits processor (wrapped with a timer here, not changed). A call
during which other processes used more than 10% of the CPUs is flagged noisy; the medians of
wall time and tokens/s are over the quiet calls (all calls if none was quiet), the ratios are
given over all reps and over the reps whose two calls were both quiet. `--wait-quiet` waits
(a bounded time) for a quiet moment before each timed call.

What this does NOT measure: stop strings (`SamplingParams.stop`; `stop=()` here), ragged
batches that finish early, or absolute speed worth quoting on a shared machine: only ratios
between calls that ran side by side.

    python bench/bench_sampler.py                     # SmolLM2-135M, batch 8, ~300 + 64 tokens
    python bench/bench_sampler.py --batch 8 32 --dtypes float32
    python bench/bench_sampler.py --quick             # tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.common import NOISY, Clock, Ratio, Section, wait_quiet, write_section
from keelrl.envs.coding_tasks import bundled_tasks
from keelrl.inference import sampler as sampling
from keelrl.policy.model import cpu_has_amx_bf16, load_policy
from keelrl.inference import SamplingParams, draw_uniforms, end_token_ids, sample
from keelrl.inference.hf import left_pad

ENGINES = ("keelrl", "hf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OUT = Path(__file__).resolve().parent / "out" / "sampler"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", 
                        help="registered name ('smollm2', 'tiny') or local model directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[8], help="batch sizes (rows per call)")
    parser.add_argument("--prompt-tokens", type=int, default=300, 
                        help="prompt length per row, about (chat template included)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row, exactly")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per (batch, dtype, engine), after one warm-up")
    parser.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPES),
                        help="weight dtypes (default: float32, and bfloat16 on a CPU with AMX)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for both engines")
    parser.add_argument("--warmup-tokens", type=int, default=8,
                        help="new tokens in the warm-up call (same batch and prompts; 0: as many as timed calls)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--wait-quiet", type=float, default=30.0,
                        help="before each timed call wait up to this many seconds for a 1 s window in which other "
                             "processes use under 10%% of the CPUs (0: never wait)")
    parser.add_argument("--group", type=int, nargs="+", default=[1, 4],
                        help="rows sharing one prompt (1: every row its own prompt; 4: GRPO groups of 4)")
    parser.add_argument("--turns", type=int, default=3,
                        help="multi-turn run: turns per row, each continuing the whole history (0: none)")
    parser.add_argument("--observation-tokens", type=int, default=48, help="multi-turn: tokens appended per turn")
    parser.add_argument("--out", type=Path, default=OUT, help="directory for sampler.json and section.json")
    parser.add_argument("--quick", "--smoke", dest="quick", action="store_true",
                        help="smoke run: tiny model, batch 4, 48 + 16 tokens, 1 rep")
    args = parser.parse_args(argv)
    if args.dtypes is None:  # bf16 only where it is fast: AMX or a GPU (on AVX2 it decodes several-fold slower)
        args.dtypes = ["float32", "bfloat16"] if cpu_has_amx_bf16() else ["float32"]
    if args.quick:
        args.model, args.batch, args.prompt_tokens, args.new_tokens, args.reps = "tiny", [4], 48, 16, 1
        args.group, args.turns, args.observation_tokens, args.dtypes = [1, 2], 2, 8, ["float32", "bfloat16"]
    if any(batch % group for batch in args.batch for group in args.group):
        parser.error(f"every --batch must be a multiple of every --group, got {args.batch} and {args.group}")
    if args.reps < 1 or args.new_tokens < 1 or args.prompt_tokens < 8 or min(args.batch) < 1:
        parser.error("--reps, --new-tokens and --batch must be >= 1, --prompt-tokens >= 8")
    return args


# --------------------------------------------------------------------------- prompts
def build_prompts(tokenizer: Any, rows: int, target: int) -> list[list[int]]:
    """`rows` chat prompts of about `target` tokens: a held-out task's prompt and files as the user
    message, cut (or extended with the next tasks' files) to fit, ending with the assistant header."""
    tasks = bundled_tasks("heldout")
    prompts = []
    for row in range(rows):
        content, extra = "", 0
        while True:  # grow the text until it is long enough, then cut it by tokens
            task = tasks[(row + extra) % len(tasks)]
            files = "\n\n".join(f"# {name}\n{text}" for name, text in task.files.items())
            content += f"{task.prompt}\n\n{files}\n\n"
            extra += 1
            if len(_render(tokenizer, content)) >= target:
                break
        content_ids = tokenizer(content, add_special_tokens=False)["input_ids"]
        keep = len(content_ids) - (len(_render(tokenizer, content)) - target)
        while keep > 0 and len(_render(tokenizer, tokenizer.decode(content_ids[:keep]))) > target:
            keep -= 1  # re-tokenising the cut text can merge differently
        prompts.append(_render(tokenizer, tokenizer.decode(content_ids[:keep])))
    return prompts


def _render(tokenizer: Any, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- the engines
class ProcessorTimer:
    """Wraps `InverseCdfProcessor.__call__` with a timer for this process (keelrl's code is unchanged)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        original = sampling.InverseCdfProcessor.__call__

        def timed(processor: Any, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = original(processor, input_ids, scores)
            self.seconds += time.perf_counter() - start
            return out

        sampling.InverseCdfProcessor.__call__ = timed  # type: ignore[method-assign,assignment]


def row_tokens(rows: list[list[int]], end_ids: tuple[int, ...]) -> int:
    """Tokens produced: each row up to and including its first end token, or all of it."""
    total = 0
    for tokens in rows:
        ends = [i + 1 for i, token in enumerate(tokens) if token in end_ids]
        total += ends[0] if ends else len(tokens)
    return total


def keelrl_call(model: Any, tokenizer: Any, contexts: list[list[int]], new_tokens: int, temperature: float,
                seed: int) -> int:
    """One `sample` call of exactly `new_tokens` per row; returns the tokens it generated."""
    model.generation_config.min_new_tokens = new_tokens  # `sample` has no such argument; generate reads it here
    uniforms = draw_uniforms(torch.Generator().manual_seed(seed), len(contexts) * new_tokens).view(len(contexts), -1)
    cfg = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=new_tokens, stop=())
    samples = sample(model, tokenizer, contexts, cfg, uniforms=uniforms)
    return sum(len(s.token_ids) for s in samples)


def hf_call(model: Any, tokenizer: Any, contexts: list[list[int]], new_tokens: int, temperature: float,
            seed: int) -> int:
    """Plain `generate(do_sample=True)` on the same batch; returns the tokens it generated."""
    model.generation_config.min_new_tokens = None
    input_ids, attention = left_pad(contexts, tokenizer.pad_token_id)
    torch.manual_seed(seed)  # a benchmark script may use the global RNG; keelrl's library code does not
    out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=temperature,
                         top_p=1.0, top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=list(end_token_ids(tokenizer)))
    return row_tokens(out[:, input_ids.shape[1]:].tolist(), end_token_ids(tokenizer))


CALLS: dict[str, Callable[..., int]] = {"keelrl": keelrl_call, "hf": hf_call}


# --------------------------------------------------------------------------- measuring
def timed_call(call: Callable[..., int], timer: ProcessorTimer, *args: Any) -> dict[str, Any]:
    timer.seconds = 0.0
    clock = Clock()
    tokens = call(*args)
    reading = clock.read()
    return {**reading, "tokens": tokens, "tokens_per_s": tokens / reading["wall_s"], "processor_s": timer.seconds}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    timer = ProcessorTimer()
    models = {}
    for name in args.dtypes:
        models[name], tokenizer = load_policy(args.model, "cpu", dtype=DTYPES[name])
        models[name].eval()
    pairs = [(dtype, engine) for dtype in args.dtypes for engine in ENGINES]
    configs = []
    for batch, group in [(b, g) for b in args.batch for g in args.group]:
        contexts = [ids for ids in build_prompts(tokenizer, batch // group, args.prompt_tokens) for _ in range(group)]
        common = (tokenizer, contexts)
        calls: dict[tuple[str, str], list[dict[str, Any]]] = {pair: [] for pair in pairs}
        warmups = {}
        for dtype, engine in pairs:
            warm = timed_call(CALLS[engine], timer, models[dtype], *common, args.warmup_tokens or args.new_tokens,
                              args.temperature, 10_000)
            warmups[f"{dtype}/{engine}"] = warm
            print(f"batch {batch} group {group} {dtype:<8} {engine:<6} warm-up {warm['wall_s']:7.2f} s", flush=True)
        for rep in range(args.reps):
            for dtype, engine in pairs if rep % 2 == 0 else pairs[::-1]:
                waited = wait_quiet(args.wait_quiet)
                result = timed_call(CALLS[engine], timer, models[dtype], *common, args.new_tokens,
                                    args.temperature, rep)
                result["waited_s"] = waited
                if result["tokens"] != batch * args.new_tokens:
                    raise RuntimeError(f"{engine} {dtype} generated {result['tokens']} tokens, "
                                       f"not {batch} x {args.new_tokens}")
                calls[dtype, engine].append(result)
                print(f"batch {batch} group {group} {dtype:<8} {engine:<6} rep {rep} {result['wall_s']:7.2f} s "
                      f"{result['tokens_per_s']:7.1f} tok/s  other processes {result['other_cpu_share']:.0%}"
                      f"{'  NOISY' if result['noisy'] else ''}",
                      flush=True)
        for dtype in args.dtypes:
            row: dict[str, Any] = {"batch": batch, "group": group, "dtype": dtype,
                                   "warmups": {e: warmups[f"{dtype}/{e}"] for e in ENGINES},
                                   "prompt_tokens": [len(ids) for ids in contexts], "new_tokens": args.new_tokens}
            for engine in ENGINES:
                reps = calls[dtype, engine]
                quiet = [r for r in reps if not r["noisy"]]
                row[engine] = {"calls": reps, "quiet_calls": len(quiet),
                               **{f"median_{key}": statistics.median(r[key] for r in quiet or reps)
                                  for key in ("wall_s", "tokens_per_s", "processor_s", "other_cpu_share")}}
            row.update(paired_ratio("keelrl_over_hf_wall", row["keelrl"]["calls"], row["hf"]["calls"]))
            configs.append(row)
        if "float32" in args.dtypes and "bfloat16" in args.dtypes:
            for engine in ENGINES:
                bf16_over_fp32 = paired_ratio("bf16_over_fp32_wall", calls["bfloat16", engine],
                                              calls["float32", engine])
                configs.append({"batch": batch, "group": group, "engine": engine, **bf16_over_fp32})
    multi = multi_turn(args, models[args.dtypes[0]], tokenizer) if args.turns > 1 else None
    return {"configs": configs, "multi_turn": multi}


def multi_turn(args: argparse.Namespace, model: Any, tokenizer: Any) -> dict[str, Any]:
    """`--turns` turns on GRPO groups: each turn continues every row's whole history (its context,
    its actions, an observation after each), by keelrl's sampler and by HF generate, interleaved
    over `--reps`. HF prefills the whole history anew each turn; keelrl keeps each row's keys and
    values between turns (`SamplingParams.keep_kv`) and runs only the new tokens. The tokens
    each prefills (recomputes) per turn are counted: keelrl's from its own `Sample.recomputed`."""
    batch, group = args.batch[0], max(args.group)
    prompts = [ids for ids in build_prompts(tokenizer, batch // group, args.prompt_tokens) for _ in range(group)]
    line = tokenizer("FAILED test_retry.py::test_retry_count - AssertionError: expected 3, got 2\n",
                     add_special_tokens=False)["input_ids"]
    observation = (line * (args.observation_tokens // len(line) + 1))[:args.observation_tokens]
    results: dict[str, list[dict[str, Any]]] = {engine: [] for engine in ENGINES}
    for rep in range(args.reps):
        for engine in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
            contexts = [list(ids) for ids in prompts]
            caches: list[Any] = [None] * len(contexts)
            recomputed, tokens = [], 0
            clock = Clock()
            for turn in range(args.turns):
                new, caches, prefilled = TURN_CALLS[engine](model, tokenizer, contexts, args.new_tokens,
                                                            args.temperature, rep * 100 + turn, caches)
                recomputed.append(prefilled)
                tokens += sum(len(ids) for ids in new)
                contexts = [ids + step + observation for ids, step in zip(contexts, new)]
            reading = clock.read()
            if tokens != batch * args.turns * args.new_tokens:
                raise RuntimeError(f"{engine} multi-turn generated {tokens} tokens, not {batch} x {args.turns} x "
                                   f"{args.new_tokens}")
            results[engine].append({"wall_s": reading["wall_s"], "tokens": tokens, "recomputed_per_turn": recomputed,
                                    "noisy": reading["noisy"], "other_cpu_share": reading["other_cpu_share"]})
            print(f"multi-turn {engine:<6} rep {rep} {reading['wall_s']:7.2f} s; prefilled per turn {recomputed}",
                  flush=True)
    return {"batch": batch, "group": group, "turns": args.turns, "observation_tokens": len(observation),
            "new_tokens": args.new_tokens, **results,
            **paired_ratio("keelrl_over_hf_wall", results["keelrl"], results["hf"])}


def keelrl_turn(model: Any, tokenizer: Any, contexts: list[list[int]], new_tokens: int, temperature: float,
                seed: int, caches: list[Any]) -> tuple[list[list[int]], list[Any], int]:
    """One turn by keelrl's sampler, keeping keys and values: (actions, caches, tokens prefilled)."""
    model.generation_config.min_new_tokens = new_tokens
    uniforms = draw_uniforms(torch.Generator().manual_seed(seed), len(contexts) * new_tokens).view(len(contexts), -1)
    cfg = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=new_tokens, stop=(), keep_kv=True)
    samples = sample(model, tokenizer, contexts, cfg, uniforms=uniforms, caches=caches)
    return [s.token_ids for s in samples], [s.cache for s in samples], sum(s.recomputed for s in samples)


def hf_turn(model: Any, tokenizer: Any, contexts: list[list[int]], new_tokens: int, temperature: float,
            seed: int, caches: list[Any]) -> tuple[list[list[int]], list[Any], int]:
    """One turn by plain HF generate on the whole history: (actions, no caches, tokens prefilled)."""
    model.generation_config.min_new_tokens = None
    input_ids, attention = left_pad(contexts, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=temperature,
                         top_p=1.0, top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=list(end_token_ids(tokenizer)))
    return ([row[:new_tokens] for row in out[:, input_ids.shape[1]:].tolist()], caches,
            sum(len(ids) for ids in contexts))


TURN_CALLS: dict[str, Callable[..., tuple[list[list[int]], list[Any], int]]] = {"keelrl": keelrl_turn, "hf": hf_turn}


def paired_ratio(name: str, top: list[dict[str, Any]], bottom: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over reps of top wall / bottom wall (same rep, run side by side), over all reps and quiet ones."""
    ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(top, bottom)]
    quiet = [r for r, a, b in zip(ratios, top, bottom) if not (a["noisy"] or b["noisy"])]
    return {name: statistics.median(ratios), f"{name}_quiet": statistics.median(quiet) if quiet else None,
            f"{name}_per_rep": ratios, f"{name}_quiet_reps": len(quiet)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()
    started = time.perf_counter()
    report = run(args)
    report.update({
        "setup": {"model": args.model, "batch": args.batch, "prompt_tokens": args.prompt_tokens,
                  "new_tokens": args.new_tokens, "reps": args.reps, "dtypes": args.dtypes, "group": args.group,
                  "turns": args.turns,
                  "temperature": args.temperature, "warmup_tokens": args.warmup_tokens, "quick": args.quick,
                  "wait_quiet": args.wait_quiet, "noisy_above": NOISY},
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "cpus": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.platform(),
        "python": sys.version.split()[0], "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "total_s": time.perf_counter() - started,
        "ratio": "keelrl_over_hf_wall: median over reps of keelrl wall / HF wall of calls run side by side "
                 "(>1: keelrl slower); both generate exactly batch x new_tokens tokens",
    })
    print()
    print(table(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampler.json").write_text(json.dumps(report, indent=2) + "\n")
    write_section(args.out, section(report, args))
    print(f"wrote {args.out / 'sampler.json'} and section.json")


def section(report: dict[str, Any], args: argparse.Namespace) -> Section:
    """The benchmark's part of BENCHMARKS.md: the table, and keelrl's speed-up over HF generate."""
    ratios = []
    for row in report["configs"]:
        if "dtype" in row:
            per_rep = row["keelrl_over_hf_wall_per_rep"]
            ratios.append(Ratio(f"sampler speed-up over HF generate, {row['dtype']}, batch {row['batch']}, "
                                f"{row['group']} row(s) per prompt", 1 / row["keelrl_over_hf_wall"], 1.5,
                                detail="HF wall / keelrl wall, median of per-rep ratios: " +
                                       ", ".join(f"{1 / r:.2f}" for r in per_rep)))
    multi = report.get("multi_turn")
    lines = [table(report)]
    if multi:
        ratios.append(Ratio(f"sampler speed-up over HF generate, {multi['turns']} turns of continuation",
                            1 / multi["keelrl_over_hf_wall"], 1.5,
                            detail="HF wall / keelrl wall over whole multi-turn runs"))
        keel, hf = multi["keelrl"][0]["recomputed_per_turn"], multi["hf"][0]["recomputed_per_turn"]
        lines += ["", f"Multi-turn continuation: batch {multi['batch']} in groups of {multi['group']}, {multi['turns']} "
                  f"turns of {multi['new_tokens']} tokens, {multi['observation_tokens']} observation tokens appended "
                  f"after each; keelrl/HF wall {multi['keelrl_over_hf_wall']:.2f}x.",
                  f"Prompt and history tokens prefilled (recomputed) per turn: keelrl {keel}, HF {hf}. keelrl "
                  "keeps each row's keys and values between turns (`rollout.keep_kv`) and runs only the last "
                  "action token and the observation; HF `generate` re-prefills the whole history each turn."]
    return Section(name="sampler", title="Sampler against HF generate", markdown="\n".join(lines), ratios=ratios,
                   smoke=args.quick, seconds=report["total_s"], data=report)


def table(report: dict[str, Any]) -> str:
    """The report as markdown: medians per (batch, dtype), then the paired ratios."""
    def ratio(row: dict[str, Any], name: str) -> str:
        quiet = row[f"{name}_quiet"]
        per_rep = ", ".join(f"{r:.2f}" for r in row[f"{name}_per_rep"])
        return (f"{row[name]:.2f}x (quiet reps: {'-' if quiet is None else f'{quiet:.2f}x'}, "
                f"{row[f'{name}_quiet_reps']} of {len(row[f'{name}_per_rep'])}; per rep {per_rep})")

    lines = ["| batch | rows per prompt | dtype | keelrl s/call | HF s/call | keelrl tok/s | HF tok/s | keelrl processor s "
             "| noisy calls | keelrl/HF wall, median of per-rep ratios |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["configs"]:
        if "dtype" in row:
            keel, hf = row["keelrl"], row["hf"]
            noisy = sum(c["noisy"] for c in keel["calls"] + hf["calls"])
            lines.append(f"| {row['batch']} | {row['group']} | {row['dtype']} | {keel['median_wall_s']:.2f} | {hf['median_wall_s']:.2f} "
                         f"| {keel['median_tokens_per_s']:.1f} | {hf['median_tokens_per_s']:.1f} "
                         f"| {keel['median_processor_s']:.2f} | {noisy} of {len(keel['calls']) * 2} "
                         f"| {ratio(row, 'keelrl_over_hf_wall')} |")
    lines.append("")
    for row in report["configs"]:
        if "engine" in row:
            lines.append(f"- batch {row['batch']}, group {row['group']}, {row['engine']}: bf16/fp32 wall {ratio(row, 'bf16_over_fp32_wall')}")
    lines.append(f"- load average (1 min) before {report['loadavg_before'][0]:.2f}, after "
                 f"{report['loadavg_after'][0]:.2f}; {report['torch_threads']} torch threads, {report['cpus']} CPUs; "
                 f"total {report['total_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
