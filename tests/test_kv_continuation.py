"""Keys and values kept between turns (SamplingParams.keep_kv): a turn runs only its new tokens and
samples exactly what a turn that re-ran the whole history samples.

The model is a float64 tiny Qwen2, so the two paths must agree to float64 rounding: the same
tokens, log-probs within 1e-9. Rows of different lengths share each batch, so the padding laid
out around the cached prefixes is exercised.
"""

from __future__ import annotations

import pytest
import torch

from keelrl.inference import RowCache, SamplingParams, draw_uniforms, sample


def _uniforms(seed: int, rows: int, n: int) -> torch.Tensor:
    return draw_uniforms(torch.Generator().manual_seed(seed), rows * n).view(rows, n)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_three_turns_with_kept_keys_equal_three_turns_from_scratch(policy, temperature):
    model, tokenizer = policy
    g = torch.Generator().manual_seed(0)
    vocab = 200
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (9, 17, 17, 4)]
    prompts[2] = list(prompts[1])  # two rows of one group: their first prefill is shared
    observations = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (3, 6, 1, 8)]
    kept = SamplingParams(temperature=temperature, max_new_tokens=7, stop=(), keep_kv=True)
    plain = SamplingParams(temperature=temperature, max_new_tokens=7, stop=())
    contexts_a = [list(p) for p in prompts]
    contexts_b = [list(p) for p in prompts]
    caches: list[RowCache | None] = [None] * len(prompts)
    recomputed = []
    for turn in range(3):
        uniforms = _uniforms(turn, len(prompts), 7)
        with_kv = sample(model, tokenizer, contexts_a, kept, uniforms=uniforms, caches=caches)
        from_scratch = sample(model, tokenizer, contexts_b, plain, uniforms=uniforms)
        for a, b in zip(with_kv, from_scratch):
            assert a.token_ids == b.token_ids and a.stopped == b.stopped
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-9)
        recomputed.append([s.recomputed for s in with_kv])
        for row, s in enumerate(with_kv):
            assert s.cache is not None and s.cache.token_ids == tuple(contexts_a[row]) + tuple(s.token_ids[:-1])
            assert all(k.shape[1] == len(s.cache.token_ids) for k in s.cache.keys)
        caches = [s.cache for s in with_kv]
        contexts_a = [c + s.token_ids + o for c, s, o in zip(contexts_a, with_kv, observations)]
        contexts_b = [c + s.token_ids + o for c, s, o in zip(contexts_b, from_scratch, observations)]
    # turn 1: the prompts, the shared one once (its second row runs only its last token);
    # later turns: the action's last token and the observation, nothing before them
    assert recomputed[0] == [9, 17, 1, 4]
    for turn in (1, 2):
        assert recomputed[turn] == [1 + len(o) for o in observations]


def test_a_cache_of_another_history_is_ignored(policy):
    model, tokenizer = policy
    cfg = SamplingParams(temperature=1.0, max_new_tokens=4, stop=(), keep_kv=True)
    first = sample(model, tokenizer, [[5, 6, 7, 8]], cfg, uniforms=_uniforms(1, 1, 4))[0]
    other = [9, 9, 9, 9, 9, 9, 9, 9, 9]  # does not start with the cached tokens
    assert first.cache is not None and not first.cache.covers(other)
    reused = sample(model, tokenizer, [other], cfg, uniforms=_uniforms(2, 1, 4), caches=[first.cache])[0]
    fresh = sample(model, tokenizer, [other], SamplingParams(temperature=1.0, max_new_tokens=4, stop=()),
                   uniforms=_uniforms(2, 1, 4))[0]
    assert reused.token_ids == fresh.token_ids and reused.recomputed == len(other)


def test_min_new_tokens_holds_end_tokens_back_in_every_path(policy):
    """A model eager to end: a row ends after one token without min_new_tokens, and with it every
    row has exactly five (plain and keep_kv paths), the end token never drawn before then."""
    import copy

    model, tokenizer = policy
    eager_to_end = copy.deepcopy(model)
    from keelrl.inference import end_token_ids

    ends = list(end_token_ids(tokenizer))
    with torch.no_grad():
        head = eager_to_end.get_output_embeddings()
        head.weight[ends[0]] = head.weight[ends[0]] * 0 + 5.0  # a large logit for the end token everywhere
    contexts = [[5, 6, 7], [8, 9]]
    for keep in (False, True):
        short = sample(eager_to_end, tokenizer, contexts, SamplingParams(temperature=0.0, max_new_tokens=5, stop=(),
                                                                         keep_kv=keep))
        assert len(short[0].token_ids) == 1 and short[0].token_ids[0] in ends
        held = sample(eager_to_end, tokenizer, contexts, SamplingParams(temperature=0.0, max_new_tokens=5, stop=(),
                                                                        min_new_tokens=5, keep_kv=keep))
        assert [len(s.token_ids) for s in held] == [5, 5]
        assert not any(t in ends for s in held for t in s.token_ids)
