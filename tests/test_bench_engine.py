"""bench/bench_engine.py: the FLOP count its peak shares rest on and the compute floor that bounds
the speed-up over HF generate, against hand-worked numbers; and its smoke run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.bench_engine import compute_floor, flops, linear_shapes

REPO = Path(__file__).resolve().parents[1]
CONFIG = SimpleNamespace(hidden_size=4, intermediate_size=6, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=2, num_hidden_layers=3, vocab_size=10)


def test_linear_shapes_fuse_qkv_and_gate_up():
    assert linear_shapes(CONFIG) == {"qkv": (4, 8), "o": (4, 4), "gate_up": (4, 12), "down": (6, 4), "head": (4, 10)}


def test_flops_count_layers_attention_and_the_head_only_where_sampled():
    # per token: 2 x 3 layers x (32 + 16 + 48 + 24) = 720; attention 4 x 3 x 2 heads x 2 x keys = 48 x keys
    assert flops(CONFIG, tokens=5, sampled=2, keys=3) == 5 * (720 + 48 * 3) + 2 * 2 * 4 * 10
    assert flops(CONFIG, tokens=0, sampled=1, keys=0) == 80


def test_compute_floor_adds_the_time_outside_the_decoder_and_bounds_the_ratio():
    pair = {"hf": {"seconds": 12.0},
            "keel": {"seconds": 5.0, "episodes": 4, "action_tokens": 24,
                     "usage": {"prefill_tokens": 100.0, "decode_tokens": 20.0, "forward_s": 3.0, "sample_s": 1.0}}}
    floor = compute_floor(CONFIG, pair, gpeak=1e-4)  # 1e5 FLOP/s
    # prefill: 100 x (720 + 48 x 12.5) = 132000; decode at 25 + 20 / 4 / 2 keys: 20 x (720 + 1320) + 24 x 80 = 42720
    assert floor["gflop"] == pytest.approx(174720 / 1e9)
    assert floor["compute_s"] == pytest.approx(1.7472)
    assert floor["decoder_s"] == 4.0 and floor["other_s"] == 1.0
    assert floor["max_ratio"] == pytest.approx(12.0 / 2.7472)
    assert compute_floor(CONFIG, {**pair, "keel": {**pair["keel"], "usage": {}}}, 1e-4) is None


@pytest.mark.slow  # the tiny model through both decoders and the sandboxed coding environment
def test_smoke_run_writes_a_section_with_every_ratio_and_each_workloads_floor(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.bench_engine", "--smoke", "--no-llamacpp", "--out",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = json.loads((tmp_path / "section.json").read_text())
    names = [ratio["name"] for ratio in section["ratios"]]
    assert any(name.startswith("evaluation workload") for name in names)
    assert any(name.startswith("rollout workload") for name in names)
    workloads = section["data"]["workloads"]
    assert [(w["label"], w["dtype"]) for w in workloads] == [("evaluation", "float32"), ("rollout", "float32"),
                                                             ("evaluation", "bfloat16"), ("rollout", "bfloat16")]
    for workload in workloads:
        assert 0 < workload["floor"]["compute_s"] and workload["floor"]["max_ratio"] > 0
        assert workload["hf"]["action_tokens"] > 0 and workload["keel"]["action_tokens"] > 0
    assert section["markdown"].count("Its compute floor") == 4
    streaming = section["data"]["streaming"]
    assert streaming["hf"]["decoder"] == "keel" and not streaming["hf"]["stream"] and streaming["keel"]["stream"]
    assert streaming["same_actions"] == streaming["episodes"]  # streaming changes no token (float32 ties aside)
    assert {row["dtype"] for row in section["data"]["engine"]} == {"float32", "bfloat16"}
    assert "llama.cpp: not measured" in section["markdown"]
    for breakdown in section["data"]["breakdown"]:
        assert breakdown["wall_ms"] > 0 and breakdown["kinds_ms"]["weight matmuls"] > 0
