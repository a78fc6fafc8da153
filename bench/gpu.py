"""GPU profile: one full RL step of a 0.5B Qwen2-shaped model: learner MFU, sampler tokens/s, peak memory.

    python -m bench.gpu --out DIR            # CUDA: Qwen2-0.5B shape, bf16, 64 rows x (1024 + 1024) tokens
    python -m bench.gpu --smoke --out DIR    # tiny model on the CPU in float32, seconds (also what runs without CUDA)

What runs. A randomly initialised `Qwen2ForCausalLM` of Qwen2-0.5B's shape (24 layers, hidden 896,
14 query heads and 2 key/value heads of 64, MLP 4864, vocabulary 151,936, tied embeddings, rope
theta 1e6: 494M parameters, 358M of them outside the embedding), bf16 weights on the GPU, seed
fixed. Prompts are chat-shaped token ids from keelrl's byte tokenizer (`<|user|>`, random byte
tokens, `<|end|><|assistant|>`; every id is below the model's vocabulary): 8 distinct prompts of
1024 tokens, 8 rows each (GRPO groups). One RL step is:

1. Sampling: one `keelrl.inference.sample` call over the 64 rows (temperature 1, top-p 1,
   no stop strings, per-row uniforms from a seeded generator), exactly 1024 new tokens per row:
   `sample` has no `min_new_tokens`, so it is set on `model.generation_config` (as
   bench/bench_sampler.py does; HF then gives end tokens probability 0 until then). Tokens are
   counted from `sample`'s output and a call that made fewer than rows x new tokens fails the
   run. tokens/s = generated tokens / wall time of the call, prefill included (`sample` prefills
   each distinct prompt once). One short warm-up call (8 new tokens) runs first.
2. Learning: one update on the sampled sequences (prompt + its sampled tokens, 2048 tokens per
   row), the way `Learner.accumulate_gradients` runs one minibatch, here the whole batch:
   `plan_passes` within `--micro-batch-tokens` padded tokens, keyed by group id with positions =
   the sampled tokens, so each group's prompt runs once and its keys and values are copied to the
   group's rows; `micro_logprobs` with entropy; the `grpo` preset's `policy_objective` (old
   log-probs = the sampler's; advantages from uniform random rewards through keelrl's `grpo`
   estimator, normalised within each group); each micro-batch's loss scaled by
   `micro_batch_scale`; then `clip_grad_norm_` at 1 and AdamW (lr 2e-5, OptimConfig's defaults).
   One warm-up update first (kernel set-up, the optimizer's state), then `--learner-steps` timed
   updates on the same batch; `torch.cuda.synchronize()` before and after each update, never
   inside it. With `--gradient-checkpointing` (`enable_gradient_checkpointing`) every pass runs
   plainly, as in the trainer (a checkpointed layer would replay its cache update).

FLOPs are counted by formula (`pass_flops`) from the shapes of the passes the plan ran: matmuls
only (norms, activations, rotary, softmax, the loss and AdamW are left out: well under 1% of the
total here). With L layers, hidden h, n query heads of width d, key/value width k (128 here), MLP
width I, vocabulary V, and W = h*n*d (q) + 2*h*k (k, v) + n*d*h (o) + 3*h*I (MLP) matmul weights
per layer (14.9M here):

    forward  = tokens x 2*W*L  +  (query, key) pairs x 4*n*d*L  +  scored positions x 2*h*V
    backward = 2 x forward, less what the shared-prompt pass does not run backward: its last layer's
               output feeds only that layer's keys and values, so its tokens run backward through
               the k and v projections of that layer alone (4*h*k each instead of 4*W) and its
               attention in that layer not at all

The output head runs only where a log-prob is wanted (the sampled tokens). Model FLOPs, the MFU
numerator: a group's prompt once (that is what runs: its first 1023 tokens; the last starts each
row's own pass), each row's own 1025 tokens, causal pairs (each query with the keys at or before
it: 1023 x 1024 / 2 in a prompt, 1024 + j for a row's j-th query) and no recompute. The default
step: 239 TFLOP (linear layers 158, attention 27, head 54). Executed FLOPs, reported beside as
hardware utilisation: what the kernels are handed, i.e. padded tokens, the whole attention
rectangle of each pass (a kernel given a mask computes all of it; a causal flash kernel skips
about half), plus recompute: the head's forward once more (keelrl recomputes its logits in the
backward rather than keep them) and, with `--gradient-checkpointing`, each layer's forward but its
last matmul (torch stops recomputing once every saved tensor is back): 266 TFLOP for the default
step. tests/test_bench_gpu.py checks the executed count against
`torch.utils.flop_counter.FlopCounterMode` over `learner_update` on eager attention, exactly, by
part, and the model count by hand; this run also repeats the update once under the counter and
records whether its linear-layer and head matmuls agree (its attention figure differs by design:
on CUDA it scores a fused attention kernel's backward as 2.5x its forward, recomputing the scores,
where this formula counts 2x; the CPU's fused kernel it does not count at all).

MFU = model FLOPs / median timed update time / peak dense bf16 FLOP/s of the device, from
`PEAK_BF16` by device name or `--peak-tflops`. Peak memory is `torch.cuda.max_memory_allocated`,
reset before the timed sampler call and before the timed updates. The MFU target, 0.3, is this
benchmark's bar (the issue's), not a measured baseline.

What this does NOT measure: the no-grad passes a keelrl step may run before its update (the
reference model's: the reference log-probs here are the sampler's, so the preset's KL term is
computed but no reference model runs; and a proximal pass where the trainer needs one), rewards,
environments and tool calls, several minibatches or epochs, real text (random token ids; a random
model's distribution is near uniform, and the rows' lengths are forced), the sampler's FLOPs (no
MFU for it), or spread over repeats (one timed sampler call; the updates repeat on one batch).
Without CUDA, or with --smoke, the same code runs at a tiny size on the CPU in float32: the
section then says so, gives no MFU, and measures nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from bench.common import Clock, Ratio, Section, arguments, machine, write_section
from keelrl.algos import compute_advantages, outcome_to_token_rewards, policy_objective
from keelrl.algos.config import AlgoConfig
from keelrl.config import OptimConfig, PerfConfig
from keelrl.policy.model import row_lengths
from keelrl.policy.prefix import MicroBatch, can_share, micro_logprobs, plan_passes
from keelrl.inference import Sample, SamplingParams, draw_uniforms, sample
from keelrl.policy.tiny import build_tiny_tokenizer
from keelrl.train.learner import aggregation_weights, enable_gradient_checkpointing, micro_batch_scale

MFU_TARGET = 0.3
"""The bar learner MFU is judged by (the issue's), not a measured baseline."""

PEAK_BF16: tuple[tuple[str, float | None], ...] = (
    ("H200 NVL", None),
    ("H100 NVL", None),
    ("H100 PCIe", 756e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
)
"""(part of the device name, dense bf16 FLOP/s): the first entry found in the name wins. NVIDIA's
datasheets: H100 SXM and H200 SXM 989 TFLOP/s (1,979 is with 2:4 sparsity), H100 PCIe 756, A100
(SXM and PCIe) 312. The NVL parts run other clocks: None, pass --peak-tflops."""


# --------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class ModelShape:
    """A Qwen2 causal LM's shape: what the FLOP formula needs and what the model is built from."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Width of one layer's keys (and of its values): kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def layer_weights(self) -> int:
        """W: matmul weights of one layer, q + k + v + o + MLP (biases are additions, not counted)."""
        query = self.heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        return self.hidden * query + 2 * self.hidden * self.kv_width + query * self.hidden + mlp

    def config(self, *, pad_token_id: int, eos_token_id: int) -> Any:
        """The `Qwen2Config` of this shape, with Qwen2-0.5B's other settings (tied embeddings, rope theta 1e6)."""
        from transformers import Qwen2Config

        rope: dict[str, Any] = {"rope_theta": 1e6}  # transformers >= 5 moves it into rope_parameters itself
        return Qwen2Config(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=32768, rms_norm_eps=1e-6,
                           tie_word_embeddings=True, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                           bos_token_id=eos_token_id, **rope)


QWEN2_0_5B = ModelShape(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab=151936)
TINY = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=1000)


@dataclass(frozen=True)
class StepSize:
    """One RL step's batch: rows (in groups sharing a prompt), prompt and new tokens, the learner's budget."""

    rows: int
    group_size: int
    prompt_tokens: int
    new_tokens: int
    micro_batch_tokens: int


FULL = StepSize(rows=64, group_size=8, prompt_tokens=1024, new_tokens=1024, micro_batch_tokens=32768)
"""32768 padded tokens: three groups (3 x 1023 prompt + 24 x 1025 continuation tokens) per micro-batch."""
SMOKE = StepSize(rows=4, group_size=2, prompt_tokens=32, new_tokens=32, micro_batch_tokens=128)
"""128 tokens: one group (31 + 2 x 33) per micro-batch, so gradients accumulate over two."""


# --------------------------------------------------------------------------- FLOPs
@dataclass(frozen=True)
class PassLayout:
    """One learner micro-batch as it ran: its units as (cut, row lengths), and its scored positions.

    A shared pass runs each unit's first `cut` tokens once, then each row's tokens from the cut to
    its length against those keys and values; a plain pass is units of one row with cut 0.
    """

    units: tuple[tuple[int, tuple[int, ...]], ...]
    scored: int

    @staticmethod
    def of(micro: MicroBatch, lengths: Sequence[int], scored: int, *, shared: bool) -> "PassLayout":
        """The layout of `micro` (rows index `lengths`); `shared`: it ran by shared prefix."""
        if shared:
            assert micro.units is not None
            units = tuple((unit.cut, tuple(lengths[micro.rows[i]] for i in unit.rows)) for unit in micro.units)
        else:
            units = tuple((0, (lengths[row],)) for row in micro.rows)
        return PassLayout(units, scored)


def _triangle(n: int) -> int:
    """Causal (query, key) pairs of n tokens attending to themselves and what precedes them: n(n+1)/2."""
    return n * (n + 1) // 2


def pass_counts(layout: PassLayout, *, executed: bool) -> dict[str, int]:
    """Tokens and (query, key) pairs of one pass, and those of its shared-prompt part.

    executed=False (model): real tokens, causal pairs. executed=True: the padded tensors the
    passes are handed, [U, P] for the prompts (P the longest cut) and [B, C] for the rows (C the
    widest row part) against P + C keys, whole rectangles.
    """
    cuts = [cut for cut, _ in layout.units]
    rows = [(cut, length) for cut, lengths in layout.units for length in lengths]
    longest_cut = max(cuts)
    widest = max(length - cut for cut, length in rows)
    if executed:
        prefix_tokens = len(cuts) * longest_cut
        prefix_pairs = len(cuts) * longest_cut ** 2
        row_tokens = len(rows) * widest
        row_pairs = len(rows) * widest * (longest_cut + widest)
    else:
        prefix_tokens = sum(cuts)
        prefix_pairs = sum(_triangle(cut) for cut in cuts)
        row_tokens = sum(length - cut for cut, length in rows)
        row_pairs = sum(_triangle(length) - _triangle(cut) for cut, length in rows)
    return {"tokens": prefix_tokens + row_tokens, "pairs": prefix_pairs + row_pairs,
            "prefix_tokens": prefix_tokens, "prefix_pairs": prefix_pairs, "scored": layout.scored}


def pass_flops(shape: ModelShape, layout: PassLayout, *, executed: bool,
               checkpointed: bool = False) -> dict[str, dict[str, int]]:
    """FLOPs of one pass, forward / backward / recompute, each split into linear / attention / head.

    The formula of the module docstring. executed=False: model FLOPs (real tokens, causal pairs);
    recompute is then still reported but belongs to no MFU. executed=True: padded tensors, whole
    attention rectangles. Recompute: the head's forward once more (its chunks are checkpointed)
    and, when `checkpointed`, the body's forward.
    """
    c = pass_counts(layout, executed=executed)
    if checkpointed and c["prefix_tokens"]:
        raise ValueError("a shared-prefix pass never runs under gradient checkpointing (see can_share)")
    linear_token = 2 * shape.layer_weights * shape.layers  # forward, per token, all layers
    pair = 4 * shape.heads * shape.head_dim * shape.layers  # forward, per (query, key) pair, all layers
    head_position = 2 * shape.hidden * shape.vocab
    # Backward skipped for a prompt token's last layer: all but the k and v projections, and its attention.
    skipped_linear = 4 * (shape.layer_weights - 2 * shape.hidden * shape.kv_width)
    skipped_pair = 2 * 4 * shape.heads * shape.head_dim
    forward = {"linear": c["tokens"] * linear_token, "attention": c["pairs"] * pair,
               "head": c["scored"] * head_position}
    backward = {"linear": 2 * forward["linear"] - c["prefix_tokens"] * skipped_linear,
                "attention": 2 * forward["attention"] - c["prefix_pairs"] * skipped_pair,
                "head": 2 * forward["head"]}
    # A checkpointed layer is rerun only until every tensor its backward saved is back (torch's
    # early stop): its last matmul, the MLP's down projection, is not rerun.
    down_projection = c["tokens"] * 2 * shape.hidden * shape.intermediate * shape.layers
    recompute = {"linear": forward["linear"] - down_projection if checkpointed else 0,
                 "attention": forward["attention"] if checkpointed else 0, "head": forward["head"]}
    return {"forward": forward, "backward": backward, "recompute": recompute}


def step_flops(shape: ModelShape, layouts: Sequence[PassLayout], *, checkpointed: bool) -> dict[str, Any]:
    """One update's FLOPs: model (forward + backward, the MFU numerator) and executed (+ recompute), by part."""
    report: dict[str, Any] = {}
    for kind, executed in (("model", False), ("executed", True)):
        parts = {phase: {"linear": 0, "attention": 0, "head": 0} for phase in ("forward", "backward", "recompute")}
        for layout in layouts:
            for phase, split in pass_flops(shape, layout, executed=executed, checkpointed=checkpointed).items():
                for part, value in split.items():
                    parts[phase][part] += value
        phases = ("forward", "backward") if kind == "model" else ("forward", "backward", "recompute")
        total = sum(parts[phase][part] for phase in phases for part in parts[phase])
        report[kind] = {**parts, "total": total}
    return report


# --------------------------------------------------------------------------- building the step
def build_model(shape: ModelShape, tokenizer: Any, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """A randomly initialised Qwen2ForCausalLM of `shape`, in `dtype` on `device`, from `seed`."""
    from transformers import Qwen2ForCausalLM

    end_of_turn = tokenizer.convert_tokens_to_ids("<|end|>")
    config = shape.config(pad_token_id=tokenizer.pad_token_id, eos_token_id=end_of_turn)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model: Any = Qwen2ForCausalLM(config)
    return model.to(dtype)


def build_contexts(tokenizer: Any, size: StepSize, generator: torch.Generator) -> list[list[int]]:
    """rows prompts of exactly size.prompt_tokens ids, the rows of a group identical:
    <|user|>, random byte tokens, <|end|><|assistant|>."""
    user, end, assistant = tokenizer.convert_tokens_to_ids(["<|user|>", "<|end|>", "<|assistant|>"])
    contexts: list[list[int]] = []
    for _ in range(size.rows // size.group_size):
        body = torch.randint(0, 256, (size.prompt_tokens - 3,), generator=generator).tolist()
        prompt = [user, *body, end, assistant]
        contexts.extend(list(prompt) for _ in range(size.group_size))
    return contexts


def sample_exactly(model: Any, tokenizer: Any, contexts: Sequence[Sequence[int]], new_tokens: int,
                   generator: torch.Generator) -> list[Sample]:
    """One `sample` call of exactly `new_tokens` per row (temperature 1, no stop strings)."""
    model.generation_config.min_new_tokens = new_tokens  # `sample` takes no min_new_tokens; generate reads it here
    uniforms = draw_uniforms(generator, len(contexts) * new_tokens).view(len(contexts), new_tokens)  # [B, N]
    cfg = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, stop=())
    samples = sample(model, tokenizer, contexts, cfg, uniforms=uniforms)
    made = sum(len(s.token_ids) for s in samples)
    if made != len(contexts) * new_tokens:
        raise RuntimeError(f"sample generated {made} tokens, not {len(contexts)} rows x {new_tokens}")
    return samples


@dataclass
class LearnerBatch:
    """One step's sequences: input_ids, attention_mask, action_mask, behaviour_logprobs, advantages [B, T];
    group_ids [B] (on the CPU: the plan reads them there)."""

    input_ids: Tensor
    attention_mask: Tensor
    action_mask: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    group_ids: Tensor


def vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_sampling(model: Any, tokenizer: Any, contexts: Sequence[Sequence[int]], new_tokens: int, dtype: torch.dtype,
                  args: argparse.Namespace) -> dict[str, Any]:
    """The same rows through `rollout.decoder=vllm` (keelrl.inference.vllm_decoder), where vLLM is
    installed: exactly `new_tokens` a row, one seed a row; its start-up (the model written to a
    folder, the engine built, compiled unless --smoke) timed apart from the call."""
    from keelrl.inference import DecoderOptions, build_decoder

    tick = time.perf_counter()
    decoder = build_decoder(model, tokenizer, DecoderOptions(decoder="vllm", dtype=dtype, max_batch=len(contexts),
                                                             kv_budget_mb=16384, eager=args.tiny))
    start_s = time.perf_counter() - tick
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, stop=())
    decoder.generate(contexts[:2], dataclasses.replace(params, max_new_tokens=8, min_new_tokens=8), seeds=[0, 1])
    synchronize(next(model.parameters()).device)
    clock = Clock()
    samples = decoder.generate(contexts, params, seeds=list(range(len(contexts))))
    timing = clock.read()
    tokens = sum(len(s.token_ids) for s in samples)
    if tokens != len(contexts) * new_tokens:
        raise RuntimeError(f"vllm generated {tokens} tokens, not {len(contexts)} rows x {new_tokens}")
    decoder.close()
    log(f"vllm sampler: {tokens} tokens in {timing['wall_s']:.2f} s = {tokens / timing['wall_s']:.1f} tokens/s "
        f"(start-up {start_s:.1f} s)")
    return {"seconds": timing["wall_s"], "tokens": tokens, "tokens_per_s": tokens / timing["wall_s"],
            "start_s": start_s, "clock": timing}


def learner_batch(contexts: Sequence[Sequence[int]], samples: Sequence[Sample], group_size: int, algo: AlgoConfig,
                  generator: torch.Generator, device: torch.device) -> LearnerBatch:
    """Prompt + sampled tokens per row, scored where sampled; advantages from uniform random rewards by
    `algo`'s estimator (grpo: normalised within each group). All rows have one length: no padding."""
    sequences = [list(context) + s.token_ids for context, s in zip(contexts, samples)]
    width = max(len(ids) for ids in sequences)
    if any(len(ids) != width for ids in sequences):
        raise ValueError("every row must have the same length (the FLOP count assumes no padding here)")
    input_ids = torch.tensor(sequences, dtype=torch.long)  # [B, T]
    action_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    behaviour = torch.zeros(input_ids.shape, dtype=torch.float32)
    for row, (context, s) in enumerate(zip(contexts, samples)):
        action_mask[row, len(context):] = True
        behaviour[row, len(context):] = torch.tensor(s.logprobs, dtype=torch.float32)
    group_ids = torch.arange(len(sequences)) // group_size  # [B]
    rewards = torch.rand(len(sequences), generator=generator)  # [B]
    advantages = compute_advantages(token_rewards=outcome_to_token_rewards(rewards, action_mask), mask=action_mask,
                                    group_ids=group_ids, cfg=algo).advantages  # [B, T]
    return LearnerBatch(input_ids.to(device), torch.ones_like(input_ids).to(device), action_mask.to(device),
                        behaviour.to(device), advantages.to(device), group_ids)


def learner_update(model: Any, optimizer: torch.optim.Optimizer, batch: LearnerBatch, algo: AlgoConfig,
                   micro_batch_tokens: int, *, share_prefix: bool,
                   max_grad_norm: float = 1.0) -> tuple[list[PassLayout], dict[str, float]]:
    """One AdamW update over the whole batch in micro-batches, as `Learner.accumulate_gradients`
    runs a minibatch (no value head, distillation or observation loss) -> (the passes run, metrics)."""
    mask = batch.action_mask  # [B, T]
    minibatch_weights = aggregation_weights(mask, algo)  # [B, T]
    scored = mask.cpu()
    lengths = row_lengths(batch.attention_mask).cpu().tolist()
    keys = batch.group_ids.cpu() if share_prefix else None
    layouts: list[PassLayout] = []
    losses: list[Tensor] = []
    optimizer.zero_grad(set_to_none=True)
    for micro in plan_passes(batch.input_ids, batch.attention_mask, micro_batch_tokens, keys=keys, positions=mask):
        rows, width = torch.tensor(micro.rows, device=mask.device), micro.width
        micro_mask = mask[rows, :width]  # [b, t]
        scale = micro_batch_scale(minibatch_weights[rows, :width], micro_mask, algo)
        out = micro_logprobs(model, batch.input_ids[rows, :width], batch.attention_mask[rows, :width], micro,
                             with_entropy=True, positions=micro_mask, temperature=1.0)
        old_logp = batch.behaviour_logprobs[rows, :width]
        loss, _ = policy_objective(logp=out["logp"], old_logp=old_logp, advantages=batch.advantages[rows, :width],
                                   mask=micro_mask, cfg=algo, ref_logp=old_logp, entropy=out["entropy"])
        total = loss * scale
        if not torch.isfinite(total):
            raise RuntimeError(f"the loss of micro-batch {len(layouts)} is not finite: {float(total)}")
        total.backward()
        losses.append(total.detach())
        shared = micro.units is not None and can_share(model, micro.units)
        layouts.append(PassLayout.of(micro, lengths, int(scored[list(micro.rows), 1:width].sum()), shared=shared))
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if not torch.isfinite(grad_norm):
        raise RuntimeError(f"the gradient norm is not finite: {float(grad_norm)}")
    optimizer.step()
    return layouts, {"loss": float(torch.stack(losses).sum()), "grad_norm": float(grad_norm)}


# --------------------------------------------------------------------------- the device
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: max_memory_allocated since the last reset. CPU: the process's peak resident set, ever."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def table_peak(device_name: str) -> float | None:
    """Dense bf16 FLOP/s of a device from PEAK_BF16, None when it is not in the table."""
    for part, peak in PEAK_BF16:
        if part in device_name:
            return peak
    return None


def count_with_torch(run: Any) -> dict[str, int]:
    """FLOPs torch's FlopCounterMode sees while `run()` runs, by op (e.g. 'aten.mm').

    Its registry has no formula for the in-place `aten.addmm_`, with which a weight gradient is
    accumulated in its buffer (keelrl's head backward does so, and autograd for a tied weight):
    uncounted, the head would count 3x its forward instead of 4x. It is given addmm's.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_flop}) as counter:
        run()
    return {str(op): int(value) for op, value in counter.get_flop_counts().get("Global", {}).items()}


def _addmm_flop(self_shape: Sequence[int], a_shape: Sequence[int], b_shape: Sequence[int], *args: Any,
                out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of addmm(self, a [m, k], b [k, n]) given the shapes: 2 m k n (the addition not counted)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


MATMUL_OPS = ("aten.mm", "aten.addmm", "aten.addmm_")
"""The ops of linear layers and the output head; attention is bmm (eager, math) or a fused sdpa op."""


def check_with_torch(update: Any, flops: dict[str, Any]) -> dict[str, Any]:
    """Run `update()` under FlopCounterMode and set its counts beside the formula's executed FLOPs.

    A counter that fails is reported in the section (the timed figures stand without it), never
    taken for agreement.
    """
    try:
        counted = count_with_torch(update)
    except Exception as error:  # noqa: BLE001 - reported in the section, see markdown()
        return {"error": f"{type(error).__name__}: {error}"}
    phases = ("forward", "backward", "recompute")
    formula_matmul = sum(flops["executed"][phase]["linear"] + flops["executed"][phase]["head"] for phase in phases)
    counted_matmul = sum(counted.get(op, 0) for op in MATMUL_OPS)
    return {"counted_by_op": counted, "counted_matmul": counted_matmul, "formula_matmul": formula_matmul,
            "matmul_agrees": counted_matmul == formula_matmul,
            "counted_attention": sum(value for op, value in counted.items() if op not in MATMUL_OPS),
            "formula_attention": sum(flops["executed"][phase]["attention"] for phase in phases)}


# --------------------------------------------------------------------------- the benchmark
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = arguments(__doc__.split("\n\n")[0], out="gpu")
    parser.add_argument("--rows", type=int, help=f"sequences in the step (default {FULL.rows}; smoke {SMOKE.rows})")
    parser.add_argument("--group-size", type=int,
                        help=f"rows sharing a prompt (default {FULL.group_size}; smoke {SMOKE.group_size})")
    parser.add_argument("--prompt-tokens", type=int,
                        help=f"tokens per prompt (default {FULL.prompt_tokens}; smoke {SMOKE.prompt_tokens})")
    parser.add_argument("--new-tokens", type=int,
                        help=f"sampled tokens per row, exactly (default {FULL.new_tokens}; smoke {SMOKE.new_tokens})")
    parser.add_argument("--micro-batch-tokens", type=int,
                        help=f"learner budget of padded tokens per pass (default {FULL.micro_batch_tokens}; "
                             f"smoke {SMOKE.micro_batch_tokens})")
    parser.add_argument("--learner-steps", type=int, default=3, help="timed updates, after one warm-up update")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute layer activations in the backward (every pass then runs plainly)")
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's dense bf16 peak in TFLOP/s (default: from PEAK_BF16 by device name)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts, uniforms and rewards")
    args = parser.parse_args(argv)
    for flag in ("rows", "group_size", "new_tokens", "micro_batch_tokens", "learner_steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.prompt_tokens is not None and args.prompt_tokens < 4:
        parser.error(f"--prompt-tokens must be >= 4 (chat headers and at least one token), got {args.prompt_tokens}")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        parser.error(f"--peak-tflops must be a finite number > 0, got {args.peak_tflops}")
    tiny = args.smoke or not torch.cuda.is_available()
    base = SMOKE if tiny else FULL
    args.size = StepSize(**{field: getattr(args, field) if getattr(args, field) is not None else value
                            for field, value in asdict(base).items()})
    if args.size.rows % args.size.group_size:
        parser.error(f"--rows ({args.size.rows}) must be a multiple of --group-size ({args.size.group_size})")
    args.tiny = tiny
    return args


def log(message: str) -> None:
    print(f"[bench.gpu] {message}", flush=True)


def run(args: argparse.Namespace) -> Section:
    """Build the model, sample, learn, count; -> the section (see the module docstring)."""
    started = time.perf_counter()
    size: StepSize = args.size
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = TINY if args.tiny else QWEN2_0_5B
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    generator = torch.Generator().manual_seed(args.seed)
    tokenizer = build_tiny_tokenizer()
    log(f"building a random Qwen2 {shape} in {dtype} on {device_name}")
    model = build_model(shape, tokenizer, device, dtype, args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    contexts = build_contexts(tokenizer, size, generator)

    # 1. sampling
    model.eval()
    sample_exactly(model, tokenizer, contexts, min(8, size.new_tokens), torch.Generator().manual_seed(args.seed + 1))
    log(f"sampling {size.rows} rows x {size.new_tokens} new tokens after {size.prompt_tokens}-token prompts")
    synchronize(device)
    reset_peak(device)
    clock = Clock()
    samples = sample_exactly(model, tokenizer, contexts, size.new_tokens, generator)
    synchronize(device)
    sampler_clock = clock.read()
    sampler_tokens = sum(len(s.token_ids) for s in samples)
    sampler = {"seconds": sampler_clock["wall_s"], "tokens": sampler_tokens,
               "tokens_per_s": sampler_tokens / sampler_clock["wall_s"], "peak_memory_gib": peak_memory_gib(device),
               "clock": sampler_clock}
    log(f"sampler: {sampler_tokens} tokens in {sampler['seconds']:.2f} s = {sampler['tokens_per_s']:.1f} tokens/s")
    vllm = vllm_sampling(model, tokenizer, contexts, size.new_tokens, dtype, args) if vllm_importable() else None

    # 2. learning
    algo = AlgoConfig(preset="grpo")
    optim, perf = OptimConfig(), PerfConfig()
    batch = learner_batch(contexts, samples, size.group_size, algo, generator, device)
    share_prefix = perf.share_prefix and not args.gradient_checkpointing  # as `prefix_keys`
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
    model.train()

    def update() -> tuple[list[PassLayout], dict[str, float]]:
        return learner_update(model, optimizer, batch, algo, size.micro_batch_tokens, share_prefix=share_prefix,
                              max_grad_norm=optim.max_grad_norm)

    log("learner: warm-up update")
    update()
    synchronize(device)
    reset_peak(device)
    steps: list[dict[str, Any]] = []
    layouts: list[PassLayout] = []
    for index in range(args.learner_steps):
        clock = Clock()
        layouts, metrics = update()
        synchronize(device)
        timing = clock.read()
        steps.append({**metrics, "clock": timing, "seconds": timing["wall_s"]})
        log(f"learner update {index + 1}/{args.learner_steps}: {steps[-1]['seconds']:.3f} s, "
            f"{len(layouts)} micro-batches, loss {metrics['loss']:.4f}")
    learner_peak = peak_memory_gib(device)
    update_s = statistics.median(step["seconds"] for step in steps)
    flops = step_flops(shape, layouts, checkpointed=args.gradient_checkpointing)

    log("one more update under torch's FlopCounterMode (not timed)")
    flop_check = check_with_torch(update, flops)

    peak = args.peak_tflops * 1e12 if args.peak_tflops is not None else table_peak(device_name)
    peak_source = "--peak-tflops" if args.peak_tflops is not None else ("PEAK_BF16" if peak else "none")
    measured = device.type == "cuda"
    mfu = flops["model"]["total"] / update_s / peak if measured and peak else None
    hfu = flops["executed"]["total"] / update_s / peak if measured and peak else None
    seconds = time.perf_counter() - started
    data = {
        "measured": measured, "cuda_available": torch.cuda.is_available(), "device": device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": asdict(shape), "parameters": parameters, "size": asdict(size), "seed": args.seed,
        "gradient_checkpointing": args.gradient_checkpointing, "share_prefix": share_prefix,
        "sampler": sampler, "vllm_sampler": vllm,
        "learner": {"update_s": update_s, "steps": steps, "micro_batches": len(layouts),
                    "passes": [asdict(layout) for layout in layouts], "peak_memory_gib": learner_peak,
                    "tokens_per_s": size.rows * (size.prompt_tokens + size.new_tokens) / update_s},
        "flops": flops, "flop_check": flop_check,
        "peak_flops": peak, "peak_source": peak_source, "mfu": mfu, "hfu": hfu, "mfu_target": MFU_TARGET,
        "total_s": seconds, "machine": machine(),
    }
    ratios = []
    if mfu is not None and peak is not None:
        ratios.append(Ratio("learner MFU", mfu, MFU_TARGET, True,
                            f"{flops['model']['total'] / 1e12:.1f} model TFLOP in {update_s:.3f} s (median of "
                            f"{len(steps)}) against {peak / 1e12:.0f} TFLOP/s dense bf16 ({device_name}); "
                            f"target {MFU_TARGET} is this benchmark's bar"))
    title = "GPU profile: one RL step of a 0.5B Qwen2-shaped model" if measured else "GPU profile (CPU smoke run)"
    return Section(name="gpu", title=title, markdown=markdown(data), ratios=ratios, smoke=not measured,
                   seconds=seconds, data=data)


def _tflop(value: float) -> str:
    return f"{value / 1e12:.3g} TFLOP" if value >= 1e10 else f"{value / 1e6:.4g} MFLOP"


def _update_flops(flops: dict[str, Any], kind: str, part: str) -> int:
    """Forward + backward FLOPs of one part ('linear', 'attention', 'head') of an update."""
    return int(flops[kind]["forward"][part] + flops[kind]["backward"][part])


def markdown(data: dict[str, Any]) -> str:
    """The section's body: what ran, the figures, the FLOP check, what is not measured."""
    size, shape, sampler, learner, flops = data["size"], data["shape"], data["sampler"], data["learner"], data["flops"]
    lines: list[str] = []
    if not data["measured"]:
        why = "--smoke was given" if data["cuda_available"] else "no GPU was present (CUDA is not available)"
        lines += [f"**Not a measurement**: {why}, so this is a CPU smoke run at a tiny size in float32. Its "
                  "figures check that the step runs and that its FLOPs are counted; they measure nothing, and "
                  "there is no MFU.", ""]
    model = (f"random Qwen2 ({shape['layers']} layers, hidden {shape['hidden']}, "
             f"{shape['heads']}/{shape['kv_heads']} heads, MLP {shape['intermediate']}, vocabulary {shape['vocab']}; "
             f"{data['parameters'] / 1e6:.1f}M parameters), {data['dtype']} on {data['device']}")
    passes = "gradient checkpointing, plain passes" if data["gradient_checkpointing"] else "shared prompts run once"
    times = ", ".join(f"{step['seconds']:.3f}" for step in learner["steps"])
    parts = ", ".join(f"{part} {_tflop(_update_flops(flops, 'model', part))}"
                      for part in ("linear", "attention", "head"))
    lines += [f"One RL step: {model}. {size['rows']} rows in groups of {size['group_size']} sharing a "
              f"{size['prompt_tokens']}-token prompt, {size['new_tokens']} sampled tokens each; learner budget "
              f"{size['micro_batch_tokens']} padded tokens per pass, {passes}.", "",
              "| | |", "|---|---|",
              f"| sampler (`sample`, prefill included, n=1) | {sampler['tokens']} tokens in "
              f"{sampler['seconds']:.2f} s = **{sampler['tokens_per_s']:.0f} tokens/s** |",
              *([f"| sampler through vLLM (`rollout.decoder=vllm`, start-up {data['vllm_sampler']['start_s']:.0f} s "
                 f"apart) | {data['vllm_sampler']['tokens']} tokens in {data['vllm_sampler']['seconds']:.2f} s = "
                 f"**{data['vllm_sampler']['tokens_per_s']:.0f} tokens/s** |"] if data.get("vllm_sampler") else
                ["| sampler through vLLM | not run: vLLM is not installed in this venv |"]),
              f"| learner update (forward + backward + AdamW) | median {learner['update_s']:.3f} s of "
              f"{len(learner['steps'])} ({times} s), {learner['micro_batches']} micro-batches, "
              f"{learner['tokens_per_s']:.0f} sequence tokens/s |",
              f"| model FLOPs of an update | {_tflop(flops['model']['total'])} ({parts}) |",
              f"| executed FLOPs (padding, whole attention rectangles, recompute) | "
              f"{_tflop(flops['executed']['total'])} |"]
    if data["mfu"] is not None:
        lines += [f"| **learner MFU** (model FLOPs / time / {data['peak_flops'] / 1e12:.0f} TFLOP/s, "
                  f"{data['peak_source']}) | **{data['mfu']:.3f}** (target {data['mfu_target']}: this "
                  f"benchmark's bar) |",
                  f"| hardware FLOP utilisation (executed FLOPs) | {data['hfu']:.3f} |"]
    elif data["measured"]:
        lines += [f"| learner MFU | not computed: no dense bf16 peak known for {data['device']}; "
                  f"pass --peak-tflops |"]
    memory = ("torch.cuda.max_memory_allocated" if data["measured"]
              else "peak resident set of the process, not a GPU figure")
    lines += [f"| peak memory ({memory}) | sampler {sampler['peak_memory_gib']:.2f} GiB, "
              f"learner {learner['peak_memory_gib']:.2f} GiB |", ""]
    check = data["flop_check"]
    if "error" in check:
        lines += [f"FLOP check: **failed to run**: torch's FlopCounterMode raised {check['error']}.", ""]
    else:
        agree = "agrees exactly" if check["matmul_agrees"] else "**differs**"
        lines += [f"FLOP check: torch's FlopCounterMode over one more update counted "
                  f"{_tflop(check['counted_matmul'])} in the linear layers and the head (mm, addmm); the formula "
                  f"says {_tflop(check['formula_matmul'])}: it {agree}. Attention: counter "
                  f"{_tflop(check['counted_attention'])}, formula {_tflop(check['formula_attention'])} (the counter "
                  f"scores fused CUDA attention's backward at 2.5x its forward, recomputing the scores, and does not "
                  f"see the CPU's fused kernel at all).", ""]
    lines += ["Not measured: no-grad passes before the update (the reference model's: the KL term uses the "
              "sampler's log-probs as the reference; a proximal pass where the trainer needs one), rewards and "
              "environments, several minibatches or epochs, real text, the sampler's FLOPs. The model is random, "
              "so sampled text is noise and lengths are forced."]
    if data["measured"] and data["total_s"] > 300:
        lines += ["", f"**Over budget**: the run took {data['total_s']:.0f} s, more than the 5 minutes it is meant to."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    section = run(args)
    path = write_section(args.out, section)
    log(f"wrote {path} in {section.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
