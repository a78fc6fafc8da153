"""Where an action ends: end-of-turn tokens and stop strings.

An action ends after its first end-of-turn token (kept: the model learns to end its turn), after
the token that completes a stop string, or at max_new_tokens. Two ways to find it, with one
answer: `row_end` reads a finished row's tokens (the HF path cuts `generate`'s padded output
with it), and `StopMatcher` decides token by token as a row is decoded (the keel decoder), on
each token's bytes for a byte-level tokenizer (`token_byte_table`) or else on the decoded text.
"""

from __future__ import annotations

from typing import Any, Sequence


def end_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a model's turn: eos and its chat template's end-of-turn token."""
    from keelrl.policy.chat import ChatFormat, ChatTemplateError

    try:
        return ChatFormat.of(tokenizer).end_token_ids
    except ChatTemplateError:
        return (int(tokenizer.eos_token_id),) if tokenizer.eos_token_id is not None else ()


def row_end(tokenizer: Any, tokens: list[int], end_ids: Sequence[int], stop: Sequence[str]) -> tuple[int, bool]:
    """(length, finished) of one generated row, from its tokens alone (padding is never consulted).

    The row ends after its first end-of-turn token or after the token that completes its first
    stop string, whichever comes first.
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


class StopMatcher:
    """Stop strings matched incrementally, one sampled token at a time.

    With a byte-level tokenizer each token's bytes extend a short window of the action's last
    bytes (`tail`, kept by the caller per row), so a stop string spanning tokens is found without
    decoding; for other tokenizers the action so far is decoded."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.table = token_byte_table(tokenizer)

    def completes(self, tokens: Sequence[int], tail: bytes, stop: Sequence[str]) -> tuple[bool, bytes]:
        """(whether the last of `tokens` completes one of the stop strings, the new tail); no stop
        string was in the action before that token."""
        if not stop:
            return False, tail
        if self.table is None:  # not a byte-level tokenizer: look at the decoded action
            text = self.tokenizer.decode(list(tokens), skip_special_tokens=False)
            return any(s in text for s in stop), tail
        window = tail + self.table[tokens[-1]]
        keep = max(len(s.encode()) for s in stop) - 1
        return any(s.encode() in window for s in stop), window[len(window) - keep:] if keep > 0 else b""


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
