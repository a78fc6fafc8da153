"""The weights seam: how new weights reach a decoder, and the keel decoder's layout of them.

Every decoder has `load_weights(state, version)` and a `version` (the policy version it samples
from). `state` is either a state dict under the base model's names, or a torch model, meaning
"read its current parameters". New weights reach a decoder only through this call: the
learner's publish (`RolloutEngine.publish_model`: `deliver` for the sync engine, a copied state
dict through `WeightSlot` for the async one, through the object store for Ray workers, through
the endpoint's decode loop for `rollout.engine=endpoint`), and the evaluator before each
evaluation. Two kinds of decoder take it differently, and say which by `shares_model`:

- True (keel, hf): the decoder samples with a torch model it was built over. A state dict is
  loaded into that model; a model (its own) is read as it now is.
- False (an engine outside torch, e.g. vLLM): it cannot read a torch model's parameters, so the
  publisher hands it a state dict (`weights_for`).

A state dict handed to a decoder is always the *merged* one, `keelrl.policy.lora.merged_state_dict`:
for a peft model the base model's names with the adapters folded in, so a decoder samples with
the adapter without knowing of it; the keel decoder fuses its layout (`FusedWeights`) from that
same dict, also when it reads its own model. Rollout sides that keep their own copy of the policy
(`own_copy`) keep it merged, so the merged state dicts published to them load into it.

A safety net stays beside the seam: `SharedWeights` also notices writes to its model's parameters
made without `load_weights` (an optimizer step in place, `load_state_dict`) by their version
counters (`weights_stamp`; the learner's fused AdamW, which writes without bumping them, bumps
them in a step hook), so a decoder never samples from weights older than its model's, and keys
and values made under other weights are never used. The explicit call is the documented path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping

import torch
from torch import Tensor

from keelrl.inference.kernels import cpu_identity


def merged_state(model: Any) -> dict[str, Tensor]:
    """`model`'s weights as a decoder receives them: the base model's names, adapters merged in."""
    from keelrl.policy.lora import merged_state_dict

    return merged_state_dict(model)


def published_state(model: Any) -> dict[str, Tensor]:
    """A copy of `merged_state(model)` that outlives later writes to the model (what engines send)."""
    return {name: tensor.detach().clone() for name, tensor in merged_state(model).items()}


def weights_for(decoder: Any, model: Any) -> Any:
    """What `decoder.load_weights` takes for the weights `model` holds now: the model itself for a
    decoder that reads torch models (`shares_model`), else its merged state dict."""
    return model if getattr(decoder, "shares_model", True) else merged_state(model)


def deliver(decoder: Any, model: Any, version: int) -> None:
    """Hand `decoder` the weights `model` holds now, as policy `version`."""
    decoder.load_weights(weights_for(decoder, model), version)


def own_copy(model: Any) -> Any:
    """A rollout side's own copy of the policy, adapters merged in (a plain model that the merged
    state dicts of later publishes load into: `keelrl.policy.lora.merged_copy`), in eval mode and
    without gradients."""
    from keelrl.policy.lora import merged_copy

    return merged_copy(model).eval().requires_grad_(False)


def base_model(model: Any) -> Any:
    """The transformers model under a peft wrapper (the model itself when there is none)."""
    from keelrl.policy.lora import unwrap

    return unwrap(model)


def body_prefix(model: Any) -> str:
    """The state-dict prefix of the model's body, its layers and embeddings ("model." for Llama),
    under a peft wrapper too: `FusedWeights.from_state`'s `prefix`."""
    return getattr(base_model(model), "base_model_prefix", "model") + "."


def weights_stamp(model: Any) -> tuple[int, ...]:
    """Version counters of the model's parameters: they change whenever one is written in place
    (`load_state_dict`, an optimizer step), so weights read before are known stale."""
    return tuple(p._version for p in model.parameters())


class SharedWeights:
    """The seam of a decoder that samples with the torch model it was built over (keel, hf).

    `serial` numbers the weights the decoder has seen: each `load`, and each write to the model's
    parameters noticed by `current` (the safety net), starts a new one. Whatever the decoder made
    under an older serial (a fused snapshot, kept keys and values) is stale."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.version = 0
        """The policy version last loaded (0: the weights the model was built with)."""
        self.serial = 0
        self._stamp = weights_stamp(model)

    def load(self, state: Any, version: int) -> None:
        """New weights: a (merged) state dict loaded into the model, or a torch model whose current
        weights are taken (the model itself: as it is now)."""
        if isinstance(state, torch.nn.Module):
            if state is not self.model:
                self.model.load_state_dict(merged_state(state))
        elif isinstance(state, Mapping):
            self.model.load_state_dict(state)
        else:
            raise TypeError(f"load_weights takes a state dict or a torch model, got {type(state).__name__}")
        self.version = version
        self.serial += 1
        self._stamp = weights_stamp(self.model)

    def current(self) -> int:
        """The serial of the model's weights now (a new one if they were written since it was read)."""
        stamp = weights_stamp(self.model)
        if stamp != self._stamp:
            self.serial += 1
            self._stamp = stamp
        return self.serial


FLOAT32_PACK_VENDORS = ("AuthenticAMD",)
"""CPU vendors (`cpu_identity()["vendor"]`) whose float32 linear weights are prepacked for oneDNN:
torch's float32 matmuls go to MKL, which runs slower code paths on CPUs that are not Intel's,
while oneDNN picks its kernels by instruction set (BENCHMARKS.md, "decode-step levers")."""


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linear weights of `dtype` on `device` are prepacked for oneDNN, on a CPU whose torch
    has mkldnn: bfloat16 where oneDNN runs a bfloat16 linear on this CPU (it refuses CPUs without
    AVX512-BW/VL/DQ or AVX-NE-CONVERT, such as AVX2-only ones: `onednn_bf16_refusal`), float32 on
    CPUs of FLOAT32_PACK_VENDORS, never float64."""
    if not (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return onednn_bf16_refusal() is None
    return dtype == torch.float32 and cpu_identity()["vendor"] in FLOAT32_PACK_VENDORS


@lru_cache(maxsize=None)
def onednn_bf16_refusal() -> str | None:
    """None where oneDNN prepacks a small bfloat16 weight and runs a linear with it on this CPU,
    else oneDNN's error (tried once a process)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), 4)
        torch.ops.mkldnn._linear_pointwise(torch.ones(4, 16, dtype=torch.bfloat16), packed, None, "none", [], "")
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


@dataclass(frozen=True)
class PackedWeight:
    """A linear layer's [out, in] weight reordered once into oneDNN's blocked layout (`prepack`), so
    each call skips the reorder that `torch.nn.functional.linear` does on every bfloat16 matmul
    (and, in float32, runs oneDNN's matmul rather than MKL's)."""

    packed: Tensor
    out_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype


def prepack(weight: Tensor, rows: int = 64) -> PackedWeight:
    """`weight` [out, in] in oneDNN's layout for inputs of about `rows` rows (any row count works)."""
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows), weight.shape[0])


def linear(x: Tensor, weight: Tensor | PackedWeight, bias: Tensor | None) -> Tensor:
    """x [N, in] @ weight.T + bias: oneDNN's linear for a `PackedWeight`, else `F.linear`."""
    if isinstance(weight, PackedWeight):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.packed, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


@dataclass
class FusedWeights:
    """The model's tensors in the decode dtype, q/k/v and gate/up fused into one matrix each: the
    keel decoder's layout, made from a merged state dict (`from_state`) under weights `serial`.

    With `packed`, the linear weights (q/k/v, o, gate/up, down, the head) are `PackedWeight`s
    (`linear` runs them): bfloat16 on a CPU with oneDNN (`can_prepack`), unless turned off."""

    serial: int
    embed: Tensor
    norm: Tensor
    norm_eps: float
    head: Tensor | PackedWeight
    head_bias: Tensor | None
    layers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def packed(self) -> bool:
        """Whether the linear weights are prepacked (`from_state` packs all of them or none)."""
        return isinstance(self.head, PackedWeight)

    @classmethod
    @torch.no_grad()
    def from_state(cls, state: Mapping[str, Tensor], config: Any, dtype: torch.dtype, serial: int,
                   prefix: str = "model.", pack: bool = True) -> "FusedWeights":
        """Fuse `state` (a Llama-family model's state dict under the base names, `prefix` the body's);
        with `pack` (and `can_prepack(dtype, device)`) the linear weights are prepacked for oneDNN."""

        def cast(name: str) -> Tensor | None:
            tensor = state.get(name)
            return None if tensor is None else tensor.detach().to(dtype)

        def cat(names: list[str]) -> Tensor | None:
            tensors = [state.get(name) for name in names]
            if any(t is None for t in tensors):
                return None
            return torch.cat([t.detach() for t in tensors if t is not None]).to(dtype)

        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        embed = state[f"{prefix}embed_tokens.weight"].detach().to(dtype)
        head = cast("lm_head.weight")
        fused = cls(serial=serial, embed=embed, norm=state[f"{prefix}norm.weight"].detach().to(dtype), norm_eps=eps,
                    head=embed if head is None else head, head_bias=cast("lm_head.bias"))
        for layer in range(config.num_hidden_layers):
            at = f"{prefix}layers.{layer}."
            qkv = [f"{at}self_attn.{p}_proj" for p in "qkv"]
            gate_up = [f"{at}mlp.gate_proj", f"{at}mlp.up_proj"]
            fused.layers.append({
                "ln1": cast(f"{at}input_layernorm.weight"), "ln1_eps": eps,
                "qkv": cat([f"{p}.weight" for p in qkv]), "qkv_bias": cat([f"{p}.bias" for p in qkv]),
                "o": cast(f"{at}self_attn.o_proj.weight"), "o_bias": cast(f"{at}self_attn.o_proj.bias"),
                "ln2": cast(f"{at}post_attention_layernorm.weight"), "ln2_eps": eps,
                "gate_up": cat([f"{p}.weight" for p in gate_up]), "gate_up_bias": cat([f"{p}.bias" for p in gate_up]),
                "down": cast(f"{at}mlp.down_proj.weight"), "down_bias": cast(f"{at}mlp.down_proj.bias"),
            })
        if pack and can_prepack(dtype, embed.device):
            assert isinstance(fused.head, Tensor)
            fused.head = prepack(fused.head)  # a tied head packs a copy: the embedding stays for lookups
            for layer_weights in fused.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    layer_weights[name] = prepack(layer_weights[name])
        return fused
