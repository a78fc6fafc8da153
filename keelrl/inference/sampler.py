"""The one sampler: each row's next token by inverting its CDF at the row's own uniform.

Given float32 logits [R, V] (as HF's scores), `choose` holds end tokens back for rows under
min_new_tokens, applies temperature and top-p, and draws row r's token by inverting the CDF at
its uniform `u[r]` (the argmax at temperature 0, without sorting); it returns the tokens and
their log-probs under the distribution actually sampled from, the behaviour policy mu of the
importance ratio. Both decoders sample through it: the keel decoder on each step's rows, the HF
path as a logits processor (`InverseCdfProcessor`) that makes `generate` run greedily over its
choices. A row's tokens thus depend only on its own context, the weights and its uniforms, never
on the batch it shares or on the global RNG (which a learner thread may be using at the same time).

Randomness comes in three forms (`row_uniforms` turns each into uniforms): uniforms [B, >= N]
(the agent loop draws them from each episode's own generator), one seed per row (for engines
that take seeds, not uniforms: `draw_seed`), or the call's `SamplingParams.seed`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from keelrl.inference.params import SamplingParams


def draw_uniforms(generator: torch.Generator, count: int) -> Tensor:
    """`count` uniforms in (0, 1] from `generator` (a zero would select a zero-probability token)."""
    return 1.0 - torch.rand(count, generator=generator, dtype=torch.float64)


def draw_seed(generator: torch.Generator) -> int:
    """A row's seed from `generator`, for a decoder that takes seeds instead of uniforms."""
    return int(torch.randint(2**62, (), generator=generator))


def row_uniforms(rows: int, params: SamplingParams, uniforms: Tensor | None = None,
                 seeds: Sequence[int] | None = None) -> Tensor:
    """[rows, >= max_new_tokens] uniforms: `uniforms` as given (checked), else row b's drawn from a
    generator seeded with `seeds[b]`, else all rows' from one generator seeded with `params.seed`
    (a fresh seed when None)."""
    n = params.max_new_tokens
    if uniforms is None and seeds is not None:
        if len(seeds) != rows:
            raise ValueError(f"{len(seeds)} seeds for {rows} rows")
        uniforms = torch.stack([draw_uniforms(torch.Generator().manual_seed(int(seed)), n) for seed in seeds]) \
            if rows else torch.empty((0, n), dtype=torch.float64)
    elif uniforms is None:
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()))
        uniforms = draw_uniforms(torch.Generator().manual_seed(seed), rows * n).view(rows, n)
    if uniforms.shape[0] != rows or uniforms.shape[1] < n:
        raise ValueError(f"uniforms has shape {tuple(uniforms.shape)}; need [{rows}, >= {n}]")
    return uniforms


def choose(logits: Tensor, u: Tensor, params: SamplingParams, early: Tensor | None = None,
           end_ids: Sequence[int] = ()) -> tuple[Tensor, Tensor]:
    """(tokens [R], their behaviour log-probs [R]) from float32 `logits` [R, V] and uniforms `u` [R].

    `early` [R] (bool): rows still under min_new_tokens, whose `end_ids` get probability 0."""
    if early is not None and end_ids and bool(early.any()):
        ends = list(end_ids)
        logits = logits.clone()
        held = logits[:, ends]
        logits[:, ends] = torch.where(early[:, None], torch.full_like(held, float("-inf")), held)
    if params.temperature > 0:
        logits = logits / params.temperature
        if params.top_p < 1.0:
            sorted_logits, order = logits.sort(-1, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs > params.top_p  # keeps the smallest prefix reaching top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        logp = torch.log_softmax(logits, -1)
        cdf = logp.exp().cumsum(-1)
        chosen = torch.searchsorted(cdf, u.to(cdf.device)[:, None] * cdf[:, -1:]).clamp(max=logits.shape[-1] - 1)
        chosen = chosen.squeeze(-1)
        return chosen, logp.gather(-1, chosen[:, None]).squeeze(-1)
    # greedy: the argmax, no sort, no cumulative sum; its log-prob is max - logsumexp = -log(sum(exp(x - max)))
    top, chosen = logits.max(-1)
    return chosen, -torch.log(torch.exp(logits - top[:, None]).sum(-1))


class InverseCdfProcessor:
    """`choose` as a logits processor for HF `generate`, over rows that all start together.

    Given raw scores [B, V] at generation position t, it draws row b's token from `uniforms[b, t]`,
    records its log-probability, and returns scores that make the chosen token the argmax, so
    `generate` runs greedily over these choices."""

    def __init__(self, params: SamplingParams, uniforms: Tensor, end_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.uniforms = uniforms  # [B, max_new_tokens], in (0, 1]
        self.end_ids = tuple(end_ids)
        self.position = 0
        self.logprobs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        early = None
        if self.position < self.params.min_new_tokens:
            early = torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device)
        chosen, logprobs = choose(scores.float(), self.uniforms[:, self.position], self.params, early, self.end_ids)
        self.position += 1
        self.logprobs.append(logprobs)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter(-1, chosen.unsqueeze(-1), 0.0)
