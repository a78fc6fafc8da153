"""The policy: any local Hugging Face causal LM, plus an optional value head.

`load_policy(path_or_tiny, device)` loads `AutoModelForCausalLM` and `AutoTokenizer` from a
local directory ("tiny" builds the built-in default into a cache directory first). Device
"auto" picks CUDA when present (bf16 weights where the GPU supports it), else CPU (fp32).

`token_logprobs` computes log pi(token_t | tokens_<t) and, optionally, the entropy of every
next-token distribution, in chunks over time: the full [B, T, V] float32 log-softmax never
exists at once. Only the [B, chunk, V] slice does, so long sequences and large vocabularies
fit. Values are computed in float32 whatever the weights' dtype.

`ValueHead` is the critic on the policy body: a linear layer on the last hidden state. With
`stop_gradient=True` the value loss does not update the body (the policy loss still does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

DEFAULT_TINY_DIR = Path.home() / ".cache" / "keelrl" / "tiny-default"


def resolve_device(name: str = "auto") -> torch.device:
    """auto -> cuda if available else cpu; otherwise the named device (checked to exist)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available here")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, else float32."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def ensure_model_dir(path: str) -> Path:
    """'tiny' -> the built-in model's directory (built on first use); else the given path."""
    if path == "tiny":
        from keelrl.policy.tiny import save_tiny_default

        if not (DEFAULT_TINY_DIR / "config.json").exists():
            save_tiny_default(DEFAULT_TINY_DIR)
        return DEFAULT_TINY_DIR
    directory = Path(path)
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"model path {path!r} has no config.json; give a local Hugging Face model "
                                f"directory or 'tiny'")
    return directory


def load_policy(path: str, device: str | torch.device = "auto", dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a local directory or 'tiny', on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    directory = ensure_model_dir(path)
    device = resolve_device(device) if isinstance(device, str) else device
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype or default_dtype(device))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)  # type: ignore[arg-type]  # transformers types .to oddly
    return model, tokenizer


def token_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor, *, chunk_size: int = 256,
                   with_entropy: bool = False, with_hidden: bool = False) -> dict[str, Tensor]:
    """input_ids, attention_mask [B, T] -> {"logp": [B, T], "entropy": [B, T], "hidden": [B, T, H]}.

    logp[:, t] = log pi(input_ids[:, t] | input_ids[:, :t]); position 0 (nothing before it)
    gets 0. entropy[:, t] is the entropy of the distribution that predicted token t.
    """
    outputs = model.model(input_ids=input_ids, attention_mask=attention_mask)
    hidden = outputs.last_hidden_state  # [B, T, H]
    head = model.get_output_embeddings()
    batch, length = input_ids.shape
    logp = hidden.new_zeros(batch, length, dtype=torch.float32)
    entropy = hidden.new_zeros(batch, length, dtype=torch.float32) if with_entropy else None
    for start in range(0, length - 1, chunk_size):
        stop = min(start + chunk_size, length - 1)
        logits = head(hidden[:, start:stop]).float()  # [B, c, V]
        log_probs = torch.log_softmax(logits, dim=-1)
        targets = input_ids[:, start + 1:stop + 1]
        logp[:, start + 1:stop + 1] = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if entropy is not None:
            entropy[:, start + 1:stop + 1] = -(log_probs.exp() * log_probs).sum(-1)
    result = {"logp": logp}
    if entropy is not None:
        result["entropy"] = entropy
    if with_hidden:
        result["hidden"] = hidden
    return result


class ValueHead(nn.Module):
    """V(history before token t) from the body's hidden state at t-1: [B, T, H] -> [B, T]."""

    def __init__(self, hidden_size: int, stop_gradient: bool = True) -> None:
        super().__init__()
        self.stop_gradient = stop_gradient
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        if self.stop_gradient:
            hidden = hidden.detach()
        values = self.linear(hidden.float()).squeeze(-1)  # [B, T]
        # Align with token_logprobs: the value used for token t is computed after token t-1.
        return torch.cat([values[:, :1], values[:, :-1]], dim=1)
