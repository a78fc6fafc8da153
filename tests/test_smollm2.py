"""SmolLM2-135M-Instruct end to end (slow: fetches the model on first use, ~35 s, then loads it).

Two RL steps of the real model on the bundled coding tasks, with every part of the default run
in miniature: base evaluation, warm start, RL, final evaluation, summary.json.
"""

from __future__ import annotations

import json

import pytest

from keelrl.config import load_config
from keelrl.policy.chat import ChatFormat
from keelrl.policy.model import load_policy
from keelrl.train.trainer import Trainer

pytestmark = pytest.mark.slow


def test_smollm2_loads_with_its_chat_format_and_pad_equal_to_its_end_token():
    model, tokenizer = load_policy("smollm2", "cpu")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    chat = ChatFormat.of(tokenizer)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2 and chat.end_token_ids == (2,)
    assert chat.observation_open.startswith("<|im_end|>") and chat.observation_close.endswith("assistant\n")


def test_two_rl_steps_on_smollm2(tmp_path):
    cfg = load_config(overrides=[
        f"run_dir={tmp_path}", "model.path=smollm2", "device=cpu", "train.steps=2", "eval.tasks=4",
        "eval.every=2", "warm_start.demos=8", "rollout.tasks_per_step=2", "rollout.group_size=2",
        "rollout.engine=sync", "train.minibatch_size=4", "warm_start.own_mistakes=4",
        "algo.dynamic_sampling=false", "eval.base=true"])  # 8 demos: groups may all fail; an update is needed
    summary = Trainer(cfg).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert rows[2]["train/updates"] >= 1 and rows[2]["memory/peak_rss_gb"] > 0
    for stage in ("base", "warm_start", "final"):
        assert summary[f"heldout_{stage}"]["tasks"] == 4
    assert (tmp_path / "summary.json").exists()
