"""Batched sampling with a KV cache, returning behaviour log-probabilities.

`sample` continues many contexts of different lengths at once (left-padded, positions taken
from the attention mask so a padded row sees the same positions as an unpadded one), with
temperature, top-p and stop strings (the run's tool-call format gives them: `env.tool_format`).
For every sampled token it returns the log-probability under the distribution actually sampled
from, i.e. after temperature and top-p: that is the behaviour policy mu of the importance ratio.

Nothing is suppressed: the distribution sampled from is the model's whole distribution, the
one the learner's log-probs come from, so ratios on fresh data are 1 even for a model whose
padding token is its end-of-turn token (SmolLM2's is). Padding is told apart by the attention
mask on the way in, and on the way out each row is cut where it ended, found from its own
tokens (the first end-of-turn token, kept as the action's last token, or the end of the first
stop string), never by looking for the padding id.

Rows with the same context (a GRPO group's attempts at one task) share its prefill: each
distinct context runs once, and its keys and values are copied to its rows before decoding
starts: the same tokens and log-probs as a prefill per row, in less time (measured:
docs/measurements.md#shared-prompts).

Multi-turn continuation (`SamplingConfig.keep_kv`): each row's keys and values come back with
its sample (`RowCache`, padding removed), and the row's next turn passes them in, so that turn
runs only its new tokens (the action's last token and the observation) instead of the whole
history. The tokens and log-probs are those of a turn that re-ran the history (tests check it
in float64); `Sample.recomputed` counts what each call prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    """How actions are sampled."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 160
    stop: tuple[str, ...] = ("</call>",)
    """Stop strings: a row ends after the token that completes one. The default is the call
    format's; the trainer sets the run's format's (keelrl.envs.formats), which may be none."""
    min_new_tokens: int = 0
    """End tokens are held back (probability 0) until a row has this many: for benchmarks that
    need exact lengths. The behaviour log-probs are then those of the held-back distribution."""
    keep_kv: bool = False
    """Keep each row's keys and values after a turn (`Sample.cache`), so the next turn of the same
    episode runs only its new tokens (the last action token and the observation)."""
    decoder: str = "auto"
    """The decode engine (`keelrl.policy.decoders.DECODERS`): keel, hf or auto."""
    dtype: Any = None
    """The decoder's dtype (a torch.dtype; None: the model's own)."""
    kv_budget_mb: int = 4096
    """The keel decoder's memory for keys and values: its slots and the kept histories."""
    max_batch: int = 64
    """Sequences the keel decoder decodes at once."""


@dataclass
class RowCache:
    """One row's keys and values after a turn, without padding: the part of its next context that
    need not run again.

    `token_ids` are the tokens they belong to: the context and the action but its last token
    (that one was sampled, never fed). Keys carry their rotary positions 0..n-1, so a later batch
    may lay the row out with any padding, positions again counted from its attention mask.
    """

    token_ids: tuple[int, ...]
    keys: list[Tensor]
    """Per layer [kv_heads, n, head_dim]."""
    values: list[Tensor]
    made_under: Any = None
    """The weights they were made under, when a decoder records it (`keelrl.policy.decoders`)."""

    def covers(self, context: Sequence[int]) -> bool:
        """Whether these are the keys and values of a proper prefix of `context`."""
        n = len(self.token_ids)
        return n < len(context) and tuple(context[:n]) == self.token_ids


@dataclass
class Sample:
    """One continuation: its tokens, their behaviour log-probs, and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    stopped: str
    """stop (a stop string or end token) | length (max_new_tokens)."""
    cache: Any = None
    """With `SamplingConfig.keep_kv`: this row's keys and values for its next turn (a `RowCache`,
    or a decoder's handle on keys and values it keeps)."""
    recomputed: int = 0
    """Context tokens this call ran through the model for the row: its prefill (a context shared by
    several rows is prefilled on its first row; the others run only its last token)."""


class _InverseCdfSampler:
    """A logits processor that draws each row's token itself, from that row's own uniforms.

    Given raw scores [B, V] at generation position t, it applies temperature and top-p, draws
    row b's token by inverting the CDF at `uniforms[b, t]` (greedy when temperature is 0),
    records its log-probability under that distribution, and returns scores that make the
    chosen token the argmax, so `generate` runs greedily over our choices. A row's tokens thus
    depend only on its own context, weights and uniforms, never on which other rows share the
    batch or on the global RNG (which a learner thread may be using at the same time).
    """

    def __init__(self, cfg: SamplingConfig, uniforms: Tensor) -> None:
        self.cfg = cfg
        self.uniforms = uniforms  # [B, max_new_tokens], in (0, 1]
        self.position = 0
        self.logprobs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        logits = scores.float()
        if self.cfg.temperature > 0:
            logits = logits / self.cfg.temperature
            if self.cfg.top_p < 1.0:
                sorted_logits, order = logits.sort(-1, descending=True)
                probs = sorted_logits.softmax(-1)
                drop = probs.cumsum(-1) - probs > self.cfg.top_p  # keeps the smallest prefix reaching top_p
                logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
            logp = torch.log_softmax(logits, -1)
            cdf = logp.exp().cumsum(-1)
            u = self.uniforms[:, self.position].to(cdf.device).unsqueeze(-1) * cdf[:, -1:]
            chosen = torch.searchsorted(cdf, u).clamp(max=logits.shape[-1] - 1).squeeze(-1)
        else:
            logp = torch.log_softmax(logits, -1)
            chosen = logits.argmax(-1)
        self.position += 1
        self.logprobs.append(logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1))
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter(-1, chosen.unsqueeze(-1), 0.0)


def draw_uniforms(generator: torch.Generator, count: int) -> Tensor:
    """`count` uniforms in (0, 1] from `generator` (a zero would select a zero-probability token)."""
    return 1.0 - torch.rand(count, generator=generator, dtype=torch.float64)


@torch.no_grad()
def sample(model: Any, tokenizer: Any, contexts: Sequence[Sequence[int]], cfg: SamplingConfig,
           generator_seed: int | None = None, uniforms: Tensor | None = None, share_prompts: bool = True,
           caches: Sequence[RowCache | None] | None = None) -> list[Sample]:
    """Continue each token-id context; returns one Sample per context, in order.

    `share_prompts`: prefill each distinct context once for all the rows that have it.
    `caches`: a row's `RowCache` from its previous turn (used when it covers a prefix of the
    row's context, ignored otherwise); with them, or with `cfg.keep_kv`, the call runs
    `_continue` (each row's cached prefix is not run again).

    Randomness: row b uses `uniforms[b]` ([B, >= max_new_tokens] in (0, 1]); without them, rows
    draw from one generator seeded with `generator_seed` (random when None). With per-row
    uniforms from per-episode generators, an episode's actions do not depend on its batch.
    """
    if not contexts:
        return []
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    if uniforms is None:
        generator = torch.Generator()
        generator.manual_seed(generator_seed if generator_seed is not None else int(torch.randint(2**62, ())))
        uniforms = draw_uniforms(generator, len(contexts) * cfg.max_new_tokens).view(len(contexts), -1)
    if uniforms.shape[0] != len(contexts) or uniforms.shape[1] < cfg.max_new_tokens:
        raise ValueError(f"uniforms has shape {tuple(uniforms.shape)}; need [{len(contexts)}, >= {cfg.max_new_tokens}]")
    if cfg.keep_kv or (caches is not None and any(c is not None for c in caches)):
        return _continue(model, tokenizer, contexts, cfg, uniforms, caches)
    input_ids, attention = left_pad(contexts, pad)
    width = input_ids.shape[1]
    input_ids, attention = input_ids.to(device), attention.to(device)
    end_ids = list(end_token_ids(tokenizer))
    sampler = _InverseCdfSampler(cfg, uniforms)
    prefilled = _shared_prefill(model, input_ids, attention, contexts) if share_prompts else {}
    out = model.generate(
        input_ids=input_ids, attention_mask=attention, do_sample=False, temperature=None, top_p=None, top_k=None,
        max_new_tokens=cfg.max_new_tokens, stop_strings=list(cfg.stop) or None, tokenizer=tokenizer,
        logits_processor=[sampler], pad_token_id=pad, eos_token_id=end_ids, **_length_kwargs(cfg), **prefilled,
    )
    new_tokens = out[:, width:] if isinstance(out, Tensor) else out.sequences[:, width:]  # [B, N]
    logprobs = torch.stack(sampler.logprobs, dim=1)[:, :new_tokens.shape[1]]
    token_rows: list[list[int]] = new_tokens.cpu().tolist()
    logprob_rows: list[list[float]] = logprobs.cpu().tolist()
    samples = []
    seen: set[tuple[int, ...]] = set()
    for row in range(len(contexts)):
        tokens = token_rows[row]
        length, finished = _row_end(tokenizer, tokens, end_ids, cfg.stop)
        text = tokenizer.decode(tokens[:length], skip_special_tokens=False)
        key = tuple(contexts[row])
        recomputed = 1 if (prefilled and key in seen) else len(key)  # a sharing row still runs its last token
        seen.add(key)
        samples.append(Sample(tokens[:length], logprob_rows[row][:length], text, "stop" if finished else "length",
                              recomputed=recomputed))
    return samples


def _continue(model: Any, tokenizer: Any, contexts: Sequence[Sequence[int]], cfg: SamplingConfig, uniforms: Tensor,
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
    sampler = _InverseCdfSampler(cfg, uniforms)
    kwargs: dict[str, Any] = {}
    if width_c:
        from keelrl.policy.prefix import cache_kwarg

        kwargs[cache_kwarg(model.model)] = DynamicCache(ddp_cache_data=list(zip(keys, values)))
    out = model.generate(
        input_ids=input_ids, attention_mask=attention, do_sample=False, temperature=None, top_p=None, top_k=None,
        max_new_tokens=cfg.max_new_tokens, stop_strings=list(cfg.stop) or None, tokenizer=tokenizer,
        logits_processor=[sampler], pad_token_id=pad, eos_token_id=end_ids, **_length_kwargs(cfg), return_dict_in_generate=True,
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
        length, finished = _row_end(tokenizer, tokens, end_ids, cfg.stop)
        text = tokenizer.decode(tokens[:length], skip_special_tokens=False)
        row_cache: RowCache | None = None
        if cfg.keep_kv:
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


def _length_kwargs(cfg: SamplingConfig) -> dict[str, Any]:
    """`generate`'s min_new_tokens when one is asked for (else the model's generation_config decides)."""
    return {"min_new_tokens": cfg.min_new_tokens} if cfg.min_new_tokens > 0 else {}


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


def end_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a model's turn: eos and its chat template's end-of-turn token."""
    from keelrl.policy.chat import ChatFormat, ChatTemplateError

    try:
        return ChatFormat.of(tokenizer).end_token_ids
    except ChatTemplateError:
        return (int(tokenizer.eos_token_id),) if tokenizer.eos_token_id is not None else ()


def _row_end(tokenizer: Any, tokens: list[int], end_ids: Sequence[int], stop: Sequence[str]) -> tuple[int, bool]:
    """(length, finished) of one generated row, from its tokens alone (padding is never consulted).

    The row ends after its first end-of-turn token (kept: the model learns to end its turn) or
    after the token that completes its first stop string, whichever comes first.
    """
    ends = [i + 1 for i, token in enumerate(tokens) if token in end_ids][:1]
    if stop and any(s in tokenizer.decode(tokens[:ends[0] if ends else len(tokens)], skip_special_tokens=False)
                    for s in stop):
        low, high = 1, ends[0] if ends else len(tokens)  # the shortest prefix holding a stop string
        while low < high:
            middle = (low + high) // 2
            text = tokenizer.decode(tokens[:middle], skip_special_tokens=False)
            if any(s in text for s in stop):
                high = middle
            else:
                low = middle + 1
        return low, True
    if ends:
        return ends[0], True
    return len(tokens), False


def recompute_logprobs(model: Any, sequences: Sequence[Sequence[int]], pad_id: int) -> list[Tensor]:
    """log pi(token_t | prefix) for every position t >= 1 of each sequence (right-padded batch)."""
    from keelrl.policy.model import token_logprobs

    device = next(model.parameters()).device
    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros_like(input_ids)
    for row, ids in enumerate(sequences):
        input_ids[row, :len(ids)] = torch.tensor(list(ids), device=device)
        attention[row, :len(ids)] = 1
    logp = token_logprobs(model, input_ids, attention)["logp"]
    return [logp[row, :len(ids)] for row, ids in enumerate(sequences)]
