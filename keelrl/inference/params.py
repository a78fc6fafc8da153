"""What a decode call is asked, and what it gives back.

`SamplingParams` are a request's: temperature, top-p, how many new tokens, stop strings, whether
to keep the row's keys and values for its next turn, and a seed for decoders given no per-row
randomness. `DecoderOptions` are the decoder's own, fixed when it is built (`rollout.decoder`,
`rollout.dtype`, `rollout.kv_budget_mb`): which decode engine, its dtype, its memory, how many
rows it decodes at once. `Sample` is one row's continuation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How one request's actions are sampled."""

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
    seed: int | None = None
    """The call's randomness when it passes neither uniforms nor per-row seeds (`Decoder.generate`):
    the same seed gives the same tokens; None draws a fresh one. Not part of what rows sharing a
    decode stream must agree on (`stream_key`)."""

    def stream_key(self) -> "SamplingParams":
        """These params without the seed: rows decoded in one stream share them."""
        return dataclasses.replace(self, seed=None)


@dataclass(frozen=True)
class DecoderOptions:
    """How a decoder is built (`keelrl.inference.build_decoder`): the engine and its resources."""

    decoder: str = "auto"
    """The decode engine (`keelrl.inference.DECODERS`): keel, hf or auto."""
    dtype: Any = None
    """The decoder's dtype (a torch.dtype; None: the model's own)."""
    kv_budget_mb: int = 4096
    """The keel decoder's memory for keys and values: its slots, kept histories and stored prefixes."""
    max_batch: int = 64
    """Sequences the keel decoder decodes at once."""
    prefill_tokens: int = 512
    """Prompt tokens the keel decoder prefills per step beside the decoding sequences."""
    eager: bool = False
    """The vllm decoder without vLLM's torch.compile of the model (enforce_eager): it starts in
    seconds rather than about a minute, and decodes slower."""


@dataclass
class Sample:
    """One continuation: its tokens, their behaviour log-probs, and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    stopped: str
    """stop (a stop string or end token) | length (max_new_tokens)."""
    cache: Any = None
    """With `SamplingParams.keep_kv`: this row's keys and values for its next turn (a `RowCache`,
    or a decoder's handle on keys and values it keeps, a `KeptKV`)."""
    recomputed: int = 0
    """Context tokens this call ran through the model for the row: its prefill (a context shared by
    several rows is prefilled on its first row; the others run only its last token)."""
