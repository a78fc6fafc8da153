"""vLLM as the decoder (`rollout.decoder=vllm`, keelrl.inference.vllm_decoder): the decoder
contract's seeded tier (tests/test_decoders.py's checks), new weights and a LoRA adapter through
the weights seam, the stream, and `keel train` sampling its rollouts and evaluations with it.

Marked vllm: they need vLLM, which lives in a venv of its own (`bash .ci/vllm` builds it and runs
`pytest -m 'vllm and not slow'` there; CI does; the benchmark's smoke run is marked slow too). The engine runs eager (no torch.compile) so each starts in
seconds. The model is a float32 tiny Qwen2 (vLLM has no float64); the recompute is float64.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FAST_RUN, SMALL
from test_decoders import SEEDED_ATOL, TIERS, _prompts, _seeded, check_seeded_tier, recompute  # the seeded tier
from keelrl.config import TINY_RUN
from keelrl.inference import DecoderOptions, SamplingParams, build_decoder, deliver
from keelrl.policy.tiny import build_tiny_model, build_tiny_tokenizer

pytestmark = pytest.mark.vllm

KEEL = str(Path(sys.executable).parent / "keel")  # this venv's: another venv on PATH (CI's .venv) lacks vLLM


VLLM_SMALL = dataclasses.replace(SMALL, heads=2, kv_heads=1, max_positions=512, seed=3)
"""SMALL with 32-wide heads: vLLM's CPU attention has no kernel for SMALL's 16."""


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A float32 tiny Qwen2 over the byte tokenizer, saved (vLLM builds its architecture from the folder)."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(VLLM_SMALL, len(tokenizer),
                             tokenizer.pad_token_id, tokenizer.eos_token_id).float().eval()
    folder = tmp_path_factory.mktemp("tiny-f32")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model.config._name_or_path = str(folder)
    return model, tokenizer


@pytest.fixture(scope="module")
def decoder(small):
    model, tokenizer = small
    built = build_decoder(model, tokenizer, DecoderOptions(decoder="vllm", max_batch=8, kv_budget_mb=256, eager=True))
    yield built
    built.close()


def test_it_declares_the_seeded_tier_and_takes_weights_as_a_state_dict(decoder):
    assert decoder.takes_uniforms is False and decoder.shares_model is False and decoder.version == 0
    with pytest.raises(ValueError, match="seeds, not uniforms"):
        decoder.generate([[5, 6]], SamplingParams(max_new_tokens=2), torch.rand(1, 2))


@pytest.mark.parametrize("temperature,top_p,stop,min_new", TIERS)
def test_the_same_seeds_give_the_same_tokens_with_recomputable_logprobs(small, decoder, temperature, top_p, stop,
                                                                        min_new):
    model, tokenizer = small
    check_seeded_tier(decoder, model, tokenizer, temperature, top_p, stop, min_new)


def test_new_weights_arrive_through_load_weights_as_a_state_dict_or_the_model(small, decoder):
    model, tokenizer = small
    cfg = SamplingParams(temperature=0.0, max_new_tokens=6, stop=())
    prompts = _prompts(5)
    before = decoder.generate(prompts, cfg, seeds=[0] * len(prompts))
    other = type(model)(model.config).float().eval()
    other.load_state_dict({k: v + 0.2 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9))
                           for k, v in model.state_dict().items()})
    decoder.load_weights(other.state_dict(), 3)
    assert decoder.version == 3
    after = decoder.generate(prompts, cfg, seeds=[0] * len(prompts))
    _seeded(other, tokenizer, prompts, cfg, after)  # greedy under the new weights, their log-probs
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    deliver(decoder, model, 4)  # the publish path: a torch model's merged state dict
    assert decoder.version == 4
    assert [s.token_ids for s in decoder.generate(prompts, cfg, seeds=[0] * len(prompts))] == \
        [s.token_ids for s in before]


def test_rows_that_join_a_running_stream_get_what_generate_gives_them(small, decoder):
    model, tokenizer = small
    cfg = SamplingParams(temperature=1.0, max_new_tokens=8, stop=())
    prompts = _prompts(21)
    alone = decoder.generate(prompts, cfg, seeds=list(range(len(prompts))))
    tickets = decoder.submit(prompts[:3], cfg, seeds=[0, 1, 2])
    done = dict(decoder.step())
    tickets += decoder.submit(prompts[3:], cfg, seeds=list(range(3, len(prompts))))
    assert decoder.in_flight > 0
    while decoder.in_flight:
        done.update(decoder.step())
    assert [done[t].token_ids for t in tickets] == [s.token_ids for s in alone]
    assert decoder.cache_usage()["requests"] >= 2 * len(prompts)


def test_a_context_past_the_engines_length_is_refused_naming_it(decoder):
    with pytest.raises(ValueError, match="max_model_len"):
        decoder.generate([[5] * 600], SamplingParams(max_new_tokens=4), seeds=[0])


def test_the_benchmarks_timed_calls_start_cold_without_an_earlier_calls_prompts(small, decoder):
    """bench.bench_vllm.cold: vLLM's automatic prefix caching serves a repeated call's prompts from its
    cache (a benchmark's second call would skip most of its prefill); after `cold` (the weights loaded
    anew through the seam, as after a publish) it serves none of them. (Before the tests that build engines
    of their own: closing one tears down the process's vLLM state the module's decoder runs on.)"""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.bench_vllm import cold

    model, tokenizer = small
    prompts = [[40 + (i * 7 + row) % 80 for i in range(300)] for row in range(3)]  # two full 128-token blocks each
    params = SamplingParams(temperature=0.0, max_new_tokens=2, stop=())
    decoder.generate(prompts, params, seeds=[0, 0, 0])
    before = decoder.stats["cached_tokens"]
    decoder.generate(prompts, params, seeds=[0, 0, 0])
    assert decoder.stats["cached_tokens"] - before >= 3 * 128  # the repeat came from the cache
    cold(decoder, model, tokenizer, decoder.version + 1)
    before = decoder.stats["cached_tokens"]
    decoder.generate(prompts, params, seeds=[0, 0, 0])
    assert decoder.stats["cached_tokens"] == before


def test_it_samples_with_a_lora_adapter_and_fails_without_it(small):
    """A peft policy: the decoder gets the adapter merged in (keelrl.policy.lora.merged_state_dict),
    so its greedy tokens and log-probs are the adapted model's, not the base's."""
    from keelrl.config import LoraSettings
    from keelrl.policy import lora

    base, tokenizer = small
    model = type(base)(base.config).float().eval()
    model.load_state_dict(base.state_dict())
    model.config._name_or_path = base.config._name_or_path
    model = lora.apply_lora(model, LoraSettings(rank=4, alpha=8.0), base=base.config._name_or_path)
    with torch.no_grad():
        for parameter in lora.adapter_parameters(model).values():
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(4)))
    cfg = SamplingParams(temperature=0.0, max_new_tokens=6, stop=())
    prompts = _prompts(7)
    decoder = build_decoder(model, tokenizer, DecoderOptions(decoder="vllm", max_batch=8, kv_budget_mb=256, eager=True))
    try:
        adapted = decoder.generate(prompts, cfg, seeds=[0] * len(prompts))
        for context, sample in zip(prompts, adapted):  # the adapted model's greedy tokens and log-probs
            torch.testing.assert_close(torch.tensor(sample.logprobs, dtype=torch.float64),
                                       torch.tensor(recompute(model, tokenizer, context, sample.token_ids, cfg),
                                                    dtype=torch.float64), rtol=0, atol=SEEDED_ATOL)
        plain = decoder.generate(prompts, cfg, seeds=[0] * len(prompts))
        decoder.load_weights(base.state_dict(), 1)  # the base alone: other tokens
        assert [s.token_ids for s in decoder.generate(prompts, cfg, seeds=[0] * len(prompts))] != \
            [s.token_ids for s in plain]
    finally:
        decoder.close()


def test_auto_picks_vllm_where_it_is_installed_and_the_config_corrects_its_mismatch(small):
    from keelrl.config import load_config
    from keelrl.inference.registry import auto_decoder

    model, _ = small
    assert auto_decoder(model) == "vllm" and auto_decoder(model, torch.float64) == "keel"
    assert load_config(overrides=["rollout.decoder=vllm"]).algo.rollout_correction == "token_tis"
    assert load_config(overrides=["rollout.decoder=vllm", "algo.rollout_correction=none"]) \
        .algo.rollout_correction == "none"  # the user's choice stands


def test_keel_train_samples_rollouts_and_evaluations_with_vllm(tmp_path):
    from keelrl.policy.tiny import save_tiny_default

    model_dir = save_tiny_default(tmp_path / "model", dataclasses.replace(VLLM_SMALL, max_positions=2048))
    run_dir = tmp_path / "run"
    overrides = [*TINY_RUN, *FAST_RUN, f"model.path={model_dir}", f"run_dir={run_dir}", "train.steps=2",
                 "eval.tasks=2", "eval.every=2", "rollout.engine=sync", "rollout.decoder=vllm", "rollout.eager=true",
                 "eval.dtype=float32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([KEEL, "train", *overrides], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2] and "eval/success" in rows[-1]
    trained = [row for row in rows if "mismatch/log_ratio_abs_max" in row or "correction/weight_mean" in row]
    assert trained, sorted(rows[-1])  # the sampler/learner mismatch is logged and corrected
    saved = (run_dir / "config.yaml").read_text()
    assert "rollout_correction: token_tis" in saved and "decoder: vllm" in saved
    # vLLM's behaviour log-probs against the learner's own (both float32): close, not equal
    mismatch = [row[key] for row in rows for key in row if key.startswith("mismatch/") and key.endswith("abs_max")]
    assert mismatch and all(0 <= value < 0.05 for value in mismatch)


@pytest.mark.slow  # about 100 s quiet, 190 s beside two CPU hogs: `pytest -m 'vllm and slow'` in .venv-vllm
def test_the_benchmark_runs_every_decoder_on_the_same_work(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "bench.bench_vllm", "--smoke", "--out", str(tmp_path)], cwd=repo,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sys.path.insert(0, str(repo))
    from bench.common import read_section

    section = read_section(tmp_path / "section.json")
    decode = section.data["decode"][0]
    assert {"keel", "vllm", "hf"} <= set(decode) and decode["same_tokens"]["keel"] == decode["rows"]
    assert all(decode[name]["tokens"] == decode["rows"] * decode["new_tokens"] for name in ("keel", "vllm", "hf"))
    assert {w["label"] for w in section.data["workloads"]} == {"evaluation", "rollouts"}
    assert all(r.value > 0 for r in section.ratios)
