"""The built-in tiny default: a byte-level tokenizer and a small Qwen2 model, built locally.

Nothing is downloaded. The tokenizer maps every byte to one token (256) plus 8 special
tokens, so any text round-trips exactly; the model is a Qwen2-architecture causal LM built
from a config with random weights. Both are saved with `save_pretrained`, so the rest of
keelrl loads them like any local Hugging Face model (`AutoModelForCausalLM`/`AutoTokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]

# Turns are <|role|>text<|end|>; generation prompts end with <|assistant|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Size of the built-in model (Qwen2 architecture)."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    max_positions: int = 4096
    seed: int = 0


def build_tiny_tokenizer():  # -> PreTrainedTokenizerFast
    """A byte-level tokenizer: 256 byte tokens + SPECIAL_TOKENS, with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>", bos_token="<|bos|>",
                                        eos_token="<|eos|>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[3:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(spec: TinyModelSpec, vocab_size: int, pad_token_id: int, eos_token_id: int):
    """A randomly initialised Qwen2 causal LM of the given size."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions, tie_word_embeddings=True,
        pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=eos_token_id,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(spec.seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model


def save_tiny_default(path: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Build the tiny tokenizer and model and save both to `path` (a new HF model directory)."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(spec or TinyModelSpec(), len(tokenizer), tokenizer.pad_token_id,
                             tokenizer.convert_tokens_to_ids("<|end|>"))
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return path
