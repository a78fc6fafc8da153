"""`python -m bench --smoke` runs the benchmarks end to end at their smallest size and writes the report.

The tests of that run are marked slow (`python -m pytest -q -m slow`); the rest run by default.

One run (module fixture) of the harness over the kernel, TRL, sampler and async benchmarks; the
tests read its sections and check what each says it measured: exact token counts, both sides of
every comparison, values that agree. Nothing here checks a speed. bench.gpu and
bench.bench_scaling have their own smoke tests (tests/test_bench_gpu.py, test_bench_scaling.py).
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_async import crossover  # noqa: E402
from bench.__main__ import BENCHES  # noqa: E402
from bench.common import Ratio, Section, fmt_spread, read_section, spread, write_section  # noqa: E402
from bench.synthetic import ToolLatency, TurnsEnv, PromptTask, reward_of  # noqa: E402

SMOKED = ("kernel", "trl", "sampler", "async", "async_heldout")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--only", *SMOKED, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.mark.slow  # the module's one `python -m bench --smoke` run: minutes beside other load
def test_the_report_lists_every_benchmark_and_each_ratio_against_its_target(smoke):
    report = (smoke / "BENCHMARKS.md").read_text()
    assert "smoke sizes: these figures measure nothing" in report
    for name in ("trl", "kernel", "sampler", "async", "async_heldout", "scaling", "gpu"):
        assert f"(`{name}`)" in report
    assert report.count("not run yet in this output directory") == len(BENCHES) - len(SMOKED)  # the ones not asked for
    summary = json.loads((smoke / "summary.json").read_text())
    for name in SMOKED:
        ratios = summary[name]
        assert ratios, name
        for ratio in ratios:
            if name == "async_heldout" and "NOT equal" in ratio["name"]:
                assert not math.isfinite(ratio["value"]) and not ratio["met"]  # unequal held-out: no speed-up counts
                continue
            assert math.isfinite(ratio["value"]) and ratio["met"] == (
                ratio["value"] >= ratio["target"] if "memory" not in ratio["name"] else ratio["value"] <= ratio["target"])
            assert f"| {name} | {ratio['name']} |" in report


@pytest.mark.slow  # the module's one `python -m bench --smoke` run: minutes beside other load
def test_kernel_smoke_runs_both_implementations_with_equal_values(smoke):
    section = read_section(smoke / "kernel" / "section.json")
    rows = section.data["rows"]
    assert [(r["vocab"], r["length"]) for r in rows] == [(8192, 256), (8192, 512)]
    for row in rows:
        assert row["keelrl"]["peak_bytes"] >= 0 and row["naive"]["peak_bytes"] > 0
        assert row["max_relative_gap"] < 1e-4  # float32 sums of 512 log-probs and gradient norms


@pytest.mark.slow  # the module's one `python -m bench --smoke` run: minutes beside other load
def test_trl_smoke_trains_both_libraries_on_the_same_prompts_with_exact_lengths(smoke):
    section = read_section(smoke / "trl" / "section.json")
    results = section.data["results"]["tiny"]
    settings = section.data["settings"]
    tokens = settings["prompts"] * settings["group"] * settings["completion_tokens"]
    for library in ("keelrl", "trl"):
        steps = results[library]["steps"]
        assert len(steps) == settings["steps"]
        assert all(round(s["completion_tokens"]) == tokens and 0 < s["learn_s"] <= s["step_s"] for s in steps)
    assert results["keelrl"]["prompt_tokens_mean"] == results["trl"]["prompt_tokens_mean"]
    assert [r.name for r in section.ratios] == ["tiny: full step tokens/s, keelrl / TRL",
                                                "tiny: learner tokens/s, keelrl / TRL"]


@pytest.mark.slow  # the module's one `python -m bench --smoke` run: minutes beside other load
def test_sampler_smoke_counts_the_history_each_turn_recomputes(smoke):
    data = read_section(smoke / "sampler" / "section.json").data
    multi = data["multi_turn"]
    batch, group, turns = multi["batch"], multi["group"], multi["turns"]
    grown = multi["new_tokens"] + multi["observation_tokens"]  # each row's history grows by this a turn
    hf, keel = multi["hf"][0]["recomputed_per_turn"], multi["keelrl"][0]["recomputed_per_turn"]
    assert len(hf) == len(keel) == turns
    assert [b - a for a, b in zip(hf, hf[1:])] == [batch * grown] * (turns - 1)  # HF: the whole history again
    prompt = hf[0] // batch  # the smoke prompts all have one length
    assert keel[0] == (batch // group) * prompt + (batch - batch // group)  # one prefill a group, a token a row
    assert keel[1:] == [batch * (1 + multi["observation_tokens"])] * (turns - 1)  # kept keys: only new tokens
    assert all(r["tokens"] == batch * turns * multi["new_tokens"] for r in multi["keelrl"] + multi["hf"])
    assert {(row["group"], row["dtype"]) for row in data["configs"] if "dtype" in row} == {
        (1, "float32"), (1, "bfloat16"), (2, "float32"), (2, "bfloat16")}


@pytest.mark.slow  # the module's one `python -m bench --smoke` run: minutes beside other load
def test_async_smoke_runs_both_engines_at_every_latency(smoke):
    section = read_section(smoke / "async" / "section.json")
    settings = section.data["settings"]
    results = section.data["results"]
    assert sorted(float(x) for x in results) == sorted(settings["latencies"])
    for runs in results.values():
        for engine in ("sync", "async"):
            steps = runs[engine]["steps"]
            assert len(steps) == settings["steps"]
            assert all(s["action_tokens"] == settings["turns"] * settings["completion_tokens"] for s in steps)
            assert runs[engine]["timed_s"] == pytest.approx(sum(s["step_s"] for s in steps[1:]))
        assert all(s["staleness_mean"] == 0 for s in runs["sync"]["steps"])
        assert all(s["staleness_mean"] <= settings["max_staleness"] for s in runs["async"]["steps"])
    assert len(section.data["speedups"]) == len(settings["latencies"])


@pytest.mark.slow  # the module's one `python -m bench --smoke` run: minutes beside other load
def test_async_heldout_smoke_evaluates_both_engines_on_the_warm_start_tasks(smoke):
    section = read_section(smoke / "async_heldout" / "section.json")
    data = section.data
    tasks = set(data["before"]["task_success"])
    assert len(tasks) == data["settings"]["eval_tasks"]
    for engine in ("sync", "async"):
        run = data["runs"][engine]
        assert set(run["task_success"]) == tasks  # the same held-out tasks before and after, both engines
        assert len(run["steps"]) == data["settings"]["steps"]
    assert all(s["staleness_mean"] == 0 for s in data["runs"]["sync"]["steps"])
    assert math.isfinite(data["gap"])


# --------------------------------------------------------------------------- the pieces, by hand
def test_spread_and_its_format_by_hand():
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    assert fmt_spread([3.0, 1.0, 2.0, 10.0]) == "2.50 (1.00-10.00, n=4)"
    assert fmt_spread([0.5]) == "0.50 (n=1)"
    with pytest.raises(ValueError):
        spread([])


def test_a_ratio_is_met_in_its_own_direction_and_never_when_not_finite():
    assert Ratio("speed", 1.5, 1.5).met and not Ratio("speed", 1.49, 1.5).met
    assert Ratio("memory", 0.25, 0.25, higher_is_better=False).met
    assert not Ratio("memory", 0.26, 0.25, higher_is_better=False).met
    assert not Ratio("speed", math.nan, 1.5).met and not Ratio("speed", math.inf, 1.5).met


def test_a_section_round_trips_through_its_json(tmp_path):
    section = Section("x", "X", "body", [Ratio("r", 2.0, 1.5, detail="d")], smoke=True, seconds=3.0, data={"k": [1]})
    write_section(tmp_path, section)
    assert read_section(tmp_path / "section.json") == section
    assert json.loads((tmp_path / "section.json").read_text())["ratios"][0]["met"] is True


def test_crossover_interpolates_where_the_speed_up_reaches_one():
    assert crossover([0, 2, 6], [0.8, 1.2, 1.6]) == pytest.approx(1.0)  # 0.8 -> 1.2 over 0..2: 1 at x = 1
    assert crossover([0, 4], [1.1, 1.9]) == 0  # async wins already without latency
    assert crossover([0, 4], [0.5, 0.9]) is None


def test_tool_latency_repeats_per_task_and_turn_and_has_its_log_normal_mean():
    latency = ToolLatency(2.0, 0.5, seed=3)
    assert latency.delay("t1", 0) == latency.delay("t1", 0) != latency.delay("t1", 1)
    assert ToolLatency(0.0).delay("t1", 0) == 0.0
    draws = [ToolLatency(2.0, 0.5, seed=s).delay(f"t{i}", 0) for s in range(20) for i in range(200)]
    assert sum(draws) / len(draws) == pytest.approx(2.0 * math.exp(0.125), rel=0.03)  # E[exp(sZ)] = exp(s^2/2)
    with pytest.raises(ValueError, match="median_s >= 0"):
        ToolLatency(-1.0)


def test_the_synthetic_env_answers_each_turn_then_scores_the_text():
    env = TurnsEnv(2, "obs")
    assert env.reset(PromptTask("a", "the prompt")) == "the prompt"
    assert env.step("ab c!")[:2] == ("obs", False)
    assert env.step("d1")[:2] == ("", True)
    assert env.grade().reward == pytest.approx(reward_of("ab c!d1")) == pytest.approx(5 / 7)
    assert reward_of("") == 0.0 and reward_of("12") == 0.0 and reward_of("a b") == 1.0
    random.seed(0)
