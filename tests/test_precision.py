"""Precision by measurement (keelrl/inference/precision.py): the cache key, the cache file, the choice
rule, the CUDA rule, the config fields, and one real measurement on the tiny model.

Every test points the cache at its own tmp dir (KEELRL_PRECISION_CACHE, or cache_dir=): nothing is
written into the user's ~/.cache/keelrl."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from conftest import FAST_RUN, SMALL

from keelrl.config import TINY_RUN, load_config
from keelrl.errors import ConfigError
from keelrl.inference import precision
from keelrl.policy.model import learner_autocast, load_policy
from keelrl.policy.tiny import TinyModelSpec, build_tiny_model

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    """Each test's precision cache: a fresh directory."""
    cache = tmp_path / "precision-cache"
    monkeypatch.setenv(precision.CACHE_ENV, str(cache))
    return cache


@pytest.fixture(scope="module")
def small_model():
    return build_tiny_model(SMALL, 264, pad_token_id=0, eos_token_id=1)


class FakeProbes:
    """The probes replaced by fixed seconds per dtype, each call counted. A bf16 matmul given up on
    (slower than give_up_after) comes back None, as the real probe's."""

    def __init__(self, monkeypatch, matmul=(1e-3, 1e-3), decode=(0.035, 0.012), learner=(0.5, 0.6)) -> None:
        self.seconds = {"matmul": dict(zip(("float32", "bfloat16"), matmul)),
                        "decode": dict(zip(("float32", "bfloat16"), decode)),
                        "learner": dict(zip(("float32", "bfloat16"), learner))}
        self.calls: list[tuple[str, str]] = []
        monkeypatch.setattr(precision, "probe_matmul", self.matmul)
        monkeypatch.setattr(precision, "probe_copy", lambda model, dtype, layers: types.SimpleNamespace(dtype=dtype))
        monkeypatch.setattr(precision, "probe_decode", lambda copy_, device: self.timed("decode", copy_.dtype))
        monkeypatch.setattr(precision, "probe_learner", lambda copy_, dtype, device: self.timed("learner", dtype))
        monkeypatch.setattr(precision, "probe_head", lambda model, device: self.timed("head", torch.float32, 0.0))
        monkeypatch.setattr(precision, "probe_threads", lambda *args: {"current": 1, "available": 1})
        monkeypatch.setattr(precision, "_load_average", lambda: 0.0)  # a quiet machine: the file is kept

    def timed(self, probe: str, dtype: torch.dtype, seconds: float | None = None) -> float:
        name = str(dtype).removeprefix("torch.")
        self.calls.append((probe, name))
        return self.seconds[probe][name] if seconds is None else seconds

    def matmul(self, rows, inner, outer, dtype, device, give_up_after=None):
        seconds = self.timed("matmul", dtype)
        return None if give_up_after is not None and seconds > give_up_after else seconds


# ----------------------------------------------------------------- the key
def test_the_cache_key_changes_with_cpu_flags_torch_version_and_model_shape(monkeypatch, small_model):
    identity = {"cpu": "AMD EPYC", "flags": ["avx", "avx2", "fma"]}
    monkeypatch.setattr(precision, "cpu_identity", lambda: identity)
    base = precision.cache_key(small_model, CPU)
    assert base["cpu"] == "AMD EPYC" and base["torch"] == torch.__version__ and base["device"] == "cpu"
    assert base["flags"] == ["avx", "avx2", "fma"] and base["threads"] == torch.get_num_threads()
    assert base["model"] == {"hidden": 64, "intermediate": 128, "layers": 2, "vocab": 264, "dtype": "float32"}
    paths = {precision.cache_path(base)}

    monkeypatch.setattr(precision, "cpu_identity", lambda: {**identity, "flags": [*identity["flags"], "avx512_bf16"]})
    paths.add(precision.cache_path(precision.cache_key(small_model, CPU)))
    monkeypatch.setattr(precision, "cpu_identity", lambda: {**identity, "cpu": "Intel Xeon"})
    paths.add(precision.cache_path(precision.cache_key(small_model, CPU)))
    monkeypatch.setattr(precision, "cpu_identity", lambda: identity)
    with monkeypatch.context() as patched:
        patched.setattr(torch, "__version__", "9.9.9+cpu")
        paths.add(precision.cache_path(precision.cache_key(small_model, CPU)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        paths.add(precision.cache_path(precision.cache_key(small_model, CPU)))
    finally:
        torch.set_num_threads(threads)
    deeper = build_tiny_model(TinyModelSpec(layers=3, hidden=64, heads=4, kv_heads=2, intermediate=128), 264, 0, 1)
    wider = build_tiny_model(TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=256), 264, 0, 1)
    float64 = build_tiny_model(SMALL, 264, 0, 1).double()
    for other in (deeper, wider, float64):
        paths.add(precision.cache_path(precision.cache_key(other, CPU)))
    assert precision.cache_path(precision.cache_key(small_model, CPU)) in paths  # the same key, the same file
    assert len(paths) == 8  # base, a new flag, another CPU, another torch, threads, deeper, wider, float64 weights


def test_the_cpu_identity_reads_the_model_name_and_the_relevant_flags():
    identity = precision.cpu_identity()
    assert identity["cpu"] and set(identity["flags"]) <= set(precision.CPU_FLAGS)
    vendors = {line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.partition(":")[0].strip() == "vendor_id"}
    assert identity["vendor"] in vendors and identity["vendor"]


# ----------------------------------------------------------------- the cache file
def test_the_cache_file_round_trips_and_a_second_call_does_not_measure(monkeypatch, small_model, own_cache):
    probes = FakeProbes(monkeypatch)
    first = precision.measurement(small_model, CPU)
    measured = len(probes.calls)
    assert measured > 0 and Path(first["path"]).parent == own_cache
    second = precision.measurement(small_model, CPU)
    assert len(probes.calls) == measured  # read back, not measured again
    assert second == first
    assert json.loads(Path(first["path"]).read_text())["choices"] == first["choices"]
    # the injected decode step, body + head matmul: bf16 0.012 + 0.001 s against float32 0.035 + 0.001 s,
    # 0.036 / 0.013 = 2.77x; the learner: bf16 slower
    assert precision.resolve_dtype("auto", "eval", small_model, CPU) == (torch.bfloat16, first["choices"]["eval"]["why"])
    assert first["choices"]["eval"]["why"] == "bfloat16: decode step 2.77x faster than float32 here (0.013 s vs 0.036 s)"
    assert precision.resolve_dtype("auto", "learner", small_model, CPU)[0] == torch.float32
    precision.measurement(small_model, CPU, refresh=True)
    assert len(probes.calls) == 2 * measured  # refresh measures again


def test_caching_off_measures_every_time_and_writes_nothing(monkeypatch, small_model, own_cache):
    probes = FakeProbes(monkeypatch)
    monkeypatch.setenv(precision.CACHE_ENV, "off")
    assert precision.measurement(small_model, CPU)["path"] is None
    measured = len(probes.calls)
    precision.measurement(small_model, CPU)
    assert len(probes.calls) == 2 * measured and not own_cache.exists()


@pytest.mark.parametrize("content", ["{not json", json.dumps({"choices": {}}), json.dumps([1, 2]), ""])
def test_a_corrupt_cache_file_is_measured_again_with_a_warning(monkeypatch, small_model, content):
    probes = FakeProbes(monkeypatch)
    path = precision.cache_path(precision.cache_key(small_model, CPU))
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.warns(UserWarning, match="precision cache"):
        dtype, why = precision.resolve_dtype("auto", "eval", small_model, CPU)
    assert probes.calls and dtype == torch.bfloat16 and why.startswith("bfloat16")
    assert json.loads(path.read_text())["choices"]["eval"]["dtype"] == "bfloat16"  # replaced by a good one


def test_a_cache_file_of_another_key_is_measured_again(monkeypatch, small_model):
    FakeProbes(monkeypatch)
    record = precision.measurement(small_model, CPU)
    path = Path(record["path"])
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "key": {**stored["key"], "cpu": "another"}}))
    with pytest.warns(UserWarning, match="does not hold a measurement of this key"):
        precision.measurement(small_model, CPU)


def test_a_measurement_taken_beside_other_work_is_used_then_measured_again(monkeypatch, small_model, own_cache):
    """One core busy with others' work on a 1-core machine (load 2.0 as measuring begins, 1.0 of it
    this process's own) is a disturbed measurement: this process keeps its choices, the next
    process measures again and a quiet measurement replaces the file for good."""
    probes = FakeProbes(monkeypatch)
    monkeypatch.setattr(precision, "_load_average", lambda: 2.0)
    monkeypatch.setattr(precision, "_TAKEN_HERE", {})
    first = precision.measurement(small_model, CPU)
    measured = len(probes.calls)
    assert first["disturbed"] and first["load_before"] == 2.0
    assert json.loads(Path(first["path"]).read_text())["disturbed"] is True
    probes.seconds["decode"] = {"float32": 0.012, "bfloat16": 0.035}  # the quiet machine says otherwise
    assert precision.measurement(small_model, CPU)["choices"] == first["choices"]  # the same process: kept
    assert len(probes.calls) == measured
    monkeypatch.setattr(precision, "_TAKEN_HERE", {})  # a new process
    monkeypatch.setattr(precision, "_load_average", lambda: 1.4)  # 0.4 of a core besides this process: quiet
    second = precision.measurement(small_model, CPU)
    assert len(probes.calls) == 2 * measured and not second["disturbed"]
    assert first["choices"]["eval"]["dtype"] == "bfloat16" and second["choices"]["eval"]["dtype"] == "float32"
    assert precision.measurement(small_model, CPU)["measured_at"] == second["measured_at"]
    assert len(probes.calls) == 2 * measured  # kept in the file, read back
    assert not precision.disturbed(None, 2) and not precision.disturbed(1.9, 2) and precision.disturbed(2.0, 2)


def test_the_decode_probe_runs_the_keel_forward_pass_where_keel_has_the_model(monkeypatch, small_model):
    """keel's forward pass is timed for a model it runs (rollouts and evaluations sample through
    keel or vLLM, and HF's body in bf16 can be several times slower on the same CPU); HF's body only
    for a model keel has no forward pass for."""
    calls = []
    real_forward = precision.LlamaForward

    class Counted(real_forward):  # type: ignore[misc, valid-type]
        def __call__(self, weights, cache, batch):
            calls.append((batch.n_decode, batch.width, weights.embed.dtype))
            return super().__call__(weights, cache, batch)

    monkeypatch.setattr(precision, "LlamaForward", Counted)
    monkeypatch.setattr(precision, "_probe_decode_hf", lambda copy_, device: pytest.fail("keel runs this model"))
    for dtype in (torch.float32, torch.bfloat16):
        copy_ = precision.probe_copy(small_model, dtype, 1)
        assert precision.probe_decode(copy_, CPU) > 0
        assert calls[-1] == (precision.DECODE_ROWS, precision.DECODE_CONTEXT, dtype)
    assert len(calls) == 2 * (1 + precision.DECODE_STEPS)  # a warm-up and the timed steps, per dtype
    monkeypatch.setattr(precision, "unsupported_reason", lambda config: "not a Llama")
    monkeypatch.setattr(precision, "_probe_decode_hf", lambda copy_, device: 0.5)
    assert precision.probe_decode(precision.probe_copy(small_model, torch.float32, 1), CPU) == 0.5


# ----------------------------------------------------------------- the choice rule
def timings(decode: tuple[float | None, float | None], learner: tuple[float | None, float | None]) -> dict:
    return {"decode_step": {"float32": decode[0], "bfloat16": decode[1]},
            "learner_step": {"float32": learner[0], "bfloat16": learner[1]}}


def test_the_choice_rule_picks_the_faster_by_its_margin():
    # decode: 0.035 / 0.012 = 2.92x faster in bf16; learner: 0.5 / 0.4 = 1.25x >= 1.15
    choices = precision.choose(timings((0.035, 0.012), (0.5, 0.4)))
    assert choices["eval"] == choices["rollout"] == {
        "dtype": "bfloat16", "why": "bfloat16: decode step 2.92x faster than float32 here (0.012 s vs 0.035 s)"}
    assert choices["learner"]["dtype"] == "bfloat16" and "1.25x faster" in choices["learner"]["why"]
    # bf16 slower: 0.06 / 0.02 = 3x slower; learner 0.5 / 0.46 = 1.087x, under 1.15
    choices = precision.choose(timings((0.02, 0.06), (0.5, 0.46)))
    assert choices["eval"] == {"dtype": "float32", "why": "float32: bfloat16 decode step 3.00x slower here "
                                                          "(0.06 s vs 0.02 s)"}
    assert choices["learner"]["dtype"] == "float32" and "only 1.09x faster" in choices["learner"]["why"]
    assert "under the 1.15x" in choices["learner"]["why"]
    # sampling's margin is 1.10: 1.05x is a tie within noise, 1.11x wins
    assert precision.choose(timings((0.105, 0.1), (1, 1)))["eval"]["dtype"] == "float32"
    assert precision.choose(timings((0.111, 0.1), (1, 1)))["eval"]["dtype"] == "bfloat16"
    assert precision.choose(timings((1, 1), (1.16, 1.0)))["learner"]["dtype"] == "bfloat16"
    # a probe not timed in bf16 says why
    choices = precision.choose(timings((0.02, None), (0.5, None)), {"decode_step": "its matmuls ran 9x slower"})
    assert choices["eval"] == {"dtype": "float32", "why": "float32: its matmuls ran 9x slower"}
    assert choices["learner"] == {"dtype": "float32", "why": "float32: bfloat16 was not measured"}


def test_measure_skips_bf16_model_probes_when_its_matmuls_are_much_slower(monkeypatch, small_model):
    probes = FakeProbes(monkeypatch, matmul=(1e-3, 3e-3))  # 3x > SKIP_FACTOR
    record = precision.measure(small_model, CPU)
    assert ("decode", "bfloat16") not in probes.calls and ("learner", "bfloat16") not in probes.calls
    assert ("decode", "float32") in probes.calls and ("learner", "float32") in probes.calls
    assert record["timings_s"]["decode_step"]["bfloat16"] is None
    assert set(record["skipped"]) == {"decode_step", "learner_step"}
    assert record["choices"]["eval"]["dtype"] == "float32" and "was not timed" in record["choices"]["eval"]["why"]
    assert "more than 2x slower" in record["skipped"]["learner_step"]
    # timed when they are close: 1.5x slower matmuls do not settle it
    probes = FakeProbes(monkeypatch, matmul=(1e-3, 1.5e-3), learner=(0.5, 0.4))
    record = precision.measure(small_model, CPU)
    assert ("decode", "bfloat16") in probes.calls and ("learner", "bfloat16") in probes.calls
    assert record["choices"]["learner"]["dtype"] == "bfloat16"
    # the decode step's estimate: layers / timed layers x the body's step + the head matmul
    assert record["timings_s"]["decode_step"]["bfloat16"] == pytest.approx(0.012 * 2 / 2 + 1.5e-3)


def test_a_slow_first_call_is_start_up_not_a_verdict(monkeypatch):
    """A library builds its kernel on a shape's first call (oneDNN's bf16 matmuls: a millisecond or
    more, against a tenth of that after): a warm-up is given up on only past WARM_UP_SLACK times
    the give-up time and past WARM_UP_FLOOR_S; the timed calls decide."""
    clock = {"now": 0.0}
    monkeypatch.setattr(precision.time, "perf_counter", lambda: clock["now"])

    def calls(*durations):
        queue = list(durations)

        def run():
            clock["now"] += queue.pop(0)
        return run

    # warm-up 2 ms (10x the 0.2 ms give-up time, under the floor), then 0.1 ms calls: timed, 0.1 ms
    assert precision._best_time(calls(2e-3, 1e-4, 1e-4, 1e-4), give_up_after=2e-4) == pytest.approx(1e-4)
    # a warm-up past both the slack and the floor: given up
    assert precision._best_time(calls(0.3, 1e-4, 1e-4, 1e-4), give_up_after=2e-4) is None
    # past the floor but within the slack of a slow probe's give-up time: timed
    assert precision._best_time(calls(0.3, 0.08, 0.09, 0.1), give_up_after=0.1) == pytest.approx(0.08)
    # a timed call over the give-up time: given up
    assert precision._best_time(calls(1e-4, 3e-4, 1e-4, 1e-4), give_up_after=2e-4) is None


# ----------------------------------------------------------------- CUDA and explicit settings
def test_cuda_is_bf16_without_measuring_unless_the_device_lacks_it(monkeypatch, small_model):
    monkeypatch.setattr(precision, "measure", lambda *args, **kwargs: pytest.fail("CUDA is not measured"))
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    for use in precision.USES:
        assert precision.resolve_dtype("auto", use, small_model, cuda) == (torch.bfloat16, "CUDA: bf16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert precision.resolve_dtype("auto", "learner", small_model, cuda)[0] == torch.float32
    assert precision.resolve_dtype("auto", "eval", small_model, torch.device("mps"))[0] == torch.float32


def test_explicit_settings_pass_through_and_bad_ones_fail(monkeypatch, small_model):
    monkeypatch.setattr(precision, "measure", lambda *args, **kwargs: pytest.fail("an explicit setting is not measured"))
    assert precision.resolve_dtype("bfloat16", "rollout", small_model, CPU) == (torch.bfloat16, "bfloat16: set explicitly")
    assert precision.resolve_dtype("float32", "learner", small_model, CPU)[0] == torch.float32
    with pytest.raises(ValueError, match="valid: auto, float32, bfloat16"):
        precision.resolve_dtype("fp16", "eval", small_model, CPU)
    with pytest.raises(ValueError, match="valid: eval, rollout, learner"):
        precision.resolve_dtype("auto", "sampler", small_model, CPU)


def test_learner_autocast_takes_the_resolved_precision_and_refuses_auto(monkeypatch, small_model):
    FakeProbes(monkeypatch, learner=(0.5, 0.4))  # bf16 autocast 1.25x faster
    dtype, _ = precision.resolve_dtype("auto", "learner", small_model, CPU)
    with learner_autocast(CPU, str(dtype).removeprefix("torch.")):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with learner_autocast(CPU, "float32"):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="resolve it first"):
        learner_autocast(CPU, "auto")


# ----------------------------------------------------------------- the config fields
def test_the_rollout_fields_default_and_validate_naming_the_dotted_field():
    rollout = load_config().rollout
    assert (rollout.dtype, rollout.decoder, rollout.kv_budget_mb) == ("float32", "auto", 4096)
    assert load_config(overrides=["rollout.dtype=auto", "rollout.decoder=hf"]).rollout.dtype == "auto"
    for override, field in (("rollout.dtype=fp16", "rollout.dtype"), ("rollout.decoder=", "rollout.decoder"),
                            ("rollout.kv_budget_mb=0", "rollout.kv_budget_mb"),
                            ("rollout.kv_budget_mb=-5", "rollout.kv_budget_mb"),
                            ("rollout.kv_budget_mb=1.5", "rollout.kv_budget_mb"),
                            ("eval.dtype=fp8", "eval.dtype"), ("perf.learner_precision=half", "perf.learner_precision")):
        with pytest.raises(ConfigError) as caught:
            load_config(overrides=[override])
        assert caught.value.field == field, override


# ----------------------------------------------------------------- wired in
def test_eval_auto_evaluates_in_the_measured_dtype(monkeypatch, tiny_model_dir):
    from keelrl.rollout.scheduler import EpisodeLimits
    from keelrl.train.evaluation import Evaluator

    FakeProbes(monkeypatch)  # decode: bf16 faster
    model, tokenizer = load_policy(str(tiny_model_dir), CPU)
    cfg = load_config(overrides=["eval.dtype=auto"])
    evaluator = Evaluator(cfg, model, tokenizer, CPU, make_env=lambda: None, rollout=EpisodeLimits.of(cfg.rollout, 2),
                          prm=None, autocast=lambda: None)
    assert evaluator.eval_dtype() == torch.bfloat16 and model.dtype == torch.float32
    FakeProbes(monkeypatch, decode=(0.01, 0.03))
    precision.measurement(model, CPU, refresh=True)
    assert evaluator.eval_dtype() == torch.float32  # float32 measured faster: the policy's own dtype


def test_the_run_records_its_precision_and_keeps_its_config_as_given(monkeypatch, tiny_model_dir, tmp_path):
    from keelrl.train.trainer import Trainer

    FakeProbes(monkeypatch, learner=(0.5, 0.4))  # bf16 decode 2.9x and bf16 autocast 1.25x faster
    events: list[tuple[str, dict]] = []
    cfg = load_config(overrides=[*TINY_RUN, *FAST_RUN, f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}",
                                 "eval.dtype=auto", "perf.learner_precision=auto", "train.steps=0",
                                 "eval.before_rl=false", "eval.base=false"])
    trainer = Trainer(cfg, progress=lambda event, info: events.append((event, info)))
    assert trainer.learner.cfg.perf.learner_precision == "bfloat16"  # resolved once, for every pass
    assert trainer.cfg.perf.learner_precision == "auto"
    trainer.run()
    recorded = json.loads((tmp_path / "run" / "precision.json").read_text())
    assert recorded["eval"]["setting"] == "auto" and recorded["eval"]["dtype"] == "bfloat16"
    assert recorded["learner"]["dtype"] == "bfloat16" and "1.25x faster" in recorded["learner"]["why"]
    assert recorded["measurement"]["timings_s"]["decode_step"] == {"float32": 0.035 + 1e-3, "bfloat16": 0.012 + 1e-3}
    line = next(info["line"] for event, info in events if event == "precision")
    assert line.startswith("precision: eval bfloat16 (bfloat16: decode step") and ", learner bfloat16 (" in line
    reread = load_config(tmp_path / "run" / "config.yaml")  # config.yaml still loads, with the settings as given
    assert reread.eval.dtype == "auto" and reread.perf.learner_precision == "auto"


# ----------------------------------------------------------------- real measurements
def test_a_real_measurement_on_the_tiny_model_is_quick_valid_and_leaves_the_model_alone(tiny_model_dir, own_cache):
    model, _ = load_policy(str(tiny_model_dir), CPU)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    record = precision.measurement(model, CPU)
    assert record["seconds"] < 30 and Path(record["path"]).exists()
    for use in precision.USES:
        assert record["choices"][use]["dtype"] in ("float32", "bfloat16") and record["choices"][use]["why"]
    for probe in ("decode_step", "learner_step"):
        assert record["timings_s"][probe]["float32"] > 0
    assert all(torch.equal(p, before[name]) and p.grad is None for name, p in model.named_parameters())
    assert model.dtype == torch.float32
    if not record["disturbed"]:  # a measurement beside other work (this suite's own) is measured again
        assert precision.measurement(model, CPU)["measured_at"] == record["measured_at"]  # cached


def test_the_bf16_model_probes_run_for_real_when_not_skipped(monkeypatch, tiny_model_dir):
    """This machine may skip them (slow bf16 matmuls): forced here, so their code runs somewhere."""
    monkeypatch.setattr(precision, "SKIP_FACTOR", float("inf"))
    model, _ = load_policy(str(tiny_model_dir), CPU)
    record = precision.measure(model, CPU)
    assert record["skipped"] == {}
    for probe in ("decode_step", "learner_step"):
        assert record["timings_s"][probe]["bfloat16"] > 0
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())


def test_keel_precision_prints_the_table_and_the_choices(tiny_model_dir, capsys):
    from keelrl.cli import main

    assert main(["precision", "--model", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert f"decode step ({precision.DECODE_ROWS} rows" in out and f"learner micro-batch ({precision.LEARNER_ROWS} x {precision.LEARNER_TOKENS} tokens" in out
    for use in precision.USES:
        assert f"{use}=auto: " in out
    assert "cache: " in out
