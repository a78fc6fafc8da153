"""Distillation divergences against float64 references written out token by token.

The references loop over the vocabulary in plain Python floats (math.exp/math.log), so they
share no code with keelrl.algos.distill.
"""

from __future__ import annotations

import math

import pytest
import torch

from keelrl.algos.distill import (forward_kl, generalized_jsd, reverse_kl, sampled_reverse_kl, top_k_gap,
                                  top_token_disagreement)

V = 11


def logits(seed: int, shape=(3, 4, V), scale: float = 2.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def softmax_list(row: list[float], temperature: float = 1.0) -> list[float]:
    top = max(x / temperature for x in row)
    exps = [math.exp(x / temperature - top) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def kl_list(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def per_position(fn, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    out = torch.empty(student.shape[:-1], dtype=torch.float64)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in student.shape[:-1]]):
        key = tuple(int(i) for i in index)
        out[key] = fn(student[key].tolist(), teacher[key].tolist())
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_and_reverse_kl_match_the_written_out_sums(temperature):
    student, teacher = logits(0), logits(1)
    want_forward = per_position(lambda s, t: kl_list(softmax_list(t, temperature), softmax_list(s, temperature)),
                                student, teacher)
    want_reverse = per_position(lambda s, t: kl_list(softmax_list(s, temperature), softmax_list(t, temperature)),
                                student, teacher)
    torch.testing.assert_close(forward_kl(student, teacher, temperature=temperature), want_forward, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reverse_kl(student, teacher, temperature=temperature), want_reverse, rtol=1e-12, atol=1e-12)
    assert forward_kl(teacher, teacher).abs().max() < 1e-12
    assert not torch.allclose(want_forward, want_reverse)  # the two directions really differ here


def test_top_k_forward_kl_buckets_the_rest_and_its_gap_is_exact():
    student, teacher = logits(2), logits(3)
    full = forward_kl(student, teacher)
    for k in (1, 3, 6, V - 1):
        def coarse(s, t, k=k):
            p, q = softmax_list(t), softmax_list(s)
            top = sorted(range(V), key=lambda i: -p[i])[:k]
            p_rest, q_rest = 1 - sum(p[i] for i in top), 1 - sum(q[i] for i in top)
            return kl_list([p[i] for i in top] + [p_rest], [q[i] for i in top] + [q_rest])

        got = forward_kl(student, teacher, top_k=k)
        torch.testing.assert_close(got, per_position(coarse, student, teacher), rtol=1e-10, atol=1e-12)
        assert (got <= full + 1e-12).all()  # coarsening never increases a KL
        # The chain rule: full = coarse + (teacher's remaining mass) x KL(renormalised remainders).
        torch.testing.assert_close(got + top_k_gap(student, teacher, top_k=k), full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(forward_kl(student, teacher, top_k=V), full)
    with pytest.raises(ValueError, match="top_k"):
        forward_kl(student, teacher, top_k=0)


def test_top_k_is_accurate_when_the_teacher_is_nearly_certain():
    student, teacher = logits(4), logits(5)
    teacher[..., 0] += 60.0  # remaining mass ~ e^-60: 1 - sum(top k) would cancel to 0 in a naive form
    got = forward_kl(student, teacher, top_k=1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got + top_k_gap(student, teacher, top_k=1), forward_kl(student, teacher),
                               rtol=1e-9, atol=1e-12)


def test_generalized_jsd_matches_its_definition_and_its_endpoints():
    student, teacher = logits(6), logits(7)
    for beta in (0.1, 0.5, 0.9):
        def jsd(s, t, beta=beta):
            p_s, p_t = softmax_list(s), softmax_list(t)
            m = [beta * a + (1 - beta) * b for a, b in zip(p_t, p_s)]
            return beta * kl_list(p_t, m) + (1 - beta) * kl_list(p_s, m)

        torch.testing.assert_close(generalized_jsd(student, teacher, beta=beta), per_position(jsd, student, teacher),
                                   rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(generalized_jsd(student, teacher, beta=0.0), forward_kl(student, teacher))
    torch.testing.assert_close(generalized_jsd(student, teacher, beta=1.0), reverse_kl(student, teacher))
    small = 1e-6  # the interior approaches the endpoints, scaled by beta or 1 - beta
    torch.testing.assert_close(generalized_jsd(student, teacher, beta=small) / small, forward_kl(student, teacher),
                               rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(generalized_jsd(student, teacher, beta=1 - small) / small, reverse_kl(student, teacher),
                               rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(student, teacher, beta=1.5)


def test_sampled_reverse_kl_is_unbiased_for_the_reverse_kl():
    student, teacher = logits(8, shape=(V,)), logits(9, shape=(V,))
    log_s, log_t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    draws = torch.multinomial(log_s.exp(), 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    estimate = sampled_reverse_kl(log_s[draws], log_t[draws])
    exact = reverse_kl(student, teacher)
    assert abs(estimate.mean() - exact) < 4 * estimate.std() / math.sqrt(draws.numel())
    # Exact expectation: sum over tokens of pi_S(a) (log pi_S(a) - log pi_T(a)).
    torch.testing.assert_close((log_s.exp() * sampled_reverse_kl(log_s, log_t)).sum(), exact)


def test_disagreement_and_shape_errors():
    student, teacher = logits(10), logits(11)
    want = (student.argmax(-1) != teacher.argmax(-1)).float()
    assert torch.equal(top_token_disagreement(student, teacher), want) and 0 < want.mean() < 1
    with pytest.raises(ValueError, match="one vocabulary"):
        forward_kl(student, teacher[..., :-1])
    with pytest.raises(ValueError, match="temperature"):
        reverse_kl(student, teacher, temperature=0.0)
