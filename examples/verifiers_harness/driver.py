"""One round of verifiers' own rollout loop against keelrl's endpoint (runs in the verifiers venv).

For each of the taskset's first --tasks tasks and each of --group-size attempts, it runs one
episode with verifiers v1's `env.run_episode` (SingleAgentEnv, the `null` chat harness in a
subprocess runtime): verifiers starts its harness program, intercepts the program's chat calls
and relays them to --base-url/v1 with the header X-Session-ID set to the trace's id. keelrl's
endpoint groups calls into sessions by that header, so the trace id IS the endpoint's session
id. When an episode finishes, verifiers has graded the trace (taskset.py's rewards); the driver
hands that reward to keelrl:

    POST {base}/keel/v1/sessions/{trace.id}/reward  {"reward": trace.reward, "group": "task-{i}"}

A trace that failed (trace or episode errors) or that verifiers discarded (a retried agent run)
is ended without a reward (POST .../end): keelrl keeps it, unfinished, and never trains on it.

The last line printed is a JSON summary: {"round", "episodes", "rewarded", "ended_unrewarded",
"mean_reward", "sessions": [{"session", "group", "reward", "ok", "reply"}...], "errors": [...]}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # verifiers imports the taskset by module name

import verifiers.v1 as vf  # noqa: E402
from verifiers.v1.runtimes import SubprocessConfig  # noqa: E402


def keel(base: str, path: str, body: dict | None, api_key: str) -> tuple[int, dict]:
    """POST to keelrl's own routes: (status, JSON body)."""
    request = urllib.request.Request(f"{base}/keel/v1/{path}", method="POST", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="keelrl endpoint root, e.g. http://127.0.0.1:PORT")
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--api-key-var", default="KEEL_API_KEY", help="env var holding the endpoint's API key")
    parser.add_argument("--model", default="keel-policy")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="episodes run at once")
    parser.add_argument("--harness", default="null", help="verifiers harness id (null: one chat call)")
    args = parser.parse_args()
    os.environ.setdefault(args.api_key_var, "keel-local")
    api_key = os.environ[args.api_key_var]
    base = args.base_url.rstrip("/")

    env = vf.load_environment(vf.SingleAgentEnvConfig(
        taskset={"id": "taskset"},
        agent=vf.AgentConfig(harness={"id": args.harness}, runtime=SubprocessConfig())))
    tasks = list(env.taskset)[: args.tasks]
    client = vf.EvalClientConfig(base_url=f"{base}/v1", api_key_var=args.api_key_var)
    gate = asyncio.Semaphore(args.concurrency)
    sessions: list[dict] = []
    errors: list[str] = []
    ended = 0

    async def one(i: int, task: vf.Task, attempt: int) -> None:
        nonlocal ended
        group = f"task-{i}"
        discarded: list[str] = []
        # `user` is also sent upstream, but verifiers' X-Session-ID (the trace id) wins at keelrl.
        ctx = vf.ModelContext(model=args.model, client=client, sampling=vf.Sampling(
            temperature=1.0, max_tokens=args.max_tokens, user=f"r{args.round}-{group}-a{attempt}"))
        async with gate:
            episode = await env.run_episode(task, ctx, on_discard=lambda trace: discarded.append(trace.id))
        for trace_id in discarded:  # a retried agent run: its calls (if any) stay unfinished
            status, _ = keel(base, f"sessions/{trace_id}/end", None, api_key)
            ended += status == 200
        if not episode.traces:
            errors.append(f"{group} a{attempt}: no trace: {[e.message[:300] for e in episode.errors]}")
            return
        trace = episode.traces[0]
        trace_errors = [e.message[:500] for e in episode.errors + trace.errors]
        ok = episode.ok and not trace_errors
        if ok:
            status, reply = keel(base, f"sessions/{trace.id}/reward", {"reward": trace.reward, "group": group},
                                 api_key)
        else:
            status, reply = keel(base, f"sessions/{trace.id}/end", None, api_key)
            ended += status == 200
            errors.append(f"{group} a{attempt} trace {trace.id}: {trace_errors}")
        if status != 200:
            errors.append(f"{group} a{attempt} trace {trace.id}: keel answered {status}: {reply}")
        sessions.append({"session": trace.id, "group": group, "reward": trace.reward if ok else None, "ok": ok,
                         "status": status, "reply": (trace.last_reply or "")[:40]})

    started = time.monotonic()
    async with env.serving():
        await asyncio.gather(*(one(i, task, a) for i, task in enumerate(tasks) for a in range(args.group_size)))
    rewards = [s["reward"] for s in sessions if s["reward"] is not None and s["status"] == 200]
    print(json.dumps({"round": args.round, "episodes": len(sessions), "rewarded": len(rewards),
                      "ended_unrewarded": ended, "mean_reward": sum(rewards) / len(rewards) if rewards else None,
                      "seconds": round(time.monotonic() - started, 2), "sessions": sessions, "errors": errors}),
          flush=True)
    return 0 if rewards else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
