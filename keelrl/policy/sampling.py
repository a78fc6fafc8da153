"""Batched sampling with a KV cache, returning behaviour log-probabilities.

`sample` continues many contexts of different lengths at once (left-padded, positions taken
from the attention mask so a padded row sees the same positions as an unpadded one), with
temperature, top-p and stop strings (a tool call ends at "</call>"). For every sampled token
it returns the log-probability under the distribution actually sampled from, i.e. after
temperature and top-p: that is the behaviour policy mu of the importance ratio.

Nothing is suppressed: the distribution sampled from is the model's whole distribution, the
one the learner's log-probs come from, so ratios on fresh data are 1 even for a model whose
padding token is its end-of-turn token (SmolLM2's is). Padding is told apart by the attention
mask on the way in, and on the way out each row is cut where it ended, found from its own
tokens (the first end-of-turn token, kept as the action's last token, or the end of the first
stop string), never by looking for the padding id.

Rows with the same context (a GRPO group's attempts at one task) share its prefill: each
distinct context runs once, and its keys and values are copied to its rows before decoding
starts. Measured on SmolLM2 (8 prompts x 4 attempts, 185 tokens, 25 new): 13.1 s -> 5.9 s, the
same tokens and log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    """How actions are sampled."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 160
    stop: tuple[str, ...] = ("</call>",)


@dataclass
class Sample:
    """One continuation: its tokens, their behaviour log-probs, and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    stopped: str
    """stop (a stop string or end token) | length (max_new_tokens)."""


class _InverseCdfSampler:
    """A logits processor that draws each row's token itself, from that row's own uniforms.

    Given raw scores [B, V] at generation position t, it applies temperature and top-p, draws
    row b's token by inverting the CDF at `uniforms[b, t]` (greedy when temperature is 0),
    records its log-probability under that distribution, and returns scores that make the
    chosen token the argmax, so `generate` runs greedily over our choices. A row's tokens thus
    depend only on its own context, weights and uniforms, never on which other rows share the
    batch or on the global RNG (which a learner thread may be using at the same time).
    """

    def __init__(self, cfg: SamplingConfig, uniforms: Tensor) -> None:
        self.cfg = cfg
        self.uniforms = uniforms  # [B, max_new_tokens], in (0, 1]
        self.position = 0
        self.logprobs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        logits = scores.float()
        if self.cfg.temperature > 0:
            logits = logits / self.cfg.temperature
            if self.cfg.top_p < 1.0:
                sorted_logits, order = logits.sort(-1, descending=True)
                probs = sorted_logits.softmax(-1)
                drop = probs.cumsum(-1) - probs > self.cfg.top_p  # keeps the smallest prefix reaching top_p
                logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
            logp = torch.log_softmax(logits, -1)
            cdf = logp.exp().cumsum(-1)
            u = self.uniforms[:, self.position].to(cdf.device).unsqueeze(-1) * cdf[:, -1:]
            chosen = torch.searchsorted(cdf, u).clamp(max=logits.shape[-1] - 1).squeeze(-1)
        else:
            logp = torch.log_softmax(logits, -1)
            chosen = logits.argmax(-1)
        self.position += 1
        self.logprobs.append(logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1))
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter(-1, chosen.unsqueeze(-1), 0.0)


def draw_uniforms(generator: torch.Generator, count: int) -> Tensor:
    """`count` uniforms in (0, 1] from `generator` (a zero would select a zero-probability token)."""
    return 1.0 - torch.rand(count, generator=generator, dtype=torch.float64)


@torch.no_grad()
def sample(model: Any, tokenizer: Any, contexts: Sequence[Sequence[int]], cfg: SamplingConfig,
           generator_seed: int | None = None, uniforms: Tensor | None = None, share_prompts: bool = True) -> list[Sample]:
    """Continue each token-id context; returns one Sample per context, in order.

    `share_prompts`: prefill each distinct context once for all the rows that have it.

    Randomness: row b uses `uniforms[b]` ([B, >= max_new_tokens] in (0, 1]); without them, rows
    draw from one generator seeded with `generator_seed` (random when None). With per-row
    uniforms from per-episode generators, an episode's actions do not depend on its batch.
    """
    if not contexts:
        return []
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    if uniforms is None:
        generator = torch.Generator()
        generator.manual_seed(generator_seed if generator_seed is not None else int(torch.randint(2**62, ())))
        uniforms = draw_uniforms(generator, len(contexts) * cfg.max_new_tokens).view(len(contexts), -1)
    if uniforms.shape[0] != len(contexts) or uniforms.shape[1] < cfg.max_new_tokens:
        raise ValueError(f"uniforms has shape {tuple(uniforms.shape)}; need [{len(contexts)}, >= {cfg.max_new_tokens}]")
    width = max(len(ids) for ids in contexts)
    input_ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, ids in enumerate(contexts):
        input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
        attention[row, width - len(ids):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    end_ids = list(end_token_ids(tokenizer))
    sampler = _InverseCdfSampler(cfg, uniforms)
    prefilled = _shared_prefill(model, input_ids, attention, contexts) if share_prompts else {}
    out = model.generate(
        input_ids=input_ids, attention_mask=attention, do_sample=False, temperature=None, top_p=None, top_k=None,
        max_new_tokens=cfg.max_new_tokens, stop_strings=list(cfg.stop) or None, tokenizer=tokenizer,
        logits_processor=[sampler], pad_token_id=pad, eos_token_id=end_ids, **prefilled,
    )
    new_tokens = out[:, width:] if isinstance(out, Tensor) else out.sequences[:, width:]  # [B, N]
    logprobs = torch.stack(sampler.logprobs, dim=1)[:, :new_tokens.shape[1]]
    token_rows: list[list[int]] = new_tokens.cpu().tolist()
    logprob_rows: list[list[float]] = logprobs.cpu().tolist()
    samples = []
    for row in range(len(contexts)):
        tokens = token_rows[row]
        length, finished = _row_end(tokenizer, tokens, end_ids, cfg.stop)
        text = tokenizer.decode(tokens[:length], skip_special_tokens=False)
        samples.append(Sample(tokens[:length], logprob_rows[row][:length], text, "stop" if finished else "length"))
    return samples


def _shared_prefill(model: Any, input_ids: Tensor, attention: Tensor, contexts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """`generate`'s cache argument holding every row's context but its last token, each distinct
    context run once; {} when no two rows share a context (nothing to gain).

    The rows are left-padded, so rows with one context are identical, padding included; the
    prefill uses the positions `generate` gives them (from the attention mask), and `generate`
    then runs only the last context token of each row before decoding.
    """
    from keelrl.policy.prefix import cache_kwarg, returned_cache

    first: dict[tuple[int, ...], int] = {}
    owner = [first.setdefault(tuple(context), row) for row, context in enumerate(contexts)]
    if len(first) == len(contexts) or input_ids.shape[1] < 2:
        return {}
    distinct = torch.tensor(sorted(first.values()), device=input_ids.device)
    slot = {row: index for index, row in enumerate(sorted(first.values()))}
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model.model(input_ids=input_ids[distinct, :-1], attention_mask=attention[distinct, :-1],
                      position_ids=positions[distinct, :-1], use_cache=True)
    cache = returned_cache(out)
    cache.batch_select_indices(torch.tensor([slot[row] for row in owner], device=input_ids.device))
    return {cache_kwarg(model.model): cache}


def end_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a model's turn: eos and its chat template's end-of-turn token."""
    from keelrl.policy.chat import ChatFormat, ChatTemplateError

    try:
        return ChatFormat.of(tokenizer).end_token_ids
    except ChatTemplateError:
        return (int(tokenizer.eos_token_id),) if tokenizer.eos_token_id is not None else ()


def _row_end(tokenizer: Any, tokens: list[int], end_ids: Sequence[int], stop: Sequence[str]) -> tuple[int, bool]:
    """(length, finished) of one generated row, from its tokens alone (padding is never consulted).

    The row ends after its first end-of-turn token (kept: the model learns to end its turn) or
    after the token that completes its first stop string, whichever comes first.
    """
    ends = [i + 1 for i, token in enumerate(tokens) if token in end_ids][:1]
    if stop and any(s in tokenizer.decode(tokens[:ends[0] if ends else len(tokens)], skip_special_tokens=False)
                    for s in stop):
        low, high = 1, ends[0] if ends else len(tokens)  # the shortest prefix holding a stop string
        while low < high:
            middle = (low + high) // 2
            text = tokenizer.decode(tokens[:middle], skip_special_tokens=False)
            if any(s in text for s in stop):
                high = middle
            else:
                low = middle + 1
        return low, True
    if ends:
        return ends[0], True
    return len(tokens), False


def recompute_logprobs(model: Any, sequences: Sequence[Sequence[int]], pad_id: int) -> list[Tensor]:
    """log pi(token_t | prefix) for every position t >= 1 of each sequence (right-padded batch)."""
    from keelrl.policy.model import token_logprobs

    device = next(model.parameters()).device
    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros_like(input_ids)
    for row, ids in enumerate(sequences):
        input_ids[row, :len(ids)] = torch.tensor(list(ids), device=device)
        attention[row, :len(ids)] = 1
    logp = token_logprobs(model, input_ids, attention)["logp"]
    return [logp[row, :len(ids)] for row, ids in enumerate(sequences)]
