"""Draw docs/figures/default_run_heldout.png from a run's summary.json: held-out strict success
(with standard errors) after the warm start and after RL, and of the base model when the run
evaluated it.

    python docs/figures/heldout_figure.py runs/default/summary.json [--base OTHER/summary.json]

--base takes the base model's figure from another run (the default run, with eval.base=false,
has none).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("summary")
    parser.add_argument("--base")
    parser.add_argument("--out", default=str(Path(__file__).with_name("default_run_heldout.png")))
    args = parser.parse_args()
    summary = json.loads(Path(args.summary).read_text())
    base = json.loads(Path(args.base).read_text())["heldout_base"] if args.base else summary.get("heldout_base")
    stages = [*([("base model", base)] if base else []), ("after warm start", summary["heldout_warm_start"]),
              (f"after RL ({summary['preset']}, {summary['steps']} steps)", summary["heldout_final"])]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    values = [block["success"] for _, block in stages]
    errors = [block["success_se"] or 0.0 for _, block in stages]
    bars = ax.bar([name for name, _ in stages], values, yerr=errors, capsize=6, color=["#999", "#4a7", "#27a"][-len(stages):])
    for bar, value, (_, block) in zip(bars, values, stages):
        ax.text(bar.get_x() + bar.get_width() / 2, value + 0.04, f"{round(value * block['tasks'])}/{block['tasks']}",
                ha="center")
    ax.set_ylabel("held-out strict success")
    ax.set_ylim(0, max(values) + 0.12)
    lift = summary["rl_lift"]
    ax.set_title(f"SmolLM2-135M-Instruct, 209 held-out tasks; RL's lift {lift['success'] * 100:+.1f} "
                 f"+- {lift['success_se'] * 100:.1f} points", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(args.out)


if __name__ == "__main__":
    main()
