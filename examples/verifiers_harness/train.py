"""Train a keelrl policy on what verifiers' own rollout loop recorded through keelrl's endpoint.

Runs in keelrl's venv. It builds a keelrl `Trainer` (the tiny model by default), serves its own
copy of the policy on an `Endpoint` (OpenAI-compatible, recording every call's tokens and
behaviour log-probs), then for each step:

  1. runs driver.py in the verifiers venv (--verifiers-python): verifiers v1's `env.run_episode`
     plays --tasks x --group-size episodes of taskset.py through the endpoint, its harness
     program calling /v1/chat/completions (streaming) and verifiers grading each trace; the
     driver files each trace's reward under its task's group (POST /keel/v1/sessions/{id}/reward);
  2. takes the round's sessions (session id = verifiers' trace id, from its X-Session-ID header),
     groups their recorded trajectories by the group the driver named, and runs `Trainer.rl_step`;
  3. hands the endpoint the updated weights (`ep.loop.offer`) and waits until they serve, so
     the next round is sampled by the new policy version.

Per step it prints the episodes and samples trained on, the mean reward, the mismatch between
the endpoint's recorded behaviour log-probs and the learner's recompute
(`mismatch/log_ratio_abs_max`), the policy versions that sampled the round (read back from
GET /keel/v1/sessions/{id}), and the update's loss metrics. The rows go to RUN_DIR/steps.jsonl.

    python examples/verifiers_harness/train.py --verifiers-python /path/to/verifiers-venv/bin/python
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import keelrl
from keelrl.config import TINY_RUN
from keelrl.inference import own_copy, published_state
from keelrl.rollout.engines import StepRollouts, staleness_metrics
from keelrl.serve import Endpoint, EndpointConfig
from keelrl.train.trainer import Trainer

HERE = Path(__file__).resolve().parent
API_KEY_VAR = "KEEL_API_KEY"


def get(url: str, key: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def run_driver(args: argparse.Namespace, url: str, key: str, round_: int) -> dict:
    """driver.py in the verifiers venv; its JSON summary (the last stdout line)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    # The verifiers venv's bin first on PATH: its `uv` runs verifiers' harness program (else
    # verifiers installs uv into ~/.local/bin itself).
    bin_dir = str(Path(args.verifiers_python).parent)
    env.update({API_KEY_VAR: key, "PYTHONPATH": str(HERE), "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"})
    env.update(dict(item.split("=", 1) for item in args.harness_env))
    command = [args.verifiers_python, str(HERE / "driver.py"), "--base-url", url, "--round", str(round_),
               "--group-size", str(args.group_size), "--tasks", str(args.tasks), "--api-key-var", API_KEY_VAR,
               "--model", args.model_name, "--max-tokens", str(args.max_new_tokens),
               "--concurrency", str(args.concurrency), "--harness", args.harness]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.driver_timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"driver exited {done.returncode} without a summary:\nstdout: {done.stdout[-3000:]}\n"
                           f"stderr: {done.stderr[-3000:]}")
    summary = json.loads(lines[-1])
    summary["returncode"] = done.returncode
    summary["stderr_tail"] = done.stderr[-1500:]
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifiers-python", default=os.environ.get("VERIFIERS_PYTHON", ""),
                        help="python of a venv with `verifiers` installed (not keelrl's: see README)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="episodes the driver runs at once")
    parser.add_argument("--harness", default="null", help="verifiers harness id: null (one chat call) or bash "
                                                            "(a tool loop: the requests carry tools)")
    parser.add_argument("--model", default="tiny", help="keelrl model.path (tiny: the built-in tiny model)")
    parser.add_argument("--model-name", default="keel-policy", help="the model id the endpoint serves")
    parser.add_argument("--run-dir", default="runs/verifiers_harness")
    parser.add_argument("--lr", default="2e-4")
    parser.add_argument("--harness-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the driver (e.g. HOME=... for a warm uv cache)")
    parser.add_argument("--driver-timeout", type=float, default=600)
    args = parser.parse_args()
    if not args.verifiers_python or not Path(args.verifiers_python).exists():
        parser.error("--verifiers-python: the python of the venv where `verifiers` is installed (see README.md)")
    found = subprocess.run([args.verifiers_python, "-c", "import verifiers, verifiers.v1; print(verifiers.__version__)"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        parser.error(f"{args.verifiers_python} cannot import verifiers.v1 (pip install verifiers==0.4.0 uv in that "
                     f"venv; see README.md):\n{found.stderr[-1500:]}")
    print(f"verifiers {found.stdout.strip()} at {args.verifiers_python}", flush=True)

    cfg = keelrl.configure(None, *TINY_RUN, f"model.path={args.model}", f"run_dir={args.run_dir}",
                           "warm_start.demos=0", "eval.before_rl=false", f"train.steps={args.steps}",
                           f"rollout.tasks_per_step={args.tasks}", f"rollout.group_size={args.group_size}",
                           f"rollout.max_new_tokens={args.max_new_tokens}", f"optim.lr={args.lr}",
                           "optim.warmup_steps=0")
    started = time.monotonic()
    trainer = Trainer(cfg)
    sampling = dataclasses.replace(trainer.rollout_sampling(), max_new_tokens=args.max_new_tokens, stop=(),
                                   keep_kv=True)
    decoder = dataclasses.replace(trainer.decoder_options(), decoder="keel")
    key = "keel-local"
    config = EndpointConfig(model_name=args.model_name, tool_format="hermes", api_key=key,
                            max_context_tokens=cfg.rollout.max_context_tokens, sampling=sampling, decoder=decoder,
                            fixed_sampling=True, seed=cfg.seed)
    own = own_copy(trainer.model)
    out = Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with Endpoint(own, trainer.tokenizer, config, version=0) as ep:
        print(f"endpoint {ep.url} serving {args.model_name} (model.path={args.model}), policy version "
              f"{ep.loop.version}; setup {time.monotonic() - started:.1f}s", flush=True)
        consumed: set[str] = set()
        for step in range(1, args.steps + 1):
            tick = time.monotonic()
            counters = dict(ep.counters)
            summary = run_driver(args, ep.url, key, step)
            driver_s = time.monotonic() - tick
            for error in summary["errors"][:5]:
                print(f"  driver error: {error}", flush=True)
            if not summary["rewarded"]:
                raise RuntimeError(f"round {step}: verifiers finished no episode (driver exit "
                                   f"{summary['returncode']}); its errors: {summary['errors'][:3]}\n"
                                   f"{summary['stderr_tail']}")
            # The round's sessions: every one the endpoint opened since the last step.
            fresh = [s for sid, s in list(ep.sessions.items()) if sid not in consumed]
            consumed.update(s.id for s in fresh)
            for session in fresh:  # a call whose trace the driver never reported: unfinished
                if not session.finished:
                    ep.end(session.id)
            groups = sorted({s.group or s.id for s in fresh})
            group_id = {name: i for i, name in enumerate(groups)}
            trajectories = []
            for session in fresh:
                for t in session.trajectories():
                    t.group_id = group_id[session.group or session.id]
                    trajectories.append(t)
            # What the endpoint recorded, read back over HTTP: the policy versions that sampled the round.
            versions = sorted({call["version"] for s in fresh
                               for call in get(f"{ep.url}/keel/v1/sessions/{s.id}", key)["calls"]})
            metrics = staleness_metrics(step, [t for t in trajectories if t.versions], 0)
            metrics.update({f"endpoint/{k}": float(ep.counters[k] - counters.get(k, 0)) for k in ep.counters})
            row = trainer.rl_step(step, StepRollouts(trajectories, metrics))
            trainer.step = step
            ep.loop.offer(published_state(trainer.model), step)  # its merged state dict, copied
            loaded = ep.loop.wait_version(step, timeout=60)
            rewarded = [t.reward for t in trajectories if not math.isnan(t.reward)]
            line = {"step": step, "episodes": len(fresh), "samples": len(trajectories),
                    "groups": len(groups), "driver_episodes": summary["episodes"],
                    "driver_rewarded": summary["rewarded"],
                    "mean_reward": sum(rewarded) / len(rewarded) if rewarded else None,
                    "sampled_by_versions": versions, "served_version_after": ep.loop.version,
                    "weights_loaded": loaded, "driver_s": round(driver_s, 1),
                    "step_s": round(time.monotonic() - tick, 1)}
            keep = ("mismatch/", "loss", "train/updates", "train/skipped", "train/unfinished_frac",
                    "train/env_error_groups_dropped", "rollout/staleness", "rollout/arrival", "endpoint/requests",
                    "endpoint/rejected", "endpoint/sampling_overridden", "endpoint/new_samples", "train/grad_norm")
            line.update({k: v for k, v in sorted(row.items()) if isinstance(v, (int, float))
                         and any(k.startswith(p) or p in k for p in keep)})
            rows.append(line)
            print(json.dumps(line), flush=True)
            with open(out / "steps.jsonl", "a", encoding="utf-8") as handle:
                handle.write(json.dumps({**line, "driver_errors": summary["errors"][:20]}) + "\n")
    print(f"done: {args.steps} steps in {time.monotonic() - started:.1f}s; policy versions sampled per step: "
          f"{[r['sampled_by_versions'] for r in rows]}; mismatch/log_ratio_abs_max per step: "
          f"{[r.get('mismatch/log_ratio_abs_max') for r in rows]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
