"""Training through the endpoint (`rollout.engine=endpoint`, keelrl.serve.engine) with the example
harness (examples/openai_harness/harness.py, which imports only openai), and the learner's side
of episodes split into several samples (keelrl.train.advantage.episode_advantages).

The `keel train` runs go through the console script's function (conftest.keel_cli) on the tiny
model, with rollout.max_staleness=0: a step's episodes are then handed out only when its batch
is asked for, so the endpoint's counters logged at a step (endpoint/*) count that step's calls
exactly, and the episodes written for the step can be checked against them (each call is one
turn of exactly one written sample). The compacting harness's token-exact accounting is checked on an
EndpointEngine in this process, where the sessions' records can be read.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST_RUN, action_runs, keel_cli, limits

from keelrl.algos import AlgoConfig
from keelrl.algos.registries import ADVANTAGES
from keelrl.config import TINY_RUN
from keelrl.envs.base import CheckResult, Grade
from keelrl.inference import DecoderOptions, SamplingParams
from keelrl.policy.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from keelrl.rollout.scheduler import GroupRequest
from keelrl.serve.engine import EndpointEngine
from keelrl.train.advantage import episode_advantages

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "examples" / "openai_harness" / "harness.py"
TASKS, GROUP = 2, 2
"""FAST_RUN's rollout.tasks_per_step and rollout.group_size: episodes per step = TASKS * GROUP."""
assert f"rollout.tasks_per_step={TASKS}" in FAST_RUN and f"rollout.group_size={GROUP}" in FAST_RUN


def harness(*flags: str) -> str:
    return " ".join(shlex.quote(part) for part in (sys.executable, str(HARNESS), *flags))


def endpoint_run(tiny_model_dir: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [*TINY_RUN, f"model.path={tiny_model_dir}", *FAST_RUN, "train.steps=2", "eval.every=100", "eval.tasks=2",
            "env.tool_format=hermes", "rollout.engine=endpoint", "rollout.max_staleness=0", f"run_dir={run_dir}",
            *overrides]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def episodes(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "episodes" / f"step_{step:04d}.jsonl").read_text().splitlines()]


def check_run(run_dir: Path) -> list[dict]:
    """What every endpoint run must show: both RL steps logged from the endpoint, fresh behaviour
    log-probs the learner's, each step's written samples exactly its calls, a final checkpoint."""
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        step = row["step"]
        assert row["endpoint/requests"] > 0 and row["endpoint/rejected"] == 0, row
        assert row["endpoint/unfinished"] == 0 and row["endpoint/sampling_overridden"] == 0, row
        assert row["mismatch/log_ratio_abs_max"] < 1e-4, row
        calls = row["endpoint/new_samples"] + row["endpoint/continued"]
        assert calls == row["endpoint/requests"], row  # max_staleness=0: no other step's call in the count
        written = episodes(run_dir, step)
        # Every sample is written, each call is one turn of exactly one of them, nothing else is.
        assert len(written) == row["endpoint/new_samples"], (len(written), row)
        assert sum(len(sample["turns"]) for sample in written) == calls
        assert row["endpoint/samples_per_episode"] == pytest.approx(len(written) / (TASKS * GROUP))
        assert len({sample["group_id"] for sample in written}) == TASKS
        for sample in written:
            assert sample["reward"] is not None and math.isfinite(sample["reward"]), sample["termination"]
            assert sample["termination"] in ("max_turns", "submitted", "context_limit"), sample["termination"]
            assert sample["turns"] and all(isinstance(turn["action"], str) for turn in sample["turns"])
            if sample["used"]:
                for turn in sample["turns"]:
                    assert turn["tokens"], "a trained turn lists its action tokens"
                    for _, _, learner, behaviour, _, _ in turn["tokens"]:
                        assert abs(learner - behaviour) <= 2e-5  # both rounded to 5 decimals in the file
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000002"]
    assert (run_dir / "checkpoints" / "step-000002" / "state.pt").exists()
    return rows


# ---------------------------------------------------------------------- keel train with the example harness
def test_keel_train_through_the_endpoint_with_the_example_harness(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = keel_cli("train", *endpoint_run(tiny_model_dir, run_dir,
                                         f"rollout.harness={harness('--concurrency', '4')}"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = check_run(run_dir)
    for row in rows[1:]:
        # The harness sends back each reply as it got it: every episode is one sample.
        assert row["endpoint/samples_per_episode"] == 1.0 and row["endpoint/new_samples"] == TASKS * GROUP, row
        assert row["endpoint/continued"] > 0, row


def test_keel_train_with_a_compacting_harness_trains_on_every_sample(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = keel_cli("train", *endpoint_run(tiny_model_dir, run_dir, "env.max_turns=4",
                                         f"rollout.harness={harness('--concurrency', '4', '--compact', '1')}"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = check_run(run_dir)
    for row in rows[1:]:
        # Four calls, the last two with a compacted history: three samples an episode.
        assert row["endpoint/samples_per_episode"] > 1, row
        assert row["endpoint/new_samples"] > TASKS * GROUP, row
        assert "train/reward" in row and math.isfinite(row["train/reward"]), row


def test_a_harness_that_exits_with_an_error_fails_the_run_quickly_naming_its_exit_code(tiny_model_dir, tmp_path):
    failing = f"{shlex.quote(sys.executable)} -c 'import sys; print(\"harness says bye\"); sys.exit(3)'"
    started = time.monotonic()
    with pytest.raises(RuntimeError) as failed:  # `keel train` ends on it, its traceback on stderr
        keel_cli("train", *endpoint_run(tiny_model_dir, tmp_path / "run", f"rollout.harness={failing}",
                                    "rollout.harness_timeout_s=600"))
    elapsed = time.monotonic() - started
    assert "exited with code 3" in str(failed.value), str(failed.value)[-3000:]
    assert "harness says bye" in str(failed.value)  # its last output, to see why
    assert elapsed < 120, elapsed  # noticed when it exits, not after rollout.harness_timeout_s


def test_the_endpoint_engine_refuses_a_tool_format_without_json_calls(tmp_path):
    refused = keel_cli("config", "rollout.engine=endpoint", "env.tool_format=call")
    assert refused.returncode == 2 and "env.tool_format" in refused.stderr, refused.stderr
    assert "hermes" in refused.stderr and "json" in refused.stderr
    train = keel_cli("train", "rollout.engine=endpoint", "env.tool_format=call", f"run_dir={tmp_path / 'run'}")
    assert train.returncode == 2 and "env.tool_format" in train.stderr, train.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    unsplittable = keel_cli("config", "rollout.engine=endpoint", "env.tool_format=hermes", "rollout.harness=python 'oops")
    assert unsplittable.returncode == 2 and "rollout.harness" in unsplittable.stderr, unsplittable.stderr
    accepted = keel_cli("config", "rollout.engine=endpoint", "env.tool_format=json")
    assert accepted.returncode == 0, accepted.stderr


# ---------------------------------------------------------------------- the compacting harness, token for token
class CountingEnv:
    """An episode that never ends by itself (the engine ends it at max_turns); reward turns / 4."""

    tool_format = "hermes"

    def reset(self, task):
        self.task, self.turn = task, 0
        return f"Task {task}: answer four times."

    def step(self, action):
        self.turn += 1
        return f"observation {self.turn}", False, {}

    def grade(self):
        return Grade(self.turn / 4, (CheckResult("four turns", self.turn >= 4),))


def test_a_compacting_harness_gives_an_episode_several_samples_holding_every_completion_token():
    tokenizer = build_tiny_tokenizer()
    spec = TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=48, max_positions=2048, seed=5)
    model = build_tiny_model(spec, len(tokenizer), tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids("<|end|>"))

    def requests_for(step):
        return [GroupRequest(index=(step - 1) * TASKS + i, task=f"t{i}", group_size=GROUP, seed=i) for i in range(TASKS)]

    engine = EndpointEngine(requests_for, model=model, tokenizer=tokenizer, make_env=CountingEnv,
                            sampling=SamplingParams(stop=("</tool_call>",), keep_kv=True, max_new_tokens=12),
                            decoder_options=DecoderOptions(decoder="keel"),
                            rollout=limits(max_turns=4, max_context_tokens=2048, max_new_tokens=12),
                            max_staleness=0, harness=harness("--concurrency", "4", "--compact", "1"),
                            harness_timeout_s=120)
    engine.last_step = 1
    engine.start(0)
    try:
        rollouts = engine.batch(1)
    finally:
        engine.close()
    sessions = sorted((s for s in engine.endpoint.sessions.values() if s.ticket is not None),
                      key=lambda s: (s.ticket.request.index, s.ticket.attempt))
    assert len(sessions) == TASKS * GROUP
    # The trajectories are every episode's samples, in request then attempt order.
    assert [(t.episode, t.sample) for t in rollouts.trajectories] == \
        [(s.id, i) for s in sessions for i in range(len(s.samples))]
    assert rollouts.metrics["endpoint/samples_per_episode"] == len(rollouts.trajectories) / (TASKS * GROUP) > 1
    for session in sessions:
        # history of 1, 3, 5, 7 messages; --compact 1 keeps 3: calls 3 and 4 each start a sample.
        assert [c.continued for c in session.calls] == [False, True, False, False], session.id
        assert [c.sample for c in session.calls] == [0, 0, 1, 2], session.id
        assert session.finished and len(session.samples) == 3
        for index, sample in enumerate(session.samples):
            # Nothing truncated: each call's completion, token for token, is one turn of its sample.
            assert action_runs(sample) == [c.completion_ids for c in session.calls if c.sample == index]
            last = [c for c in session.calls if c.sample == index][-1]
            assert sample.token_ids == last.prompt_ids + last.completion_ids
            assert [sample.behaviour_logprobs[i] for i, m in enumerate(sample.action_mask) if m] == \
                [lp for c in session.calls if c.sample == index for lp in c.logprobs]
            # The episode's outcome on every sample, which says how many there were.
            assert (sample.reward, sample.termination, sample.samples) == (1.0, "max_turns", 3)
            assert sample.group_id == session.ticket.request.index and sample.versions == [0] * len(action_runs(sample))
        assert sum(s.num_action_tokens for s in session.samples) == sum(len(c.completion_ids) for c in session.calls)


# ---------------------------------------------------------------------- the learner: one episode, one vote
def _split_batch():
    """Group 0: episodes A (reward 1.0), B (0.2, split in two samples; its first sample's turn also
    earned 0.1) and C (0.5); group 1: D (1.0) and E (0.0). Scores: A 1.0, B 0.3, C 0.5, D 1.0, E 0.0."""
    mask = torch.tensor([[0, 1, 1, 0],   # A
                         [0, 1, 1, 0],   # B, first sample
                         [0, 0, 1, 1],   # B, second sample
                         [1, 1, 0, 0],   # C
                         [0, 1, 1, 1],   # D
                         [0, 0, 1, 0]],  # E
                        dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.2, 0.2, 0.5, 1.0, 0.0], dtype=torch.float64)
    token_rewards = torch.zeros(mask.shape, dtype=torch.float64)
    for row in range(6):
        token_rewards[row, int(mask[row].nonzero().max())] = rewards[row]  # the outcome on the last action token
    token_rewards[1, 1] = 0.1  # a turn's own reward in B's first sample
    return (token_rewards, mask, rewards, torch.tensor([0, 0, 0, 0, 1, 1]), torch.tensor([0, 1, 1, 2, 3, 4]))


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_an_episode_split_into_samples_counts_once_in_its_groups_baseline(estimator):
    token_rewards, mask, rewards, groups, episode_ids = _split_batch()
    out = episode_advantages(token_rewards, mask, rewards, groups, episode_ids,
                             AlgoConfig(preset="grpo", advantage=estimator, norm_by_std=True))
    if estimator == "grpo":  # (score - group mean) / (group std, Bessel + 1e-6), three episodes in group 0, not four
        std0, std1 = math.sqrt((0.4**2 + 0.3**2 + 0.1**2) / 2), math.sqrt((0.5**2 + 0.5**2) / 1)
        per_episode = [0.4 / (std0 + 1e-6), -0.3 / (std0 + 1e-6), -0.1 / (std0 + 1e-6),
                       0.5 / (std1 + 1e-6), -0.5 / (std1 + 1e-6)]
    else:  # score - mean of the group's other episodes
        per_episode = [1.0 - (0.3 + 0.5) / 2, 0.3 - (1.0 + 0.5) / 2, 0.5 - (1.0 + 0.3) / 2, 1.0 - 0.0, 0.0 - 1.0]
    expected = torch.tensor([per_episode[e] for e in episode_ids.tolist()], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, torch.where(mask, expected[:, None], 0.0).to(torch.float64),
                               rtol=0, atol=1e-12)
    # Rows as episodes (B counted twice, its samples apart) would have given B's samples other values.
    assert out.advantages[1, 1] == out.advantages[2, 2] == pytest.approx(per_episode[1], abs=1e-12)


@pytest.mark.parametrize("estimator", ADVANTAGES.names())
def test_only_an_outcome_estimator_may_credit_an_episode_split_into_samples(estimator):
    token_rewards, mask, rewards, groups, episode_ids = _split_batch()
    algo = AlgoConfig(preset="grpo", advantage=estimator)
    outcome = sorted(name for name in ADVANTAGES.names() if "outcome" in ADVANTAGES.entry(name).tags)
    assert {"grpo", "rloo"} <= set(outcome) and "turn_grpo" not in outcome
    if estimator in outcome:
        out = episode_advantages(token_rewards, mask, rewards, groups, episode_ids, algo)
        assert out.advantages.shape == mask.shape and (out.advantages[~mask] == 0).all()
        return
    with pytest.raises(ValueError) as info:
        episode_advantages(token_rewards, mask, rewards, groups, episode_ids, algo)
    message = str(info.value)
    assert estimator in message and all(name in message for name in outcome), message


def test_keel_serve_answers_the_openai_client_and_records_every_call_on_exit(tiny_model_dir, tmp_path):
    """The `keel serve` console script: binds 127.0.0.1 on a free port, refuses a call without its
    key, answers one with it, and on SIGTERM writes every call's tokens to --record."""
    import re
    import signal

    from openai import AuthenticationError, OpenAI

    record = tmp_path / "calls.jsonl"
    exe = Path(sys.executable).parent / "keel"
    server = subprocess.Popen([str(exe), "serve", f"model.path={tiny_model_dir}", "--port", "0", "--api-key", "k",
                               "--max-tokens", "8", "--record", str(record)], cwd=REPO, stderr=subprocess.PIPE,
                              text=True)
    try:
        line = server.stderr.readline()
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        assert found, line
        url = found.group(1)
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).chat.completions.create(
                model="keel-policy", messages=[{"role": "user", "content": "hi"}])
        reply = OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0).chat.completions.create(
            model="keel-policy", messages=[{"role": "user", "content": "hi"}], user="cli-session",
            extra_body={"return_token_ids": True})
        assert 1 <= reply.usage.completion_tokens <= 8
    finally:
        server.send_signal(signal.SIGTERM)
        rest = server.communicate(timeout=60)[1]
    assert server.returncode == 0, rest
    [row] = [json.loads(line) for line in record.read_text().splitlines()]
    assert row["session"] == "cli-session"
    assert row["completion_ids"] == reply.model_extra["keel"]["completion_token_ids"]
    assert row["prompt_ids"] == reply.model_extra["keel"]["prompt_token_ids"]
    assert len(row["logprobs"]) == len(row["completion_ids"]) and row["version"] == 0


def test_the_verifiers_example_refuses_a_python_without_verifiers_at_once():
    """examples/verifiers_harness/train.py needs verifiers in its own venv; given a python without it
    (this one), it stops before any work, saying so."""
    done = subprocess.run([sys.executable, str(REPO / "examples" / "verifiers_harness" / "train.py"),
                           "--verifiers-python", sys.executable], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode != 0
    assert "cannot import verifiers.v1" in done.stderr
