"""Sampling and learner precision chosen by measurement on this machine, cached per machine and model shape.

`resolve_dtype(setting, use, model, device)` turns a dtype setting (`eval.dtype`, `rollout.dtype`,
`perf.learner_precision`: auto, float32 or bfloat16) into a torch dtype and a one-line reason. An
explicit setting is returned as it is. auto:

- CUDA: bfloat16 for sampling and bf16 autocast for the learner, without measuring (float32 where
  `torch.cuda.is_bf16_supported()` is false).
- CPU: the choice of a measurement of bfloat16 against float32 at the model's own shapes, taken
  once per machine, thread count and model shape (`measure`) and cached as JSON under
  `model_cache_dir() / "precision"`. The same 2-core CPU can run bf16 matmuls several times slower
  than float32 (AVX2 only, no bf16 instructions) or faster (AVX512-BF16, AMX): a CPU flag does not
  say which, a measurement does.
- Any other device (mps): float32, not measured.

Uses: "eval" and "rollout" (the dtype the sampler's weights are cast to: bfloat16 when the decode
step ran at least `SAMPLING_MARGIN` times faster in it) and "learner" (torch.bfloat16 means bf16
autocast over float32 weights, `keelrl.policy.model.learner_autocast`: chosen when the learner's
micro-batch ran at least `LEARNER_MARGIN` times faster under it).

What `measure` times, each candidate dtype on the current torch threads, the minimum over a few
repetitions after a warm-up (the least disturbed run):

1. matmul: [n, hidden] @ [hidden, intermediate] for n = 8, 64 (decode batches) and 256 (prefill),
   and the decode head [64, hidden] @ [hidden, vocab] (timed on MATMUL_COLUMNS of its columns and
   scaled: its time is linear in them);
2. decode step: DECODE_ROWS (64) rows of one token each through the model's first `k` layers
   (k = 2, or all of a smaller model), scaled to all its layers, plus the head matmul of 1. It runs
   the keel decoder's forward pass (each row attending to 256 cached keys) where keel has the
   model's, as rollouts and evaluations sample through keel or vLLM; else HF's body with a KV cache
   of an 8-token prompt;
3. learner micro-batch: forward and backward of the first k layers on 4 x 512 tokens (float32
   weights, with bf16 autocast or without), scaled to all layers, plus the head's log-prob pass
   and its backward (`HeadLogprobs`, float32 under either: the head never autocasts), timed on
   HEAD_POSITIONS (32) positions and scaled to the micro-batch's 2048.

The timed copies of the model share its float32 weights or hold a cast copy of the first k layers
and the embeddings; the model itself is never modified. A bfloat16 candidate whose matmuls at a
probe's shapes took more than `SKIP_FACTOR` times float32's time is not timed on that probe (the
decode step and the micro-batch are mostly those matmuls: it would not win by a margin), and a
matmul is given up on once it is that slow; this keeps a first measurement to a few seconds on
SmolLM2 where bf16 is slow. The thread probe times the prefill matmul on the available cores
as well when torch runs on fewer threads; the faster count is recorded, not applied (setting
torch's threads is the process's business, STYLE habit 9).

A measurement begun while other processes kept half the cores or more busy (the 1-minute load
average, less this process's own) is marked `disturbed`: the run that took it uses it, and the next
measures again and replaces it (under load a descheduled torch thread makes its peer spin, which has
skewed bf16 against float32 by several times). `keel precision --refresh` (or
`measurement(..., refresh=True)`) measures again at any time.

What it does NOT guarantee: the scaled times are estimates from k layers, not a timed pass of the
whole model; a load that starts after measuring began is not seen. Two processes measuring the same
key at once are serialised by a file lock; the second reads the first's file.

Cache: one JSON file per key (CPU model name, the CPU's vector and matrix flags, torch version,
torch's thread count, device type, the model's shape: hidden, intermediate, layers, vocab,
weights' dtype, and `PROBE_VERSION`), written atomically. The thread count is in the key because
the ratio moves with it (a process pinned to one core measures for one thread). A file that does
not parse or does not match its key is measured again (with a warning) and replaced.
`KEELRL_PRECISION_CACHE` sets another directory, or `off`: measure on every call and write
nothing.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from keelrl.inference.kernels import CPU_FLAGS as CPU_FLAGS  # the flags in the cache key (see cpu_identity)
from keelrl.inference.kernels import cpu_identity
from keelrl.inference.kv import SlotCache
from keelrl.inference.model import LlamaForward, StepBatch, unsupported_reason
from keelrl.inference.weights import FusedWeights, body_prefix
from keelrl.runs import atomic_write_text, exclusive_lock

PROBE_VERSION = 5
"""Bumped when the probes or the choice rule change: older cache files are then measured again."""
USES = ("eval", "rollout", "learner")
SETTINGS = ("auto", "float32", "bfloat16", "float64")
MEASURED = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes auto chooses between, each timed."""
DTYPES = {**MEASURED, "float64": torch.float64}
"""Every explicit setting's dtype (float64: reference runs, never chosen by auto)."""
SAMPLING_MARGIN = 1.1
"""bf16 sampling must win by this factor: it rounds every weight, so a tie within timing noise
keeps float32."""
LEARNER_MARGIN = 1.15
"""bf16 autocast must win the learner's micro-batch by this factor: it rounds the body's matmuls,
and fresh importance ratios then move off 1 by more than float rounding."""
SKIP_FACTOR = 2.0
"""A bf16 candidate whose matmuls at a probe's shapes took more than this many times float32's
time (together) is not timed on that probe."""
MATMUL_TOKENS = (8, 64, 256)
DECODE_ROWS, DECODE_PROMPT, DECODE_CONTEXT, DECODE_STEPS = 64, 8, 256, 3
"""The decode step: DECODE_ROWS rows, each attending to DECODE_CONTEXT keys (the keel decoder) or
to a DECODE_PROMPT-token prompt (HF's body, which prefills it), DECODE_STEPS timed steps."""
LEARNER_ROWS, LEARNER_TOKENS, HEAD_POSITIONS = 4, 512, 32
"""The learner's micro-batch: half of perf.micro_batch_tokens' default, near what the learner runs
(a much smaller one understates bf16 autocast's gain: docs/measurements.md)."""
TIMED_LAYERS = 2
MATMUL_COLUMNS = 8192
WARM_UP_SLACK = 5.0
"""A warm-up (which may start a library's kernels) may take this many times a candidate's give-up time,"""
WARM_UP_FLOOR_S = 0.25
"""and at least this long: a library builds its kernel for each new shape on the first call (oneDNN's
bf16 matmuls take a millisecond or more), which says nothing about the calls after it."""
CACHE_ENV = "KEELRL_PRECISION_CACHE"
BUSY_SHARE = 0.5
"""A measurement begun while other processes kept this share of the cores busy is `disturbed`: the
run that took it uses it, and the next one measures again (and replaces the file)."""


# ----------------------------------------------------------------- the cache key
def model_signature(model: Any) -> dict[str, Any]:
    """The shape the probes time: hidden, intermediate, layers, vocab and the weights' dtype."""
    config = model.config
    hidden = int(config.hidden_size)
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    return {"hidden": hidden, "intermediate": int(intermediate), "layers": int(config.num_hidden_layers),
            "vocab": int(config.vocab_size), "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def cache_key(model: Any, device: torch.device) -> dict[str, Any]:
    """What a measurement depends on: this machine's CPU, torch and its thread count, the device
    type and the model's shape."""
    identity = cpu_identity()
    return {"cpu": identity["cpu"], "flags": list(identity["flags"]), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": device.type, "model": model_signature(model),
            "version": PROBE_VERSION}


def cache_path(key: dict[str, Any], cache_dir: str | Path | None = None) -> Path | None:
    """The key's JSON file, or None when caching is off (`KEELRL_PRECISION_CACHE=off`)."""
    from keelrl.policy.download import model_cache_dir

    where = str(cache_dir) if cache_dir is not None else os.environ.get(CACHE_ENV, "")
    if where == "off":
        return None
    root = Path(where).expanduser() if where else model_cache_dir() / "precision"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    shape = key["model"]
    return root / f"{key['device']}-h{shape['hidden']}-l{shape['layers']}-t{key['threads']}-{digest}.json"


# ----------------------------------------------------------------- resolving a setting
def resolve_dtype(setting: str, use: str, model: Any, device: torch.device, *,
                  cache_dir: str | Path | None = None) -> tuple[torch.dtype, str]:
    """(dtype, why) for a dtype setting (auto, float32, bfloat16, float64) of `use` (eval, rollout, learner).

    For "learner", torch.bfloat16 means bf16 autocast over the weights. auto on a CPU measures on
    first use and reads the cache after (module docstring); `why` is one line for the run's record.
    """
    if setting not in SETTINGS:
        raise ValueError(f"dtype setting {setting!r}; valid: {', '.join(SETTINGS)}")
    if use not in USES:
        raise ValueError(f"precision use {use!r}; valid: {', '.join(USES)}")
    if setting != "auto":
        return DTYPES[setting], f"{setting}: set explicitly"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "CUDA: bf16"
        return torch.float32, "CUDA without bf16 support: float32"
    if device.type != "cpu":
        return torch.float32, f"{device.type}: not measured, float32"
    choice = measurement(model, device, cache_dir=cache_dir)["choices"][use]
    return DTYPES[choice["dtype"]], choice["why"]


def measurement(model: Any, device: torch.device, *, refresh: bool = False,
                cache_dir: str | Path | None = None) -> dict[str, Any]:
    """The cached measurement of `model`'s shape on this machine, measured first if there is none
    (or it is unreadable, or `refresh`). -> the record (`measure`), with "path": its file or None."""
    key = cache_key(model, device)
    path = cache_path(key, cache_dir)
    if path is None:
        return {**measure(model, device, key), "path": None}
    if not refresh and str(path) in _TAKEN_HERE:  # a disturbed record holds for the process that took it
        return {**_TAKEN_HERE[str(path)], "path": str(path)}
    with exclusive_lock(path.parent / ".locks" / f"{path.stem}.lock"):  # a second process waits, then finds the first's file
        record = None if refresh else _read(path, key)
        if record is None:
            record = measure(model, device, key)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(record, indent=2))
            if record["disturbed"]:
                _TAKEN_HERE[str(path)] = record
    return {**record, "path": str(path)}


_TAKEN_HERE: dict[str, dict[str, Any]] = {}
"""The disturbed measurements this process took, by cache file: the file would be measured again on
its next read, but every later use in this process keeps the same choices."""


def _read(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The record at `path` if it is a complete one for `key`; None when there is none (a broken or
    foreign file warns: it is measured again and replaced)."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        choices = record["choices"]
        valid = (record["key"] == key and all(choices[use]["dtype"] in MEASURED and isinstance(choices[use]["why"], str)
                                              for use in USES))
    except (OSError, ValueError, KeyError, TypeError) as error:
        warnings.warn(f"precision cache {path} is unreadable ({type(error).__name__}: {error}); measuring again",
                      stacklevel=3)
        return None
    if not valid:
        warnings.warn(f"precision cache {path} does not hold a measurement of this key; measuring again", stacklevel=3)
        return None
    if record.get("disturbed"):
        return None  # taken beside other work: measured again, quietly
    return record


# ----------------------------------------------------------------- the choice rule
def choose(timings: dict[str, Any], skipped: dict[str, str] | None = None,
           layers_note: str = "") -> dict[str, dict[str, str]]:
    """{use: {"dtype", "why"}} from the probes' seconds: `timings["decode_step"]` and
    `timings["learner_step"]`, each {"float32": s, "bfloat16": s or None}. A bf16 time of None
    was not measured; `skipped[probe]` says why."""
    skipped = skipped or {}
    sampling = _pick("decode step", timings["decode_step"], SAMPLING_MARGIN, skipped.get("decode_step"), layers_note)
    learner = _pick("learner micro-batch under bf16 autocast", timings["learner_step"], LEARNER_MARGIN,
                    skipped.get("learner_step"), layers_note)
    return {"eval": sampling, "rollout": dict(sampling), "learner": learner}


def _pick(probe: str, times: dict[str, float | None], margin: float, skip: str | None, note: str) -> dict[str, str]:
    fp32, bf16 = times["float32"], times.get("bfloat16")
    if bf16 is None or fp32 is None:
        return {"dtype": "float32", "why": f"float32: {skip or 'bfloat16 was not measured'}"}
    speedup = fp32 / bf16
    figures = f"({bf16:.3g} s vs {fp32:.3g} s{note})"
    if speedup >= margin:
        return {"dtype": "bfloat16", "why": f"bfloat16: {probe} {speedup:.2f}x faster than float32 here {figures}"}
    if speedup < 1:
        return {"dtype": "float32", "why": f"float32: bfloat16 {probe} {1 / speedup:.2f}x slower here {figures}"}
    return {"dtype": "float32", "why": f"float32: bfloat16 {probe} only {speedup:.2f}x faster here {figures}, "
                                      f"under the {margin:.2f}x it must win by"}


# ----------------------------------------------------------------- the probes
def measure(model: Any, device: torch.device, key: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time the probes of the module docstring for `model` on `device` (a CPU) -> the record:
    {"key", "measured_at", "threads", "load_average", "probes", "timings_s", "skipped", "choices",
    "seconds"}."""
    started = time.perf_counter()
    load_before = _load_average()
    shape = model_signature(model)
    hidden, intermediate, vocab, layers = shape["hidden"], shape["intermediate"], shape["vocab"], shape["layers"]
    timed_layers = min(TIMED_LAYERS, layers)
    probe_matmul(8, 8, 8, torch.bfloat16, device)  # bf16's libraries start up here, not in the first shape's time
    shapes = {str(n): (n, hidden, intermediate) for n in MATMUL_TOKENS}
    shapes["head"] = (DECODE_ROWS, hidden, vocab)
    matmul: dict[str, dict[str, float | None]] = {"float32": {}, "bfloat16": {}}
    for name, (rows, inner, outer) in shapes.items():
        fp32 = probe_matmul(rows, inner, outer, torch.float32, device)
        matmul["float32"][name] = fp32
        matmul["bfloat16"][name] = probe_matmul(rows, inner, outer, torch.bfloat16, device,
                                                give_up_after=SKIP_FACTOR * fp32 if fp32 is not None else None)
    copies = {"float32": probe_copy(model, torch.float32, timed_layers)}
    decode: dict[str, float | None] = {}
    learner: dict[str, float | None] = {}
    skipped: dict[str, str] = {}
    for dtype_name, dtype in MEASURED.items():
        slow = _slow_matmuls(matmul, (str(DECODE_ROWS), "head"), dtype_name, "decode step")
        if slow:
            decode[dtype_name], skipped["decode_step"] = None, slow
        else:
            if dtype_name not in copies:
                copies[dtype_name] = probe_copy(model, dtype, timed_layers)
            copy_ = copies[dtype_name]
            head = matmul[dtype_name]["head"]
            assert head is not None  # else slow
            decode[dtype_name] = probe_decode(copy_, device) * layers / timed_layers + head
        slow = _slow_matmuls(matmul, ("256",), dtype_name, "learner micro-batch")
        if slow:
            learner[dtype_name], skipped["learner_step"] = None, slow
        else:
            learner[dtype_name] = probe_learner(copies["float32"], dtype, device) * layers / timed_layers
    head_s = probe_head(model, device)  # the same under either: added to both
    learner = {name: None if body is None else body + head_s for name, body in learner.items()}
    timings = {"matmul": matmul, "decode_step": decode, "learner_step": learner, "learner_head": head_s}
    note = f", {timed_layers} of {layers} layers timed" if timed_layers < layers else ""
    threads = probe_threads(hidden, intermediate, device)
    return {"key": key or cache_key(model, device),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "threads": threads, "load_average": _load_average(), "load_before": load_before,
            "disturbed": disturbed(load_before, threads["available"]),
            "probes": {"matmul_tokens": list(MATMUL_TOKENS), "decode_rows": DECODE_ROWS,
                       "decode_prompt": DECODE_PROMPT, "learner_rows": LEARNER_ROWS,
                       "learner_tokens": LEARNER_TOKENS, "layers_timed": timed_layers, "layers": layers},
            "timings_s": timings, "skipped": skipped, "choices": choose(timings, skipped, note),
            "seconds": round(time.perf_counter() - started, 3)}


def disturbed(load_before: float | None, cores: int) -> bool:
    """Whether other processes kept at least BUSY_SHARE of the `cores` busy as measuring began: the
    1-minute load average then, less the one this process itself adds while loading the model."""
    return load_before is not None and load_before - 1 >= BUSY_SHARE * cores


def _load_average() -> float | None:
    """The 1-minute load average while measuring (None where the OS has none): a figure taken with
    more runnable processes than cores says more about the load than about the dtypes."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _slow_matmuls(matmul: dict[str, dict[str, float | None]], names: tuple[str, ...], dtype_name: str,
                  probe: str) -> str:
    """Why `dtype_name` is not timed on `probe`, whose matmuls are `names`: they took more than
    SKIP_FACTOR times float32's time, or one was given up on. Empty: it is timed."""
    if dtype_name == "float32":
        return ""
    fp32 = [matmul["float32"][name] for name in names]
    mine = [matmul[dtype_name][name] for name in names]
    if any(t is None for t in fp32):
        return ""
    total_fp32 = sum(t for t in fp32 if t is not None)
    if any(t is None for t in mine):
        ratio = f"more than {SKIP_FACTOR:.0f}x"
    else:
        seconds = sum(t for t in mine if t is not None)
        if seconds <= SKIP_FACTOR * total_fp32:
            return ""
        ratio = f"{seconds / total_fp32:.1f}x"
    return (f"{dtype_name} matmuls at the {probe}'s shapes ({', '.join(_SHAPE_NAMES[name] for name in names)}) "
            f"ran {ratio} slower than float32 here, so its {dtype_name} {probe} was not timed")


_SHAPE_NAMES = {**{str(n): f"{n} tokens" for n in MATMUL_TOKENS}, "head": f"the head on {DECODE_ROWS} rows"}


def _best_time(run: Callable[[], Any], repeats: int = 3, give_up_after: float | None = None,
               warm_up: bool = True) -> float | None:
    """The least of `repeats` timed calls of `run` after one warm-up; None once a call took longer
    than `give_up_after` seconds, or the warm-up WARM_UP_SLACK times that and over WARM_UP_FLOOR_S
    (it lost: no need for a precise figure, and a slow candidate must not cost seconds)."""
    if warm_up:
        began = time.perf_counter()
        run()
        if give_up_after is not None and time.perf_counter() - began > max(WARM_UP_SLACK * give_up_after,
                                                                          WARM_UP_FLOOR_S):
            return None
    best = math.inf
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
        if give_up_after is not None and best > give_up_after:
            return None
    return best


def probe_matmul(rows: int, inner: int, outer: int, dtype: torch.dtype, device: torch.device,
                 give_up_after: float | None = None) -> float | None:
    """Seconds of [rows, inner] @ [inner, outer] in `dtype` (None: slower than `give_up_after`).

    A wide matrix (the head's vocabulary) is timed on its first MATMUL_COLUMNS columns and scaled
    to all of them: its time is linear in them, and a slow candidate then costs little to time."""
    columns = min(outer, MATMUL_COLUMNS)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inner, generator=generator).to(device, dtype)
    w = torch.randn(inner, columns, generator=generator).to(device, dtype)
    scale = outer / columns
    seconds = _best_time(lambda: x @ w, give_up_after=None if give_up_after is None else give_up_after / scale)
    return None if seconds is None else seconds * scale


def probe_threads(hidden: int, intermediate: int, device: torch.device) -> dict[str, Any]:
    """Torch's thread count now, the cores this process may use, and (when they differ) the float32
    prefill matmul's seconds at each count, with the faster one. Nothing is changed afterwards."""
    current = torch.get_num_threads()
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    record: dict[str, Any] = {"current": current, "available": available}
    if available == current or device.type != "cpu":
        return record
    seconds = {}
    try:
        for count in (current, available):
            torch.set_num_threads(count)
            seconds[str(count)] = probe_matmul(MATMUL_TOKENS[-1], hidden, intermediate, torch.float32, device)
    finally:
        torch.set_num_threads(current)
    record["matmul_256_s"] = seconds
    record["faster"] = int(min(seconds, key=lambda count: seconds[count] or math.inf))
    return record


def probe_copy(model: Any, dtype: torch.dtype, layers: int) -> Any:
    """A copy of `model` with its first `layers` layers, its weights in `dtype`: the model's own
    tensors where they are in `dtype` already (shared, never written), cast copies otherwise. The
    copy's parameters are its own objects, so gradients into them never reach `model`."""
    from keelrl.policy.lora import merged_state_dict, unwrap

    model = unwrap(model)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        probe = type(model)(config)
    source = merged_state_dict(model)  # a LoRA policy's: under the base's names, the adapters folded in
    probe.load_state_dict({name: source[name].detach().to(dtype) for name in probe.state_dict()}, assign=True)
    buffers = dict(model.named_buffers())
    for name, buffer in list(probe.named_buffers()):  # non-persistent buffers (rotary frequencies) stay as they are
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            probe.get_submodule(owner)._buffers[leaf] = buffers[name].clone()
    probe.tie_weights()
    return probe


def probe_decode(copy_: Any, device: torch.device) -> float:
    """Seconds of one decode step of DECODE_ROWS single-token rows through the body of `copy_`
    (`probe_copy`), in the dtype of its weights: the keel decoder's forward pass
    (`keelrl.inference.model`) where it has the model's, each row attending to DECODE_CONTEXT
    cached keys, else HF's body with a KV cache of a DECODE_PROMPT-token prompt. The rollouts and
    evaluations sample through keel or vLLM where they can, and HF's body in bf16 can be several
    times slower than either on the same CPU, so it stands in only where keel cannot run."""
    if unsupported_reason(copy_.config) is not None:
        return _probe_decode_hf(copy_, device)
    dtype = next(copy_.parameters()).dtype
    forward = LlamaForward(copy_, dtype, device)
    weights = FusedWeights.from_state(copy_.state_dict(), copy_.config, dtype, 0, prefix=body_prefix(copy_))
    cache = SlotCache(forward.layers, forward.kv_heads, forward.head_dim, dtype, device)
    cache.reserve(DECODE_CONTEXT, DECODE_ROWS, 0, DECODE_ROWS, DECODE_ROWS * DECODE_CONTEXT * cache.token_bytes)
    generator = torch.Generator().manual_seed(0)
    for stored in (*cache.keys, *cache.values):  # keys and values of a context already decoded
        stored.copy_(torch.randn(stored.shape, generator=generator).to(stored))
    rows = torch.arange(DECODE_ROWS, device=device)
    batch = StepBatch(ids=torch.randint(0, copy_.config.vocab_size, (DECODE_ROWS,), generator=generator).to(device),
                      slots=rows, positions=torch.full((DECODE_ROWS,), DECODE_CONTEXT - 1, device=device),
                      n_decode=DECODE_ROWS, n_active=DECODE_ROWS,
                      lengths=torch.full((DECODE_ROWS,), DECODE_CONTEXT, device=device), width=DECODE_CONTEXT,
                      prefill=[])
    with torch.no_grad():
        seconds = _best_time(lambda: forward(weights, cache, batch), repeats=DECODE_STEPS)
    assert seconds is not None  # no give_up_after
    return seconds


def _probe_decode_hf(copy_: Any, device: torch.device) -> float:
    """`probe_decode` through HF's body, for a model the keel decoder has no forward pass for."""
    from transformers import DynamicCache

    from keelrl.policy.prefix import cache_kwarg

    body = copy_.base_model.eval()
    generator = torch.Generator().manual_seed(0)
    vocab = copy_.config.vocab_size
    prompt = torch.randint(0, vocab, (DECODE_ROWS, DECODE_PROMPT), generator=generator).to(device)
    token = torch.randint(0, vocab, (DECODE_ROWS, 1), generator=generator).to(device)
    kwarg = cache_kwarg(body)
    with torch.no_grad():
        cache = DynamicCache()
        body(input_ids=prompt, use_cache=True, **{kwarg: cache})
        seconds = _best_time(lambda: body(input_ids=token, use_cache=True, **{kwarg: cache}), repeats=DECODE_STEPS)
    assert seconds is not None  # no give_up_after
    return seconds


def probe_learner(copy_: Any, dtype: torch.dtype, device: torch.device) -> float:
    """Seconds of forward and backward of the body of `copy_` (`probe_copy`, float32) on
    LEARNER_ROWS x LEARNER_TOKENS tokens, under bf16 autocast when `dtype` is bfloat16 (what
    `learner_autocast` does)."""
    copy_.get_input_embeddings().weight.requires_grad_(False)  # the head's [V, H] gradient is probe_head's
    body = copy_.base_model.train()
    ids = torch.randint(0, copy_.config.vocab_size, (LEARNER_ROWS, LEARNER_TOKENS),
                        generator=torch.Generator().manual_seed(0)).to(device)

    def step() -> None:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            hidden = body(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).last_hidden_state
        hidden.float().square().mean().backward()
        copy_.zero_grad(set_to_none=True)

    seconds = _best_time(step, repeats=1)
    assert seconds is not None  # no give_up_after
    return seconds


def probe_head(model: Any, device: torch.device) -> float:
    """Seconds of the learner's head pass (log-probs of HEAD_POSITIONS positions, `HeadLogprobs`)
    and its backward, in the head weight's float32, scaled to LEARNER_ROWS x LEARNER_TOKENS
    positions (it is linear in them; autocast never reaches it)."""
    from keelrl.policy.model import HeadLogprobs, head_chunk

    head = model.get_output_embeddings()
    weight = head.weight.detach().float().requires_grad_(True)  # a leaf of our own: no gradient reaches the model
    bias = None if getattr(head, "bias", None) is None else head.bias.detach().float()
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(HEAD_POSITIONS, weight.shape[1], generator=generator).to(device).requires_grad_(True)
    targets = torch.randint(0, weight.shape[0], (HEAD_POSITIONS,), generator=generator).to(device)
    chunk = head_chunk(1, weight.shape[0], None)

    def step() -> None:
        logp, _ = HeadLogprobs.apply(hidden, weight, bias, targets, 1.0, False, chunk)
        logp.sum().backward()
        weight.grad = hidden.grad = None

    seconds = _best_time(step, repeats=1, warm_up=False)  # float32 only: nothing to start up
    assert seconds is not None  # no give_up_after
    return seconds * LEARNER_ROWS * LEARNER_TOKENS / HEAD_POSITIONS


# ----------------------------------------------------------------- showing it
def table_rows(record: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(probe, float32 s, bfloat16 s, bf16 speed-up) for `keel precision` and docs/measurements.md."""
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    def speedup(fp32: float | None, bf16: float | None, gave_up: str = "not timed") -> str:
        return gave_up if fp32 is None or bf16 is None else f"{fp32 / bf16:.2f}x"

    timings, probes, shape = record["timings_s"], record["probes"], record["key"]["model"]
    hidden, intermediate, vocab = shape["hidden"], shape["intermediate"], shape["vocab"]
    rows = []
    for name, fp32 in timings["matmul"]["float32"].items():
        bf16 = timings["matmul"]["bfloat16"][name]
        label = (f"matmul [{probes['decode_rows']}, {hidden}] @ [{hidden}, {vocab}] (head)" if name == "head" else
                 f"matmul [{name}, {hidden}] @ [{hidden}, {intermediate}]")
        rows.append((label, seconds(fp32), seconds(bf16), speedup(fp32, bf16, f"< {1 / SKIP_FACTOR:.1f}x (given up)")))
    scaled = (f", {probes['layers_timed']} of {probes['layers']} layers timed"
              if probes["layers_timed"] < probes["layers"] else "")
    for name, label in (("decode_step", f"decode step ({probes['decode_rows']} rows{scaled})"),
                        ("learner_step", f"learner micro-batch ({probes['learner_rows']} x "
                                         f"{probes['learner_tokens']} tokens{scaled})")):
        fp32, bf16 = timings[name]["float32"], timings[name]["bfloat16"]
        rows.append((label, seconds(fp32), seconds(bf16), speedup(fp32, bf16)))
    return rows
