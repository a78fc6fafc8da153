"""keelrl's own decoder (`rollout.decoder=keel`): a slot KV cache, continuous batching, chunked
prefill, shared prefixes and kept histories, over the Llama family's forward pass.

`KeelDecoder.generate` (or `submit` and `step`) continues many token-id contexts and returns, per
context, the tokens and behaviour log-probs the HF path (`keelrl.inference.hf.sample`) would
(same uniforms, same temperature / top-p / min_new_tokens / end tokens / stop strings, the same
float32 logits), without `generate`. Its parts, one job a module: the weights it samples with
(`weights`: fused from the merged state dict, reloaded through `load_weights`), the forward pass
(`model`), slots and kept keys and values (`kv`), stored prefixes (`prefix`), rows and admission
(`scheduler`), the sampler (`sampler`) and stops (`stops`). This module runs the step loop.

- A stream. `submit` queues contexts at any time, also while others decode, and `step` runs one
  step (admit queued rows into free slots, one forward over every slot, sample) and returns the
  rows that finished; a finished row frees its slot at once and the next queued row takes it in
  the same step, so no row waits for the longest and nothing is padded. `generate` is
  submit-then-step-until-done. The agent loop's scheduler submits each episode when its tool
  call returns, so it joins the running batch at the next step.
- One stream samples with one `SamplingParams` (its seed aside) under one set of weights: new
  weights are loaded only when nothing is in flight (`in_flight`), and a change of the model's
  parameters under a running stream is an error, never a silent mix.
- With `SamplingParams.keep_kv` a finished row's keys and values (context and action but its
  last token) are kept under a `KeptKV` handle (`Sample.cache`); passed back as the episode's
  cache on its next turn, only the new tokens run. Kept histories and stored prefixes live
  within `kv_budget_mb` together with the slots; over it the least recently used is evicted (a
  later row then prefills in full). Kept keys and values are valid only for the weights that
  made them.

The equality with the HF path holds up to floating-point summation order (tests check tokens
and log-probs in float64). No speculative decoding, no CUDA graphs.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import torch
from torch import Tensor

from keelrl.inference.kv import KeptKV, SlotCache
from keelrl.inference.model import LlamaForward, UnsupportedModelError, unsupported_reason
from keelrl.inference.params import Sample, SamplingParams
from keelrl.inference.sampler import choose, row_uniforms
from keelrl.inference.scheduler import Row, Scheduler
from keelrl.inference.stops import StopMatcher, end_token_ids
from keelrl.inference.weights import FusedWeights, SharedWeights, body_prefix, merged_state

__all__ = ["KeelDecoder", "KeptKV", "UnsupportedModelError", "unsupported_reason"]


class KeelDecoder:
    """keelrl's decode engine over one model (see the module docstring).

    `dtype`: the decode dtype (None: the model's). `max_batch`: sequences decoded together.
    `prefill_tokens`: prompt tokens prefilled per step beside the decoding sequences.
    `kv_budget_mb`: memory for the slots' keys and values plus kept histories and stored prefixes.
    `prepack`: prepack the linear weights for oneDNN where that applies (bfloat16 where oneDNN
    runs it, float32 on AMD CPUs: `keelrl.inference.weights.can_prepack`); False keeps
    `torch.nn.functional.linear`.
    `kernels`: the forward pass's ops (`keelrl.inference.model.KERNELS`): auto runs keelrl's CPU
    kernels where they serve (`keelrl.inference.kernels`: float32 or bfloat16 on a CPU, built),
    else torch's ops.
    """

    takes_uniforms = True
    """Row b's t-th token inverts its CDF at uniforms[b, t] (the decoder contract's exact tier)."""
    shares_model = True
    """Samples with the torch model it was built over: `load_weights(model, version)` suffices."""

    _ids = itertools.count()

    def __init__(self, model: Any, tokenizer: Any, *, dtype: torch.dtype | None = None, max_batch: int = 64,
                 prefill_tokens: int = 512, kv_budget_mb: int = 4096, prepack: bool = True,
                 kernels: str = "auto") -> None:
        if max_batch < 1 or prefill_tokens < 1 or kv_budget_mb < 1:
            raise ValueError(f"max_batch={max_batch}, prefill_tokens={prefill_tokens} and kv_budget_mb={kv_budget_mb} "
                             f"must be positive")
        self.model, self.tokenizer = model, tokenizer
        self.dtype = dtype or next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.forward = LlamaForward(model, self.dtype, self.device, kernels)
        self.max_batch, self.prefill_tokens = max_batch, prefill_tokens
        self.prepack = prepack
        self.budget = kv_budget_mb * 2**20
        self.id = next(self._ids)
        self.shared = SharedWeights(model)
        self._weights: FusedWeights | None = None
        self.slots = SlotCache(self.forward.layers, self.forward.kv_heads, self.forward.head_dim, self.dtype,
                               self.device)
        self.token_bytes = self.slots.token_bytes
        """Bytes of keys and values per token over all layers."""
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "evicted": 0, "forward_s": 0.0,
                      "sample_s": 0.0, "busy_slots": 0.0, "decode_only_s": 0.0, "decode_only_tokens": 0,
                      "prefix_hits": 0, "joined_in_flight": 0}
        """Counters since construction; decode_only_*: the steps that ran no prompt tokens (forward
        and sampling), the decode throughput; prefix_hits: rows started from a stored prefix (a common
        prefix or a group's context); joined_in_flight: rows submitted while others were decoding."""
        self.scheduler = Scheduler(self.slots, decoder=self.id, max_batch=max_batch, prefill_tokens=prefill_tokens,
                                   budget=self.budget, stats=self.stats)
        self._tickets = itertools.count()
        self._stream_params: SamplingParams | None = None
        self._stream_weights: FusedWeights | None = None
        self.end_ids = tuple(end_token_ids(tokenizer))
        self.stops = StopMatcher(tokenizer)

    # ------------------------------------------------------------------ weights and memory
    @property
    def version(self) -> int:
        """The policy version of the weights last loaded (`load_weights`)."""
        return self.shared.version

    def load_weights(self, state: Any, version: int) -> None:
        """New weights, policy `version`: a merged state dict (loaded into the model), or the model
        (read as it is now). Only between streams; kept keys and values of the old weights are dropped."""
        if self.in_flight:
            raise RuntimeError(f"load_weights while {self.in_flight} rows are decoding: finish the stream first")
        self._weights = None  # free the old snapshot; the next stream fuses the new weights
        self.shared.load(state, version)
        self.scheduler.kept.drop_stale(self.shared.serial)

    def weights(self) -> FusedWeights:
        """The fused snapshot of the current weights (made anew when they changed)."""
        serial = self.shared.current()
        if self._weights is None or self._weights.serial != serial:
            if self.in_flight:
                raise RuntimeError(f"the model's weights changed while {self.in_flight} rows were decoding: "
                                   f"load new weights only between streams (KeelDecoder.in_flight == 0)")
            self._weights = None  # free the old snapshot before building the next
            self._weights = FusedWeights.from_state(merged_state(self.model), self.model.config, self.dtype, serial,
                                                    prefix=body_prefix(self.model), pack=self.prepack)
            self.scheduler.kept.drop_stale(serial)
        return self._weights

    def cache_usage(self) -> dict[str, float]:
        """Memory of the slots and kept histories, in MiB, and counters since construction."""
        kept, prefixes = self.scheduler.kept, self.scheduler.prefixes
        return {"slots": float(self.slots.slots), "capacity_tokens": float(self.slots.capacity),
                "slot_mb": self.slots.nbytes / 2**20,
                "kept": float(len(kept) - len(prefixes)), "prefixes": float(len(prefixes)),
                "kept_mb": kept.nbytes / 2**20,
                "budget_mb": self.budget / 2**20, **{k: float(v) for k, v in self.stats.items()}}

    @property
    def budget(self) -> int:
        """Bytes for keys and values: slots, kept histories and stored prefixes together."""
        return self._budget

    @budget.setter
    def budget(self, value: int) -> None:
        self._budget = value
        if hasattr(self, "scheduler"):
            self.scheduler.budget = value

    # ------------------------------------------------------------------ the stream
    @property
    def in_flight(self) -> int:
        """Rows submitted and not finished (queued or decoding)."""
        return self.scheduler.in_flight

    @torch.no_grad()
    def generate(self, contexts: Sequence[Sequence[int]], params: SamplingParams, uniforms: Tensor | None = None,
                 caches: Sequence[Any] | None = None, *, seeds: Sequence[int] | None = None,
                 share_prompts: bool = True) -> list[Sample]:
        """One Sample per context, in order (the contract: `keelrl.inference.registry`): `submit`
        them to an idle decoder and `step` until all are done."""
        if self.in_flight:
            raise RuntimeError(f"generate needs an idle decoder; {self.in_flight} rows of a stream are in flight")
        tickets = self.submit(contexts, params, uniforms, caches, seeds=seeds, share_prompts=share_prompts)
        done: dict[int, Sample] = {}
        while self.in_flight:
            done.update(self.step())
        return [done[ticket] for ticket in tickets]

    def submit(self, contexts: Sequence[Sequence[int]], params: SamplingParams, uniforms: Tensor | None = None,
               caches: Sequence[Any] | None = None, *, seeds: Sequence[int] | None = None,
               share_prompts: bool = True) -> list[int]:
        """Queue contexts for decoding beside the rows in flight; returns a ticket per context (`step`
        hands back each one's Sample). Every row of a stream samples with one `params` (its seed
        aside) and one set of weights: the weights are read when the decoder is idle, and may not
        change until it is idle again. With `share_prompts`, equal contexts are prefilled once (the
        first row's keys and values copied to the others), and a prefix that the rows share or that
        is stored from an earlier call (a common system prompt, a group's context) is prefilled once."""
        if not contexts:
            return []
        if any(len(c) == 0 for c in contexts):
            raise ValueError("every context needs at least one token")
        uniforms = row_uniforms(len(contexts), params, uniforms, seeds)
        if self.in_flight:
            self.stats["joined_in_flight"] += len(contexts)
        if not self.in_flight:
            self._stream_weights, self._stream_params = self.weights(), params.stream_key()
        elif params.stream_key() != self._stream_params:
            raise ValueError(f"a stream samples with one SamplingParams: {params} differs from the rows in flight's "
                             f"{self._stream_params}")
        elif self._stream_weights is None or self.shared.current() != self._stream_weights.serial:
            raise RuntimeError("the model's weights changed while rows were decoding: load new weights only "
                               "between streams (KeelDecoder.in_flight == 0)")
        assert self._stream_weights is not None
        rows = [Row(next(self._tickets), tuple(c), uniforms[i]) for i, c in enumerate(contexts)]
        self.scheduler.add(rows, caches, self._stream_weights.serial, share_prompts, params.max_new_tokens)
        return [row.index for row in rows]

    def cancel(self) -> None:
        """Drop every queued and decoding row (nothing is returned for them); the decoder is idle after."""
        self.scheduler.cancel()

    def step(self) -> list[tuple[int, Sample]]:
        """Admit queued rows into free slots, run one forward over every slot (the next token of each
        decoding row, a chunk of prefill) and sample; returns (ticket, Sample) of the rows that finished."""
        if not self.in_flight:
            return []
        assert self._stream_weights is not None and self._stream_params is not None
        params, serial = self._stream_params, self._stream_weights.serial
        self.scheduler.admit(serial)
        with torch.no_grad():
            stepped = self._step(self._stream_weights, params)
        done = []
        for row in stepped:
            if row.finished:
                self.scheduler.release(row, keep=params.keep_kv and not row.prefix_only, serial=serial)
                if not row.prefix_only:
                    done.append((row.index, self._sample(row)))
        return done

    def _sample(self, row: Row) -> Sample:
        tokens = row.tokens
        logprobs = torch.stack(row.logprobs).tolist() if row.logprobs else []
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return Sample(tokens, logprobs, text, "stop" if row.stopped else "length", cache=row.kept,
                      recomputed=row.recomputed)

    def _step(self, weights: FusedWeights, params: SamplingParams) -> list[Row]:
        """One forward over every decoding slot's next token and a chunk of prefill; samples the
        next token of every row whose context is now fully in the cache. Returns those rows, and
        prefix rows that are now complete (finished, nothing sampled)."""
        tick = time.perf_counter()
        plan = self.scheduler.plan(self.device)
        hidden = self.forward(weights, self.slots, plan.batch)
        ready, last, complete = self.scheduler.advance(plan, weights.serial)
        n_decode = plan.batch.n_decode
        self.stats["forward_s"] += time.perf_counter() - tick
        self.stats["steps"] += 1
        self.stats["prefill_tokens"] += plan.batch.ids.shape[0] - n_decode
        self.stats["decode_tokens"] += n_decode
        self.stats["busy_slots"] += plan.batch.n_active
        if ready:
            sampling = time.perf_counter()
            self._choose(ready, self.forward.logits(weights, hidden[last]), params)
            self.stats["sample_s"] += time.perf_counter() - sampling
        if not plan.prefill:
            self.stats["decode_only_s"] += time.perf_counter() - tick
            self.stats["decode_only_tokens"] += n_decode
        return ready + complete

    def _choose(self, rows: list[Row], logits: Tensor, params: SamplingParams) -> None:
        """Each row's next token from its own uniform (`keelrl.inference.sampler.choose`), then its stops."""
        steps = [len(row.tokens) for row in rows]
        early = None
        if params.min_new_tokens > 0:
            early = torch.tensor([t < params.min_new_tokens for t in steps], device=logits.device)
        u = torch.stack([row.uniforms[t] for row, t in zip(rows, steps)])
        chosen, chosen_logp = choose(logits, u, params, early, self.end_ids)
        for row, token, logprob in zip(rows, chosen.tolist(), chosen_logp.unbind(0)):
            row.tokens.append(int(token))
            row.logprobs.append(logprob)
            stopped = token in self.end_ids
            if not stopped and params.stop:
                stopped, row.tail = self.stops.completes(row.tokens, row.tail, params.stop)
            if stopped:
                row.finished = row.stopped = True
            elif len(row.tokens) >= params.max_new_tokens:
                row.finished = True
