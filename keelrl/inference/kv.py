"""Keys and values: the slots rows decode in, and those kept after a row is done.

- `RowCache`: one row's keys and values without padding (per layer [kv_heads, n, head_dim]),
  the tokens they cover, and the weights they were made under. The HF path returns them as
  `Sample.cache`; the keel decoder keeps them in its `KeptStore`.
- `KeptKV`: the keel decoder's handle on a `RowCache` it keeps (what its `Sample.cache` holds).
- `SlotCache`: the keel decoder's preallocated [slots, kv_heads, capacity, head_dim] buffer per
  layer. Rows in flight hold slots 0..n-1 (a finished row's slot is filled by the last one, so
  decode attention runs over a dense range); nothing grows by concatenation, and a buffer that
  must grow is rounded up to CAPACITY_STEP tokens where the budget allows.
- `KeptStore`: kept histories and stored prefixes, least recently used first, within what the
  budget leaves beside the slots; each entry is valid only for the weights that made it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

CAPACITY_STEP = 256
"""The slot buffer grows in steps of this many tokens (each growth copies the rows in flight)."""


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
    """The weights they were made under, when a decoder records it (the HF decoder's weights serial)."""

    def covers(self, context: Sequence[int]) -> bool:
        """Whether these are the keys and values of a proper prefix of `context`."""
        n = len(self.token_ids)
        return n < len(context) and tuple(context[:n]) == self.token_ids


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


class SlotCache:
    """Per layer, keys and values of the rows in flight: [slots, kv_heads, capacity, head_dim]."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.token_bytes = layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        """Bytes of keys and values per token over all layers."""
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.slots = 0
        self.capacity = 0

    @property
    def nbytes(self) -> int:
        return self.slots * self.capacity * self.token_bytes

    def reserve(self, capacity: int, rows: int, live: int, max_batch: int, budget: int) -> None:
        """Slots of at least `capacity` tokens, as many as `budget` allows (up to `max_batch` and
        `rows`); the `live` rows in flight are copied into a buffer that grows."""
        per_slot = capacity * self.token_bytes
        slots = max(1, min(max_batch, rows, budget // max(1, per_slot)))
        if capacity <= self.capacity and slots <= self.slots:
            return
        slots = max(slots, self.slots)
        if self.capacity and capacity > self.capacity:  # growing: leave room for the next turns
            room = budget // max(1, slots * self.token_bytes)
            capacity = max(capacity, min(-(-capacity // CAPACITY_STEP) * CAPACITY_STEP, room))
        capacity = max(capacity, self.capacity)
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        old = self.capacity
        # zeros, not empty: a masked key still multiplies its value by 0, and 0 * NaN is NaN
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        if live:
            for layer in range(self.layers):
                keys[layer][:live, :, :old] = self.keys[layer][:live]
                values[layer][:live, :, :old] = self.values[layer][:live]
        self.keys, self.values = keys, values
        self.slots, self.capacity = slots, capacity

    def load(self, slot: int, cache: RowCache, n: int) -> None:
        """Copy the first `n` tokens of `cache` into `slot`."""
        for layer in range(self.layers):
            self.keys[layer][slot, :, :n] = cache.keys[layer]
            self.values[layer][slot, :, :n] = cache.values[layer]

    def read(self, slot: int, token_ids: tuple[int, ...]) -> RowCache:
        """A copy of `slot`'s keys and values of its first len(token_ids) tokens."""
        n = len(token_ids)
        return RowCache(token_ids, [k[slot, :, :n].clone() for k in self.keys],
                        [v[slot, :, :n].clone() for v in self.values])

    def move(self, source: int, target: int, n: int) -> None:
        """Copy `source`'s first `n` tokens into `target`."""
        for layer in range(self.layers):
            self.keys[layer][target, :, :n] = self.keys[layer][source, :, :n]
            self.values[layer][target, :, :n] = self.values[layer][source, :, :n]


class KeptStore:
    """Keys and values kept off the slots: key -> (RowCache, the weights serial that made it),
    least recently used first. `forgotten(key, cache)` hears of every entry dropped."""

    def __init__(self, token_bytes: int, forgotten: Callable[[int, RowCache], None] = lambda key, cache: None) -> None:
        self.token_bytes = token_bytes
        self.entries: OrderedDict[int, tuple[RowCache, int]] = OrderedDict()
        self.nbytes = 0
        self._forgotten = forgotten
        self._keys = itertools.count()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def store(self, cache: RowCache, serial: int) -> int:
        """Keep `cache` (made under weights `serial`); its key."""
        key = next(self._keys)
        self.entries[key] = (cache, serial)
        self.nbytes += len(cache.token_ids) * self.token_bytes
        return key

    def get(self, key: int, serial: int) -> RowCache | None:
        """The entry `key` if it was made under weights `serial` (now the most recently used)."""
        found = self.entries.get(key)
        if found is None or found[1] != serial:
            return None
        self.entries.move_to_end(key)
        return found[0]

    def forget(self, key: int) -> None:
        cache, _ = self.entries.pop(key)
        self.nbytes -= len(cache.token_ids) * self.token_bytes
        self._forgotten(key, cache)

    def evict(self, room: int) -> int:
        """Drop the least recently used entries until they fit in `room` bytes; how many went."""
        evicted = 0
        while self.entries and self.nbytes > room:
            self.forget(next(iter(self.entries)))
            evicted += 1
        return evicted

    def drop_stale(self, serial: int) -> None:
        """Drop every entry made under other weights than `serial`."""
        for key in [k for k, (_, made) in self.entries.items() if made != serial]:
            self.forget(key)
