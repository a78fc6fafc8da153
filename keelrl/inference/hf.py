"""The HF path: HF `generate` with keelrl's sampler (the reference decoder, `rollout.decoder=hf`).

`sample` continues many contexts of different lengths at once (left-padded, positions taken
from the attention mask so a padded row sees the same positions as an unpadded one), with
temperature, top-p and stop strings (the run's tool-call format gives them: `env.tool_format`).
Each row's tokens are drawn by `keelrl.inference.sampler` (`InverseCdfProcessor`), and for every
sampled token it returns the log-probability under the distribution actually sampled from,
i.e. after temperature and top-p: that is the behaviour policy mu of the importance ratio.

Nothing is suppressed: the distribution sampled from is the model's whole distribution, the
one the learner's log-probs come from, so ratios on fresh data are 1 even for a model whose
padding token is its end-of-turn token (SmolLM2's is). Padding is told apart by the attention
mask on the way in, and on the way out each row is cut where it ended, found from its own
tokens (`keelrl.inference.stops.row_end`), never by looking for the padding id.

Rows with the same context (a GRPO group's attempts at one task) share its prefill: each
distinct context runs once, and its keys and values are copied to its rows before decoding
starts: the same tokens and log-probs as a prefill per row, in less time (measured:
docs/measurements.md#shared-prompts).

Multi-turn continuation (`SamplingParams.keep_kv`): each row's keys and values come back with
its sample (`RowCache`, padding removed), and the row's next turn passes them in, so that turn
runs only its new tokens (the action's last token and the observation) instead of the whole
history. The tokens and log-probs are those of a turn that re-ran the history (tests check it
in float64); `Sample.recomputed` counts what each call prefilled.

`HFDecoder` is `sample` behind the decoder contract, in the model's dtype or in a copy of it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from keelrl.inference.kv import RowCache
from keelrl.inference.params import Sample, SamplingParams
from keelrl.inference.sampler import InverseCdfProcessor, row_uniforms
from keelrl.inference.stops import end_token_ids, row_end
from keelrl.inference.weights import SharedWeights, merged_state, own_copy


class HFDecoder:
    """HF `generate` with keelrl's sampler (`sample`), in the model's own dtype, or in a copy of it
    in `dtype`, refreshed when the model's weights change."""

    takes_uniforms = True
    shares_model = True

    def __init__(self, model: Any, tokenizer: Any, dtype: torch.dtype | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.dtype = dtype or next(model.parameters()).dtype
        self.shared = SharedWeights(model)
        self._copy: Any = None
        self._copy_serial: int | None = None
        self.stats = {"calls": 0.0}

    @property
    def version(self) -> int:
        """The policy version of the weights last loaded (`load_weights`)."""
        return self.shared.version

    def load_weights(self, state: Any, version: int) -> None:
        """New weights, policy `version`: a merged state dict (loaded into the model), or the model
        (read as it is now). Kept caches of older weights are not used again."""
        self.shared.load(state, version)

    def runner(self) -> Any:
        """The model that samples: the model itself (with its adapter, if any), or a plain copy of it in
        `dtype` holding its current merged weights (`keelrl.inference.weights.merged_state`)."""
        if self.dtype == next(self.model.parameters()).dtype:
            return self.model
        serial = self.shared.current()
        if self._copy is None:
            self._copy = own_copy(self.model).to(self.dtype)
            self._copy_serial = None
        if serial != self._copy_serial:
            self._copy.load_state_dict(merged_state(self.model))  # cast into the copy's dtype
            self._copy_serial = serial
        return self._copy

    def generate(self, contexts: Sequence[Sequence[int]], params: SamplingParams, uniforms: Tensor | None = None,
                 caches: Sequence[Any] | None = None, *, seeds: Sequence[int] | None = None) -> list[Sample]:
        self.stats["calls"] += 1
        uniforms = row_uniforms(len(contexts), params, uniforms, seeds)
        runner = self.runner()
        serial = self.shared.current()
        if caches is not None:  # keys and values of other weights are not this policy's
            caches = [c if c is not None and getattr(c, "made_under", None) == serial else None for c in caches]
        samples = sample(runner, self.tokenizer, contexts, params, uniforms=uniforms, caches=caches)
        for s in samples:
            if s.cache is not None:
                s.cache.made_under = serial
        return samples

    def cache_usage(self) -> dict[str, float]:
        return dict(self.stats)


@torch.no_grad()
def sample(model: Any, tokenizer: Any, contexts: Sequence[Sequence[int]], params: SamplingParams,
           uniforms: Tensor | None = None, share_prompts: bool = True,
           caches: Sequence[RowCache | None] | None = None, seeds: Sequence[int] | None = None) -> list[Sample]:
    """Continue each token-id context; returns one Sample per context, in order.

    `share_prompts`: prefill each distinct context once for all the rows that have it.
    `caches`: a row's `RowCache` from its previous turn (used when it covers a prefix of the
    row's context, ignored otherwise); with them, or with `params.keep_kv`, the call runs
    `_continue` (each row's cached prefix is not run again).

    Randomness: row b uses `uniforms[b]` ([B, >= max_new_tokens] in (0, 1]); without them, those
    drawn from `seeds[b]`, else from one generator seeded with `params.seed` (random when None):
    `keelrl.inference.sampler.row_uniforms`. With per-row uniforms from per-episode generators, an
    episode's actions do not depend on its batch.
    """
    if not contexts:
        return []
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    uniforms = row_uniforms(len(contexts), params, uniforms, seeds)
    if params.keep_kv or (caches is not None and any(c is not None for c in caches)):
        return _continue(model, tokenizer, contexts, params, uniforms, caches)
    input_ids, attention = left_pad(contexts, pad)
    width = input_ids.shape[1]
    input_ids, attention = input_ids.to(device), attention.to(device)
    end_ids = list(end_token_ids(tokenizer))
    sampler = InverseCdfProcessor(params, uniforms, end_ids)
    prefilled = _shared_prefill(model, input_ids, attention, contexts) if share_prompts else {}
    out = model.generate(
        input_ids=input_ids, attention_mask=attention, do_sample=False, temperature=None, top_p=None, top_k=None,
        max_new_tokens=params.max_new_tokens, stop_strings=list(params.stop) or None, tokenizer=tokenizer,
        logits_processor=[sampler], pad_token_id=pad, eos_token_id=end_ids, **prefilled,
    )
    new_tokens = out[:, width:] if isinstance(out, Tensor) else out.sequences[:, width:]  # [B, N]
    logprobs = torch.stack(sampler.logprobs, dim=1)[:, :new_tokens.shape[1]]
    token_rows: list[list[int]] = new_tokens.cpu().tolist()
    logprob_rows: list[list[float]] = logprobs.cpu().tolist()
    samples = []
    seen: set[tuple[int, ...]] = set()
    for row in range(len(contexts)):
        tokens = token_rows[row]
        length, finished = row_end(tokenizer, tokens, end_ids, params.stop)
        text = tokenizer.decode(tokens[:length], skip_special_tokens=False)
        key = tuple(contexts[row])
        recomputed = 1 if (prefilled and key in seen) else len(key)  # a sharing row still runs its last token
        seen.add(key)
        samples.append(Sample(tokens[:length], logprob_rows[row][:length], text, "stop" if finished else "length",
                              recomputed=recomputed))
    return samples


def _continue(model: Any, tokenizer: Any, contexts: Sequence[Sequence[int]], params: SamplingParams, uniforms: Tensor,
              caches: Sequence[RowCache | None] | None) -> list[Sample]:
    """`sample` over rows with cached prefixes: each row runs only what its cache does not cover.

    Rows without a usable cache are prefilled first (each distinct context once, all but its last
    token) into a cache of their own. Then row b is laid out as [padding, its n_b cached tokens,
    padding, its s_b uncached tokens] over widths C = max n_b and S = max s_b, its keys and values
    right-aligned in the first C positions of one batch cache, padding masked out; positions come
    from the attention mask, so each token sits at its place in the row's own sequence. `generate`
    runs the S uncached positions, then decodes. Afterwards each row's keys and values (context
    and action, padding dropped) are cut out of the batch cache into its `RowCache`.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    rows = len(contexts)
    usable: list[RowCache | None] = [c if c is not None and c.covers(ids) else None
                                     for c, ids in zip(caches or [None] * rows, contexts)]
    recomputed = [0] * rows
    missing = [row for row in range(rows) if usable[row] is None]
    prefilled_rows = set(missing)
    if missing:
        first: dict[tuple[int, ...], int] = {}
        for row in missing:
            first.setdefault(tuple(contexts[row]), row)
        owners = sorted(first.values())
        built = _prefill_caches(model, [contexts[row][:-1] for row in owners], pad, device)
        for owner, cache in zip(owners, built):
            recomputed[owner] = len(contexts[owner]) - 1
        by_context = {tuple(contexts[owner]): cache for owner, cache in zip(owners, built)}
        for row in missing:
            usable[row] = by_context[tuple(contexts[row])]
    held = [c for c in usable if c is not None]
    assert len(held) == rows
    cached = [len(c.token_ids) for c in held]
    suffixes = [list(contexts[row][cached[row]:]) for row in range(rows)]
    for row in range(rows):
        recomputed[row] += len(suffixes[row]) if row not in prefilled_rows else 1  # a prefilled row runs its last token
    width_c, width_s = max(cached), max(len(s) for s in suffixes)
    input_ids = torch.full((rows, width_c + width_s), pad, dtype=torch.long)
    attention = torch.zeros((rows, width_c + width_s), dtype=torch.long)
    layers = len(held[0].keys)
    keys: list[Tensor] = []
    values: list[Tensor] = []
    for layer in range(layers):
        shape_k = held[0].keys[layer].shape
        shape_v = held[0].values[layer].shape
        keys.append(torch.zeros((rows, shape_k[0], width_c, shape_k[2]), dtype=held[0].keys[layer].dtype, device=device))
        values.append(torch.zeros((rows, shape_v[0], width_c, shape_v[2]), dtype=held[0].values[layer].dtype,
                                  device=device))
    for row in range(rows):
        n, suffix = cached[row], suffixes[row]
        if n:
            input_ids[row, width_c - n:width_c] = torch.tensor(list(held[row].token_ids), dtype=torch.long)
            attention[row, width_c - n:width_c] = 1
            for layer in range(layers):
                keys[layer][row, :, width_c - n:] = held[row].keys[layer]
                values[layer][row, :, width_c - n:] = held[row].values[layer]
        input_ids[row, width_c + width_s - len(suffix):] = torch.tensor(suffix, dtype=torch.long)
        attention[row, width_c + width_s - len(suffix):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    end_ids = list(end_token_ids(tokenizer))
    sampler = InverseCdfProcessor(params, uniforms, end_ids)
    kwargs: dict[str, Any] = {}
    if width_c:
        from keelrl.policy.prefix import cache_kwarg

        kwargs[cache_kwarg(model.model)] = DynamicCache(ddp_cache_data=list(zip(keys, values)))
    out = model.generate(
        input_ids=input_ids, attention_mask=attention, do_sample=False, temperature=None, top_p=None, top_k=None,
        max_new_tokens=params.max_new_tokens, stop_strings=list(params.stop) or None, tokenizer=tokenizer,
        logits_processor=[sampler], pad_token_id=pad, eos_token_id=end_ids, return_dict_in_generate=True,
        use_cache=True, **kwargs,
    )
    start = width_c + width_s
    new_tokens = out.sequences[:, start:]  # [B, N]
    logprobs = torch.stack(sampler.logprobs, dim=1)[:, :new_tokens.shape[1]]
    token_rows: list[list[int]] = new_tokens.cpu().tolist()
    logprob_rows: list[list[float]] = logprobs.cpu().tolist()
    batch_cache = out.past_key_values
    samples = []
    for row in range(rows):
        tokens = token_rows[row]
        length, finished = row_end(tokenizer, tokens, end_ids, params.stop)
        text = tokenizer.decode(tokens[:length], skip_special_tokens=False)
        row_cache: RowCache | None = None
        if params.keep_kv:
            n, s = cached[row], len(suffixes[row])
            kept = torch.cat([torch.arange(width_c - n, width_c), torch.arange(start - s, start),
                              torch.arange(start, start + max(0, length - 1))]).to(device)
            row_cache = RowCache(tuple(contexts[row]) + tuple(tokens[:max(0, length - 1)]),
                                 [layer.keys[row].index_select(1, kept) for layer in batch_cache.layers],
                                 [layer.values[row].index_select(1, kept) for layer in batch_cache.layers])
        samples.append(Sample(tokens[:length], logprob_rows[row][:length], text, "stop" if finished else "length",
                              cache=row_cache, recomputed=recomputed[row]))
    return samples


def left_pad(contexts: Sequence[Sequence[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Token-id contexts -> input_ids, attention_mask [B, T], left-padded to the longest (on the CPU)."""
    width = max(len(ids) for ids in contexts)
    input_ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, ids in enumerate(contexts):
        if ids:
            input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
            attention[row, width - len(ids):] = 1
    return input_ids, attention


def _prefill_caches(model: Any, contexts: Sequence[Sequence[int]], pad: int, device: torch.device) -> list[RowCache]:
    """The keys and values of each context (left-padded into one pass, padding dropped after)."""
    input_ids, attention = left_pad(contexts, pad)
    width = input_ids.shape[1]
    if width == 0:
        return [_empty_cache(model, device) for _ in contexts]
    input_ids, attention = input_ids.to(device), attention.to(device)
    from keelrl.policy.prefix import returned_cache

    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
    cache = returned_cache(out)
    result = []
    for row, ids in enumerate(contexts):
        kept = torch.arange(width - len(ids), width, device=device)
        result.append(RowCache(tuple(ids), [layer.keys[row].index_select(1, kept) for layer in cache.layers],
                               [layer.values[row].index_select(1, kept) for layer in cache.layers]))
    return result


def _empty_cache(model: Any, device: torch.device) -> RowCache:
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    empty = torch.zeros((kv_heads, 0, head_dim), dtype=dtype, device=device)
    return RowCache((), [empty] * config.num_hidden_layers, [empty] * config.num_hidden_layers)


def _shared_prefill(model: Any, input_ids: Tensor, attention: Tensor, contexts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """`generate`'s cache argument holding every row's context but its last token, each distinct
    context run once; {} when no two rows share a context (nothing to gain).

    The rows are left-padded, so rows with one context are identical, padding included; the
    prefill uses the positions `generate` gives them (from the attention mask), and `generate`
    then runs only the last context token of each row before decoding.
    """
    from keelrl.policy.prefix import cache_kwarg, returned_cache

    first: dict[tuple[int, ...], int] = {}
    owner = [first.setdefault(tuple(context), row) for row, context in enumerate(contexts)]
    if len(first) == len(contexts) or input_ids.shape[1] < 2:
        return {}
    distinct = torch.tensor(sorted(first.values()), device=input_ids.device)
    slot = {row: index for index, row in enumerate(sorted(first.values()))}
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model.model(input_ids=input_ids[distinct, :-1], attention_mask=attention[distinct, :-1],
                      position_ids=positions[distinct, :-1], use_cache=True)
    cache = returned_cache(out)
    cache.batch_select_indices(torch.tensor([slot[row] for row in owner], device=input_ids.device))
    return {cache_kwarg(model.model): cache}


