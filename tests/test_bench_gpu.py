"""bench/gpu.py: the smoke run as a user runs it, and its FLOP count against torch's own and by hand.

The FLOP formula is the benchmark's honesty: MFU is only as good as its numerator. It is checked
against hand-worked counts (comments below) and against `torch.utils.flop_counter.FlopCounterMode`
over the very forward/backward the benchmark runs (`learner_update`), on eager attention so that
the attention matmuls are visible to the counter (it has no formula for the CPU's fused attention
kernel). Counts are integers and must agree exactly, by part (linear layers and head; attention).
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench import gpu
from keelrl.algos.config import AlgoConfig
from keelrl.train.learner import enable_gradient_checkpointing

REPO = Path(__file__).resolve().parents[1]

# Small enough to work out by hand: W = q 4*4 + k, v 2*4*2 + o 4*4 + MLP 3*4*8 = 144 weights per layer.
HAND = gpu.ModelShape(layers=1, hidden=4, heads=2, kv_heads=1, intermediate=8, vocab=10)


def torch_count(run) -> dict[str, int]:
    """FLOPs by op as FlopCounterMode counts them while `run()` runs. Its registry has no formula for
    the in-place addmm_ that accumulates a weight gradient in its buffer (keelrl's head backward,
    autograd for a tied weight); it gets addmm's, 2 m k n, written here rather than taken from bench.gpu."""
    def addmm_inplace(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_inplace}) as counter:
        run()
    return {str(op): int(value) for op, value in counter.get_flop_counts()["Global"].items()}


def eager_model(shape: gpu.ModelShape, seed: int = 0):
    """A random Qwen2 of `shape` whose attention is plain matmuls (bmm), which the counter sees."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(shape.config(pad_token_id=0, eos_token_id=1))
    model.set_attn_implementation("eager")
    return model.train()


def batch_of(rows: list[tuple[list[int], int]], group_ids: list[int], seed: int = 0) -> gpu.LearnerBatch:
    """rows: (prompt ids, sampled tokens) each, right-padded into [B, T]; the sampled tokens are scored."""
    generator = torch.Generator().manual_seed(seed)
    width = max(len(prompt) + new for prompt, new in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    action = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, (prompt, new) in enumerate(rows):
        length = len(prompt) + new
        input_ids[row, :len(prompt)] = torch.tensor(prompt)
        input_ids[row, len(prompt):length] = torch.randint(2, 10, (new,), generator=generator)
        attention[row, :length] = 1
        action[row, len(prompt):length] = True
    behaviour = torch.log(torch.rand(input_ids.shape, generator=generator)).masked_fill(~action, 0.0)
    advantages = torch.randn(input_ids.shape, generator=generator).masked_fill(~action, 0.0)
    return gpu.LearnerBatch(input_ids, attention, action, behaviour, advantages, torch.tensor(group_ids))


def count_update(model, batch: gpu.LearnerBatch, budget: int, *, share_prefix: bool):
    """(torch's count by op, the passes `learner_update` ran) of one update."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ran = []
    counted = torch_count(lambda: ran.extend(gpu.learner_update(model, optimizer, batch, AlgoConfig(preset="grpo"),
                                                                budget, share_prefix=share_prefix)[0]))
    return counted, ran


def by_part(counted: dict[str, int]) -> tuple[int, int]:
    """(linear layers + head: mm, addmm, addmm_; attention: bmm) of a count on eager attention."""
    matmul = sum(counted.get(op, 0) for op in ("aten.mm", "aten.addmm", "aten.addmm_"))
    assert set(counted) <= {"aten.mm", "aten.addmm", "aten.addmm_", "aten.bmm"}, counted
    return matmul, counted.get("aten.bmm", 0)


def executed_parts(flops: dict) -> tuple[int, int]:
    phases = ("forward", "backward", "recompute")
    return (sum(flops["executed"][p]["linear"] + flops["executed"][p]["head"] for p in phases),
            sum(flops["executed"][p]["attention"] for p in phases))


# --------------------------------------------------------------------------- by hand
def test_flop_formula_on_a_hand_worked_shared_prompt_pass():
    # One group of 2 rows sharing a 3-token prompt, 2 sampled tokens each (rows of 5). The prompt
    # pass runs the cut = 2 tokens, each row its positions 2, 3, 4 against them.
    # Per token 2*W*L = 288, per (query, key) pair 4*n*d*L = 4*2*2 = 16, per scored position 2*h*V = 80.
    # Model: tokens 2 + 2*3 = 8; causal pairs: prompt 1 + 2 = 3, each row 3 + 4 + 5 = 12 -> 27;
    # scored: positions 3 and 4 of each row -> 4.
    #   forward: linear 8*288 = 2304, attention 27*16 = 432, head 4*80 = 320
    #   backward: twice that, less the prompt's 2 tokens in its last (here only) layer, which run
    #   backward through k and v alone: 4*(W - 2*h*k) = 4*(144 - 16) = 512 each, and its 3 pairs
    #   not at all: 2*16 = 32 each -> linear 4608 - 1024 = 3584, attention 864 - 96 = 768, head 640
    #   total 2304 + 432 + 320 + 3584 + 768 + 640 = 8048
    # Executed: prompt [1, 2] -> 4 pairs; rows [2, 3] against 2 + 3 keys -> 2*3*5 = 30 pairs; 34 in all
    #   attention forward 34*16 = 544, backward 2*544 - 4*32 = 960; the head's recompute 320
    #   total 2304 + 544 + 320 + 3584 + 960 + 640 + 320 = 8672
    layout = gpu.PassLayout(units=((2, (5, 5)),), scored=4)
    model = gpu.pass_flops(HAND, layout, executed=False)
    assert model["forward"] == {"linear": 2304, "attention": 432, "head": 320}
    assert model["backward"] == {"linear": 3584, "attention": 768, "head": 640}
    flops = gpu.step_flops(HAND, [layout], checkpointed=False)
    assert flops["model"]["total"] == 8048
    assert flops["executed"]["forward"]["attention"] == 544 and flops["executed"]["backward"]["attention"] == 960
    assert flops["executed"]["total"] == 8672

    # The same numbers from torch: the prompt is shared, row 1's sampled tokens differ from row 0's.
    counted, ran = count_update(eager_model(HAND), batch_of([([3, 4, 5], 2), ([3, 4, 5], 2)], [0, 0]), 64,
                                share_prefix=True)
    assert ran == [layout]
    assert by_part(counted) == (2304 + 320 + 3584 + 640 + 320, 544 + 960)


def test_flop_formula_on_a_hand_worked_padded_plain_pass_with_checkpointing():
    # Two rows run plainly (no shared prompt) in one pass, lengths 3 and 5, padded to [2, 5];
    # scored: row 0 position 2, row 1 positions 3 and 4 -> 3.
    # Model: tokens 3 + 5 = 8, causal pairs 6 + 15 = 21:
    #   forward linear 2304, attention 336, head 240; backward 4608, 672, 480; total 8640
    # Executed: tokens 2*5 = 10, pairs 2*5*5 = 50: forward linear 2880, attention 800, head 240;
    #   backward 5760, 1600, 480; recompute: the body's forward less each layer's last matmul
    #   (down projection, 2*h*I = 64 per token: torch stops recomputing once every saved tensor is
    #   back) -> linear 2880 - 640 = 2240, attention 800, and the head 240
    #   total 3920 + 7840 + 3280 = 15040
    layout = gpu.PassLayout(units=((0, (5,)), (0, (3,))), scored=3)  # longest row first, as split_rows
    flops = gpu.step_flops(HAND, [layout], checkpointed=True)
    assert flops["model"]["total"] == 8640
    assert flops["executed"]["recompute"] == {"linear": 2240, "attention": 800, "head": 240}
    assert flops["executed"]["total"] == 15040

    model = eager_model(HAND)
    enable_gradient_checkpointing(model)
    counted, ran = count_update(model, batch_of([([3, 4], 1), ([6, 7, 8], 2)], [0, 1]), 64, share_prefix=False)
    assert ran == [layout]
    assert by_part(counted) == (2880 + 240 + 5760 + 480 + 2240 + 240, 800 + 1600 + 800)


def test_shared_prefix_pass_is_refused_under_checkpointing():
    with pytest.raises(ValueError, match="gradient checkpointing"):
        gpu.pass_flops(HAND, gpu.PassLayout(units=((2, (5, 5)),), scored=4), executed=True, checkpointed=True)


# --------------------------------------------------------------------------- against torch, ragged
@pytest.mark.parametrize("share_prefix, budget", [(True, 10_000), (True, 20), (False, 10_000), (False, 16)])
def test_executed_flops_equal_torchs_count_on_ragged_groups(share_prefix, budget):
    # Group 0: a 6-token prompt with 4 and 2 sampled tokens; group 1: a 4-token prompt with 3 each.
    # Prompts of two lengths pad the prompt pass, rows of different lengths pad the rows' pass;
    # the small budgets split the batch into several micro-batches.
    rows = [([2, 3, 4, 5, 6, 7], 4), ([2, 3, 4, 5, 6, 7], 2), ([9, 8, 7, 6], 3), ([9, 8, 7, 6], 3)]
    counted, ran = count_update(eager_model(gpu.TINY), batch_of(rows, [0, 0, 1, 1]), budget,
                                share_prefix=share_prefix)
    assert all((max(cut for cut, _ in layout.units) > 0) == share_prefix for layout in ran)
    if budget < 100:
        assert len(ran) > 1
    assert by_part(counted) == executed_parts(gpu.step_flops(gpu.TINY, ran, checkpointed=False))


# --------------------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def smoke_section(tmp_path_factory) -> dict:
    """section.json of `python -m bench.gpu --smoke`, run once from the repository root."""
    out = tmp_path_factory.mktemp("gpu")
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((out / "section.json").read_text())


def test_smoke_run_reports_exact_tokens_and_a_flop_count_torch_agrees_with(smoke_section):
    section = copy.deepcopy(smoke_section)
    data = section["data"]
    assert section["name"] == "gpu" and section["smoke"] is True
    assert data["measured"] is False and data["dtype"] == "float32" and data["device"] == "cpu"
    assert section["ratios"] == [] and data["mfu"] is None  # no peak on a CPU, so no MFU
    assert "Not a measurement" in section["markdown"] and "CPU smoke run" in section["markdown"]
    size = data["size"]
    assert size == {"rows": 4, "group_size": 2, "prompt_tokens": 32, "new_tokens": 32, "micro_batch_tokens": 128}

    sampler = data["sampler"]
    assert sampler["tokens"] == size["rows"] * size["new_tokens"]  # exactly: the run fails on fewer
    assert sampler["seconds"] > 0 and sampler["tokens_per_s"] == pytest.approx(sampler["tokens"] / sampler["seconds"])
    learner = data["learner"]
    assert len(learner["steps"]) == 3 and all(step["seconds"] > 0 for step in learner["steps"])
    assert learner["update_s"] > 0 and learner["micro_batches"] == 2  # the 128-token budget holds one group
    assert section["seconds"] > 0

    # Model FLOPs (the MFU numerator) by hand for the smoke shape: L = 2, h = 64, 4 heads of 16,
    # k = 32, I = 128, V = 1000 -> W = 4096 + 4096 + 4096 + 24576 = 36864. Per group (one pass):
    # the prompt's cut 31 tokens, then each row's 64 - 31 = 33.
    per_token, per_pair, per_scored = 2 * 36864 * 2, 4 * 4 * 16 * 2, 2 * 64 * 1000
    tokens = 2 * (31 + 2 * 33)  # 194
    pairs = 2 * (31 * 32 // 2 + 2 * (64 * 65 // 2 - 31 * 32 // 2))  # 2 * (496 + 3168) = 7328
    scored = 4 * 32
    forward = tokens * per_token + pairs * per_pair + scored * per_scored  # 48,742,400
    # Backward: 2x, less the 2 prompts' 31 tokens in the last layer (all but k and v run backward there:
    # 4 x (W - 2hk) each) and their 2 x 496 pairs' attention in that layer (2 x 4 n d each).
    backward = 2 * forward - 2 * 31 * 4 * (36864 - 2 * 64 * 32) - 2 * 496 * 2 * 4 * 4 * 16  # 88,850,432
    assert data["flops"]["model"]["total"] == forward + backward == 137_592_832

    # Executed FLOPs against torch's count of the same update (same shapes, eager attention here).
    rows = [(prompt, 32) for prompt in ([7] * 32, [7] * 32, [8] * 32, [8] * 32)]
    counted, ran = count_update(eager_model(gpu.TINY), batch_of(rows, [0, 0, 1, 1]), size["micro_batch_tokens"],
                                share_prefix=True)
    assert [gpu.PassLayout(tuple((c, tuple(r)) for c, r in p["units"]), p["scored"]) for p in learner["passes"]] == ran
    assert by_part(counted) == executed_parts(data["flops"])
    assert sum(counted.values()) == data["flops"]["executed"]["total"]
    # The run's own check (sdpa: only the matmuls are visible to the counter on a CPU).
    assert data["flop_check"]["matmul_agrees"] is True


def test_markdown_of_a_measured_run_states_mfu_target_and_overrun(smoke_section):
    # The CUDA branch of the section's text, checked here where no GPU is: the smoke run's data
    # relabelled as measured, with an MFU, and a run over the 5-minute budget.
    data = copy.deepcopy(smoke_section["data"])
    data.update(measured=True, device="NVIDIA H200", mfu=0.31, hfu=0.36, peak_flops=989e12,
                peak_source="PEAK_BF16", total_s=301.0)
    text = gpu.markdown(data)
    assert "Not a measurement" not in text
    assert "**0.310** (target 0.3" in text and "989 TFLOP/s, PEAK_BF16" in text and "| 0.360 |" in text
    assert "Over budget" in text and "max_memory_allocated" in text
    data.update(mfu=None, hfu=None, peak_flops=None, peak_source="none", total_s=100.0)
    text = gpu.markdown(data)
    assert "not computed: no dense bf16 peak known for NVIDIA H200; pass --peak-tflops" in text
    assert "Over budget" not in text


def test_bad_flags_fail_naming_the_flag(capsys):
    for argv, flag in ((["--peak-tflops", "0"], "--peak-tflops"), (["--peak-tflops", "nan"], "--peak-tflops"),
                       (["--rows", "5"], "--rows"), (["--new-tokens", "0"], "--new-tokens"),
                       (["--prompt-tokens", "3"], "--prompt-tokens")):
        with pytest.raises(SystemExit) as error:
            gpu.parse_args(["--smoke", *argv])
        assert error.value.code == 2
        assert flag in capsys.readouterr().err


def test_peak_table_by_device_name():
    assert gpu.table_peak("NVIDIA H200") == 989e12
    assert gpu.table_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu.table_peak("NVIDIA H100 PCIe") == 756e12
    assert gpu.table_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu.table_peak("NVIDIA H200 NVL") is None  # other clocks: --peak-tflops
    assert gpu.table_peak("Tesla T4") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_at_a_reduced_size_reports_mfu(tmp_path):
    out = tmp_path / "gpu"
    peak = [] if gpu.table_peak(torch.cuda.get_device_name(0)) else ["--peak-tflops", "100"]
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--out", str(out), "--rows", "16", "--prompt-tokens",
                           "256", "--new-tokens", "64", "--learner-steps", "2", *peak], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    section = json.loads((out / "section.json").read_text())
    data = section["data"]
    assert section["smoke"] is False and data["measured"] is True and data["dtype"] == "bfloat16"
    assert data["sampler"]["tokens"] == 16 * 64
    assert [ratio["name"] for ratio in section["ratios"]] == ["learner MFU"]
    assert 0 < data["mfu"] < 1 and data["mfu"] < data["hfu"]
    assert data["learner"]["peak_memory_gib"] > 0 and data["sampler"]["peak_memory_gib"] > 0
    assert data["flop_check"]["matmul_agrees"] is True
