"""bench/bench_scaling.py: its smoke run times keelrl's own Trainer at the points it says (three
sweeps, exact token counts checked against the trainer's rows, a real PNG), and its counts,
budget, fit, growth exponent and claims follow numbers worked by hand. The smoke run's tests are
marked slow (`python -m pytest -q -m slow tests/test_bench_scaling.py`), as tests/test_bench.py's."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `bench` is a top-level package of the checkout, not installed
    sys.path.insert(0, str(REPO))

from bench.bench_scaling import (  # noqa: E402
    Point, check_step, fit_line, growth, growth_exponent, reasons, step_counts, summarize, timed_steps,
)

SMOKE_X = {"length": [4, 8], "turns": [1, 2], "group": [2, 4]}
"""--smoke's sweeps: L in (4, 8), K in (1, 2), G in (2, 4)..."""
SMOKE_BASE = {"length": 8, "turns": 1, "group": 2}
"""...each at the others' base values L=8, K=1, G=2; 2 tasks, 48-token prompts, a warm-up and 2 timed steps."""
FIGURE = REPO / "docs" / "figures" / "bench_scaling.png"


def _stamp(path: Path) -> tuple[int, int] | None:
    return (path.stat().st_mtime_ns, path.stat().st_size) if path.exists() else None


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("scaling")
    figure_before = _stamp(FIGURE)
    result = subprocess.run([sys.executable, "-m", "bench.bench_scaling", "--smoke", "--out", str(out)],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    section = json.loads((out / "section.json").read_text())
    return {"out": out, "section": section, "data": section["data"], "figure_before": figure_before,
            "figure_after": _stamp(FIGURE)}


@pytest.mark.slow  # the module's one `bench.bench_scaling --smoke` run: a minute of a 2-core machine
def test_smoke_section_is_a_smoke_scaling_section_without_ratios(smoke):
    section = smoke["section"]
    assert section["name"] == "scaling" and section["smoke"] is True
    assert section["ratios"] == []
    assert section["seconds"] > 0
    assert smoke["data"]["setup"]["model"] == "tiny" and smoke["data"]["setup"]["reps"] == 2


@pytest.mark.slow  # the module's one `bench.bench_scaling --smoke` run: a minute of a 2-core machine
def test_the_trainer_ran_grpo_without_kl_reference_or_proximal_pass(smoke):
    trainer = smoke["data"]["trainer"]
    assert trainer["algo_preset"] == "grpo" and trainer["kl_coef"] == 0.0 and trainer["engine"] == "sync"
    # read off the trainer itself (its reference model, its prox_from_update), and said so in the section
    assert trainer["reference_pass"] is False and trainer["proximal_pass"] is False
    assert "no reference pass, and the proximal log-probs from the update's own pass" in smoke["section"]["markdown"]
    for point in smoke["data"]["points"]:  # one minibatch: the whole step's rows
        assert point["trainer"]["minibatch_size"] == point["rows"] == 2 * point["group"]


@pytest.mark.slow  # the module's one `bench.bench_scaling --smoke` run: a minute of a 2-core machine
def test_three_sweeps_with_their_x_values_and_the_others_at_base(smoke):
    data = smoke["data"]
    assert set(data["sweeps"]) == set(SMOKE_X)
    for name, xs in SMOKE_X.items():
        sweep = data["sweeps"][name]
        assert sweep["x"] == xs
        points = [data["points"][i] for i in sweep["points"]]
        assert [point[name] for point in points] == xs
        for point in points:
            assert {k: point[k] for k in SMOKE_BASE if k != name} == {k: v for k, v in SMOKE_BASE.items() if k != name}
            assert point["skipped_reps"] == 0
            # one run of 3 trainer steps: step 1 is the warm-up, steps 2 and 3 are timed
            assert point["warmup"]["step"] == 1
            assert [m["step"] for m in point["measurements"]] == [2, 3]
    # the base point (8, 1, 2) is in all three sweeps and measured once: 2 + 2 + 2 - 2 points
    assert len(data["points"]) == 4


@pytest.mark.slow  # the module's one `bench.bench_scaling --smoke` run: a minute of a 2-core machine
def test_every_step_ran_exactly_rows_x_turns_x_length_action_tokens(smoke):
    data = smoke["data"]
    prompts, observation = data["prompt_tokens"], data["observation_tokens"]
    assert prompts == [48, 48]  # 2 tasks, both cut to 48 tokens
    assert 0 < observation <= data["setup"]["observation_tokens"] == 16
    for point in data["points"]:
        L, K, G = point["length"], point["turns"], point["group"]
        rows = 2 * G
        assert point["rows"] == rows
        assert point["counts"]["generated_tokens"] == rows * K * L
        for m in [point["warmup"], *point["measurements"]]:
            # the trainer's own rows: action tokens per trajectory x rows, turns, mean episode length
            assert m["action_tokens"] * rows == rows * K * L
            assert m["turns"] == K
            assert m["episode_tokens"] == 48 + K * L + (K - 1) * observation
            assert m["step_s"] > m["learn_s"] > 0
            assert m["sample_s"] == pytest.approx(m["step_s"] - m["learn_s"], abs=1e-12)
            assert 0 < m["generate_s"] <= m["sample_s"] + 1e-3  # the sampler's share of the rollouts
            assert m["micro_batches"] == 1  # at most 226 learner tokens, under the 2048 budget


@pytest.mark.slow  # the module's one `bench.bench_scaling --smoke` run: a minute of a 2-core machine
def test_turns_re_prefill_the_history_and_the_learner_runs_each_prompt_once(smoke):
    data = smoke["data"]
    observation = data["observation_tokens"]
    (two_turns,) = [p for p in data["points"] if p["turns"] == 2]
    counts = two_turns["counts"]
    # K=2, L=8, G=2, 2 tasks of 48 prompt tokens: turn 1 prefills the 2 distinct prompts once (96 tokens);
    # turn 2 each of the 4 rows' whole history: prompt + 8 action tokens + the observation.
    history = 48 + 8 + observation
    assert counts["prefill_tokens"] == 2 * 48 + 4 * history
    # One pass by shared prompt: each group's prompt once, cut before its last token (47), then each row
    # from there to its end (prompt + 8 + observation + 8): with the 16-token observation, 2 x 47 + 4 x 33 = 226.
    assert counts["learner_tokens"] == 2 * 47 + 4 * (history + 8 - 47)
    one_turn = data["points"][data["sweeps"]["turns"]["points"][0]]
    assert one_turn["turns"] == 1 and one_turn["counts"]["prefill_tokens"] == 2 * 48  # one turn: the prompts alone


@pytest.mark.slow  # the module's one `bench.bench_scaling --smoke` run: a minute of a 2-core machine
def test_png_is_written_linked_and_the_docs_figure_left_alone(smoke):
    png = Path(smoke["data"]["png"])
    assert png.parent == smoke["out"] and png.name == "scaling.png"
    blob = png.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(blob) > 20_000  # three panels of lines, not an empty canvas (about 100 kB)
    assert f"]({smoke['data']['figure']})" in smoke["section"]["markdown"]
    assert Path(smoke["data"]["figure"]) == png  # --smoke links its own PNG...
    assert smoke["figure_after"] == smoke["figure_before"]  # ...and never writes docs/figures


@pytest.mark.slow  # the module's one `bench.bench_scaling --smoke` run: a minute of a 2-core machine
def test_reported_exponents_and_verdicts_follow_the_measured_medians(smoke):
    data, markdown = smoke["data"], smoke["section"]["markdown"]
    for name, sweep in data["sweeps"].items():
        points = [data["points"][i] for i in sweep["points"]]
        medians = [sum(m["step_s"] for m in p["measurements"]) / 2 for p in points]  # the median of two: their mean
        exponent = growth_exponent(sweep["x"], medians)
        assert sweep["exponent"]["step"] == pytest.approx(exponent, rel=1e-9)
        assert data["exponents"][name]["step"] == pytest.approx(exponent, rel=1e-9)
        assert sweep["verdict"]["step"] == growth(exponent)
        assert f"step {exponent:.2f} ({growth(exponent)})" in markdown


# --------------------------------------------------------------------------- the helpers, by hand
def test_step_counts_by_hand():
    # L=3, K=3, G=2, prompts of 10 and 12 tokens, a 5-token observation.
    counts = step_counts(Point(length=3, turns=3, group=2), [10, 12], 5)
    # episodes: 10 + 3 x 3 + 2 x 5 = 29 and 12 + 9 + 10 = 31, two rows each: 2 x 29 + 2 x 31 = 120
    assert counts["episode_tokens"] == 120
    assert counts["rows"] == 4 and counts["generated_tokens"] == 4 * 3 * 3
    # prefill: task 1: its prompt once (10), turn 2: 2 rows x (10 + 3 + 5) = 36, turn 3: 2 x (10 + 2 x 8) = 52
    # -> 98; task 2: 12 + 2 x 20 + 2 x 28 = 108; 206 in all
    assert counts["prefill_tokens"] == 206
    # learner: task 1: 9 + 2 x (29 - 9) = 49, task 2: 11 + 2 x (31 - 11) = 51; 100 in all
    assert counts["learner_tokens"] == 100


def _row(step: int = 2, action_tokens: float = 6.0, turns: float = 2.0, episode_tokens: float = 30.5,
         updates: int = 1) -> dict:
    return {"step": step, "train/action_tokens": action_tokens, "train/turns": turns,
            "train/episode_tokens": episode_tokens, "train/updates": updates, "train/skipped_updates": 0}


def test_check_step_raises_on_any_count_the_trainer_did_not_run():
    point = Point(length=3, turns=2, group=2)
    counts = step_counts(point, [10, 12], 5)
    # 4 rows x 2 turns x 3 tokens = 24 action tokens, 6 a row; episodes 10 + 6 + 5 = 21 and 23: mean 22
    assert counts["generated_tokens"] == 24 and counts["episode_tokens"] == 88
    check_step(point, _row(episode_tokens=22.0), counts)  # what was asked: no error
    with pytest.raises(RuntimeError, match="23 in all, not 4 rows x 2 x 3 = 24"):
        check_step(point, _row(action_tokens=5.75, episode_tokens=22.0), counts)  # one action a token short
    with pytest.raises(RuntimeError, match="1.5 turns"):
        check_step(point, _row(turns=1.5, episode_tokens=22.0), counts)
    with pytest.raises(RuntimeError, match="episodes of 89 tokens"):
        check_step(point, _row(episode_tokens=22.25), counts)
    with pytest.raises(RuntimeError, match="0 updates"):
        check_step(point, _row(episode_tokens=22.0, updates=0), counts)


def test_budget_gives_later_points_one_timed_step():
    assert timed_steps(10.0, 600.0, 3) == 3
    assert timed_steps(600.0, 600.0, 3) == 3  # not past the budget yet
    assert timed_steps(600.5, 600.0, 3) == 1


def test_growth_exponent_by_hand():
    # times 1 then 4 as x doubles: log(4) / log(2) = 2
    assert growth_exponent([1, 2], [1, 4]) == pytest.approx(2.0, rel=1e-12)
    # proportional: 3 -> 6 as x 2 -> 4: exponent 1; square root: 1 -> 2 as x 1 -> 4: log 2 / log 4 = 0.5
    assert growth_exponent([2, 4], [3, 6]) == pytest.approx(1.0, rel=1e-12)
    assert growth_exponent([1, 4], [1, 2]) == pytest.approx(0.5, rel=1e-12)
    # only the two largest x count, whatever the order: x 2 -> 4, y 1.5 -> 2: log(4/3) / log 2 = 0.41504
    assert growth_exponent([4, 1, 2], [2.0, 100.0, 1.5]) == pytest.approx(0.415037, rel=1e-5)
    assert math.isnan(growth_exponent([1, 2], [0.0, 1.0]))
    with pytest.raises(ValueError):
        growth_exponent([3, 3], [1.0, 2.0])


def test_fit_line_by_hand():
    # (0, 1), (1, 2), (2, 4): mean x 1, mean y 7/3; Sxy = (-1)(-4/3) + 0 + (1)(5/3) = 3, Sxx = 2,
    # so b = 3/2 and a = 7/3 - 3/2 = 5/6
    a, b = fit_line([0, 1, 2], [1, 2, 4])
    assert a == pytest.approx(5 / 6, rel=1e-12) and b == pytest.approx(1.5, rel=1e-12)
    # points on y = 3 + 2x give the line back exactly
    a, b = fit_line([1, 2, 3], [5, 7, 9])
    assert a == pytest.approx(3.0, rel=1e-12) and b == pytest.approx(2.0, rel=1e-12)
    with pytest.raises(ValueError):
        fit_line([1], [1.0])


def test_growth_words_have_their_thresholds():
    assert growth(2.0) == "faster than linear"
    assert growth(1.11) == "faster than linear"
    assert growth(1.1) == "about linear"  # not above 1.1
    assert growth(0.95) == "about linear"
    assert growth(0.85) == "sub-linear"
    assert growth(-0.2) == "falling"
    assert growth(math.nan) == "not measurable"


def _turns_rows(sample_s: list[float]) -> list[dict]:
    """A made-up turns sweep K = 1, 2, 4 (2 tasks x 4 rows, L = 64) with these sampling times."""
    rows = []
    for k, seconds in zip([1, 2, 4], sample_s):
        learn = 1.0 + 2.0 * k
        m = {"sample_s": seconds, "generate_s": 0.9 * seconds, "learn_s": learn, "step_s": seconds + learn,
             "noisy": False}
        counts = {"generated_tokens": 8 * k * 64, "prefill_tokens": 400 + 800 * k * (k - 1),
                  "learner_tokens": 400 * (1 + k * k), "micro_batches": 1, "rows": 8}
        rows.append({"turns": k, "measurements": [m], "counts": counts})
    return rows


def test_claims_follow_the_numbers_not_the_sweep():
    # sampling 1, 2.5, 9 s at K = 1, 2, 4: log(9 / 2.5) / log 2 = 1.85, faster than linear
    steep = summarize("turns", _turns_rows([1.0, 2.5, 9.0]))
    assert steep["exponent"]["sample"] == pytest.approx(math.log(9 / 2.5) / math.log(2), rel=1e-9)
    assert steep["verdict"]["sample"] == "faster than linear"
    # steps 1 + 3, 2.5 + 5, 9 + 9 s at K = 1, 2, 4: log(18 / 7.5) / log 2 = 1.263
    assert steep["exponent"]["step"] == pytest.approx(math.log(18 / 7.5) / math.log(2), rel=1e-9)
    assert steep["verdict"]["step"] == "faster than linear"
    text = " ".join(reasons("turns", steep, 2048))
    assert "Sampling grew faster than linearly (exponent 1.85)" in text and "the growing history is why" in text
    # prefill tokens 400, 2000, 10000: log(5) / log(2) = 2.32
    assert "faster than linearly (exponent 2.32), as K turns prefill about K^2/2" in text
    # learner tokens 2000 -> 6800 as K 2 -> 4: log(3.4) / log 2 = 1.77; learn 5 -> 9 s: log(1.8) / log 2 = 0.85
    assert "the tokens its pass runs grew faster than linearly (exponent 1.77)" in text
    assert "Learning grew slower (exponent 0.85) than the learner tokens behind it (1.77)" in text
    assert "1 and 1 micro-batches of <= 2048 tokens" in text
    # the same sweep with sampling 1, 2, 4 s: exponent 1, so no claim of faster than linear sampling
    flat = summarize("turns", _turns_rows([1.0, 2.0, 4.0]))
    assert flat["verdict"]["sample"] == "about linear"
    text = " ".join(reasons("turns", flat, 2048))
    assert "Sampling grew about linearly (exponent 1.00)" in text and "outweighs the re-prefill" in text
    assert "the growing history is why" not in text
