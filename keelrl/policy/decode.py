"""keelrl's own decode loop: a slot KV cache, continuous batching, chunked prefill, kept histories.

`KeelDecoder.generate` (or `submit` and `step`) continues many token-id contexts and returns, per context, the tokens
and behaviour log-probs `keelrl.policy.sampling.sample` would (same uniforms, same temperature /
top-p / min_new_tokens / end tokens / stop strings, the same float32 logits), without `generate`:

- Weights. A snapshot of the model's tensors in the decode dtype, q/k/v and gate/up fused into
  one matrix each, rebuilt when the model's parameters change in place (`load_state_dict` or an
  optimizer step bump their version counters). The forward pass is written here for the
  Llama family (llama, mistral without a sliding window, qwen2 without sliding layers): RMSNorm,
  rotary embeddings from the model's own rotary module, grouped-query attention, gated MLP.
- Slots. Keys and values live in a preallocated [slots, kv_heads, capacity, head_dim] buffer per
  layer; the sequences in flight hold slots 0..n-1 (a finished one's slot is filled by the last
  one, so decode attention runs over a dense range). Nothing grows by concatenation.
- Continuous batching. Every step runs one forward over the next token of every decoding slot
  plus up to `prefill_tokens` prompt tokens of sequences being admitted (chunked prefill: a
  long context is prefilled over several steps while the others decode). A sequence that ends
  frees its slot at once and the next queued context takes it in the same step, so no row waits
  for the longest and nothing is padded.
- A stream. `submit` queues contexts at any time, also while others decode, and `step` runs one
  step and returns the rows that finished; `generate` is submit-then-step-until-done. The agent
  loop's scheduler submits each episode when its tool call returns, so it joins the running
  batch at the next step. One stream samples with one `SamplingConfig` under one set of weights:
  new weights are loaded only when nothing is in flight (`in_flight`), and a change of the
  model's parameters under a running stream is an error, never a silent mix.
- Prefix sharing. Equal contexts (a GRPO group's attempts) are prefilled once: the first runs its
  context, the others copy its keys and values and run only its last token. Contexts submitted
  together that begin with the same MIN_COMMON_PREFIX or more tokens (a system prompt) prefill
  that prefix once. Both are kept as stored prefixes (at most MAX_PREFIXES), so a later
  submission reuses them: a group's attempt that arrives late, the next batch's system prompt.
  With `SamplingConfig.keep_kv` a finished sequence's keys and values (context and action but
  its last token) are kept under a `KeptKV` handle (`Sample.cache`); passed back as the
  episode's cache on its next turn, only the new tokens run. Kept histories and stored prefixes
  live within `kv_budget_mb` together with the slots; over it the least recently used is
  evicted (a later row then prefills in full). Kept keys and values are valid only for the
  weights that made them.
- Stops. End-of-turn tokens and stop strings end a sequence as it is decoded: stop strings are
  matched incrementally on each token's bytes (a byte-level tokenizer's token table) or, for
  other tokenizers, on the decoded tail. Temperature 0 takes the argmax without sorting.

What this does NOT do: sliding-window attention, q/k norms (qwen3), other architectures (use
`rollout.decoder=hf`), paged KV blocks shared between live sequences, speculative decoding, or
CUDA graphs. The equality with `sample` holds up to floating-point summation order (tests check
tokens and log-probs in float64).
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from keelrl.policy.sampling import RowCache, Sample, SamplingConfig, end_token_ids

SUPPORTED = ("llama", "mistral", "qwen2")
"""`config.model_type`s whose forward pass the decoder implements."""
MIN_COMMON_PREFIX = 16
"""Rows submitted together that all begin with this many equal tokens prefill them once."""
MAX_PREFIXES = 16
"""Stored prefixes (common prefixes and group contexts) kept at most, least recently used dropped."""
CAPACITY_STEP = 256
"""The slot buffer grows in steps of this many tokens (each growth copies the rows in flight)."""


class UnsupportedModelError(ValueError):
    """The decoder has no forward pass for this model; the message names the way out."""


def unsupported_reason(config: Any) -> str | None:
    """Why `KeelDecoder` cannot run a model with this config, or None when it can."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {', '.join(SUPPORTED)}"
    if kind == "mistral" and getattr(config, "sliding_window", None):
        return "mistral with a sliding window"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding-window attention layers"
    return None


@dataclass(frozen=True)
class KeptKV:
    """A handle on keys and values a `KeelDecoder` keeps after a turn (a `Sample.cache`).

    `token_ids` are the tokens they cover (context and action but its last token)."""

    key: int
    token_ids: tuple[int, ...]
    decoder: int
    """id of the decoder that holds them."""

    def covers(self, context: Sequence[int]) -> bool:
        n = len(self.token_ids)
        return n < len(context) and tuple(context[:n]) == self.token_ids


class _Weights:
    """The model's tensors in the decode dtype, q/k/v and gate/up fused; rebuilt on change."""

    def __init__(self, model: Any, dtype: torch.dtype) -> None:
        body = model.model
        self.stamp = weights_stamp(model)
        self.embed = body.embed_tokens.weight.detach().to(dtype)
        self.layers = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            bias = None
            if attn.q_proj.bias is not None:
                bias = torch.cat([p.bias.detach() for p in projections]).to(dtype)
            self.layers.append({
                "ln1": layer.input_layernorm.weight.detach().to(dtype),
                "ln1_eps": _eps(layer.input_layernorm),
                "qkv": torch.cat([p.weight.detach() for p in projections]).to(dtype),
                "qkv_bias": bias,
                "o": attn.o_proj.weight.detach().to(dtype),
                "o_bias": None if attn.o_proj.bias is None else attn.o_proj.bias.detach().to(dtype),
                "ln2": layer.post_attention_layernorm.weight.detach().to(dtype),
                "ln2_eps": _eps(layer.post_attention_layernorm),
                "gate_up": torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]).to(dtype),
                "gate_up_bias": None if mlp.gate_proj.bias is None else
                torch.cat([mlp.gate_proj.bias.detach(), mlp.up_proj.bias.detach()]).to(dtype),
                "down": mlp.down_proj.weight.detach().to(dtype),
                "down_bias": None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach().to(dtype),
            })
        self.norm = body.norm.weight.detach().to(dtype)
        self.norm_eps = _eps(body.norm)
        head = model.get_output_embeddings()
        self.head = head.weight.detach().to(dtype)
        self.head_bias = None if getattr(head, "bias", None) is None else head.bias.detach().to(dtype)


def _eps(norm: Any) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def weights_stamp(model: Any) -> tuple[int, ...]:
    """Version counters of the model's parameters: they change whenever one is written in place
    (`load_state_dict`, an optimizer step), so a snapshot or kept keys/values made under other
    weights are known stale."""
    return tuple(p._version for p in model.parameters())


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """As LlamaRMSNorm: normalised in float32 (also a float64 model's), scaled in the input's dtype."""
    wide = x.to(torch.float32)
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(eq=False)  # a row is itself: finding its slot must not compare prefix rows of equal tokens field by field
class _Row:
    """One context submitted to the decoder, queued, in flight, or done."""

    index: int
    context: tuple[int, ...]
    uniforms: Tensor
    source: RowCache | None = None
    """Keys and values covering the first `cached` tokens, copied into the slot on admission."""
    cached: int = 0
    fed: int = 0
    """Context tokens already in the slot's cache."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Tensor] = field(default_factory=list)
    recomputed: int = 0
    tail: bytes = b""
    """The action's last bytes, for stop strings that span tokens."""
    finished: bool = False
    stopped: bool = False
    """Finished by an end token or a stop string (not by max_new_tokens)."""
    kept: KeptKV | None = None
    publishes: tuple[int, ...] | None = None
    """Once this row has these tokens in its slot, their keys and values go to the prefix store
    (the first row of a group publishes its context but the last token; a prefix row its whole context)."""
    waits_for: tuple[int, ...] | None = None
    """Admitted once another row has published these tokens; it then starts from a copy of them."""
    prefix_only: bool = False
    """A common prefix prefilled for other rows: nothing is sampled for it."""

    @property
    def length(self) -> int:
        """Tokens in the slot once the pending ones are fed: context, then the action so far."""
        return len(self.context) + len(self.tokens)


class KeelDecoder:
    """keelrl's decode engine over one model (see the module docstring).

    `dtype`: the decode dtype (None: the model's). `max_batch`: sequences decoded together.
    `prefill_tokens`: prompt tokens prefilled per step beside the decoding sequences.
    `kv_budget_mb`: memory for the slots' keys and values plus kept histories and stored prefixes.
    """

    _ids = itertools.count()

    def __init__(self, model: Any, tokenizer: Any, *, dtype: torch.dtype | None = None, max_batch: int = 64,
                 prefill_tokens: int = 512, kv_budget_mb: int = 4096) -> None:
        reason = unsupported_reason(model.config)
        if reason is not None:
            raise UnsupportedModelError(f"keelrl's decoder cannot run this model ({reason}); "
                                        f"set rollout.decoder=hf to sample with HF generate")
        if max_batch < 1 or prefill_tokens < 1 or kv_budget_mb < 1:
            raise ValueError(f"max_batch={max_batch}, prefill_tokens={prefill_tokens} and kv_budget_mb={kv_budget_mb} "
                             f"must be positive")
        self.model, self.tokenizer = model, tokenizer
        self.dtype = dtype or next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.max_batch, self.prefill_tokens = max_batch, prefill_tokens
        self.budget = kv_budget_mb * 2**20
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = config.num_hidden_layers
        self.act = _activation(config.hidden_act)
        self.token_bytes = self.layers * 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        """Bytes of keys and values per token over all layers."""
        self.id = next(self._ids)
        self._weights: _Weights | None = None
        self._keys: list[Tensor] = []
        self._values: list[Tensor] = []
        self._slots = 0
        self._capacity = 0
        self._kept: OrderedDict[int, tuple[RowCache, tuple[int, ...]]] = OrderedDict()
        """key -> (keys and values, the weights stamp they were made under), least recently used
        first: kept histories (a `KeptKV` names the key) and stored prefixes (`_prefixes`)."""
        self._prefixes: dict[tuple[int, ...], int] = {}
        """Stored prefixes: their tokens -> their key in `_kept` (common prefixes and group contexts)."""
        self._kept_bytes = 0
        self._next_key = itertools.count()
        self._tickets = itertools.count()
        self._queue: list[_Row] = []
        self._active: list[_Row] = []
        """_active[s] holds slot s."""
        self._unpublished: set[tuple[int, ...]] = set()
        """Tokens a queued or active row will publish and has not yet: the rows waiting for them are
        passed over."""
        self._stream_cfg: SamplingConfig | None = None
        self._stream_weights: _Weights | None = None
        self.end_ids = tuple(end_token_ids(tokenizer))
        self._table = token_byte_table(tokenizer)
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "evicted": 0, "forward_s": 0.0,
                      "sample_s": 0.0, "busy_slots": 0.0, "decode_only_s": 0.0, "decode_only_tokens": 0,
                      "prefix_hits": 0, "joined_in_flight": 0}
        """Counters since construction; decode_only_*: the steps that ran no prompt tokens (forward
        and sampling), the decode throughput; prefix_hits: rows started from a stored prefix (a common
        prefix or a group's context);
        joined_in_flight: rows submitted while others were decoding."""

    # ------------------------------------------------------------------ weights and memory
    def weights(self) -> _Weights:
        """The snapshot of the current weights (rebuilt when the parameters changed)."""
        stamp = weights_stamp(self.model)
        if self._weights is None or self._weights.stamp != stamp:
            if self.in_flight:
                raise RuntimeError(f"the model's weights changed while {self.in_flight} rows were decoding: "
                                   f"load new weights only between streams (KeelDecoder.in_flight == 0)")
            self._weights = None  # free the old snapshot before building the next
            with torch.no_grad():
                self._weights = _Weights(self.model, self.dtype)
            self._drop_stale(stamp)
        return self._weights

    def load_weights(self, state: Any) -> None:
        """Load a state dict into the model; kept keys and values of the old weights are dropped."""
        if self.in_flight:
            raise RuntimeError(f"load_weights while {self.in_flight} rows are decoding: finish the stream first")
        self.model.load_state_dict(state)
        self.weights()

    def cache_usage(self) -> dict[str, float]:
        """Memory of the slots and kept histories, in MiB, and counters since construction."""
        return {"slots": float(self._slots), "capacity_tokens": float(self._capacity),
                "slot_mb": self._slots * self._capacity * self.token_bytes / 2**20,
                "kept": float(len(self._kept) - len(self._prefixes)), "prefixes": float(len(self._prefixes)),
                "kept_mb": self._kept_bytes / 2**20,
                "budget_mb": self.budget / 2**20, **{k: float(v) for k, v in self.stats.items()}}

    def _drop_stale(self, stamp: tuple[int, ...]) -> None:
        for key in [k for k, (_, made) in self._kept.items() if made != stamp]:
            self._forget(key)

    def _forget(self, key: int) -> None:
        cache, _ = self._kept.pop(key)
        self._kept_bytes -= len(cache.token_ids) * self.token_bytes
        if self._prefixes.get(cache.token_ids) == key:
            del self._prefixes[cache.token_ids]

    def _reserve(self, capacity: int, rows: int) -> None:
        """Slots of at least `capacity` tokens, as many as the budget allows (up to max_batch). A
        buffer that grows is rounded up to CAPACITY_STEP tokens where the budget allows, and the
        rows in flight are copied into it."""
        per_slot = capacity * self.token_bytes
        slots = max(1, min(self.max_batch, rows, self.budget // max(1, per_slot)))
        if capacity <= self._capacity and slots <= self._slots:
            return
        slots = max(slots, self._slots)
        if self._capacity and capacity > self._capacity:  # growing: leave room for the next turns
            room = self.budget // max(1, slots * self.token_bytes)
            capacity = max(capacity, min(-(-capacity // CAPACITY_STEP) * CAPACITY_STEP, room))
        capacity = max(capacity, self._capacity)
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        live, old = len(self._active), self._capacity
        # zeros, not empty: a masked key still multiplies its value by 0, and 0 * NaN is NaN
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        if live:
            for layer in range(self.layers):
                keys[layer][:live, :, :old] = self._keys[layer][:live]
                values[layer][:live, :, :old] = self._values[layer][:live]
        self._keys, self._values = keys, values
        self._slots, self._capacity = slots, capacity

    def _store(self, cache: RowCache, stamp: tuple[int, ...]) -> int:
        key = next(self._next_key)
        self._kept[key] = (cache, stamp)
        self._kept_bytes += len(cache.token_ids) * self.token_bytes
        self._evict()
        return key

    def _keep(self, cache: RowCache, stamp: tuple[int, ...]) -> KeptKV:
        return KeptKV(self._store(cache, stamp), cache.token_ids, self.id)

    def _store_prefix(self, cache: RowCache, stamp: tuple[int, ...]) -> None:
        old = self._prefixes.get(cache.token_ids)
        if old is not None:
            self._forget(old)
        while len(self._prefixes) >= MAX_PREFIXES:
            self._forget(next(key for key in self._kept if key in self._prefixes.values()))
        key = self._store(cache, stamp)
        if key in self._kept:  # else the budget could not hold it beside the slots: not stored
            self._prefixes[cache.token_ids] = key

    def _evict(self) -> None:
        room = self.budget - self._slots * self._capacity * self.token_bytes
        while self._kept and self._kept_bytes > room:
            self._forget(next(iter(self._kept)))
            self.stats["evicted"] += 1

    def _lookup(self, cache: Any, context: Sequence[int], stamp: tuple[int, ...]) -> RowCache | None:
        if isinstance(cache, RowCache):
            return cache if cache.covers(context) else None
        if isinstance(cache, KeptKV) and cache.decoder == self.id and cache.key in self._kept and cache.covers(context):
            kept, made = self._kept[cache.key]
            if made == stamp:
                self._kept.move_to_end(cache.key)
                return kept
        return None

    def _stored_prefix(self, context: tuple[int, ...], stamp: tuple[int, ...]) -> RowCache | None:
        """The longest stored prefix of `context` (shorter than it) made under `stamp`, or None."""
        best: tuple[int, RowCache] | None = None
        for tokens, key in self._prefixes.items():
            n = len(tokens)
            if n < len(context) and (best is None or n > len(best[1].token_ids)) and context[:n] == tokens:
                cache, made = self._kept[key]
                if made == stamp:
                    best = (key, cache)
        if best is None:
            return None
        self._kept.move_to_end(best[0])
        return best[1]

    # ------------------------------------------------------------------ the stream
    @property
    def in_flight(self) -> int:
        """Rows submitted and not finished (queued or decoding)."""
        return len(self._queue) + len(self._active)

    @torch.no_grad()
    def generate(self, contexts: Sequence[Sequence[int]], cfg: SamplingConfig, uniforms: Tensor,
                 caches: Sequence[Any] | None = None, share_prompts: bool = True) -> list[Sample]:
        """One Sample per context, in order (see `keelrl.policy.sampling.sample` for the contract):
        `submit` them to an idle decoder and `step` until all are done."""
        if self.in_flight:
            raise RuntimeError(f"generate needs an idle decoder; {self.in_flight} rows of a stream are in flight")
        tickets = self.submit(contexts, cfg, uniforms, caches, share_prompts)
        done: dict[int, Sample] = {}
        while self.in_flight:
            done.update(self.step())
        return [done[ticket] for ticket in tickets]

    def submit(self, contexts: Sequence[Sequence[int]], cfg: SamplingConfig, uniforms: Tensor,
               caches: Sequence[Any] | None = None, share_prompts: bool = True) -> list[int]:
        """Queue contexts for decoding beside the rows in flight; returns a ticket per context (`step`
        hands back each one's Sample). Every row of a stream samples with one `cfg` and one set of
        weights: the weights are read when the decoder is idle, and may not change until it is idle
        again. With `share_prompts`, equal contexts are prefilled once (the first row's keys and
        values copied to the others), and a prefix that the rows share or that is stored from an
        earlier call (a common system prompt, a group's context) is prefilled once."""
        if not contexts:
            return []
        if any(len(c) == 0 for c in contexts):
            raise ValueError("every context needs at least one token")
        if uniforms.shape[0] != len(contexts) or uniforms.shape[1] < cfg.max_new_tokens:
            raise ValueError(f"uniforms has shape {tuple(uniforms.shape)}; need [{len(contexts)}, >= {cfg.max_new_tokens}]")
        if self.in_flight:
            self.stats["joined_in_flight"] += len(contexts)
        if not self.in_flight:
            self._stream_weights, self._stream_cfg = self.weights(), cfg
        elif cfg != self._stream_cfg:
            raise ValueError(f"a stream samples with one SamplingConfig: {cfg} differs from the rows in flight's "
                             f"{self._stream_cfg}")
        elif self._stream_weights is None or weights_stamp(self.model) != self._stream_weights.stamp:
            raise RuntimeError("the model's weights changed while rows were decoding: load new weights only "
                               "between streams (KeelDecoder.in_flight == 0)")
        assert self._stream_weights is not None
        stamp = self._stream_weights.stamp
        rows = [_Row(next(self._tickets), tuple(c), uniforms[i]) for i, c in enumerate(contexts)]
        for row, cache in zip(rows, caches or [None] * len(rows)):
            kept = self._lookup(cache, row.context, stamp) if cache is not None else None
            if kept is not None:
                row.source, row.cached = kept, len(kept.token_ids)
        queued: list[_Row] = []
        if share_prompts:
            queued = self._plan_sharing([row for row in rows if row.source is None], stamp)
        self._queue.extend(queued + rows)
        self._reserve(max(r.length for r in rows) + cfg.max_new_tokens, self.in_flight)
        self._evict()
        return [row.index for row in rows]

    def cancel(self) -> None:
        """Drop every queued and decoding row (nothing is returned for them); the decoder is idle after."""
        self._queue.clear()
        self._active.clear()
        self._unpublished.clear()

    def _plan_sharing(self, rows: list[_Row], stamp: tuple[int, ...]) -> list[_Row]:
        """Who prefills what among fresh rows: a context equal to an earlier row's waits for that row's
        keys and values (or takes them from the store); the rows that run their own context start
        from a stored prefix, or from a common prefix that a prefix row (returned, to be queued
        first) prefills once, when they share at least MIN_COMMON_PREFIX tokens."""
        own: list[_Row] = []
        counts = Counter(row.context for row in rows)
        for row in rows:
            key = row.context[:-1]
            if len(row.context) > 1 and key in self._unpublished:
                row.waits_for = key
            elif len(row.context) > 1 and key in self._prefixes and self._kept[self._prefixes[key]][1] == stamp:
                row.waits_for = key  # stored already: admitted at once
            else:
                own.append(row)
                if len(row.context) > 1 and counts[row.context] > 1:
                    row.publishes = key
                    self._unpublished.add(key)
        fresh = []
        for row in own:
            stored = self._stored_prefix(row.context, stamp)
            if stored is not None:
                row.source, row.cached = stored, len(stored.token_ids)
                self.stats["prefix_hits"] += 1
            else:
                fresh.append(row)
        if len(fresh) < 2:
            return []
        common = len(os.path.commonprefix([row.context for row in fresh]))
        common = min(common, min(len(row.context) for row in fresh) - 1)
        if common < MIN_COMMON_PREFIX:
            return []
        prefix = fresh[0].context[:common]
        pseudo = _Row(-1, prefix, fresh[0].uniforms, prefix_only=True, publishes=prefix)
        self._unpublished.add(prefix)
        for row in fresh:
            row.waits_for = prefix
        fresh[0].recomputed += common
        return [pseudo]

    def step(self) -> list[tuple[int, Sample]]:
        """Admit queued rows into free slots, run one forward over every slot (the next token of each
        decoding row, a chunk of prefill) and sample; returns (ticket, Sample) of the rows that finished."""
        if not self.in_flight:
            return []
        assert self._stream_weights is not None and self._stream_cfg is not None
        cfg, stamp = self._stream_cfg, self._stream_weights.stamp
        self._admit()
        with torch.no_grad():
            stepped = self._step(self._active, self._stream_weights, cfg)
        done = []
        for row in stepped:
            if row.finished:
                self._release(row, keep=cfg.keep_kv and not row.prefix_only, stamp=stamp)
                if not row.prefix_only:
                    done.append((row.index, self._sample(row)))
        return done

    def _admit(self) -> None:
        """Fill free slots from the queue, in order; a row waiting for another's keys and values is
        passed over until they are published (later rows may go first)."""
        active, queue = self._active, self._queue
        stamp = self._stream_weights.stamp if self._stream_weights is not None else ()
        position = 0
        while len(active) < self._slots and position < len(queue):
            row = queue[position]
            if row.waits_for is not None:
                key = row.waits_for
                if key in self._unpublished:
                    position += 1
                    continue
                stored = self._prefixes.get(key)
                if stored is not None and self._kept[stored][1] == stamp:
                    self._kept.move_to_end(stored)
                    row.source, row.cached = self._kept[stored][0], len(key)
                    self.stats["prefix_hits"] += 1
                # else: evicted before this row came in: it prefills in full
                row.waits_for = None
            queue.pop(position)
            slot = len(active)
            active.append(row)
            if row.source is not None and row.cached:
                for layer in range(self.layers):
                    self._keys[layer][slot, :, :row.cached] = row.source.keys[layer]
                    self._values[layer][slot, :, :row.cached] = row.source.values[layer]
            row.fed = row.cached
            row.source = None

    def _release(self, row: _Row, keep: bool, stamp: tuple[int, ...]) -> None:
        """Free a finished row's slot (the last slot's sequence moves into it); keep its history."""
        active = self._active
        slot = active.index(row)
        if keep:
            n = row.length - 1  # the last sampled token was never fed
            kept = RowCache(row.context + tuple(row.tokens[:-1]),
                            [k[slot, :, :n].clone() for k in self._keys], [v[slot, :, :n].clone() for v in self._values])
            row.kept = self._keep(kept, stamp)
        last = len(active) - 1
        if slot != last:
            moved = active[last]
            n = moved.fed if moved.fed < len(moved.context) else moved.length - 1
            for layer in range(self.layers):
                self._keys[layer][slot, :, :n] = self._keys[layer][last, :, :n]
                self._values[layer][slot, :, :n] = self._values[layer][last, :, :n]
            active[slot] = moved
        active.pop()

    def _publish(self, row: _Row, slot: int, stamp: tuple[int, ...]) -> None:
        """Store the keys and values of the tokens `row.publishes` names (now in `slot`)."""
        key = row.publishes
        assert key is not None
        n = len(key)
        self._store_prefix(RowCache(key, [k[slot, :, :n].clone() for k in self._keys],
                                    [v[slot, :, :n].clone() for v in self._values]), stamp)
        self._unpublished.discard(key)
        row.publishes = None

    def _sample(self, row: _Row) -> Sample:
        tokens = row.tokens
        logprobs = torch.stack(row.logprobs).tolist() if row.logprobs else []
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return Sample(tokens, logprobs, text, "stop" if row.stopped else "length", cache=row.kept,
                      recomputed=row.recomputed)

    # ------------------------------------------------------------------ one step
    def _step(self, active: list[_Row], weights: _Weights, cfg: SamplingConfig) -> list[_Row]:
        """One forward over every decoding slot's next token and a chunk of prefill; samples the
        next token of every row whose context is now fully in the cache. Returns those rows, and
        prefix rows that are now complete (finished, nothing sampled)."""
        tick = time.perf_counter()
        decode = [(s, row) for s, row in enumerate(active) if row.fed >= len(row.context)]
        prefill = []
        budget = self.prefill_tokens
        for s, row in enumerate(active):
            if row.fed < len(row.context) and budget > 0:
                take = min(budget, len(row.context) - row.fed)
                prefill.append((s, row, row.fed, take))
                budget -= take
        token_ids: list[int] = [row.tokens[-1] for _, row in decode]
        slots: list[int] = [s for s, _ in decode]
        positions: list[int] = [row.length - 1 for _, row in decode]
        for s, row, start, take in prefill:
            token_ids.extend(row.context[start:start + take])
            slots.extend([s] * take)
            positions.extend(range(start, start + take))
        device = self.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        slot_t = torch.tensor(slots, dtype=torch.long, device=device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=device)
        n_decode = len(decode)
        lengths = torch.tensor([row.length if row.fed >= len(row.context) else max(1, row.fed) for row in active],
                               dtype=torch.long, device=device)  # keys each decode query attends to
        width = int(max([row.length for _, row in decode] + [1]))
        hidden = self._forward(weights, ids, slot_t, pos_t, n_decode, len(active), lengths, width, prefill)
        last = list(range(n_decode))
        ready = [row for _, row in decode]
        offset = n_decode
        complete = []
        for s, row, start, take in prefill:
            offset += take
            row.fed += take
            row.recomputed += take
            if row.publishes is not None and row.fed >= len(row.publishes):
                self._publish(row, s, weights.stamp)
            if row.fed >= len(row.context):
                if row.prefix_only:
                    row.finished = True
                    complete.append(row)
                else:
                    last.append(offset - 1)
                    ready.append(row)
        self.stats["forward_s"] += time.perf_counter() - tick
        self.stats["steps"] += 1
        self.stats["prefill_tokens"] += len(token_ids) - n_decode
        self.stats["decode_tokens"] += n_decode
        self.stats["busy_slots"] += len(active)
        if ready:
            sampling = time.perf_counter()
            h = _rms_norm(hidden[last], weights.norm, weights.norm_eps)
            logits = torch.nn.functional.linear(h, weights.head, weights.head_bias).float()  # [R, V], as HF's scores
            self._choose(ready, logits, cfg)
            self.stats["sample_s"] += time.perf_counter() - sampling
        if not prefill:
            self.stats["decode_only_s"] += time.perf_counter() - tick
            self.stats["decode_only_tokens"] += n_decode
        return ready + complete

    def _forward(self, weights: _Weights, ids: Tensor, slot_t: Tensor, pos_t: Tensor, n_decode: int, n_active: int,
                 lengths: Tensor, width: int, prefill: list[tuple[int, _Row, int, int]]) -> Tensor:
        """Hidden states [N, H] after the last layer for the packed step tokens (decode first)."""
        x = weights.embed[ids]  # [N, H]
        cos, sin = self.model.model.rotary_emb(x[None], pos_t[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [N, 1, D]
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads
        scale = d ** -0.5
        soft_dtype = torch.promote_types(self.dtype, torch.float32)
        n = ids.shape[0]
        key_range = torch.arange(width, device=self.device)
        decode_mask = key_range[None, :] < lengths[:, None]  # [A, W]
        decode_slots = slot_t[:n_decode]
        # A slot range of the cache is strided (its rows are `capacity` apart): float32 matmuls read
        # it in place, but 16-bit ones take a slow path on it, slower than a dense copy and a fast one.
        dense = (lambda t: t.contiguous()) if self.dtype in (torch.bfloat16, torch.float16) else (lambda t: t)
        hidden_future = [~(torch.arange(start + take, device=self.device)[None, :]
                           <= torch.arange(start, start + take, device=self.device)[:, None])
                         for _, _, start, take in prefill]  # [c, L] per prefill chunk: keys after the query
        for layer, w in enumerate(weights.layers):
            h = _rms_norm(x, w["ln1"], w["ln1_eps"])
            qkv = torch.nn.functional.linear(h, w["qkv"], w["qkv_bias"])
            qk = qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d)
            qk = qk * cos + _rotate_half(qk) * sin  # queries and keys rotated together
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
            cache_k, cache_v = self._keys[layer], self._values[layer]
            cache_k[slot_t, :, pos_t] = k
            cache_v[slot_t, :, pos_t] = v
            out = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
            if n_decode:
                # one query per sequence: its query heads of a kv head attend as a group of queries
                if n_decode == n_active:  # every slot decodes, in slot order: no scatter
                    q_all = q[:n_decode].view(n_decode, kv_heads, group, d)
                else:
                    q_all = torch.zeros((n_active, kv_heads, group, d), dtype=x.dtype, device=x.device)
                    q_all[decode_slots] = q[:n_decode].view(n_decode, kv_heads, group, d)
                keys = dense(cache_k[:n_active, :, :width])  # [A, KVH, W, D]
                scores = torch.matmul(q_all, keys.transpose(-1, -2)) * scale  # [A, KVH, G, W]
                scores = scores.masked_fill(~decode_mask[:, None, None, :], float("-inf"))
                probs = torch.softmax(scores, dim=-1, dtype=soft_dtype).to(x.dtype)
                attended = torch.matmul(probs, dense(cache_v[:n_active, :, :width]))  # [A, KVH, G, D]
                picked = attended if n_decode == n_active else attended[decode_slots]
                out[:n_decode] = picked.reshape(n_decode, heads, d)
            offset = n_decode
            for (s, _, start, take), future in zip(prefill, hidden_future):
                span = start + take
                q_p = q[offset:offset + take].view(take, kv_heads, group, d).permute(1, 2, 0, 3)  # [KVH, G, c, D]
                keys = dense(cache_k[s, :, :span])  # [KVH, L, D]
                scores = torch.matmul(q_p.reshape(kv_heads, group * take, d), keys.transpose(-1, -2)) * scale
                scores = scores.view(kv_heads, group, take, span)
                scores = scores.masked_fill(future, float("-inf"))
                probs = torch.softmax(scores, dim=-1, dtype=soft_dtype).to(x.dtype)
                attended = torch.matmul(probs.view(kv_heads, group * take, span), dense(cache_v[s, :, :span]))
                out[offset:offset + take] = attended.view(kv_heads, group, take, d).permute(2, 0, 1, 3).reshape(take, heads, d)
                offset += take
            x = x + torch.nn.functional.linear(out.view(n, heads * d), w["o"], w["o_bias"])
            h = _rms_norm(x, w["ln2"], w["ln2_eps"])
            gate_up = torch.nn.functional.linear(h, w["gate_up"], w["gate_up_bias"])
            gate, up = gate_up.chunk(2, dim=-1)
            x = x + torch.nn.functional.linear(self.act(gate) * up, w["down"], w["down_bias"])
        return x

    def _choose(self, rows: list[_Row], logits: Tensor, cfg: SamplingConfig) -> None:
        """Each row's next token from its own uniform (as `_InverseCdfSampler`), then its stops."""
        steps = [len(row.tokens) for row in rows]
        if cfg.min_new_tokens > 0 and self.end_ids:
            early = torch.tensor([t < cfg.min_new_tokens for t in steps], device=logits.device)
            if bool(early.any()):
                held = logits[:, list(self.end_ids)]
                logits[:, list(self.end_ids)] = torch.where(early[:, None], torch.full_like(held, float("-inf")), held)
        if cfg.temperature > 0:
            logits = logits / cfg.temperature
            if cfg.top_p < 1.0:
                sorted_logits, order = logits.sort(-1, descending=True)
                probs = sorted_logits.softmax(-1)
                drop = probs.cumsum(-1) - probs > cfg.top_p
                logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
            logp = torch.log_softmax(logits, -1)
            cdf = logp.exp().cumsum(-1)
            u = torch.stack([row.uniforms[t] for row, t in zip(rows, steps)]).to(cdf.device)[:, None] * cdf[:, -1:]
            chosen = torch.searchsorted(cdf, u).clamp(max=logits.shape[-1] - 1).squeeze(-1)
            chosen_logp = logp.gather(-1, chosen[:, None]).squeeze(-1)
        else:  # greedy: no sort, no cumulative sum
            chosen = logits.argmax(-1)
            chosen_logp = logits.gather(-1, chosen[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        for row, token, logprob in zip(rows, chosen.tolist(), chosen_logp.unbind(0)):
            row.tokens.append(int(token))
            row.logprobs.append(logprob)
            if token in self.end_ids or self._completes_stop(row, int(token), cfg.stop):
                row.finished = row.stopped = True
            elif len(row.tokens) >= cfg.max_new_tokens:
                row.finished = True

    def _completes_stop(self, row: _Row, token: int, stop: Sequence[str]) -> bool:
        """Whether `token` completes one of the stop strings (none was in the action before it)."""
        if not stop:
            return False
        if self._table is None:  # not a byte-level tokenizer: look at the decoded action
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=False)
            return any(s in text for s in stop)
        window = row.tail + self._table[token]
        keep = max(len(s.encode()) for s in stop) - 1
        row.tail = window[len(window) - keep:] if keep > 0 else b""
        return any(s.encode() in window for s in stop)


def _activation(name: str) -> Any:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: byte -> the printable character that stands for it (the
    printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


def token_byte_table(tokenizer: Any) -> list[bytes] | None:
    """Each token id's bytes, for a byte-level BPE tokenizer whose decode is their concatenation
    (checked on a sample); None otherwise."""
    decoder = {ch: b for b, ch in _byte_level_alphabet().items()}
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = set(getattr(tokenizer, "all_special_ids", ()))
    added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    table: list[bytes] = []
    for i, piece in enumerate(pieces):
        if i in added or i in special:
            table.append((added.get(i) or piece or "").encode())
        elif piece is None or any(ch not in decoder for ch in piece):
            return None
        else:
            table.append(bytes(decoder[ch] for ch in piece))
    probe = tokenizer("def retry_count(x):\n    return None  # <a href='x'>b</a> é ünï", add_special_tokens=False)["input_ids"]
    probe = list(probe) + [i for i in sorted(added)[:4]]
    if b"".join(table[i] for i in probe).decode("utf-8", "replace") != tokenizer.decode(probe, skip_special_tokens=False):
        return None
    return table
