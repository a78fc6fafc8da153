"""Batched sampling with a KV cache, returning behaviour log-probabilities.

`sample` continues many contexts of different lengths at once (left-padded, positions taken
from the attention mask so a padded row sees the same positions as an unpadded one), with
temperature, top-p and stop strings (a tool call ends at "</call>"). For every sampled token
it returns the log-probability under the distribution actually sampled from, i.e. after
temperature and top-p: that is the behaviour policy mu of the importance ratio. The padding
token is never sampled, so it marks the end of each row unambiguously.
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


@torch.no_grad()
def sample(model: Any, tokenizer: Any, contexts: Sequence[Sequence[int]], cfg: SamplingConfig,
           generator_seed: int | None = None) -> list[Sample]:
    """Continue each token-id context; returns one Sample per context, in order."""
    if not contexts:
        return []
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    width = max(len(ids) for ids in contexts)
    input_ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, ids in enumerate(contexts):
        input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
        attention[row, width - len(ids):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    end_ids = [tokenizer.eos_token_id]
    end_token = tokenizer.convert_tokens_to_ids("<|end|>")
    if isinstance(end_token, int) and end_token != tokenizer.unk_token_id:
        end_ids.append(end_token)
    if generator_seed is not None:
        torch.manual_seed(generator_seed)
    do_sample = cfg.temperature > 0
    out = model.generate(
        input_ids=input_ids, attention_mask=attention, do_sample=do_sample,
        temperature=cfg.temperature if do_sample else None, top_p=cfg.top_p if do_sample else None,
        top_k=0 if do_sample else None,
        max_new_tokens=cfg.max_new_tokens, stop_strings=list(cfg.stop) or None, tokenizer=tokenizer,
        return_dict_in_generate=True, output_scores=True, pad_token_id=pad, eos_token_id=end_ids,
        suppress_tokens=[pad],
    )
    new_tokens = out.sequences[:, width:]  # [B, N]
    scores = torch.stack(out.scores, dim=1).float()  # [B, N, V]
    logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
    token_rows: list[list[int]] = new_tokens.cpu().tolist()
    logprob_rows: list[list[float]] = logprobs.cpu().tolist()
    samples = []
    for row in range(len(contexts)):
        tokens = token_rows[row]
        length = tokens.index(pad) if pad in tokens else len(tokens)
        text = tokenizer.decode(tokens[:length], skip_special_tokens=False)
        finished = length < len(tokens) or (length > 0 and (tokens[length - 1] in end_ids
                                                            or any(text.endswith(s) for s in cfg.stop)))
        samples.append(Sample(tokens[:length], logprob_rows[row][:length], text, "stop" if finished else "length"))
    return samples


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
