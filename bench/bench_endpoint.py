"""Harness sessions through the endpoint against the same episodes through the in-process agent loop.

An agent builder's harness talks to keelrl over HTTP (`keelrl.serve`): every turn is a chat
call that is rendered through the chat template, continued token for token from the session's
previous call, sampled beside the other sessions' calls (continuous batching, kept keys and
values where the prefix holds) and recorded. This measures what that costs against keelrl's own
agent loop (`keelrl.rollout.agent_loop.run_episodes`), which does the same sampling in process.

The workload (`bench.synthetic`): S episodes (S/4 prompts of about P tokens, 4 attempts each),
K turns each, every action exactly L tokens (no stop strings; end tokens held back), the same
observation of about O tokens after each action but the last. Both sides sample with the same
model, weights, dtype, decoder and sampling settings, in this one process, one after the other:

- in-process: `run_episodes` over the `TurnsEnv` environment;
- endpoint: an `Endpoint` on 127.0.0.1 and a harness in a separate process (this module with
  --harness) that runs S sessions concurrently, one thread each, with the real `openai` client:
  each session sends its growing message list (the observation as a tool message) K times. The
  endpoint samples on the main thread, as `keel serve` does (--decode-thread: in a thread of its
  own, what the endpoint engine does while the learner updates).

Throughput is completion tokens over wall-clock seconds: in-process from the call to its
return; endpoint from the harness's start barrier to its last reply (the harness process's
start-up and imports are not counted). The ratio is endpoint over in-process, median over
repeats, run alternately.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, Clock, Ratio, Section, arguments, fmt_spread, machine, write_section


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="endpoint")
    parser.add_argument("--model", default="smollm2", help="registered name or model dir")
    parser.add_argument("--sessions", type=int, default=32, help="concurrent episodes (a multiple of 4)")
    parser.add_argument("--turns", type=int, default=3, help="chat calls per episode")
    parser.add_argument("--completion-tokens", type=int, default=32, help="tokens per action, exactly")
    parser.add_argument("--prompt-tokens", type=int, default=160, help="prompt length, about")
    parser.add_argument("--observation-tokens", type=int, default=32, help="observation length, about")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating")
    parser.add_argument("--decode-thread", action="store_true",
                        help="the endpoint samples in a thread of its own (as in training) instead of on the main "
                             "thread (as `keel serve` does)")
    parser.add_argument("--harness", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- the harness process
def harness(url: str, spec_path: str) -> None:
    """S sessions at once, each K chat calls; prints {"seconds", "completion_tokens", "calls"}."""
    from openai import OpenAI

    spec = json.loads(Path(spec_path).read_text())
    client = OpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=3600)
    barrier = threading.Barrier(len(spec["prompts"]) + 1)
    tokens: list[int] = []
    prompts: list[int] = []
    errors: list[BaseException] = []

    def session(index: int, prompt: str) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        barrier.wait()
        try:
            for turn in range(spec["turns"]):
                reply = client.chat.completions.create(model="keel-policy", messages=messages,
                                                       extra_headers={"X-Session-Id": f"bench-{index}"})
                tokens.append(reply.usage.completion_tokens)
                prompts.append(reply.usage.prompt_tokens)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                if turn + 1 < spec["turns"]:
                    messages.append({"role": "tool", "content": spec["observation"]})
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=session, args=(i, p)) for i, p in enumerate(spec["prompts"])]
    for thread in threads:
        thread.start()
    barrier.wait()
    tick = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - tick
    if errors:
        raise errors[0]
    print(json.dumps({"seconds": seconds, "completion_tokens": sum(tokens), "calls": len(tokens),
                      "prompt_tokens": sum(prompts)}))


# --------------------------------------------------------------------------- the two sides
def in_process(model: Any, tokenizer: Any, prompts: list[str], args: argparse.Namespace, sampling: Any,
               options: Any, observation: str, seed: int) -> dict[str, float]:
    from bench.synthetic import PromptTask, TurnsEnvFactory
    from keelrl.rollout.agent_loop import EpisodeLimits, model_actor, run_episodes

    limits = EpisodeLimits(max_turns=args.turns, max_context_tokens=8192, max_new_tokens=args.completion_tokens,
                           env_threads=4, interruptible=True, label_steps=False, lockstep=False)
    tasks = [PromptTask(id=f"p{i}", prompt=p) for i, p in enumerate(prompts)]
    act = model_actor(model, tokenizer, sampling, options)
    tick = time.perf_counter()
    trajectories = run_episodes(TurnsEnvFactory(args.turns, observation), tasks, tokenizer, act, limits, seed=seed)
    seconds = time.perf_counter() - tick
    tokens = sum(t.num_action_tokens for t in trajectories)
    prompt_tokens = sum(position for t in trajectories for position, (acting, before) in enumerate(
        zip(t.action_mask, [False, *t.action_mask])) if acting and not before)  # each turn's context length
    return {"seconds": seconds, "completion_tokens": tokens, "calls": sum(len(t.actions) for t in trajectories),
            "prompt_tokens": prompt_tokens,
            "prefill_tokens": act.decoder.cache_usage()["prefill_tokens"]}


def through_endpoint(model: Any, tokenizer: Any, prompts: list[str], args: argparse.Namespace, sampling: Any,
                     options: Any, observation: str, seed: int, spec_dir: Path) -> dict[str, float]:
    from keelrl.serve import Endpoint, EndpointConfig

    spec = spec_dir / f"spec-{seed}.json"
    spec.write_text(json.dumps({"prompts": prompts, "turns": args.turns, "observation": observation}))
    config = EndpointConfig(tool_format="json", max_context_tokens=8192, sampling=sampling, decoder=options,
                            fixed_sampling=True, seed=seed)
    with Endpoint(model, tokenizer, config, decode_thread=args.decode_thread) as endpoint, \
            tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        harness = subprocess.Popen([sys.executable, "-m", "bench.bench_endpoint", "--harness", endpoint.url,
                                    "--spec", str(spec)], cwd=ROOT, stdout=out, stderr=err,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
        if args.decode_thread:
            harness.wait()
        else:  # as `keel serve` does: sample on this (the main) thread
            endpoint.serve(until=lambda: harness.poll() is not None)
        if harness.wait() != 0:
            err.seek(0)
            raise RuntimeError(f"the harness failed (exit {harness.returncode}):\n{err.read()[-3000:]}")
        out.seek(0)
        result = json.loads(out.read().strip().splitlines()[-1])
        sessions = list(endpoint.sessions.values())
        result["samples_per_session"] = sum(len(s.samples) for s in sessions) / max(1, len(sessions))
        result["recorded_tokens"] = sum(len(c.completion_ids) for s in sessions for c in s.calls)
        result["prefill_tokens"] = endpoint.loop.decoder.cache_usage()["prefill_tokens"]
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench.bench_trl import prompt_texts
    from bench.synthetic import observation_text
    from keelrl.policy.download import resolve_model_path
    from keelrl.policy.model import load_policy
    from keelrl.inference import DecoderOptions, SamplingParams

    model, tokenizer = load_policy(resolve_model_path(args.model), device="cpu", dtype=torch.float32)
    model.eval().requires_grad_(False)
    distinct = prompt_texts(tokenizer, args.sessions // 4, args.prompt_tokens)
    prompts = [p for p in distinct for _ in range(4)]
    observation = observation_text(tokenizer, args.observation_tokens)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.completion_tokens,
                              min_new_tokens=args.completion_tokens, stop=(), keep_kv=True)
    options = DecoderOptions(decoder="keel", dtype=torch.float32, max_batch=64)
    runs: dict[str, list[dict[str, Any]]] = {"in_process": [], "endpoint": []}
    with tempfile.TemporaryDirectory() as spec_dir:
        for repeat in range(args.repeats):
            for side in ("in_process", "endpoint") if repeat % 2 == 0 else ("endpoint", "in_process"):
                clock = Clock()
                if side == "in_process":
                    result = in_process(model, tokenizer, prompts, args, sampling, options, observation, seed=repeat)
                else:
                    result = through_endpoint(model, tokenizer, prompts, args, sampling, options, observation, repeat,
                                              Path(spec_dir))
                result["tokens_per_s"] = result["completion_tokens"] / result["seconds"]
                result["other_cpu"] = clock.read()["other_cpu_share"]
                runs[side].append(result)
                print(f"{side}: {result}", file=sys.stderr, flush=True)
    return runs


def summarise(runs: dict[str, Any], args: argparse.Namespace, seconds: float) -> Section:
    rate = {side: [r["tokens_per_s"] for r in rows] for side, rows in runs.items()}
    ratio = statistics.median(rate["endpoint"]) / statistics.median(rate["in_process"])
    lines = [f"{args.sessions} episodes ({args.sessions // 4} prompts of about {args.prompt_tokens} tokens x 4), "
             f"{args.turns} turns, exactly {args.completion_tokens} tokens an action, observations of about "
             f"{args.observation_tokens} tokens; model {args.model}, float32, keel decoder, kept keys and values; "
             f"{args.repeats} runs a side, alternating; the endpoint samples "
             + ("in a thread of its own (--decode-thread)" if args.decode_thread else
                "on the main thread (as `keel serve` does, and the endpoint engine while the learner waits)")
             + ".", "",
             "| side | seconds | completion tok/s | calls | prefill tokens | samples / session | other CPU share |",
             "|---|---|---|---|---|---|---|"]
    for side, rows in runs.items():
        lines.append(f"| {side} | {fmt_spread([r['seconds'] for r in rows])} | {fmt_spread(rate[side], 1)} | "
                     f"{rows[0]['calls']} | {fmt_spread([r['prefill_tokens'] for r in rows], 0)} | "
                     f"{rows[0].get('samples_per_session', 1.0):g} | "
                     f"{max(r['other_cpu'] for r in rows):.0%} |")
    lines += ["", f"- endpoint / in-process completion tokens/s: **{ratio:.2f}x** (target >= 0.8x)"]
    return Section(name="endpoint", title="Harness sessions through the endpoint against the in-process loop",
                   markdown="\n".join(lines), smoke=args.smoke, seconds=seconds, data={"runs": runs},
                   ratios=[Ratio(f"{args.sessions} harness sessions through the endpoint / in-process loop, "
                                 "completion tokens/s" + (", sampling in its own thread" if args.decode_thread else ""),
                                 ratio, 0.8)])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.harness:
        harness(args.harness, args.spec)
        return
    if args.smoke:
        args.model, args.sessions, args.turns, args.completion_tokens, args.repeats = "tiny", 8, 2, 8, 1
        args.prompt_tokens, args.observation_tokens = 48, 24
    started = time.perf_counter()
    runs = measure(args)
    section = summarise(runs, args, time.perf_counter() - started)
    print(json.dumps({"machine": machine()["cpu"], "ratio": section.ratios[0].value}), flush=True)
    write_section(args.out, section)


if __name__ == "__main__":
    main()
