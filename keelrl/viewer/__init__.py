"""The trajectory viewer: `keel view RUN_DIR` writes one self-contained HTML page of a run.

The page holds everything it shows (no server, no network, no script from elsewhere): the run's
curves (training reward and held-out success, partial credit, entropy, KL, clip fractions,
the agent's test runs, recoveries and turns, the importance ratio's spread, staleness) drawn from metrics.jsonl, the alarms from alarms.jsonl with the trajectories each one
saved (alarms/NAME_step_NNNN.txt), and, for any step, the episodes of episodes/step_NNNN.jsonl
(`keelrl.train.episodes`): each turn's action and observation, the reward and the checks behind
it, and each action token shaded by its advantage, with its log-prob, behaviour log-prob, ratio
and clip on hover. Filters (step, task, outcome, alarm) live in the URL's fragment
(`view.html#step=3&success=0`, `#alarm=entropy_collapse@7`), so a view can be linked to.

`serve` serves the page on localhost (`keel view RUN_DIR --serve`); the page works as well
opened from disk. What it does not do: read TensorBoard events, or show runs side by side.
"""

from __future__ import annotations

import http.server
import json
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from keelrl.runs import alarm_sample_path, read_alarms
from keelrl.runs import read_metrics
from keelrl.runs import read_episodes

CHARTS: list[dict[str, Any]] = [
    {"id": "reward", "title": "training reward and held-out success",
     "series": [("train/reward", "training reward"), ("train/success", "training success"),
                ("eval/success", "held-out success")]},
    {"id": "partial", "title": "partial credit",
     "series": [("train/partial", "training"), ("eval/partial", "held-out")]},
    {"id": "entropy", "title": "entropy (nats per action token)", "series": [("policy/entropy", "entropy")]},
    {"id": "kl", "title": "KL",
     "series": [("policy/approx_kl", "to the behaviour policy"), ("policy/kl_ref", "to the reference")]},
    {"id": "clip", "title": "clip fractions",
     "series": [("policy/clip_frac", "all"), ("policy/clip_frac_low", "low"), ("policy/clip_frac_high", "high")]},
    {"id": "agent", "title": "the agent: tests run, recoveries, turns",
     "series": [("train/tested_frac", "training: ran the tests"), ("eval/tested_frac", "held-out: ran the tests"),
                ("train/recovery_rate", "training: recovered"), ("eval/recovery_rate", "held-out: recovered"),
                ("eval/turns_mean", "held-out: turns per episode")]},
    {"id": "ratio", "title": "importance ratio spread",
     "series": [("policy/is_weight_min", "min"), ("policy/is_weight_mean", "mean"), ("policy/is_weight_max", "max")]},
    {"id": "staleness", "title": "staleness (policy versions behind)",
     "series": [("rollout/staleness_mean", "mean"), ("rollout/staleness_max", "max")]},
]
"""The page's charts: (metric key, label) series each; a chart without data says so."""


class ViewError(ValueError):
    """RUN_DIR is not a run (no metrics.jsonl and no episodes/)."""


def _alarms(run_dir: Path) -> list[dict[str, Any]]:
    alarms = read_alarms(run_dir)
    for alarm in alarms:
        saved = alarm_sample_path(run_dir, alarm["alarm"], alarm["step"])
        alarm["saved_file"] = str(saved.relative_to(run_dir)) if saved.exists() else None
        alarm["saved"] = saved.read_text() if saved.exists() else None
    return alarms


def _headline(summary: dict[str, Any], metrics: list[dict[str, Any]]) -> list[dict[str, str]]:
    items = []
    for stage, label in (("base", "held-out success, base model"), ("warm_start", "held-out success, warm start"),
                         ("final", "held-out success, after RL")):
        block = summary.get(f"heldout_{stage}")
        if isinstance(block, dict) and "success" in block:
            se = block.get("success_se")
            items.append({"label": label, "value": f"{block['success']:.3f}" + (f" ± {se:.3f}" if se is not None else "")})
    lift = summary.get("rl_lift")
    if isinstance(lift, dict) and "success" in lift:
        items.append({"label": "RL's lift (points)", "value": f"{100 * lift['success']:+.1f}"})
    final = summary.get("heldout_final") or summary.get("heldout_warm_start")
    agent = final.get("agent") if isinstance(final, dict) else None
    if isinstance(agent, dict) and "turns_mean" in agent:
        recovery = agent.get("recovery_rate")
        items += [{"label": "held-out turns per episode", "value": f"{agent['turns_mean']:.2f}"},
                  {"label": "held-out episodes that ran the tests", "value": f"{agent['tested_frac']:.3f}"},
                  {"label": "held-out recovery rate", "value": "-" if recovery is None else
                   f"{recovery:.3f} of {agent['first_edit_failed']}"}]
    steps = [row["step"] for row in metrics if row.get("step", 0) > 0]
    if steps:
        items.append({"label": "RL steps", "value": str(max(steps))})
    rewards = [row["train/reward"] for row in metrics if isinstance(row.get("train/reward"), (int, float))]
    if rewards:
        items.append({"label": "last training reward", "value": f"{rewards[-1]:.3f}"})
    return items


def collect_run(run_dir: str | Path) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-ready data."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    episodes = read_episodes(run_dir)
    if not metrics and not episodes:
        raise ViewError(f"{str(run_dir)!r} is not a run directory: no metrics.jsonl and no episodes/")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    config: dict[str, Any] = {}
    if (run_dir / "config.yaml").exists():
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    return {
        "run_dir": str(run_dir), "run_name": run_dir.resolve().name,
        "preset": (config.get("algo") or {}).get("preset", summary.get("preset", "")),
        "model": (config.get("model") or {}).get("path", ""),
        "metrics": metrics, "episodes": {str(step): rows for step, rows in episodes.items()},
        "alarms": _alarms(run_dir), "headline": _headline(summary, metrics),
        "charts": [{"id": c["id"], "title": c["title"], "series": [{"key": k, "label": label} for k, label in c["series"]]}
                   for c in CHARTS],
    }


def render_html(data: dict[str, Any]) -> str:
    """The page for `collect_run`'s data: the template with the data inlined as JSON."""
    template = resources.files("keelrl.viewer").joinpath("report.html").read_text(encoding="utf-8")
    # Inside <script>, "</" could end the element early; "\/" is the same string to JSON.parse.
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/").replace("<!--", "<\\!--")
    title = data["run_name"].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return template.replace("__TITLE__", title).replace("__DATA__", payload)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's page (default run_dir/view.html); -> its path."""
    from keelrl.runs import atomic_write_text

    path = Path(out) if out is not None else Path(run_dir) / "view.html"
    atomic_write_text(path, render_html(collect_run(run_dir)))
    return path


def serve(page: str | Path, port: int = 0, host: str = "127.0.0.1") -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve `page` at http://host:port/ (port 0: a free one) from a background thread.

    -> (the server, its URL). Only the page itself is served; `server.shutdown()` stops it."""
    body = Path(page).read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path.split("?")[0] not in ("/", "/" + Path(page).name):
                self.send_error(404, "only the report is served here")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the CLI prints the URL
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="keel-view").start()
    return server, f"http://{host}:{server.server_address[1]}/"
