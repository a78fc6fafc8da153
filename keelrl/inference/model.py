"""The keel decoder's forward pass, written for the Llama family (llama, mistral without a sliding
window, qwen2 without sliding layers): RMSNorm, rotary embeddings from the model's own rotary
module, grouped-query attention over the slot cache, gated MLP.

One call runs a step's packed tokens (`StepBatch`): the next token of every decoding slot first,
then chunks of prompt tokens being prefilled, each written into its slot's keys and values
before attending. Decode queries attend over the dense range of slots 0..A-1 (masked past each
row's length), a prefill chunk over its own slot, causally. On a CPU in float32 or bfloat16 the
decode queries go through keelrl's decode-attention kernel (`keelrl.inference.kernels`: each
sequence reads its own keys once, up to its own length), and the elementwise steps (residual add
and RMSNorm, rotary embedding and cache write, gated activation) through its fused kernels.
Elsewhere, and for every prefill chunk's attention, torch's `scaled_dot_product_attention` runs
(its fused CPU kernel reads the strided slot range in place, with no dense copy of the keys and
values and no materialised score matrix). The linear layers run through
`keelrl.inference.weights.linear`: oneDNN on weights prepacked once per weights snapshot where
that applies (bfloat16 on a CPU), else `torch.nn.functional.linear`.

What this does NOT do: sliding-window attention, q/k norms (qwen3), other architectures (use
`rollout.decoder=hf`), paged KV blocks shared between live sequences, CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from keelrl.inference import kernels as cpu_kernels
from keelrl.inference.kv import SlotCache
from keelrl.inference.weights import FusedWeights, base_model, linear

SUPPORTED = ("llama", "mistral", "qwen2")
"""`config.model_type`s whose forward pass is written here."""


class UnsupportedModelError(ValueError):
    """The keel decoder has no forward pass for this model; the message names the way out."""


def unsupported_reason(config: Any) -> str | None:
    """Why the keel decoder cannot run a model with this config, or None when it can."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {', '.join(SUPPORTED)}"
    if kind == "mistral" and getattr(config, "sliding_window", None):
        return "mistral with a sliding window"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding-window attention layers"
    return None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """As LlamaRMSNorm: normalised in float32 (also a float64 model's), scaled in the input's dtype."""
    wide = x.to(torch.float32)
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def activation(name: str) -> Any:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


@dataclass
class StepBatch:
    """One step's packed tokens: `n_decode` decoding slots' next tokens first, then prefill chunks."""

    ids: Tensor
    """[N] token ids."""
    slots: Tensor
    """[N] the slot of each token."""
    positions: Tensor
    """[N] each token's position in its sequence."""
    n_decode: int
    n_active: int
    """Slots in use (0..n_active-1)."""
    lengths: Tensor
    """[n_active] keys each slot's decode query attends to."""
    width: int
    """The longest decoding sequence: decode attention runs over keys 0..width-1."""
    prefill: list[tuple[int, int, int]]
    """(slot, start, take) of each prefill chunk, in packing order."""


KERNELS = ("auto", "keel", "torch")
"""The forward pass's ops: keelrl's CPU kernels where they serve (auto), those kernels or an
error (keel), or torch's ops only (torch)."""


class LlamaForward:
    """The forward pass over a model's config and rotary module, in the decode `dtype`.

    `kernels` (one of KERNELS) picks keelrl's CPU kernels (`keelrl.inference.kernels`: decode
    attention, the residual add with RMSNorm, the rotary embedding with the cache write, the gated
    activation) or torch's ops; `self.kernels` is the choice made ("keel" or "torch") and
    `self.kernels_note` why, when auto fell back to torch's ops."""

    def __init__(self, model: Any, dtype: torch.dtype, device: torch.device, kernels: str = "auto") -> None:
        reason = unsupported_reason(model.config)
        if reason is not None:
            raise UnsupportedModelError(f"keelrl's decoder cannot run this model ({reason}); "
                                        f"set rollout.decoder=hf to sample with HF generate")
        config = model.config
        self.config, self.dtype, self.device = config, dtype, device
        self.rotary = base_model(model).model.rotary_emb
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = config.num_hidden_layers
        self.act = activation(config.hidden_act)
        self.silu = config.hidden_act == "silu"
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r} is not one of {', '.join(KERNELS)}")
        reason = None if kernels == "torch" else cpu_kernels.supports(dtype, device)
        if reason is None and kernels != "torch" and cpu_kernels.kernel() is None:
            reason = f"they could not be built ({cpu_kernels.kernel_error()})"
        if kernels == "keel" and reason is not None:
            raise ValueError(f"kernels='keel' cannot serve this decoder: {reason}")
        self.kernels = "torch" if kernels == "torch" or reason is not None else "keel"
        self.kernels_note = reason

    def __call__(self, weights: FusedWeights, cache: SlotCache, batch: StepBatch) -> Tensor:
        """Hidden states [N, H] after the last layer for the batch's tokens (their keys and values
        written into `cache` on the way)."""
        ids, slot_t, pos_t, n_decode, n_active = batch.ids, batch.slots, batch.positions, batch.n_decode, batch.n_active
        x = weights.embed[ids]  # [N, H]
        cos, sin = self.rotary(x[None], pos_t[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [N, 1, D]
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads
        scale = d ** -0.5
        n = ids.shape[0]
        width = batch.width
        decode_slots = slot_t[:n_decode]
        keel = self.kernels == "keel"
        if keel:
            decode_lengths = batch.lengths[decode_slots]  # [n_decode] the keys each decode query attends to
            cos2, sin2 = cos.reshape(n, d).contiguous(), sin.reshape(n, d).contiguous()
            pending: Tensor | None = None  # the last layer's MLP output, added to x with the next RMSNorm
        else:
            attend = torch.arange(width, device=self.device)[None, :] < batch.lengths[:, None]
            attend = attend[:, None, None, :]  # [A, 1, 1, W]: the keys each decode query attends to
        # a prefill chunk from position 0 is plainly causal; one after kept keys sees them all too
        chunk_masks = [None if start == 0 else
                       torch.arange(start + take, device=self.device)[None, :]
                       <= torch.arange(start, start + take, device=self.device)[:, None]
                       for _, start, take in batch.prefill]  # [c, L]: the keys each chunk query attends to
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for layer, w in enumerate(weights.layers):
            cache_k, cache_v = cache.keys[layer], cache.values[layer]
            h = cpu_kernels.add_rms_norm(x, pending, w["ln1"], w["ln1_eps"]) if keel else \
                rms_norm(x, w["ln1"], w["ln1_eps"])
            qkv = linear(h, w["qkv"], w["qkv_bias"])
            if keel:
                q = cpu_kernels.rope_store(qkv, cos2, sin2, cache_k, cache_v, slot_t, pos_t, heads, kv_heads)
            else:
                qk = qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d)
                qk = qk * cos + rotate_half(qk) * sin  # queries and keys rotated together
                q, k = qk[:, :heads], qk[:, heads:]
                v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
                cache_k[slot_t, :, pos_t] = k
                cache_v[slot_t, :, pos_t] = v
            out = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
            if n_decode and keel:
                # each sequence's query heads over its own keys, up to its own length
                out[:n_decode] = cpu_kernels.decode_attention(
                    q[:n_decode].view(n_decode, kv_heads, group, d), cache_k, cache_v, decode_slots,
                    decode_lengths, scale).view(n_decode, heads, d)
            elif n_decode:
                # one query per sequence: its query heads of a kv head attend as a group of queries,
                # over the slot range of the cache read in place (its rows `capacity` apart)
                if n_decode == n_active:  # every slot decodes, in slot order: no scatter
                    q_all = q[:n_decode].view(n_decode, kv_heads, group, d)
                else:
                    q_all = torch.zeros((n_active, kv_heads, group, d), dtype=x.dtype, device=x.device)
                    q_all[decode_slots] = q[:n_decode].view(n_decode, kv_heads, group, d)
                attended = sdpa(q_all, cache_k[:n_active, :, :width], cache_v[:n_active, :, :width],
                                attn_mask=attend, scale=scale)  # [A, KVH, G, D]
                picked = attended if n_decode == n_active else attended[decode_slots]
                out[:n_decode] = picked.reshape(n_decode, heads, d)
            offset = n_decode
            for (s, start, take), mask in zip(batch.prefill, chunk_masks):
                span = start + take
                q_p = q[offset:offset + take].transpose(0, 1)[None]  # [1, heads, c, D]
                attended = sdpa(q_p, cache_k[s, None, :, :span], cache_v[s, None, :, :span], attn_mask=mask,
                                is_causal=mask is None, scale=scale, enable_gqa=group > 1)  # [1, heads, c, D]
                out[offset:offset + take] = attended[0].transpose(0, 1)
                offset += take
            attended_o = linear(out.view(n, heads * d), w["o"], w["o_bias"])
            if keel:
                h = cpu_kernels.add_rms_norm(x, attended_o, w["ln2"], w["ln2_eps"])
            else:
                x = x + attended_o
                h = rms_norm(x, w["ln2"], w["ln2_eps"])
            gate_up = linear(h, w["gate_up"], w["gate_up_bias"])
            gated = cpu_kernels.silu_mul(gate_up) if keel and self.silu else self._gated(gate_up)
            mlp = linear(gated, w["down"], w["down_bias"])
            if keel:
                pending = mlp
            else:
                x = x + mlp
        if keel and pending is not None:
            x = x + pending
        return x

    def _gated(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def logits(self, weights: FusedWeights, hidden: Tensor) -> Tensor:
        """float32 next-token logits [R, V] (as HF's scores) from last-layer hidden states [R, H]."""
        h = rms_norm(hidden, weights.norm, weights.norm_eps)
        return linear(h, weights.head, weights.head_bias).float()
