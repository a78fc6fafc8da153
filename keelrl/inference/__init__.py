"""The decoder: how keelrl samples actions from a policy, one job a module.

(The rollout *engine*, `rollout.engine`, decides where and when episodes run: keelrl.rollout.
The decoder, `rollout.decoder`, continues token contexts for it.)

- `params`: per-request `SamplingParams` (temperature, top-p, max_new_tokens, stop strings,
  min_new_tokens, keep_kv, seed), the decoder's `DecoderOptions` (which decoder, dtype,
  kv_budget_mb, max_batch, prefill_tokens) and the `Sample` a row gets back.
- `registry`: the decoder contract (`Decoder`), the decoders by name (`DECODERS`: keel, hf, auto)
  and `build_decoder`.
- `weights`: the versioned weights seam, `load_weights(state, version)`, through which new
  weights reach every decoder (merged with a LoRA adapter when there is one), and the keel
  decoder's fused layout of them (`FusedWeights`).
- `decoder`: `KeelDecoder`, keelrl's own decoder: the stream (`submit` / `step` / `generate`)
  and its step loop.
- `model`: the Llama family's forward pass over the slot cache (rms norm, rotary, attention).
- `kv`: keys and values: a row's `RowCache`, the keel decoder's slots (`SlotCache`) and the
  kept histories within the budget (`KeptStore`, handed out as `KeptKV`).
- `prefix`: the keel decoder's stored prefixes (a group's context, a common system prompt).
- `scheduler`: the keel decoder's rows: sharing plans, admission into slots, release, packing a step.
- `sampler`: the one inverse-CDF sampler both decoders draw tokens with, and where uniforms come
  from (`draw_uniforms`, per-row seeds, `SamplingParams.seed`).
- `stops`: end-of-turn tokens and stop strings (`end_token_ids`, `row_end`, `token_byte_table`).
- `hf`: the HF path: `sample` (HF `generate` over the sampler) and `HFDecoder`, the reference.
"""

from keelrl.inference.decoder import KeelDecoder
from keelrl.inference.hf import HFDecoder, sample
from keelrl.inference.kv import KeptKV, RowCache
from keelrl.inference.model import UnsupportedModelError, unsupported_reason
from keelrl.inference.params import DecoderOptions, Sample, SamplingParams
from keelrl.inference.registry import DECODERS, Decoder, build_decoder
from keelrl.inference.sampler import draw_seed, draw_uniforms
from keelrl.inference.stops import end_token_ids, token_byte_table
from keelrl.inference.weights import deliver, own_copy, published_state

__all__ = ["DECODERS", "Decoder", "DecoderOptions", "HFDecoder", "KeelDecoder", "KeptKV", "RowCache", "Sample",
           "SamplingParams", "UnsupportedModelError", "build_decoder", "deliver", "draw_seed", "draw_uniforms",
           "end_token_ids", "own_copy", "published_state", "sample", "token_byte_table", "unsupported_reason"]
