"""llama.cpp as the CPU baseline: the same weights as a GGUF file, decoded by llama.cpp's batched API.

`llama-cpp-python` is a bench-only extra (`pip install -e .[llamacpp]`: a source build, minutes);
keelrl itself never imports it, and neither does this module until a function here is called.

- `gguf_of(model_dir, outtype)`: a Hugging Face model directory converted once, by llama.cpp's
  own converter (`convert_hf_to_gguf.py`), into an F32 / F16 / BF16 / Q8_0 GGUF cached under
  keelrl's cache (`model_cache_dir()/llamacpp/`), named by the sha256 of the directory's files
  and the converter's version, so a changed directory or converter converts anew. The converter
  is not in the llama-cpp-python wheel; it ships in the matching sdist
  (`vendor/llama.cpp/convert_hf_to_gguf.py`, with its `conversion/` package and its own
  `gguf-py`, newer than the `gguf` release on PyPI: the PyPI one lacks `LazyChunkedTensor`).
  `converter_dir()` fetches that sdist once with `pip download` and keeps those three pieces.
- `llamacpp_generate(gguf_path, prompts, max_new_tokens, batch, threads)`: decodes token-id
  prompts with `llama_batch_init` / `llama_decode`, up to `batch` sequences in one batch (one
  sequence id each, `n_seq_max = batch`), refilling a finished sequence's slot from the queue
  (its keys and values dropped with `llama_memory_seq_rm`), each sequence ending at an
  end-of-generation token (`llama_vocab_is_eog`, plus the ids given) or after
  `max_new_tokens`. Greedy is the argmax of `llama_get_logits_ith`, so engine comparisons
  exclude sampler differences.

Prompts are token ids, never text: both engines get identical prompts (build them with the HF
tokenizer). `llamacpp_tokenize` is there to check that the GGUF's tokenizer agrees.

Threads on a shared 2-core box: ggml's worker threads spin at every barrier (hundreds per token),
so with `threads` equal to the cores and a neighbour busy, each barrier waits for a descheduled
peer: measured here beside ~50% other load, 2 threads decoded 3-4x SLOWER than 1 (batch 8, F32).
Record the other processes' CPU share (`bench.common.Clock`) with every figure, and prefer
threads=1 beside load; `OMP_WAIT_POLICY=PASSIVE` in the environment of the process (set before
llama_cpp is imported: run it in a `bench.common.run_worker` process) halved that loss.

What this does NOT do: the KV cache is F32 by default (`kv_type`), not llama.cpp's default F16,
so an F32 GGUF is compared with an F32 engine end to end; pass kv_type="f16" for llama.cpp's
usual setting. Sampling other than greedy is a plain numpy softmax draw, not llama.cpp's
sampler chain.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

PACKAGE = "llama-cpp-python"
INSTALL_HINT = (f"{PACKAGE} is a bench-only extra: `pip install -e .[llamacpp]` (or `pip install {PACKAGE}==0.3.36`; "
                "a source build with cmake and a C++ compiler, minutes)")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
CONVERTER_ENV = "KEELRL_LLAMACPP_CONVERTER"
"""A path to `convert_hf_to_gguf.py` (next to its `conversion/` and `gguf-py/`), used instead of the fetched one."""
CONVERT_TIMEOUT_S = 1800


class LlamaCppError(RuntimeError):
    """llama.cpp, its converter or a conversion is missing or failed."""


# --------------------------------------------------------------------------- the package
def llama_cpp_module() -> Any:
    """The imported `llama_cpp` package, or LlamaCppError saying how to install it."""
    try:
        import llama_cpp
    except ImportError as error:
        raise LlamaCppError(f"cannot import llama_cpp ({error}). {INSTALL_HINT}") from error
    return llama_cpp


def llama_cpp_version() -> str:
    return str(llama_cpp_module().__version__)


# --------------------------------------------------------------------------- the converter
def _cache_root() -> Path:
    from keelrl.policy.download import model_cache_dir

    return model_cache_dir() / "llamacpp"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """An exclusive cross-process lock on `name` under the cache (a second converter waits, then finds it done)."""
    locks = _cache_root() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")


def converter_dir(version: str | None = None, *, sdist: str | Path | None = None) -> Path:
    """The directory holding llama.cpp's `convert_hf_to_gguf.py` for llama-cpp-python `version`
    (default: the installed one): `$KEELRL_LLAMACPP_CONVERTER`'s directory if set, else a copy cached
    under keelrl's cache, extracted once from the package's sdist (`sdist`, a local .tar.gz, or
    fetched with `pip download --no-binary :all:`, about a minute)."""
    configured = os.environ.get(CONVERTER_ENV)
    if configured:
        script = Path(configured).expanduser()
        if not script.is_file():
            raise LlamaCppError(f"${CONVERTER_ENV}={configured!r}: no such file (it should name convert_hf_to_gguf.py)")
        return script.parent
    version = version or llama_cpp_version()
    target = _cache_root() / f"convert-{version}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    with _locked(target.name):
        if (target / "convert_hf_to_gguf.py").is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{target.name}.partial-", dir=target.parent) as scratch:
            archive = Path(sdist) if sdist is not None else _pip_download_sdist(version, Path(scratch))
            _extract_converter(archive, version, Path(scratch) / "out")
            os.replace(Path(scratch) / "out", target)
    return target


def _pip_download_sdist(version: str, destination: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
               "--no-input", f"{PACKAGE}=={version}", "-d", str(destination)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
        status, output = done.returncode, (done.stderr or done.stdout)
    except (OSError, subprocess.TimeoutExpired) as error:
        status, output = None, str(error)
    archives = sorted(destination.glob("*.tar.gz"))
    if status != 0 or len(archives) != 1:
        tail = "\n".join(output.strip().splitlines()[-10:])
        raise LlamaCppError(
            f"llama.cpp's converter (convert_hf_to_gguf.py) is not in the {PACKAGE} wheel; fetching the {PACKAGE}=="
            f"{version} sdist that has it failed ({' '.join(command)}; exit {status}):\n{tail}\n"
            f"Give it instead: set ${CONVERTER_ENV} to a convert_hf_to_gguf.py from llama.cpp (with its conversion/ "
            f"and gguf-py/ beside it), or call converter_dir(sdist=PATH) with a downloaded sdist.")
    return archives[0]


def _extract_converter(archive: Path, version: str, out: Path) -> None:
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                   and m.name[len(prefix):].split("/", 1)[0] in CONVERTER_PARTS and (m.isfile() or m.isdir())]
        if not any(m.name == prefix + "convert_hf_to_gguf.py" for m in members):
            raise LlamaCppError(f"{archive.name} has no {prefix}convert_hf_to_gguf.py (is it the {PACKAGE}=={version} "
                                f"sdist?)")
        for member in members:
            member.name = member.name[len(prefix):]
        tar.extractall(out, members=members, filter="data")


# --------------------------------------------------------------------------- conversion
_DIGESTS: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def directory_sha256(model_dir: Path) -> str:
    """sha256 over every file of a model directory (relative path and content's sha256), in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(model_dir).as_posix()}\0{_file_sha256(path)}\n".encode())
    return digest.hexdigest()


def gguf_of(model_dir: str | Path, outtype: str = "f32", *, converter: str | Path | None = None,
            quiet: bool = True) -> Path:
    """`model_dir` (a Hugging Face model directory, e.g. `resolve_model_path("smollm2")`) as a GGUF file
    of `outtype` weights, converted once by llama.cpp's converter and cached under keelrl's cache as
    `llamacpp/<dir name>-<sha16 of its files>.llamacpp-<version>.<outtype>.gguf` (a JSON note beside it
    says what it came from). `converter`: a convert_hf_to_gguf.py to use (default: `converter_dir()`).
    Raises LlamaCppError naming what is missing (llama-cpp-python, the converter, sentencepiece) or
    the converter's own complaint (e.g. a tokenizer it does not recognise)."""
    model_dir = Path(model_dir).expanduser().resolve()
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
    version = llama_cpp_version()
    script = Path(converter) if converter is not None else converter_dir(version) / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise LlamaCppError(f"llama.cpp's converter {script}: no such file")
    sha = directory_sha256(model_dir)
    target = _cache_root() / f"{model_dir.name}-{sha[:16]}.llamacpp-{version}.{outtype}.gguf"
    if target.is_file():
        return target
    _check_converter_imports(model_dir)
    with _locked(target.name):
        if target.is_file():
            return target
        partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
        command = [sys.executable, str(script), str(model_dir), "--outtype", outtype, "--outfile", str(partial)]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            partial.unlink(missing_ok=True)
            raise LlamaCppError(f"converting {model_dir} to GGUF timed out after {error.timeout} s") from error
        if done.returncode != 0 or not partial.is_file():
            partial.unlink(missing_ok=True)
            tail = "\n".join(done.stderr.strip().splitlines()[-12:])
            raise LlamaCppError(f"llama.cpp's converter could not convert {model_dir} ({outtype}); exit "
                                f"{done.returncode}:\n{tail}")
        os.replace(partial, target)
        note = {"model_dir": str(model_dir), "directory_sha256": sha, "outtype": outtype, "converter": str(script),
                "llama_cpp_python": version, "seconds": round(time.perf_counter() - started, 1),
                "bytes": target.stat().st_size}
        target.with_suffix(".json").write_text(json.dumps(note, indent=2) + "\n")
        if not quiet:
            print(f"converted {model_dir} -> {target} in {note['seconds']} s", file=sys.stderr)
    return target


def _check_converter_imports(model_dir: Path) -> None:
    """The converter's own imports, checked up front so a missing one is named, not buried in a traceback."""
    import importlib.util

    needed = ["torch", "numpy", "transformers"]
    config = json.loads((model_dir / "config.json").read_text())
    if "llama" in str(config.get("model_type", "")).lower() or any("Llama" in a for a in config.get("architectures", [])):
        needed.append("sentencepiece")  # the Llama converter imports it before looking for tokenizer.model
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise LlamaCppError(f"llama.cpp's converter needs {', '.join(missing)} (pip install {' '.join(missing)}; "
                            f"`pip install -e .[llamacpp]` brings them)")


# --------------------------------------------------------------------------- loading
_BACKEND_READY = False
_MODELS: dict[str, Any] = {}


def _backend() -> Any:
    global _BACKEND_READY
    llama_cpp = llama_cpp_module()
    if not _BACKEND_READY:
        from llama_cpp import _logger

        _logger.set_verbose(False)  # llama.cpp's log goes to stderr; errors only
        llama_cpp.llama_backend_init()
        _BACKEND_READY = True
    return llama_cpp


def load_model(gguf_path: str | Path, *, vocab_only: bool = False) -> Any:
    """A llama.cpp model loaded from `gguf_path` (kept for the process: loading is paid once)."""
    llama_cpp = _backend()
    key = f"{Path(gguf_path).resolve()}|{vocab_only}"
    if key not in _MODELS:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = vocab_only
        model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), params)
        if not model:
            raise LlamaCppError(f"llama.cpp could not load {gguf_path}")
        _MODELS[key] = model
    return _MODELS[key]


def llamacpp_tokenize(gguf_path: str | Path, text: str, *, parse_special: bool = True) -> list[int]:
    """`text` tokenized by the GGUF's own tokenizer (no BOS added; special tokens parsed as such)."""
    llama_cpp = _backend()
    vocab = llama_cpp.llama_model_get_vocab(load_model(gguf_path, vocab_only=True))
    raw = text.encode("utf-8")
    room = len(raw) + 16
    buffer = (llama_cpp.llama_token * room)()
    count = llama_cpp.llama_tokenize(vocab, raw, len(raw), buffer, room, False, parse_special)
    if count < 0:
        raise LlamaCppError(f"llama_tokenize needs {-count} tokens, had room for {room}")
    return list(buffer[:count])


# --------------------------------------------------------------------------- generation
KV_TYPES = {"f32": 0, "f16": 1}  # GGML_TYPE_F32, GGML_TYPE_F16


@dataclass
class _Slot:
    seq: int
    prompt: int
    """index into the prompts"""
    feed: list[int]
    """tokens still to decode: the prompt's (prefill), then the last generated one"""
    pos: int = 0
    generated: list[int] = field(default_factory=list)
    prefilling: bool = True


def llamacpp_generate(gguf_path: str | Path, prompts: list[list[int]], max_new_tokens: int, batch: int,
                      threads: int, greedy: bool = True, *, end_ids: Sequence[int] = (), ignore_eog: bool = False,
                      kv_type: str = "f32", n_batch: int = 2048, n_ubatch: int = 512, flash_attn: int | None = None,
                      kv_unified: bool | None = None, temperature: float = 1.0, seed: int = 0) -> dict[str, Any]:
    """Decode `prompts` (token ids) with llama.cpp, up to `batch` sequences at once.

    Each sequence ends after an end-of-generation token (the GGUF's `llama_vocab_is_eog`, or one of
    `end_ids`; kept in its tokens) or after `max_new_tokens`; `ignore_eog=True` makes every sequence
    run exactly `max_new_tokens` (as `min_new_tokens` does in HF). A finished sequence's slot is
    refilled with the next queued prompt in the same step. Each `llama_decode` call takes up to
    `n_batch` tokens: one per generating sequence first, then prompt tokens (a long prompt spans
    calls). greedy: argmax of the logits; else a softmax draw at `temperature` (numpy, `seed`).
    flash_attn: llama.cpp's flash_attn_type (-1 auto, 0 off, 1 on); None: off for an F32 KV cache
    (its CPU flash attention on F32 keys decoded batch 8 at half the speed here), auto for F16.
    kv_unified: one KV buffer shared by all sequences, else one stream per sequence (llama.cpp's
    default); None: unified only when slots get refilled (more prompts than `batch`). Measured
    here (SmolLM2, 250-token prompts, 1 thread): per-sequence streams decoded a refilled slot's
    sequence about 3x slower than the first wave (batch 8: 135 -> 391 ms a step in F32, 106 ->
    283 ms in F16, the same with twice the room), unified ran both waves alike (158 / 98 ms);
    without refill streams were faster (batch 16 = prompts: unified decoded at ~0.6x and
    prefilled at ~0.45x, attending over every sequence's cells).

    Returns wall_s (the decode loop; context set-up is `setup_s`, model loading is paid once per
    process and excluded), prompt_tokens, generated_tokens, tokens_per_s ((prompt + generated) /
    wall), generated_per_s (generated / wall), decode_only (tokens, seconds and tokens_per_s of the
    steps that had no prompt tokens in them: the decode throughput), prefill (the other steps:
    their prompt tokens, the first generated tokens and seconds), steps, and tokens: the generated
    ids per prompt, in prompt order.
    """
    import numpy as np

    if batch < 1 or max_new_tokens < 1 or threads < 1:
        raise ValueError("batch, max_new_tokens and threads must be >= 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type {kv_type!r}: one of {', '.join(KV_TYPES)}")
    llama_cpp = _backend()
    model = load_model(gguf_path)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    ends = set(int(t) for t in end_ids)
    batch = min(batch, len(prompts))
    per_seq = -(-(max(len(p) for p in prompts) + max_new_tokens) // 256) * 256  # llama.cpp pads a stream to 256 cells
    n_batch = max(n_batch, batch)

    setup = time.perf_counter()
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = batch * per_seq
    params.n_batch = n_batch
    params.n_ubatch = min(n_ubatch, n_batch)
    params.n_seq_max = batch
    params.n_threads = threads
    params.n_threads_batch = threads
    params.type_k = params.type_v = KV_TYPES[kv_type]
    params.flash_attn_type = (0 if kv_type == "f32" else -1) if flash_attn is None else flash_attn
    if kv_unified is None:
        kv_unified = len(prompts) > batch
    params.kv_unified = kv_unified
    params.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise LlamaCppError(f"llama.cpp could not make a context (n_ctx {batch * per_seq}, {batch} sequences)")
    tokens_batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    memory = llama_cpp.llama_get_memory(ctx)
    setup_s = time.perf_counter() - setup
    rng = np.random.default_rng(seed)

    queue = deque(range(len(prompts)))
    free = list(range(batch))[::-1]
    active: list[_Slot] = []
    results: list[list[int] | None] = [None] * len(prompts)
    decode_s = prefill_s = 0.0
    decode_tokens = prefill_first = steps = 0
    started = time.perf_counter()
    try:
        while queue or active:
            while queue and free:
                index = queue.popleft()
                active.append(_Slot(seq=free.pop(), prompt=index, feed=list(prompts[index])))
            # one llama_batch: every generating sequence's last token, then prompt tokens while room is left
            n, outputs, has_prompt = 0, [], False
            for slot in sorted(active, key=lambda s: s.prefilling):
                take = min(len(slot.feed), n_batch - n)
                if take <= 0:
                    continue
                for j in range(take):
                    tokens_batch.token[n] = slot.feed[j]
                    tokens_batch.pos[n] = slot.pos + j
                    tokens_batch.n_seq_id[n] = 1
                    tokens_batch.seq_id[n][0] = slot.seq
                    tokens_batch.logits[n] = 0
                    n += 1
                has_prompt |= slot.prefilling
                slot.pos += take
                del slot.feed[:take]
                if not slot.feed:  # its last token is in: its logits give the next token
                    tokens_batch.logits[n - 1] = 1
                    outputs.append((slot, n - 1))
            tokens_batch.n_tokens = n
            step = time.perf_counter()
            status = llama_cpp.llama_decode(ctx, tokens_batch)
            if status != 0:
                raise LlamaCppError(f"llama_decode returned {status} (1: no room in the KV cache) at step {steps}")
            finished = []
            for slot, i in outputs:
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                if greedy:
                    token = int(np.argmax(logits))
                else:
                    scaled = logits.astype(np.float64) / temperature
                    probs = np.exp(scaled - scaled.max())
                    token = int(rng.choice(n_vocab, p=probs / probs.sum()))
                if slot.prefilling:
                    prefill_first += 1
                slot.prefilling = False
                slot.generated.append(token)
                ended = not ignore_eog and (token in ends or llama_cpp.llama_vocab_is_eog(vocab, token))
                if ended or len(slot.generated) >= max_new_tokens:
                    finished.append(slot)
                else:
                    slot.feed = [token]
            elapsed = time.perf_counter() - step
            if has_prompt:
                prefill_s += elapsed
            else:
                decode_s += elapsed
                decode_tokens += len(outputs)
            steps += 1
            for slot in finished:
                results[slot.prompt] = slot.generated
                llama_cpp.llama_memory_seq_rm(memory, slot.seq, -1, -1)
                active.remove(slot)
                free.append(slot.seq)
        wall = time.perf_counter() - started
    finally:
        llama_cpp.llama_batch_free(tokens_batch)
        llama_cpp.llama_free(ctx)
    generated = [r or [] for r in results]
    prompt_tokens = sum(len(p) for p in prompts)
    new = sum(len(g) for g in generated)
    return {
        "wall_s": wall, "setup_s": setup_s, "prompt_tokens": prompt_tokens, "generated_tokens": new,
        "tokens_per_s": (prompt_tokens + new) / wall, "generated_per_s": new / wall,
        "decode_only": {"tokens": decode_tokens, "seconds": decode_s,
                        "tokens_per_s": decode_tokens / decode_s if decode_s > 0 else float("nan")},
        "prefill": {"prompt_tokens": prompt_tokens, "first_tokens": prefill_first, "seconds": prefill_s,
                    "tokens_per_s": prompt_tokens / prefill_s if prefill_s > 0 else float("nan")},
        "steps": steps, "batch": batch, "threads": threads, "n_ctx": batch * per_seq, "kv_type": kv_type,
        "flash_attn": params.flash_attn_type, "kv_unified": kv_unified,
        "tokens": generated, "engine": f"llama.cpp via {PACKAGE} {llama_cpp.__version__}",
    }


def llamacpp_generate_serial(gguf_path: str | Path, prompts: list[list[int]], max_new_tokens: int, threads: int,
                             greedy: bool = True, **options: Any) -> dict[str, Any]:
    """The fallback: the prompts one after another (batch 1): `llamacpp_generate` with batch=1."""
    return llamacpp_generate(gguf_path, prompts, max_new_tokens, 1, threads, greedy, **options)
