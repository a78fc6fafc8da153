"""bench/llamacpp.py: the llama.cpp baseline converts the same weights and decodes them like HF.

llama-cpp-python is a bench-only extra (a source build), so every test that needs it is skipped
where it is not installed; CI does not have it. The built-in tiny model cannot be converted:
llama.cpp's converter recognises a BPE tokenizer only by the ids it gives a probe text (a hash
of known models' tokenizers), and the tiny byte-level one is no known model's (transformers 5
also loads it as a Qwen2Tokenizer with a 265th token the 264-row model lacks, which the converter
asserts against first). So the greedy tests use a tiny random Llama over SmolLM2's tokenizer
(skipped unless SmolLM2 is in keelrl's cache), and the tiny default model is checked to be
refused with the converter's reason.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from bench.llamacpp import LlamaCppError, gguf_of

NEAR_TIE = 1e-3
"""Greedy tokens are compared up to the first step at which HF's top two logits are closer than this."""


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python (bench-only extra, `pip install -e .[llamacpp]`) "
                                                   "is not installed")


@pytest.fixture(scope="module")
def converter(llama_cpp) -> Path:
    """llama.cpp's convert_hf_to_gguf.py, from keelrl's real cache (fetched once if it is not there)."""
    from bench.llamacpp import converter_dir

    try:
        return converter_dir() / "convert_hf_to_gguf.py"
    except LlamaCppError as error:
        pytest.skip(f"llama.cpp's converter is not available: {error}")


def smollm2_dir() -> Path:
    from keelrl.policy.download import list_models

    row = next(row for row in list_models() if row["name"] == "smollm2")
    if not row["cached"]:
        pytest.skip("SmolLM2 is not in keelrl's cache (`keel model fetch smollm2`); its tokenizer is the one the "
                    "converter recognises")
    return Path(row["path"])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, converter) -> tuple[Path, Path]:
    """(HF directory, F32 GGUF) of a 2-layer random Llama over SmolLM2's tokenizer, converted into a temporary cache."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = smollm2_dir()
    directory = tmp_path_factory.mktemp("tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, directory / name)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         initializer_range=0.5)  # peaked logits: few near-ties between the two engines' argmax
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        LlamaForCausalLM(config).save_pretrained(directory)
    finally:
        torch.random.set_rng_state(state)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KEELRL_CACHE", str(tmp_path_factory.mktemp("cache")))
        gguf = gguf_of(directory, "f32", converter=converter)
    return directory, gguf


def hf_greedy(directory: Path, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Per prompt, HF's greedy tokens (no end token: exactly `new_tokens`) and each step's top-2 logit margin."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            tokens, margins = [], []
            for _ in range(new_tokens):  # the whole sequence each step, no cache: short, and plainly right
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
                top = logits.topk(2).values
                margins.append(float(top[0] - top[1]))
                tokens.append(int(logits.argmax()))
            out.append((tokens, margins))
    return out


def assert_same_greedy(got: list[int], expected: tuple[list[int], list[float]]) -> None:
    tokens, margins = expected
    upto = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(tokens))
    assert upto >= len(tokens) // 2, f"HF's logits nearly tie at step {upto}: the prompt tells nothing"
    assert got[:upto] == tokens[:upto], f"llama.cpp {got} != HF {tokens} (compared up to step {upto})"


def chat_prompts(directory: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    from keelrl.rollout.scheduler import prompt_tokens

    tokenizer = AutoTokenizer.from_pretrained(directory)
    return [prompt_tokens(tokenizer, text) for text in texts]


TEXTS = ["Fix the bug in add(a, b): it returns a - b.", "Write a test for parse_date('2024-01-31').",
         "Rename the variable x to count everywhere in utils.py and keep the tests passing."]


# --------------------------------------------------------------------------- no llama.cpp needed
def test_a_missing_llama_cpp_is_named_with_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    with pytest.raises(LlamaCppError, match=r"llama-cpp-python is a bench-only extra.*pip install -e \.\[llamacpp\]"):
        gguf_of(tmp_path)


def test_gguf_of_refuses_an_unknown_outtype_and_a_non_model_directory(tmp_path):
    with pytest.raises(ValueError, match="outtype 'q4'"):
        gguf_of(tmp_path, "q4")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        gguf_of(tmp_path)


# --------------------------------------------------------------------------- with llama.cpp
@pytest.mark.slow  # the converter's start-up (torch, transformers) is ~15 s
def test_tiny_default_model_is_refused_with_the_converters_reason(tiny_model_dir, converter, tmp_path, monkeypatch):
    monkeypatch.setenv("KEELRL_CACHE", str(tmp_path))
    with pytest.raises(LlamaCppError, match="could not convert"):
        gguf_of(tiny_model_dir, converter=converter)
    assert not list(tmp_path.rglob("*.gguf")), "a failed conversion left a file behind"


@pytest.mark.slow  # one conversion, ~15 s
def test_tiny_llama_converts_once_and_decodes_greedy_as_hf(tiny_llama, converter, monkeypatch):
    from bench.llamacpp import llamacpp_generate

    directory, gguf = tiny_llama
    assert gguf.is_file() and gguf.with_suffix(".json").is_file()
    monkeypatch.setenv("KEELRL_CACHE", str(gguf.parent.parent))
    assert gguf_of(directory, "f32", converter=converter) == gguf  # cached: same file, no second conversion

    prompts = chat_prompts(directory, TEXTS)
    expected = hf_greedy(directory, prompts, 12)
    for batch in (1, 2, 3):  # 2: the third prompt waits for a finished sequence's slot
        result = llamacpp_generate(gguf, prompts, 12, batch, 1, ignore_eog=True)
        assert result["generated_tokens"] == 3 * 12 and result["prompt_tokens"] == sum(map(len, prompts))
        for got, want in zip(result["tokens"], expected):
            assert_same_greedy(got, want)
    assert result["decode_only"]["tokens"] + result["prefill"]["first_tokens"] == result["generated_tokens"]


@pytest.mark.slow
def test_end_tokens_stop_a_sequence_and_ignore_eog_does_not(tiny_llama):
    from bench.llamacpp import llamacpp_generate

    directory, gguf = tiny_llama
    prompts = chat_prompts(directory, TEXTS[:2])
    full = llamacpp_generate(gguf, prompts, 8, 2, 1, ignore_eog=True)["tokens"]
    stop = full[0][2]  # the first prompt's third token ends its sequence there
    stopped = llamacpp_generate(gguf, prompts, 8, 2, 1, end_ids=[stop])["tokens"]
    assert stopped[0] == full[0][:3]
    cut = full[1].index(stop) + 1 if stop in full[1] else 8
    assert stopped[1] == full[1][:cut]


@pytest.mark.slow  # SmolLM2: converts once into keelrl's cache (~15 s), then 2 x 16 tokens
def test_smollm2_gguf_tokenizes_and_decodes_greedy_as_hf(llama_cpp, converter):
    from transformers import AutoTokenizer

    from bench.llamacpp import llamacpp_generate, llamacpp_tokenize

    directory = smollm2_dir()
    gguf = gguf_of(directory, "f32", converter=converter)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompts = chat_prompts(directory, TEXTS[:2])
    for ids in prompts:  # the chat prompt as text, through the GGUF's tokenizer: the same ids
        assert llamacpp_tokenize(gguf, tokenizer.decode(ids)) == ids
    expected = hf_greedy(directory, prompts, 16)
    result = llamacpp_generate(gguf, prompts, 16, 2, 2, ignore_eog=True)
    for got, want in zip(result["tokens"], expected):
        assert_same_greedy(got, want)


@pytest.mark.slow
def test_sampling_is_seeded_and_a_cold_temperature_is_greedy(tiny_llama):
    from bench.llamacpp import llamacpp_generate

    directory, gguf = tiny_llama
    prompts = chat_prompts(directory, TEXTS[:2])
    greedy = llamacpp_generate(gguf, prompts, 6, 2, 1, ignore_eog=True)["tokens"]
    cold = llamacpp_generate(gguf, prompts, 6, 2, 1, False, ignore_eog=True, temperature=1e-4)["tokens"]
    assert cold == greedy
    draws = [llamacpp_generate(gguf, prompts, 6, 2, 1, False, ignore_eog=True, seed=seed)["tokens"] for seed in (1, 1, 2)]
    assert draws[0] == draws[1] != draws[2]
