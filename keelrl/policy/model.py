"""The policy: any local Hugging Face causal LM, plus an optional value head.

`load_policy(path_or_tiny, device)` loads `AutoModelForCausalLM` and `AutoTokenizer` from a
local directory ("tiny" builds the built-in default into a cache directory first), after
checking that it holds a causal LM with a chat template (an encoder or a base tokenizer fails
with a message naming what is missing, instead of loading with a random head). Device
"auto" picks CUDA when present (bf16 weights where the GPU supports it), else CPU (fp32).

`token_logprobs` computes log pi(token_t | tokens_<t) and, optionally, the entropy of every
next-token distribution, in chunks over time: the full [B, T, V] float32 log-softmax never
exists at once. Only the [B, chunk, V] slice does, so long sequences and large vocabularies
fit. Values are computed in float32 whatever the weights' dtype.

`ValueHead` is the critic on the policy body: a linear layer on the last hidden state. With
`stop_gradient=True` the value loss does not update the body (the policy loss still does).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

def resolve_device(name: str = "auto") -> torch.device:
    """auto -> cuda if available else cpu; otherwise the named device (checked to exist)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available here")
    return device


def pin_to_cores(cores: Sequence[int]) -> None:
    """Run every thread of this process on `cores` only, with as many torch threads.

    `os.sched_setaffinity(0, ...)` moves only the calling thread; threads that exist already
    (torch's pool, Ray's) are moved one by one through /proc/self/task. Threads started later
    inherit the mask.
    """
    import os

    mask = set(cores)
    if not mask:
        raise ValueError("pin_to_cores needs at least one core")
    os.sched_setaffinity(0, mask)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), mask)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass
    torch.set_num_threads(len(mask))


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, else float32."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


LEARNER_PRECISIONS = ("auto", "float32", "bfloat16")


@functools.lru_cache(maxsize=None)
def cpu_has_amx_bf16() -> bool:
    """True when this CPU multiplies bf16 matrices in hardware (Intel AMX-BF16). A flag, not a speed:
    the dtype choices of auto settings are measured instead (keelrl.inference.precision)."""
    try:
        return " amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def learner_autocast(device: torch.device, precision: str = "auto") -> contextlib.AbstractContextManager[Any]:
    """The autocast context of the learner's forward/backward passes.

    float32: none. bfloat16: bf16 autocast on `device` (weights and optimizer state stay in their
    own dtype, float32 on CPU). auto is a measurement on the model's shapes, resolved before it
    gets here (`keelrl.inference.precision.resolve_dtype("auto", "learner", model, device)`: the
    Trainer resolves it once); here it raises.
    """
    if precision not in LEARNER_PRECISIONS:
        raise ValueError(f"learner precision {precision!r}; valid: {', '.join(LEARNER_PRECISIONS)}")
    if precision == "auto":
        raise ValueError("learner precision 'auto' is measured on the model's shapes: resolve it first with "
                         "keelrl.inference.precision.resolve_dtype('auto', 'learner', model, device)")
    if precision == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def ensure_model_dir(path: str) -> Path:
    """A registered name ('tiny', 'smollm2'; fetched on first use), a .gguf file or a local directory -> a directory.

    See `keelrl.policy.download.resolve_model_path`.
    """
    from keelrl.policy.download import resolve_model_path

    return resolve_model_path(path)


class NotCausalLMError(ValueError):
    """The model path holds a model that is not a causal (next-token) language model."""


def base_name(path: str) -> str:
    """How a LoRA adapter of the model at model.path `path` names its base (adapter_config.json):
    a registered name as it is, anything else as its absolute local directory."""
    from keelrl.policy.download import MODELS

    return path if path in MODELS else str(ensure_model_dir(path).resolve())


def load_policy(path: str, device: str | torch.device = "auto", dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a local directory or 'tiny', on `device`.

    Checked: the directory must hold a causal LM whose checkpoint has every weight
    (`NotCausalLMError` otherwise; transformers would load a BERT encoder as a BertLMHeadModel
    with a random head), and its tokenizer must have a chat template
    (`keelrl.policy.chat.ChatTemplateError`), before the weights load.

    A folder holding a LoRA adapter (adapter_config.json: a LoRA run's checkpoint) loads as the
    base model it names with the adapter on it (`keelrl.policy.lora.load_adapter`); the tokenizer
    is the folder's own where it has one, else the base's.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from keelrl.policy.chat import ChatFormat
    from keelrl.policy.lora import adapter_base, is_adapter_dir, load_adapter

    directory = ensure_model_dir(path)
    adapter: Path | None = None
    if is_adapter_dir(directory):
        adapter = directory
        directory = ensure_model_dir(adapter_base(adapter))
        if is_adapter_dir(directory):
            raise NotCausalLMError(f"model path {path!r}: the adapter's base {str(directory)!r} is an adapter "
                                   f"itself; an adapter's base must be a model")
    device = resolve_device(device) if isinstance(device, str) else device
    hf_logging.disable_progress_bar()
    check_causal_lm(path, directory)
    has_tokenizer = adapter is not None and (adapter / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(adapter if has_tokenizer else directory)
    ChatFormat.of(tokenizer)  # every episode is laid out in the chat template: fail now, not mid-run
    loaded: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype or default_dtype(device),
                                                       output_loading_info=True)
    model, loading = loaded
    missing = sorted(loading["missing_keys"])
    if missing:  # transformers would initialise them at random and carry on
        raise NotCausalLMError(
            f"model path {path!r} ({directory}): the checkpoint has no weights for {len(missing)} parameters of "
            f"{type(model).__name__} ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); they would "
            f"start random: the directory does not hold a complete causal-LM checkpoint (an encoder, or an "
            f"incomplete download?). Point model.path at a causal LM")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    if adapter is not None:
        model = load_adapter(model, adapter)
    return model, tokenizer


def check_causal_lm(path: str, directory: Path) -> None:
    """Raise NotCausalLMError unless `directory`'s config.json describes a causal language model.

    The saved `architectures` decide (a class transformers lists as a causal LM: Qwen2ForCausalLM,
    GPT2LMHeadModel...); a config without them falls back to its model_type.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(directory)
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", "?")
    if architectures:
        if any(name in causal_classes for name in architectures):
            return
        found = f"a {' / '.join(architectures)} (model_type {model_type!r})"
    elif model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(config, "is_encoder_decoder", False):
        return
    else:
        found = f"a model of type {model_type!r}, which has no causal-LM class in transformers"
    raise NotCausalLMError(
        f"model path {path!r} ({directory}) holds {found}, not a causal language model: keelrl samples "
        f"actions token by token and needs a decoder with a next-token head (an architecture such as "
        f"Qwen2ForCausalLM, LlamaForCausalLM or GPT2LMHeadModel). Point model.path at a causal LM, "
        f"e.g. an instruct model such as SmolLM2-135M-Instruct")


HEAD_CHUNK_BYTES = 64 * 2**20
"""The float32 logits of one head call are kept under this size: 256 positions at SmolLM2's
49k vocabulary, 110 at Qwen2's 152k. `HeadLogprobs` holds a few tensors of that size at a time,
so this bounds the head's working memory whatever the vocabulary. With gradients, most of the
head's memory is then the [V, H] weight gradient, never a [T, V] tensor (peak memory against a
full log-softmax, `python -m bench.bench_kernel`: BENCHMARKS.md's kernel section)."""


def head_chunk(rows: int, vocab: int, chunk_size: int | None) -> int:
    """Positions per head call for `rows` rows: `chunk_size`, or (None) what fits HEAD_CHUNK_BYTES."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    return max(8, min(256, HEAD_CHUNK_BYTES // (4 * vocab * max(1, rows))))


def token_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor, *, chunk_size: int | None = None,
                   with_entropy: bool = False, with_hidden: bool = False,
                   positions: Tensor | None = None, temperature: float = 1.0) -> dict[str, Tensor]:
    """input_ids, attention_mask [B, T] -> {"logp": [B, T], "entropy": [B, T], "hidden": [B, T, H]}.

    logp[:, t] = log pi(input_ids[:, t] | input_ids[:, :t]); position 0 (nothing before it)
    gets 0. entropy[:, t] is the entropy of the distribution that predicted token t. Both are
    float32 (float64 for float64 weights) whatever the weights' dtype.

    The body runs without a KV cache (nothing here reuses one). When gradients are needed, each
    chunk's logits and log-softmax are recomputed in the backward pass (checkpointed), so
    autograd keeps the hidden states and the [B, T] results, not a float32 [B, chunk, V] copy
    of every chunk. This bounds the head's memory, not the body's: the body's activations grow
    with B x T, which is what the trainer's micro-batches bound.

    `positions` [B, T] (bool): compute logp and entropy only where it is True (0 elsewhere). The
    losses read only action tokens, often a small share of an agent's context; the vocabulary
    head (49k outputs for SmolLM2, kept in float32) is then run on those alone, which is most of
    the saving when prompts are long.

    `temperature`: the log-probs and entropy of the tempered distribution softmax(logits / T),
    the one a sampler at temperature T draws from. The RL losses use the rollouts' temperature,
    so that on fresh data the learner's pi and the behaviour mu are the same distribution and
    the importance ratio is 1 (a learner at another temperature than the sampler sees ratios
    far from 1 on fresh data: docs/history.md#what-it-took-to-get-there, run 1).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    outputs = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = outputs.last_hidden_state  # [B, T, H]
    logp, entropy = logprobs_from_hidden(model, hidden, input_ids, positions=positions, with_entropy=with_entropy,
                                          temperature=temperature, chunk_size=chunk_size)
    return _result(logp, entropy, hidden if with_hidden else None)


def logprobs_from_hidden(model: Any, hidden: Tensor, input_ids: Tensor, *, positions: Tensor | None,
                          with_entropy: bool, temperature: float, chunk_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """The head half of `token_logprobs`: hidden [B, T, H] of input_ids [B, T] -> (logp, entropy) [B, T].

    The scored positions (all of them, or where `positions` is True) are gathered into one flat
    [N, H] batch and run through `HeadLogprobs` (a linear head) in chunks of `chunk_size`
    positions (None: `head_chunk`'s, from the vocabulary). A head that is not a plain linear
    layer runs chunk by chunk under activation checkpointing instead.
    """
    head = model.get_output_embeddings()
    batch, length = input_ids.shape
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # float64 weights keep float64
    scored = torch.ones(batch, length - 1, dtype=torch.bool, device=input_ids.device) if positions is None \
        else positions[:, 1:].bool()
    rows, steps = scored.nonzero(as_tuple=True)  # token steps+1 is predicted at steps
    flat_hidden, targets = hidden[rows, steps], input_ids[rows, steps + 1]  # [N, H], [N]
    if isinstance(head, nn.Linear):
        vocab = head.weight.shape[0]
        flat_logp, flat_entropy = HeadLogprobs.apply(flat_hidden, head.weight, head.bias, targets, temperature,
                                                     with_entropy, head_chunk(1, vocab, chunk_size))
    else:
        flat_logp, flat_entropy = _checkpointed_head(head, flat_hidden, targets, with_entropy, temperature,
                                                     chunk_size or 256)
    logp = hidden.new_zeros(batch, length, dtype=dtype).index_put((rows, steps + 1), flat_logp.to(dtype))
    entropy = None
    if with_entropy:
        entropy = hidden.new_zeros(batch, length, dtype=dtype).index_put((rows, steps + 1), flat_entropy.to(dtype))
    return logp, entropy


def _head_dtype(weight: Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, torch.float32)


def _tempered_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """hidden [c, H] -> logits / temperature [c, V], float32 at least, the head in its weights' dtype
    (as `output_logits`: never bf16 logits under a learner's autocast)."""
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).to(_head_dtype(weight))
    return logits / temperature if temperature != 1.0 else logits


class HeadLogprobs(torch.autograd.Function):
    """hidden [N, H], a linear head (weight [V, H], bias [V] or None), targets [N] ->
    (logp [N], entropy [N]) of softmax(head(hidden) / temperature), in chunks of positions.

    Neither pass keeps logits: the forward keeps each position's log-sum-exp and entropy ([N]),
    the backward recomputes one chunk's logits at a time and writes the head's gradient into one
    [V, H] buffer (`addmm_`). With z = logits / temperature, log q = z - logsumexp(z), q = exp:
    d logp_target / dz = onehot(target) - q, and d entropy / dz = -q (log q + entropy).
    Working memory is a few [chunk, V] tensors plus that one gradient buffer; autograd through
    a full log-softmax holds several [N, V] tensors, and through checkpointed chunks it holds a
    second [V, H] buffer (each chunk's weight gradient, summed by the engine).
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                temperature: float, with_entropy: bool, chunk: int) -> tuple[Tensor, Tensor]:
        count, dtype = hidden.shape[0], _head_dtype(weight)
        logp = hidden.new_empty(count, dtype=dtype)
        log_norm = hidden.new_empty(count, dtype=dtype)
        entropy = hidden.new_zeros(count, dtype=dtype)
        for start in range(0, count, chunk):
            piece = slice(start, start + chunk)
            z = _tempered_logits(hidden[piece], weight, bias, temperature)  # [c, V]
            lse = torch.logsumexp(z, dim=-1)  # [c]
            log_norm[piece] = lse
            logp[piece] = z.gather(-1, targets[piece].unsqueeze(-1)).squeeze(-1) - lse
            if with_entropy:
                log_q = z.sub_(lse.unsqueeze(-1))  # [c, V], in place: z is not needed again
                entropy[piece] = -(log_q.exp() * log_q).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, log_norm, entropy)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None: its terms are skipped
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
                 ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, log_norm, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype = _head_dtype(weight)
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_bias else None
        use_entropy = ctx.with_entropy and grad_entropy is not None
        for start in range(0, hidden.shape[0], ctx.chunk):
            piece = slice(start, start + ctx.chunk)
            log_q = _tempered_logits(hidden[piece], weight, bias, ctx.temperature).sub_(log_norm[piece].unsqueeze(-1))
            q = log_q.exp()  # [c, V]
            grad_z = torch.zeros_like(q)  # [c, V]
            if grad_logp is not None:
                g = grad_logp[piece].to(dtype).unsqueeze(-1)  # [c, 1]
                grad_z.addcmul_(q, g, value=-1.0).scatter_add_(-1, targets[piece].unsqueeze(-1), g)
            if use_entropy and grad_entropy is not None:
                log_q.add_(entropy[piece].unsqueeze(-1))  # log q + entropy
                grad_z.addcmul_(q.mul_(log_q), grad_entropy[piece].to(dtype).unsqueeze(-1), value=-1.0)
            if ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)
            grad_z = grad_z.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[piece] = (grad_z @ weight).to(hidden.dtype)
            if grad_weight is not None:
                h = hidden[piece].to(weight.dtype)
                if grad_weight.dtype == weight.dtype:
                    grad_weight.addmm_(grad_z.t(), h)
                else:  # low-precision weights: accumulate in float32
                    grad_weight.add_((grad_z.t() @ h).to(grad_weight.dtype))
            if grad_bias is not None:
                grad_bias.add_(grad_z.sum(0).to(grad_bias.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _checkpointed_head(head: nn.Module, hidden: Tensor, targets: Tensor, with_entropy: bool, temperature: float,
                       chunk: int) -> tuple[Tensor, Tensor]:
    """hidden [N, H], targets [N] -> (logp, entropy) [N] through any head module, each chunk
    checkpointed (its logits recomputed in the backward pass)."""
    from torch.utils.checkpoint import checkpoint

    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk):
        piece, goal = hidden[start:start + chunk].unsqueeze(0), targets[start:start + chunk].unsqueeze(0)  # [1, c, H]
        if recompute:
            chunk_logp, chunk_entropy = checkpoint(_head_logprobs, head, piece, goal, with_entropy, temperature,
                                                   use_reentrant=False)
        else:
            chunk_logp, chunk_entropy = _head_logprobs(head, piece, goal, with_entropy, temperature)
        logps.append(chunk_logp[0])
        entropies.append(chunk_entropy[0] if chunk_entropy is not None else torch.zeros_like(chunk_logp[0]))
    empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
    return (torch.cat(logps) if logps else empty), (torch.cat(entropies) if entropies else empty)


def _result(logp: Tensor, entropy: Tensor | None, hidden: Tensor | None) -> dict[str, Tensor]:
    result = {"logp": logp}
    if entropy is not None:
        result["entropy"] = entropy
    if hidden is not None:
        result["hidden"] = hidden
    return result


def output_logits(head: nn.Module, hidden: Tensor, temperature: float = 1.0) -> Tensor:
    """The output head's logits of hidden [..., H] -> [..., V], float32 at least, over temperature.

    The head runs in the weights' own precision even under a learner's bf16 autocast: bf16
    logits (8 mantissa bits, values around +-20) would put ~0.05 of noise on every log-prob.
    """
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        weight_dtype = next(head.parameters()).dtype
        logits = head(hidden.to(weight_dtype))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits / temperature if temperature != 1.0 else logits


def _head_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor,
                   with_entropy: bool, temperature: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """hidden [B, c, H], targets [B, c] -> (log-prob of each target [B, c], entropy [B, c] or None),
    under softmax(logits / temperature)."""
    log_probs = torch.log_softmax(output_logits(head, hidden, temperature), dim=-1)  # [B, c, V]
    chunk_logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, c]
    chunk_entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None  # [B, c]
    return chunk_logp, chunk_entropy


def row_lengths(attention_mask: Tensor) -> Tensor:
    """attention_mask [B, T] -> [B]: one past each row's last attended position (at least 1).

    Cutting a row at its length drops only padding after it, so the kept positions'
    log-probs do not change (attention is causal).
    """
    positions = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)
    return torch.where(attention_mask.bool(), positions, 0).amax(dim=1).clamp(min=1)  # [B]


def split_rows(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices grouped so each group's rows x its longest row is at most `max_tokens`.

    Rows are sorted longest first (ties keep their order), so rows of similar length share a
    group and little padding is added; groups are filled greedily in that order. A row longer
    than `max_tokens` on its own forms a group of one: it still runs, over budget.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    groups: list[list[int]] = []
    for row in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


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
