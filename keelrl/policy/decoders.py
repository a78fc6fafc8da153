"""The decode engines by name (`rollout.decoder`), behind one interface.

A decoder samples actions for the agent loop. Its contract (tests/test_decoders.py runs it
against every registered decoder, so a new backend, e.g. vLLM or SGLang on a GPU, proves itself
by passing it):

- `generate(contexts, cfg, uniforms, caches=None) -> list[Sample]`: one `Sample` per token-id
  context, in order: the new tokens, their behaviour log-probs under the distribution sampled
  from (after temperature and top-p), the text, why it stopped, and (with `cfg.keep_kv`) a
  cache handle for the row's next turn. Row b's t-th token is drawn by inverting the CDF at
  `uniforms[b, t]`, so a row's tokens depend only on its own context, the weights and its
  uniforms: never on the batch it shares. An action ends after its first end-of-turn token
  (kept), after the token completing a stop string, or at `cfg.max_new_tokens`.
- `caches[b]`: what row b's previous `Sample.cache` was. A decoder uses it when it still holds
  those keys and values under the current weights and they cover a prefix of the context, and
  otherwise prefills the row in full: a cache can only save time, never change a token.
- `load_weights(state)`: load a state dict into the decoder's model; later calls sample from it.
  Writing the model's parameters in place (an optimizer step, `load_state_dict`) has the same
  effect: every decoder notices the change by itself.
- `cache_usage() -> dict[str, float]`: what its caches hold (MiB, counts), for logs.

Optional, streaming (keelrl's own decoder has it; the agent loop uses it where present):
`submit(contexts, cfg, uniforms, caches=None) -> tickets` queues rows beside those in flight,
`step() -> [(ticket, Sample)]` runs one decode step and returns the rows that finished,
`in_flight` counts rows queued or decoding, and `cancel()` drops them. A row's Sample is the one
`generate` would give it; weights may change only while `in_flight` is 0.

Registered: `keel` (keelrl's own decode loop, `keelrl.policy.decode`), `hf` (HF `generate`
through `keelrl.policy.sampling.sample`, the reference), and `auto` (keel where it supports the
model, else hf). A builder takes (model, tokenizer, options) and returns the decoder.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor

from keelrl.policy.decode import KeelDecoder, unsupported_reason
from keelrl.policy.sampling import Sample, SamplingConfig, sample
from keelrl.registry import Registry


class Decoder(Protocol):
    """What the agent loop needs of a decode engine (see the module docstring)."""

    def generate(self, contexts: Sequence[Sequence[int]], cfg: SamplingConfig, uniforms: Tensor,
                 caches: Sequence[Any] | None = None) -> list[Sample]: ...

    def load_weights(self, state: Any) -> None: ...

    def cache_usage(self) -> dict[str, float]: ...


class HFDecoder:
    """HF `generate` with keelrl's per-row sampler (`keelrl.policy.sampling.sample`), in the
    model's own dtype, or in a copy of it in `dtype`, refreshed when the model's weights change."""

    def __init__(self, model: Any, tokenizer: Any, dtype: torch.dtype | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.dtype = dtype or next(model.parameters()).dtype
        self._copy: Any = None
        self._stamp: tuple[int, ...] | None = None
        self.stats = {"calls": 0.0}

    def runner(self) -> Any:
        """The model that samples: the model itself, or its copy in `dtype` with current weights."""
        if self.dtype == next(self.model.parameters()).dtype:
            return self.model
        from keelrl.policy.decode import weights_stamp
        import copy

        stamp = weights_stamp(self.model)
        if self._copy is None:
            self._copy = copy.deepcopy(self.model).to(self.dtype).eval()
            self._stamp = None
        if stamp != self._stamp:
            self._copy.load_state_dict(self.model.state_dict())
            self._stamp = stamp
        return self._copy

    def generate(self, contexts: Sequence[Sequence[int]], cfg: SamplingConfig, uniforms: Tensor,
                 caches: Sequence[Any] | None = None) -> list[Sample]:
        from keelrl.policy.decode import weights_stamp

        self.stats["calls"] += 1
        runner = self.runner()
        stamp = weights_stamp(runner)
        if caches is not None:  # keys and values of other weights are not this policy's
            caches = [c if c is not None and getattr(c, "made_under", None) == stamp else None for c in caches]
        samples = sample(runner, self.tokenizer, contexts, cfg, uniforms=uniforms, caches=caches)
        for s in samples:
            if s.cache is not None:
                s.cache.made_under = stamp
        return samples

    def load_weights(self, state: Any) -> None:
        self.model.load_state_dict(state)

    def cache_usage(self) -> dict[str, float]:
        return dict(self.stats)


DecoderBuilder = Callable[..., Decoder]

DECODERS: Registry[DecoderBuilder] = Registry("decoder", ("model", "tokenizer", "options"))
"""rollout.decoder's names -> builders (model, tokenizer, options: a dict of dtype, max_batch,
prefill_tokens, kv_budget_mb)."""


@DECODERS.register("keel", summary="keelrl's own decode loop: slot KV cache, continuous batching, kept histories")
def _keel(model: Any, tokenizer: Any, options: dict[str, Any]) -> Decoder:
    return KeelDecoder(model, tokenizer, dtype=options.get("dtype"), max_batch=options.get("max_batch", 64),
                       prefill_tokens=options.get("prefill_tokens", 512),
                       kv_budget_mb=options.get("kv_budget_mb", 4096))


@DECODERS.register("hf", summary="HF generate with keelrl's per-row sampler (the reference)")
def _hf(model: Any, tokenizer: Any, options: dict[str, Any]) -> Decoder:
    return HFDecoder(model, tokenizer, dtype=options.get("dtype"))


@DECODERS.register("auto", summary="keel where it has the model's forward pass, else hf")
def _auto(model: Any, tokenizer: Any, options: dict[str, Any]) -> Decoder:
    name = "keel" if unsupported_reason(model.config) is None else "hf"
    return DECODERS.get(name)(model, tokenizer, options)


def build_decoder(name: str, model: Any, tokenizer: Any, **options: Any) -> Decoder:
    """The decoder `name` (a `DECODERS` name) over `model`."""
    return DECODERS.get(name)(model, tokenizer, options)
