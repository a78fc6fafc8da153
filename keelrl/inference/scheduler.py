"""The keel decoder's rows: queueing, who prefills what, admission into slots, release.

- Rows. Every submitted context is a `Row`: queued, then holding a slot while its context is
  prefilled and its action decoded, then released (its slot filled by the last slot's row).
- Sharing. Equal contexts (a GRPO group's attempts) are prefilled once: the first runs its
  context and publishes its keys and values but the last token to the prefix store, the others
  wait for them and run only that token. Fresh rows submitted together that begin with the same
  MIN_COMMON_PREFIX or more tokens (a system prompt) start from a prefix row that prefills that
  prefix once. A row starts from the longest stored prefix of its context, or from its own kept
  history (`KeptKV`, passed back as its cache on the next turn).
- Admission. Free slots are filled from the queue in order; a row waiting for keys and values
  another row will publish is passed over until they are (later rows may go first).
- Packing. Each step runs the next token of every decoding slot plus up to `prefill_tokens`
  prompt tokens of rows being prefilled (chunked prefill: a long context is prefilled over
  several steps while the others decode); `advance` books what the step ran.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from keelrl.inference.kv import KeptKV, KeptStore, RowCache, SlotCache
from keelrl.inference.model import StepBatch
from keelrl.inference.prefix import MIN_COMMON_PREFIX, PrefixStore


@dataclass(eq=False)  # a row is itself: finding its slot must not compare prefix rows of equal tokens field by field
class Row:
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


@dataclass
class StepPlan:
    """A step's batch and the rows behind it."""

    batch: StepBatch
    decode: list[Row]
    """The decoding rows, in the batch's order."""
    prefill: list[tuple[int, Row, int, int]]
    """(slot, row, start, take) of each prefill chunk."""


class Scheduler:
    """Rows queued and in slots (see the module docstring). `decoder`: the id its `KeptKV`s carry."""

    def __init__(self, slots: SlotCache, *, decoder: int, max_batch: int, prefill_tokens: int, budget: int,
                 stats: dict[str, Any]) -> None:
        self.slots, self.decoder = slots, decoder
        self.max_batch, self.prefill_tokens, self.budget = max_batch, prefill_tokens, budget
        self.stats = stats
        self.prefixes: PrefixStore
        self.kept = KeptStore(slots.token_bytes, forgotten=lambda key, cache: self.prefixes.forgotten(key, cache))
        self.prefixes = PrefixStore(self.kept)
        self.queue: list[Row] = []
        self.active: list[Row] = []
        """active[s] holds slot s."""
        self.unpublished: set[tuple[int, ...]] = set()
        """Tokens a queued or active row will publish and has not yet: the rows waiting for them are
        passed over."""

    @property
    def in_flight(self) -> int:
        return len(self.queue) + len(self.active)

    # ------------------------------------------------------------------ memory
    def evict(self) -> None:
        """Kept histories and stored prefixes within what the budget leaves beside the slots."""
        self.stats["evicted"] += self.kept.evict(self.budget - self.slots.nbytes)

    def keep(self, cache: RowCache, serial: int) -> KeptKV:
        kept = KeptKV(self.kept.store(cache, serial), cache.token_ids, self.decoder)
        self.evict()
        return kept

    def lookup(self, cache: Any, context: tuple[int, ...], serial: int) -> RowCache | None:
        """Keys and values a row's cache offers for its context under weights `serial`, if usable."""
        if isinstance(cache, RowCache):
            return cache if cache.covers(context) else None
        if isinstance(cache, KeptKV) and cache.decoder == self.decoder and cache.covers(context):
            return self.kept.get(cache.key, serial)
        return None

    # ------------------------------------------------------------------ intake
    def add(self, rows: list[Row], caches: Any, serial: int, share_prompts: bool, max_new_tokens: int) -> None:
        """Queue fresh rows (each starting from its cache where usable; with `share_prompts`, shared
        and stored prefixes planned) and make room in the slots for them."""
        for row, cache in zip(rows, caches or [None] * len(rows)):
            kept = self.lookup(cache, row.context, serial) if cache is not None else None
            if kept is not None:
                row.source, row.cached = kept, len(kept.token_ids)
        queued: list[Row] = []
        if share_prompts:
            queued = self.plan_sharing([row for row in rows if row.source is None], serial)
        self.queue.extend(queued + rows)
        self.slots.reserve(max(r.length for r in rows) + max_new_tokens, self.in_flight, len(self.active),
                           self.max_batch, self.budget)
        self.evict()

    def plan_sharing(self, rows: list[Row], serial: int) -> list[Row]:
        """Who prefills what among fresh rows: a context equal to an earlier row's waits for that row's
        keys and values (or takes them from the store); the rows that run their own context start
        from a stored prefix, or from a common prefix that a prefix row (returned, to be queued
        first) prefills once, when they share at least MIN_COMMON_PREFIX tokens."""
        own: list[Row] = []
        counts = Counter(row.context for row in rows)
        for row in rows:
            key = row.context[:-1]
            if len(row.context) > 1 and key in self.unpublished:
                row.waits_for = key
            elif len(row.context) > 1 and self.prefixes.has(key, serial):
                row.waits_for = key  # stored already: admitted at once
            else:
                own.append(row)
                if len(row.context) > 1 and counts[row.context] > 1:
                    row.publishes = key
                    self.unpublished.add(key)
        fresh = []
        for row in own:
            stored = self.prefixes.longest(row.context, serial)
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
        pseudo = Row(-1, prefix, fresh[0].uniforms, prefix_only=True, publishes=prefix)
        self.unpublished.add(prefix)
        for row in fresh:
            row.waits_for = prefix
        fresh[0].recomputed += common
        return [pseudo]

    def cancel(self) -> None:
        self.queue.clear()
        self.active.clear()
        self.unpublished.clear()

    # ------------------------------------------------------------------ slots
    def admit(self, serial: int) -> None:
        """Fill free slots from the queue, in order; a row waiting for another's keys and values is
        passed over until they are published (later rows may go first)."""
        active, queue = self.active, self.queue
        position = 0
        while len(active) < self.slots.slots and position < len(queue):
            row = queue[position]
            if row.waits_for is not None:
                key = row.waits_for
                if key in self.unpublished:
                    position += 1
                    continue
                stored = self.prefixes.take(key, serial)
                if stored is not None:
                    row.source, row.cached = stored, len(key)
                    self.stats["prefix_hits"] += 1
                # else: evicted before this row came in: it prefills in full
                row.waits_for = None
            queue.pop(position)
            slot = len(active)
            active.append(row)
            if row.source is not None and row.cached:
                self.slots.load(slot, row.source, row.cached)
            row.fed = row.cached
            row.source = None

    def release(self, row: Row, keep: bool, serial: int) -> None:
        """Free a finished row's slot (the last slot's row moves into it); keep its history."""
        active = self.active
        slot = active.index(row)
        if keep:
            # the last sampled token was never fed
            row.kept = self.keep(self.slots.read(slot, row.context + tuple(row.tokens[:-1])), serial)
        last = len(active) - 1
        if slot != last:
            moved = active[last]
            self.slots.move(last, slot, moved.fed if moved.fed < len(moved.context) else moved.length - 1)
            active[slot] = moved
        active.pop()

    def publish(self, row: Row, slot: int, serial: int) -> None:
        """Store the keys and values of the tokens `row.publishes` names (now in `slot`)."""
        key = row.publishes
        assert key is not None
        self.prefixes.put(self.slots.read(slot, key), serial)
        self.evict()
        self.unpublished.discard(key)
        row.publishes = None

    # ------------------------------------------------------------------ one step
    def plan(self, device: torch.device) -> StepPlan:
        """The next step's tokens: every decoding slot's next token, then prefill chunks up to
        `prefill_tokens`."""
        active = self.active
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
        lengths = torch.tensor([row.length if row.fed >= len(row.context) else max(1, row.fed) for row in active],
                               dtype=torch.long, device=device)  # keys each decode query attends to
        batch = StepBatch(ids=torch.tensor(token_ids, dtype=torch.long, device=device),
                          slots=torch.tensor(slots, dtype=torch.long, device=device),
                          positions=torch.tensor(positions, dtype=torch.long, device=device),
                          n_decode=len(decode), n_active=len(active), lengths=lengths,
                          width=int(max([row.length for _, row in decode] + [1])),
                          prefill=[(s, start, take) for s, _, start, take in prefill])
        return StepPlan(batch, [row for _, row in decode], prefill)

    def advance(self, plan: StepPlan, serial: int) -> tuple[list[Row], list[int], list[Row]]:
        """Book a step's prefill: (rows to sample now, their positions in the step's hidden states,
        prefix rows now complete). Published prefixes go to the store."""
        last = list(range(len(plan.decode)))
        ready = list(plan.decode)
        offset = len(plan.decode)
        complete = []
        for s, row, start, take in plan.prefill:
            offset += take
            row.fed += take
            row.recomputed += take
            if row.publishes is not None and row.fed >= len(row.publishes):
                self.publish(row, s, serial)
            if row.fed >= len(row.context):
                if row.prefix_only:
                    row.finished = True
                    complete.append(row)
                else:
                    last.append(offset - 1)
                    ready.append(row)
        return ready, last, complete
