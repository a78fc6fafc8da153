"""The keel decoder's stored prefixes: keys and values of token prefixes that later rows start from.

Two kinds are stored: a GRPO group's context (its first attempt publishes all of it but the last
token, so the other attempts, also those arriving later, run only that token) and a common
prefix of rows submitted together (MIN_COMMON_PREFIX tokens or more, e.g. a system prompt),
prefilled once by a prefix row. They live in the decoder's `KeptStore` beside kept histories,
under the same budget and least-recently-used order, at most MAX_PREFIXES of them, and are valid
only for the weights that made them. (Not to be confused with keelrl.policy.prefix, the
learner's passes that run a group's shared prompt once.)
"""

from __future__ import annotations

from keelrl.inference.kv import KeptStore, RowCache

MIN_COMMON_PREFIX = 16
"""Rows submitted together that all begin with this many equal tokens prefill them once."""
MAX_PREFIXES = 16
"""Stored prefixes (common prefixes and group contexts) kept at most, least recently used dropped."""


class PrefixStore:
    """Stored prefixes: their tokens -> their key in a `KeptStore` (which tells this one what it drops)."""

    def __init__(self, kept: KeptStore) -> None:
        self.kept = kept
        self.keys: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def forgotten(self, key: int, cache: RowCache) -> None:
        """The kept store dropped `key`: forget it if it was a stored prefix."""
        if self.keys.get(cache.token_ids) == key:
            del self.keys[cache.token_ids]

    def put(self, cache: RowCache, serial: int) -> None:
        """Store `cache` as the prefix of its tokens (replacing an older one), dropping the least
        recently used prefix when MAX_PREFIXES are stored. The caller evicts to its budget."""
        old = self.keys.get(cache.token_ids)
        if old is not None:
            self.kept.forget(old)
        while len(self.keys) >= MAX_PREFIXES:
            stored = set(self.keys.values())
            self.kept.forget(next(key for key in self.kept.entries if key in stored))
        self.keys[cache.token_ids] = self.kept.store(cache, serial)

    def has(self, tokens: tuple[int, ...], serial: int) -> bool:
        """A prefix of exactly `tokens` made under weights `serial` is stored."""
        key = self.keys.get(tokens)
        return key is not None and self.kept.entries[key][1] == serial

    def take(self, tokens: tuple[int, ...], serial: int) -> RowCache | None:
        """The stored prefix of exactly `tokens` made under `serial` (now the most recently used)."""
        key = self.keys.get(tokens)
        return None if key is None else self.kept.get(key, serial)

    def longest(self, context: tuple[int, ...], serial: int) -> RowCache | None:
        """The longest stored prefix of `context` (shorter than it) made under `serial`, or None."""
        best: tuple[int, RowCache] | None = None
        for tokens, key in self.keys.items():
            n = len(tokens)
            if n < len(context) and (best is None or n > len(best[1].token_ids)) and context[:n] == tokens:
                cache, made = self.kept.entries[key]
                if made == serial:
                    best = (key, cache)
        if best is None:
            return None
        self.kept.entries.move_to_end(best[0])
        return best[1]
