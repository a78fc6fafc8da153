"""keelrl's CPU kernels (keelrl.inference.kernels): decode attention against a float64 reference and
blind to every key past a row's length, the fused elementwise steps against torch's own ops, their
errors, and the keel decoder sampling with them what it samples with torch's ops."""

from __future__ import annotations

import copy

import pytest
import torch

from keelrl.inference import KeelDecoder, SamplingParams, draw_uniforms
from keelrl.inference import kernels
from keelrl.inference.model import rms_norm, rotate_half


def reference(q, keys, values, slots, lengths, scale) -> torch.Tensor:
    """float64 attention of each query n over keys[slots[n], :, :lengths[n]], one row at a time."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for n, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist())):
        k, v = keys[slot, :, :length].double(), values[slot, :, :length].double()  # [H, L, D]
        scores = q[n].double() @ k.transpose(-1, -2) * scale  # [H, G, L]
        out[n] = torch.softmax(scores, dim=-1) @ v
    return out


def _case(dtype, dim, groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots_n, heads, capacity = 9, 3, 70
    keys = torch.randn(slots_n, heads, capacity, dim, generator=g).to(dtype)
    values = torch.randn(slots_n, heads, capacity, dim, generator=g).to(dtype)
    slots = torch.tensor([4, 0, 8, 2, 7, 5])
    lengths = torch.tensor([1, 70, 33, 2, 69, 17])
    q = (3 * torch.randn(len(slots), heads, groups, dim, generator=g)).to(dtype)  # peaked and flat rows both
    return q, keys, values, slots, lengths


@pytest.mark.parametrize("dtype,dim,groups", [(torch.float32, 64, 3), (torch.float32, 128, 1), (torch.float32, 8, 2),
                                              (torch.bfloat16, 64, 3), (torch.bfloat16, 40, 4)])
def test_the_kernel_equals_a_float64_reference(dtype, dim, groups):
    """float32: to float32 rounding; bfloat16: the float64 result rounded to bfloat16 (to 1 ulp)."""
    q, keys, values, slots, lengths = _case(dtype, dim, groups, seed=dim + groups)
    got = kernels.decode_attention(q, keys, values, slots, lengths, dim ** -0.5)
    want = reference(q, keys, values, slots, lengths, dim ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-6)
    assert not torch.equal(got[0], got[1])  # the rows read their own slots


def test_keys_past_a_rows_length_and_other_slots_are_never_read():
    """NaN in every position past each row's length and in the slots no query reads: the output is
    unchanged (one NaN read would spread through the softmax)."""
    q, keys, values, slots, lengths = _case(torch.float32, 64, 3)
    clean = kernels.decode_attention(q, keys, values, slots, lengths, 0.125)
    poisoned_k, poisoned_v = keys.clone(), values.clone()
    unread = torch.ones(keys.shape[:3], dtype=torch.bool)
    for slot, length in zip(slots.tolist(), lengths.tolist()):
        unread[slot, :, :length] = False
    poisoned_k[unread] = float("nan")
    poisoned_v[unread] = float("nan")
    assert torch.equal(kernels.decode_attention(q, poisoned_k, poisoned_v, slots, lengths, 0.125), clean)


def test_the_cache_is_read_in_place_through_its_strides():
    """A slot range of a bigger buffer and a slice of its positions (the decoder's views) give what
    contiguous copies give."""
    q, keys, values, slots, lengths = _case(torch.bfloat16, 64, 3)
    wide_k = torch.randn(12, 3, 100, 64).to(torch.bfloat16)
    wide_v = torch.randn(12, 3, 100, 64).to(torch.bfloat16)
    wide_k[:9, :, :70], wide_v[:9, :, :70] = keys, values
    view_k, view_v = wide_k[:9, :, :70], wide_v[:9, :, :70]
    assert not view_k.is_contiguous()
    assert torch.equal(kernels.decode_attention(q, view_k, view_v, slots, lengths, 0.125),
                       kernels.decode_attention(q, keys, values, slots, lengths, 0.125))


def test_bad_slots_lengths_and_dtypes_are_errors_naming_them():
    q, keys, values, slots, lengths = _case(torch.float32, 64, 3)
    with pytest.raises(RuntimeError, match="reads slot 9 up to 1 keys, outside the cache's 9 slots of 70"):
        kernels.decode_attention(q, keys, values, torch.tensor([9, 0, 8, 2, 7, 5]), lengths, 0.125)
    with pytest.raises(RuntimeError, match="reads slot 0 up to 71 keys"):
        kernels.decode_attention(q, keys, values, slots, torch.tensor([1, 71, 33, 2, 69, 17]), 0.125)
    with pytest.raises(RuntimeError, match="Double is not float32 or bfloat16"):
        kernels.decode_attention(q.double(), keys.double(), values.double(), slots, lengths, 0.125)
    with pytest.raises(RuntimeError, match="share one dtype"):
        kernels.decode_attention(q, keys.bfloat16(), values, slots, lengths, 0.125)


def test_the_decoder_samples_with_the_kernels_what_it_samples_with_torch_ops(policy):
    """float32 decoders over the same model, one with keelrl's kernels, one with torch's ops: rows of different
    lengths, a prefilling row beside decoding ones, a row joining the running stream; the same
    tokens, log-probs to float32 rounding."""
    model, tokenizer = policy
    model32 = copy.deepcopy(model).float()
    g = torch.Generator().manual_seed(5)
    first = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 40, 3, 17)]
    later = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (60, 2)]
    cfg = SamplingParams(temperature=1.0, max_new_tokens=12, stop=())
    uniforms = draw_uniforms(torch.Generator().manual_seed(6), 6 * 12).view(6, 12)
    runs = {}
    for kind in ("keel", "torch"):
        decoder = KeelDecoder(model32, tokenizer, max_batch=4, prefill_tokens=8, kernels=kind)
        assert decoder.forward.kernels == kind
        tickets = decoder.submit(first, cfg, uniforms[:4])
        done: dict = {}
        for _ in range(4):
            done.update(decoder.step())
        tickets += decoder.submit(later, cfg, uniforms[4:])
        while decoder.in_flight:
            done.update(decoder.step())
        runs[kind] = [done[t] for t in tickets]
    for a, b in zip(runs["keel"], runs["torch"], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


def test_auto_picks_the_kernels_on_a_cpu_and_torch_ops_where_they_cannot_serve(policy):
    model, tokenizer = policy
    assert KeelDecoder(copy.deepcopy(model).float(), tokenizer).forward.kernels == "keel"
    exact = KeelDecoder(model, tokenizer)  # float64: the contract's exact tier runs torch's ops
    assert exact.forward.kernels == "torch" and "float64" in exact.forward.kernels_note
    with pytest.raises(ValueError, match="kernels='keel' cannot serve this decoder: dtype torch.float64"):
        KeelDecoder(model, tokenizer, kernels="keel")
    with pytest.raises(ValueError, match="kernels='triton' is not one of auto, keel, torch"):
        KeelDecoder(model, tokenizer, kernels="triton")


# ---------------------------------------------------------------------- the fused elementwise steps
ULP = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7}
"""Relative tolerance: a result may differ from torch's by the RMS sum's order, exp's last bit, or
(float32) a multiply and add the compiler fused; bfloat16 rounds them away but at ties."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_equals_the_residual_add_and_rms_norm(dtype, with_delta):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=g).to(dtype)
    delta = torch.randn(7, 96, generator=g).to(dtype) if with_delta else None
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    want_x = x + delta if with_delta else x.clone()
    want = rms_norm(want_x, weight, 1e-5)
    got_x = x.clone()
    got = kernels.add_rms_norm(got_x, delta, weight, 1e-5)
    assert torch.equal(got_x, want_x)  # the residual add, in place, rounded as torch rounds
    torch.testing.assert_close(got, want, rtol=ULP[dtype], atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_like_torch_and_writes_keys_and_values_where_told(dtype):
    g = torch.Generator().manual_seed(2)
    n, heads, kv_heads, d = 5, 6, 2, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    angles = torch.rand(n, d // 2, generator=g) * 40
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    keys = torch.zeros(4, kv_heads, 9, d, dtype=dtype)
    values = torch.zeros(4, kv_heads, 9, d, dtype=dtype)
    slots, positions = torch.tensor([3, 0, 0, 2, 1]), torch.tensor([8, 0, 1, 4, 2])
    q = kernels.rope_store(qkv, cos, sin, keys, values, slots, positions, heads, kv_heads)
    qk = qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d)
    rotated = qk * cos[:, None] + rotate_half(qk) * sin[:, None]  # the torch path's ops, in dtype
    want_k, want_v = torch.zeros_like(keys), torch.zeros_like(values)
    want_k[slots, :, positions] = rotated[:, heads:]
    want_v[slots, :, positions] = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
    assert torch.equal(values, want_v)
    if dtype == torch.bfloat16:  # each product and the sum rounded to bfloat16, as torch's ops round
        assert torch.equal(q, rotated[:, :heads]) and torch.equal(keys, want_k)
    else:
        torch.testing.assert_close(q, rotated[:, :heads], rtol=ULP[dtype], atol=1e-6)
        torch.testing.assert_close(keys, want_k, rtol=ULP[dtype], atol=1e-6)
    with pytest.raises(RuntimeError, match="token 0 writes slot 3 position 9, outside the cache's 4 slots of 9"):
        kernels.rope_store(qkv, cos, sin, keys, values, slots, torch.tensor([9, 0, 1, 4, 2]), heads, kv_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_torchs_gated_activation(dtype):
    gate_up = (4 * torch.randn(6, 2 * 80, generator=torch.Generator().manual_seed(3))).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up,
                               rtol=ULP[dtype], atol=1e-6)


def test_a_failed_build_falls_back_to_torch_ops_and_says_why(policy, monkeypatch):
    model, tokenizer = policy
    monkeypatch.setattr(kernels, "_built", {"error": "CalledProcessError: no C++ compiler"})
    decoder = KeelDecoder(copy.deepcopy(model).float(), tokenizer)
    assert decoder.forward.kernels == "torch"
    assert decoder.forward.kernels_note == "they could not be built (CalledProcessError: no C++ compiler)"
    with pytest.raises(ValueError, match="kernels='keel' cannot serve this decoder: they could not be built"):
        KeelDecoder(copy.deepcopy(model).float(), tokenizer, kernels="keel")


def test_each_torch_install_and_cpu_builds_its_own_extension(monkeypatch):
    """A venv's build never overwrites another's (their torch headers differ), nor one CPU's another's
    (-march=native)."""
    here = kernels.build_name()
    assert here == kernels.build_name() and here.startswith("keel_kernels_")
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    elsewhere = kernels.build_name()
    monkeypatch.setattr(kernels, "cpu_identity", lambda: {"cpu": "another CPU", "flags": ["avx2"]})
    assert len({here, elsewhere, kernels.build_name()}) == 3
