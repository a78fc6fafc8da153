"""The trajectory viewer: episodes/ as the learner saw each token, and `keel view`'s page,
rendered in a real headless Chromium (Debian's `chromium`; `.ci/run` installs it)."""

from __future__ import annotations

import html
import json
import math
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import FAST_RUN

from keelrl.config import TINY_RUN, load_config
from keelrl.runs import read_episodes
from keelrl.viewer import CHARTS
from keelrl.train.trainer import Trainer
from keelrl.viewer import ViewError, collect_run, render_html, serve, write_report

EPS = 0.001
RUN = [*FAST_RUN, "eval.tasks=3", "eval.every=3", "output.sample_trajectories=1", "train.steps=3",
       "rollout.engine=sync",
       # reinforce: each token's advantage is its episode's reward (checked below; the tiny model's
       # groups often tie, so a group baseline would leave every advantage 0); two minibatches a
       # step, so the second sees moved weights (ratios off 1), under a tight PPO clip
       "algo.preset=reinforce", "algo.clip=ppo", "train.minibatch_size=2", f"algo.eps_low={EPS}",
       f"algo.eps_high={EPS}",
       # every group has at most 2 distinct patches: patch_collapse fires after one step
       "monitor.window=1", "monitor.distinct_patches_min=100"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("run")
    Trainer(load_config(None, [*TINY_RUN, *RUN, f"run_dir={out}", f"model.path={tiny_model_dir}"])).run()
    return out


def tokens_of(episode: dict) -> list[list]:
    return [token for turn in episode["turns"] for token in (turn["tokens"] or [])]


def test_episodes_hold_each_token_as_the_update_saw_it(run_dir):
    steps = read_episodes(run_dir)
    assert sorted(steps) == [1, 2, 3]
    clipped = unclipped = 0
    for step, episodes in steps.items():
        assert len(episodes) == 4 and all(e["step"] == step and e["used"] for e in episodes)
        for episode in episodes:
            assert episode["kind"] and episode["checks"] and episode["prompt"]
            assert 0 < len(episode["turns"]) <= 2  # env.max_turns
            tokens = tokens_of(episode)
            assert tokens, "every used episode has action tokens"
            for text, advantage, logp, behaviour, ratio, was_clipped in tokens:
                assert isinstance(text, str)
                assert advantage == pytest.approx(episode["reward"], abs=2e-5)
                assert ratio == pytest.approx(math.exp(logp - behaviour), rel=1e-4)
                if abs(ratio - (1 + EPS)) < 1e-4 or abs(ratio - (1 - EPS)) < 1e-4:
                    continue  # rounded to 5 digits on the boundary: either side is right
                limited = (ratio > 1 + EPS and advantage > 0) or (ratio < 1 - EPS and advantage < 0)
                assert was_clipped == limited, (step, text, advantage, ratio, was_clipped)
                clipped += was_clipped
                unclipped += not was_clipped
    assert clipped > 0 and unclipped > 0  # both sides of the rule were exercised


def test_a_fresh_run_forgets_an_earlier_runs_episodes_and_keeps_at_most_save_episodes(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "episodes" / "step_0099.jsonl").write_text("{}\n")
    cfg = load_config(copy / "config.yaml", [f"run_dir={copy}", "train.steps=1", "eval.base=false",
                                             "output.save_episodes=3"])
    Trainer(cfg).run()
    episodes = read_episodes(copy)
    assert sorted(episodes) == [1] and len(episodes[1]) == 3


def test_save_episodes_must_not_be_negative():
    from keelrl.errors import ConfigError

    with pytest.raises(ConfigError, match="save_episodes"):
        load_config(None, ["output.save_episodes=-1"])


# ---------------------------------------------------------------------------------- the page

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("KEEL_REQUIRE_BROWSER"),
    reason="no chromium on PATH (apt-get install chromium; .ci/run does, and sets KEEL_REQUIRE_BROWSER=1)")


def render(page: Path, fragment: str = "", tmp_path: Path | None = None) -> tuple[str, str]:
    """-> (the DOM after the page's script ran, Chromium's stderr) for page#fragment."""
    assert CHROMIUM is not None, "KEEL_REQUIRE_BROWSER is set but chromium is not installed"
    profile = (tmp_path or page.parent) / f"chromium-profile-{abs(hash(fragment))}"
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000",
         "--dump-dom", page.resolve().as_uri() + fragment],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, result.stderr


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def count(dom: str, pattern: str) -> int:
    return len(re.findall(pattern, dom))


@pytest.fixture(scope="module")
def page(run_dir) -> Path:
    exe = Path(sys.executable).parent / "keel"
    result = subprocess.run([str(exe), "view", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path == run_dir / "view.html"
    return path


@needs_browser
def test_page_renders_curves_alarms_and_the_last_steps_tokens(page, run_dir, tmp_path):
    dom, stderr = render(page, tmp_path=tmp_path)
    assert 'data-ready="true"' in dom and console_lines(stderr) == []
    assert count(dom, r'class="chart" data-chart=') == len(CHARTS) == 8
    for key in ("eval/tested_frac", "policy/is_weight_min"):
        assert f'data-key="{key}"' in dom, key  # the agent and ratio-spread charts draw
    for key in ("train/reward", "eval/success", "policy/entropy", "policy/clip_frac"):
        assert f'data-key="{key}"' in dom, key  # a drawn curve
    episodes = read_episodes(run_dir)[3]
    assert count(dom, r'<div class="episode ') == len(episodes) == 4
    assert ">4 of 4 episodes of step 3<" in dom
    tokens = [t for e in episodes for t in tokens_of(e)]
    assert count(dom, r'<span class="tok') == len(tokens)
    assert count(dom, r'<span class="tok clipped"') == sum(t[5] for t in tokens)
    alarms = [json.loads(line) for line in (run_dir / "alarms.jsonl").read_text().splitlines()]
    assert any(a["alarm"] == "patch_collapse" for a in alarms)
    for alarm in alarms:
        link = f'href="#step={alarm["step"]}&amp;alarm={alarm["alarm"]}%40{alarm["step"]}"'
        assert link in dom, link


@needs_browser
def test_filters_from_the_fragment_step_outcome_task_and_alarm(page, run_dir, tmp_path):
    episodes = read_episodes(run_dir)
    failures = [e for e in episodes[1] if not e["success"]]
    dom, stderr = render(page, "#step=1&success=0", tmp_path)
    assert 'data-ready="true"' in dom and console_lines(stderr) == []
    assert count(dom, r'<div class="episode ') == len(failures)
    assert f">{len(failures)} of 4 episodes of step 1<" in dom
    assert 'data-success="1"' not in dom

    task = episodes[2][0]["task_id"]
    dom, _ = render(page, f"#step=2&task={task}", tmp_path)
    assert count(dom, r'<div class="episode ') == sum(e["task_id"] == task for e in episodes[2]) > 0
    assert set(re.findall(r'data-task="([^"]+)"', dom)) == {task}

    alarm = json.loads((run_dir / "alarms.jsonl").read_text().splitlines()[0])
    dom, _ = render(page, f"#alarm={alarm['alarm']}%40{alarm['step']}", tmp_path)
    assert f"alarm {alarm['alarm']} at step {alarm['step']}" in dom
    saved = (run_dir / "alarms" / f"{alarm['alarm']}_step_{alarm['step']:04d}.txt").read_text()
    assert html.escape(saved.splitlines()[0], quote=False) in dom  # the trajectories it saved
    assert f">4 of 4 episodes of step {alarm['step']}<" in dom


@needs_browser
def test_episode_text_is_shown_as_text_never_run(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "reference", "tb"))
    path = copy / "episodes" / "step_0003.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    hostile = "</script><script>document.title='pwned'</script><b>bold</b>"
    rows[0]["turns"][0]["tokens"][0][0] = hostile
    rows[0]["turns"][0]["observation"] = hostile
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dom, stderr = render(write_report(copy), tmp_path=tmp_path)
    assert 'data-ready="true"' in dom and console_lines(stderr) == []
    assert "pwned" not in dom.split("<title>")[1].split("</title>")[0]
    assert dom.count(html.escape(hostile, quote=False)) == 2  # the token and the observation, as text


@needs_browser
def test_the_error_trap_reports_a_broken_page(run_dir, tmp_path):
    data = collect_run(run_dir)
    del data["charts"]  # the page's script now fails: the check the other tests rely on must see it
    broken = tmp_path / "broken.html"
    broken.write_text(render_html(data))
    dom, stderr = render(broken, tmp_path=tmp_path)
    assert 'data-ready="errors"' in dom
    assert any("TypeError" in line for line in console_lines(stderr))


def test_serve_serves_the_page_and_nothing_else(page):
    server, url = serve(page, port=0)
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200 and response.read() == page.read_bytes()
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(url + "config.yaml", timeout=10)
        assert error.value.code == 404
    finally:
        server.shutdown()


def test_view_of_a_directory_without_a_run_says_so(tmp_path, capsys):
    from keelrl.cli import main

    with pytest.raises(ViewError, match="not a run directory"):
        collect_run(tmp_path)
    assert main(["view", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_keel_view_serve_serves_until_stopped(page, run_dir):
    exe = Path(sys.executable).parent / "keel"
    process = subprocess.Popen([str(exe), "view", str(run_dir), "--serve", "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stderr is not None
        assert process.stdout.readline().strip() == str(page)
        line = process.stderr.readline()
        url = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        assert url, line
        with urllib.request.urlopen(url.group(1), timeout=30) as response:
            assert response.read() == page.read_bytes()
        assert process.poll() is None  # still serving
    finally:
        process.terminate()
        process.wait(timeout=30)
