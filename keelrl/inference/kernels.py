"""The keel decoder's CPU kernels: C++ of keelrl's own, built on first use.

- `decode_attention(q, keys, values, slots, lengths, scale)` attends one query token per
  sequence over the slot cache: query n's heads (grouped by the kv head they share,
  [N, KVH, G, D]) read `keys[slots[n], :, :lengths[n]]` and the same values, each key and value
  row once for the whole group and only up to that sequence's own length, in float32, rounded
  back to the cache's dtype. torch's `scaled_dot_product_attention` (what the decoder uses
  otherwise) reads every sequence up to the longest and streams the cache at about half the
  memory's speed on a CPU (BENCHMARKS.md, "keel decoder: decode-step levers").
- `add_rms_norm`, `rope_store`, `silu_mul`: a layer's elementwise steps, one op each where torch
  runs several (the residual add and RMSNorm; the rotary embedding of queries and keys and the
  write of keys and values into the cache; the gated activation). Each rounds to the tensor's
  dtype where torch's own ops would, so its results equal torch's up to the order of a sum and
  the last bit of an exp.

The C++ (csrc/kernels.cpp) is compiled by `torch.utils.cpp_extension.load` the first time a
process asks for it (a C++ compiler and ninja are needed; torch caches the build under its
extensions directory, so later processes load it in well under a second). It is built for the
CPU it runs on (-O3 -march=native -ffast-math: no NaN or infinity reaches these kernels), under
a name that carries that CPU's model and instruction-set flags, the torch install and the
source's hash. `kernel()` returns None, and `kernel_error()` says why, where it cannot be built;
the decoder then runs torch's ops.

What this does NOT do: CUDA (the decoder runs torch's ops there), float16 or float64 (torch's
ops), prefill attention (a prompt chunk's causal attention stays SDPA).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("csrc") / "kernels.cpp"
DTYPES = (torch.float32, torch.bfloat16)

_built: dict[str, Any] = {}

CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_fp16", "amx_int8")
"""The /proc/cpuinfo flags that change how fast float32 and bf16 matrices multiply."""


@lru_cache(maxsize=None)
def cpu_identity() -> dict[str, Any]:
    """{"cpu": the CPU's model name, "vendor": its vendor_id (GenuineIntel, AuthenticAMD; "" where
    unknown), "flags": which of CPU_FLAGS it has} (Linux: /proc/cpuinfo)."""
    name, vendor, flags = "", "", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = line.partition(":")
            if field.strip() == "model name" and not name:
                name = value.strip()
            elif field.strip() == "vendor_id" and not vendor:
                vendor = value.strip()
            elif field.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": name or platform.processor() or platform.machine(), "vendor": vendor,
            "flags": [f for f in CPU_FLAGS if f in flags]}


def build_name() -> str:
    """The extension's name: it changes with the source, the torch install (its version and where it
    lives: each venv builds against its own headers) and the CPU (its model name and the
    instruction-set flags CPU_FLAGS lists)."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__, str(Path(torch.__file__).resolve().parent),
                 repr(sorted(cpu_identity().items()))):
        digest.update(part if isinstance(part, bytes) else part.encode())
    return f"keel_kernels_{digest.hexdigest()[:16]}"


def kernel() -> Any | None:
    """The compiled kernel module (built once a process, cached on disk by torch), or None where it
    cannot be built (`kernel_error()` says why)."""
    if "module" in _built or "error" in _built:
        return _built.get("module")
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        name = build_name()
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
        if not any(root.rglob(f"{name}*.so")):
            print(f"keelrl: building its CPU kernels for this CPU ({name}, once; about 30 s on 2 cores)",
                  file=sys.stderr, flush=True)
        _built["module"] = load(name=name, sources=[str(SOURCE)], extra_ldflags=["-fopenmp"],
                                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                                verbose=bool(os.environ.get("KEELRL_VERBOSE_BUILD")))
    except Exception as exc:  # no compiler, no ninja, a failed build: the decoder runs torch's ops
        _built["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        return None
    return _built["module"]


def kernel_error() -> str | None:
    """Why `kernel()` returned None, once it has been asked."""
    return _built.get("error")


def supports(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernels cannot serve this decoder, or None when they can (their build aside)."""
    if device.type != "cpu":
        return f"device {device.type} (the kernels are for CPUs)"
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernels run float32 and bfloat16)"
    return None


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, slots: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """Attention of q [N, KVH, G, D] over keys/values [S, KVH, C, D]: query n over
    keys[slots[n], :, :lengths[n]]. Returns [N, KVH, G, D] in q's dtype. Needs `kernel()`."""
    return _module().decode_attention(q.contiguous(), keys, values, slots, lengths, scale)


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    """x += delta (in place, when given; x [N, H] contiguous), then LlamaRMSNorm(x) with `weight`."""
    return _module().add_rms_norm(x, delta, weight, eps)


def rope_store(qkv: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, slots: Tensor, positions: Tensor,
               heads: int, kv_heads: int) -> Tensor:
    """Rotary queries and keys of qkv [N, (heads + 2 kv_heads) D] (cos, sin [N, D]); the rotated keys and
    the values written into keys/values [S, kv_heads, C, D] at (slots[n], :, positions[n]). Returns the
    rotated queries [N, heads, D]."""
    return _module().rope_store(qkv, cos, sin, keys, values, slots, positions, heads, kv_heads)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of gate_up [N, 2 I]: [N, I]."""
    return _module().silu_mul(gate_up)


def _module() -> Any:
    module = kernel()
    if module is None:
        raise RuntimeError(f"keelrl's CPU kernels could not be built: {kernel_error()}")
    return module
