"""The trainer end to end on a very small model: smoke, critic and group presets, resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST_RUN, step_one_rollouts

from keelrl.components import check
from keelrl.config import TINY_RUN, load_config
from keelrl.inference.weights import linear
from keelrl.runs import latest_checkpoint
from keelrl.train.trainer import Trainer

FAST = [*FAST_RUN, "eval.tasks=3", "eval.every=2", "train.minibatch_size=2", "output.sample_trajectories=1"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_keel_train_cli_smoke_writes_every_output(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    exe = Path(sys.executable).parent / "keel"
    result = subprocess.run([str(exe), "train", *TINY_RUN, "eval.base=true", f"run_dir={run_dir}",
                             f"model.path={tiny_model_dir}", "train.steps=2",
                             *FAST], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert "eval/success" in rows[0] and "eval/success" in rows[2]
    assert rows[1]["train/lr"] == pytest.approx(1e-4) and rows[2]["train/lr"] == pytest.approx(2e-4)  # warmup 2
    for key in ("train/reward", "train/zero_advantage_frac", "policy/entropy", "policy/clip_frac",
                "policy/is_weight_max", "policy/approx_kl", "policy/kl_ref", "time/tokens_per_s", "time/step_s"):
        assert key in rows[1], key
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and "eval_success_before_rl" in summary and "eval_success_after_rl" in summary
    # base (before the warm start), warm start and final held-out figures, each with its error
    for stage in ("base", "warm_start", "final"):
        block = summary[f"heldout_{stage}"]
        assert block["tasks"] == 3 and 0 <= block["success"] <= 1 and 0 <= block["partial"] <= 1
        assert "success_se" in block and "partial_se" in block
        kinds = summary["heldout"][stage]["by_kind"]
        assert sum(k["tasks"] for k in kinds.values()) == 3 and len(summary["heldout"][stage]["task_success"]) == 3
    assert summary["heldout_warm_start"]["success"] == rows[0]["eval/success"]
    assert summary["heldout_final"]["success"] == rows[2]["eval/success"]
    assert "rl_lift" in summary and "eval/context_limit_frac" in rows[0] and "train/context_limit_frac" in rows[1]
    for name in ("reward_vs_eval", "entropy", "kl", "clip_fraction", "importance_weight"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 1000
    assert (run_dir / "config.yaml").exists() and list((run_dir / "tb").iterdir())
    assert "ACTION:" in (run_dir / "samples" / "step_0001.txt").read_text()
    assert (latest_checkpoint(run_dir) / "state.pt").exists() and latest_checkpoint(run_dir).name == "step-000002"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000002"]  # older ones removed


@pytest.mark.parametrize("preset, critic", [("ppo", "head"), ("ppo", "success_token"), ("grpo", "head")])
def test_presets_train_a_model_given_by_path(tiny_model_dir, tmp_path, preset, critic):
    cfg = load_config(overrides=[*TINY_RUN, f"run_dir={tmp_path / preset}", f"model.path={tiny_model_dir}", f"algo.preset={preset}",
                                 f"model.critic={critic}", "train.steps=2", *FAST])
    trainer = Trainer(cfg)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    summary = trainer.run()
    rows = metrics(tmp_path / preset)
    assert summary["steps"] == 2 and rows[-1]["train/updates"] >= 1
    changed = any(not (p.detach() == before[name]).all() for name, p in trainer.model.named_parameters())
    assert changed
    if preset == "ppo":
        assert trainer.value_head is not None and "value/loss" in rows[1]
    else:
        assert trainer.value_head is None and "value/loss" not in rows[1]


def test_a_resumed_run_repeats_the_uninterrupted_one(tiny_model_dir, tmp_path):
    # Exact repetition needs the sync engine: under async, which turn sees which weights is timing.
    overrides = [*TINY_RUN, f"model.path={tiny_model_dir}", "rollout.engine=sync", "train.steps=4", "output.checkpoint_every=2", "eval.every=4", *FAST]
    full = tmp_path / "full"
    Trainer(load_config(overrides=[f"run_dir={full}", *overrides])).run()
    part = tmp_path / "part"
    Trainer(load_config(overrides=[f"run_dir={part}", *overrides])).run(stop_after=2)
    assert [row["step"] for row in metrics(part)] == [0, 1, 2]
    Trainer(load_config(part / "config.yaml")).run(resume=True)
    expected, resumed = metrics(full), metrics(part)
    assert [row["step"] for row in resumed] == [0, 1, 2, 3, 4]
    for want, got in zip(expected[3:], resumed[3:]):
        for key, value in want.items():
            if key.startswith(("time/", "engine/", "memory/")) or not isinstance(value, (int, float)):  # timing-dependent
                continue
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_bad_config_fails_before_any_work(tmp_path):
    from keelrl.errors import ConfigError

    for override, field in (("rollout.group_size=0", "rollout.group_size"), ("env.verifier=strict", "env.verifier"),
                            ("optim.lr=-1", "optim.lr"), ("rollout.top_p=1.5", "rollout.top_p")):
        with pytest.raises(ConfigError) as info:
            check(load_config(overrides=[f"run_dir={tmp_path}", override]))
        assert info.value.field == field
    assert not any(tmp_path.iterdir())


def test_the_warm_starts_own_mistakes_round_trains_on_the_teachers_continuations(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    import math

    import keelrl.train.trainer as trainer_module
    from keelrl.envs.teacher import moves

    def wrong_first(model, tokenizer, sampling, options=None):  # the student: every task's plausible wrong fix, then its fix
        def act(active):
            out = []
            for episode in active:
                task = episode.request.task
                text = moves(dict(task.files), task.wrong_fix or task.reference_fix, task.entry_file)[0]
                tokens = list(tokenizer(text, add_special_tokens=False)["input_ids"])
                out.append((tokens, [0.0] * len(tokens), text))
            return out
        return act

    monkeypatch.setattr(trainer_module, "model_actor", wrong_first)
    cfg = load_config(overrides=[*TINY_RUN, f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", *FAST,
                                 "env.max_turns=5", "warm_start.own_mistakes=6"])
    out = Trainer(cfg).warm_start()
    assert out["warm_start/own_tried"] == 6
    # a wrong fix the visible tests catch is continued (some pass them: those fail only a hidden check)
    assert 0 < out["warm_start/own_continued"] <= 6
    assert out["warm_start/own_demos"] == out["warm_start/own_continued"]  # the teacher's fix always solves
    assert math.isfinite(out["warm_start/own_final_loss"])


def test_a_non_finite_loss_is_skipped_counted_and_logged(tiny_model_dir, tmp_path, monkeypatch):
    import torch

    import keelrl.train.learner as learner_module

    real = learner_module.policy_objective

    def poisoned(**kwargs):
        loss, metrics = real(**kwargs)
        return loss * float("nan"), metrics

    cfg = load_config(overrides=[*TINY_RUN, f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "train.steps=1",
                                 *FAST])
    trainer = Trainer(cfg)
    trainer.warm_start = lambda: {}  # type: ignore[method-assign]
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    monkeypatch.setattr(learner_module, "policy_objective", poisoned)
    summary = trainer.run()
    row = metrics(tmp_path)[-1]
    assert row["train/skipped_updates"] == row["train/updates"] + row["train/skipped_updates"] > 0
    assert row["train/updates"] == 0 and summary["skipped_updates"] == row["train/skipped_updates"]
    assert all(torch.equal(p.detach(), before[name]) for name, p in trainer.model.named_parameters())


def test_the_kl_reference_is_the_policy_as_rl_starts(tiny_model_dir, tmp_path):
    import torch

    cfg = load_config(overrides=[*TINY_RUN, f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "train.steps=0",
                                 "algo.preset=grpo", *FAST])
    trainer = Trainer(cfg)
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.run()
    warm = dict(trainer.model.named_parameters())
    reference = dict(trainer.reference.named_parameters())
    assert any(not torch.equal(warm[name], initial[name]) for name in initial)  # the warm start trained it
    assert all(torch.equal(reference[name], warm[name].detach()) for name in warm)
    assert (tmp_path / "reference" / "config.json").exists()


def test_evaluation_in_bf16_samples_the_current_weights_cast(tiny_model_dir, tmp_path, monkeypatch):
    """The evaluation's decoder gets the policy's current weights through `load_weights` (the
    trainer's step as their version) and samples them cast to eval.dtype."""
    import torch

    from keelrl.train import evaluation

    cfg = load_config(overrides=[*TINY_RUN, f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "eval.dtype=bfloat16",
                                 *FAST])
    trainer = Trainer(cfg)
    decoders = []
    model_actor = evaluation.model_actor

    def recording(*args, **kwargs):
        act = model_actor(*args, **kwargs)
        decoders.append(act.decoder)
        return act

    monkeypatch.setattr(evaluation, "model_actor", recording)
    first = trainer.evaluate()
    assert first["eval/tasks"] == 3 and trainer.model.dtype == torch.float32
    with torch.no_grad():  # an update: the next evaluation must see it
        for p in trainer.model.parameters():
            p.add_(0.01)
    trainer.policy_version = 4
    trainer.evaluate()
    decoder = decoders[-1]
    assert decoder.version == 4 and decoder.dtype == torch.bfloat16
    fused = decoder.weights()  # the keel decoder (auto, a Qwen2): its weights in its fused layout
    body = trainer.model.model
    assert torch.equal(fused.embed, body.embed_tokens.weight.detach().to(torch.bfloat16))
    down = body.layers[0].mlp.down_proj.weight.detach().to(torch.bfloat16)
    # read back through the layer's own matmul (a bf16 weight may be prepacked for oneDNN): identity rows
    # pick out each weight exactly
    assert torch.equal(linear(torch.eye(down.shape[1], dtype=torch.bfloat16), fused.layers[0]["down"], None).T, down)
    with pytest.raises(Exception, match="eval.dtype"):
        load_config(overrides=["eval.dtype=fp8"])


def test_fresh_rollouts_arrive_with_importance_weight_one_at_any_temperature(tiny_model_dir, tmp_path):
    """Sync engine, one update per step: the learner scores each fresh batch at the rollouts'
    temperature, so the arrival weight pi/mu is 1 on every action token (up to float error)."""
    cfg = load_config(overrides=[*TINY_RUN, f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "train.steps=1",
                                 "rollout.engine=sync", "rollout.temperature=0.6", *FAST])
    Trainer(cfg).run()
    row = metrics(tmp_path)[1]
    assert row["rollout/arrival_is_weight_max"] == pytest.approx(1.0, abs=1e-3)
    assert row["rollout/arrival_is_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_one_update_a_step_takes_its_proximal_logprobs_from_the_update_and_changes_nothing(tiny_model_dir, tmp_path,
                                                                                          monkeypatch):
    """One epoch, the whole batch one minibatch: the no-grad pass before the update is skipped
    (its log-probs are the update's own, detached), and the step's weights and metrics are those
    of a step that ran it."""
    import torch

    from keelrl.train import advantage as advantage_module
    from keelrl.train.advantage import AdvantageStage

    overrides = [*TINY_RUN, f"model.path={tiny_model_dir}", "train.steps=1", "rollout.engine=sync", *FAST,
                 "train.minibatch_size=4", "eval.every=5"]
    passes = []
    real = advantage_module.chunked_token_logprobs
    monkeypatch.setattr(advantage_module, "chunked_token_logprobs",
                        lambda *a, **k: passes.append(1) or real(*a, **k))
    results = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(AdvantageStage, "update_gives_prox", lambda self: False)
        run_dir = tmp_path / str(fused)
        trainer = Trainer(load_config(overrides=[*overrides, f"run_dir={run_dir}"]))
        rollouts = step_one_rollouts(trainer)
        passes.clear()
        row = trainer.rl_step(1, rollouts)
        assert row["train/updates"] == 1
        results[fused] = (row, [p.detach().clone() for p in trainer.model.parameters()], len(passes))
    (fused_row, fused_params, fused_passes), (plain_row, plain_params, plain_passes) = results[True], results[False]
    assert plain_passes == fused_passes + 1  # (a reference model, if any, has its own pass in both)
    for a, b in zip(fused_params, plain_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for key in ("policy/loss", "rollout/arrival_is_weight_mean", "rollout/arrival_is_weight_max", "train/reward"):
        assert fused_row[key] == pytest.approx(plain_row[key], rel=1e-4, abs=1e-5), key
    assert fused_row["rollout/arrival_is_weight_max"] == pytest.approx(1.0, abs=1e-3)


def test_two_updates_a_step_run_the_no_grad_pass_over_the_second_updates_rows_only(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    """Two minibatches a step: the first update's rows take their proximal log-probs from that
    update's own pass (it runs on the weights the step started from), so the no-grad pass before
    the update scores only the second minibatch's rows; the step's weights, losses and arrival
    weights are those of a step whose pass scored every row."""
    import torch

    from keelrl.train import advantage as advantage_module
    from keelrl.train.advantage import AdvantageStage

    overrides = [*TINY_RUN, f"model.path={tiny_model_dir}", "train.steps=1", "rollout.engine=sync", *FAST,
                 "train.minibatch_size=2", "eval.every=5", "rollout.temperature=0.6"]
    scored = []
    real = advantage_module.chunked_token_logprobs
    monkeypatch.setattr(advantage_module, "chunked_token_logprobs",
                        lambda model, ids, *a, **k: scored.append(ids.shape[0]) or real(model, ids, *a, **k))
    results = {}
    for partial in (True, False):
        if not partial:
            monkeypatch.setattr(AdvantageStage, "update_gives_prox", lambda self: False)
        trainer = Trainer(load_config(overrides=[*overrides, f"run_dir={tmp_path / str(partial)}"]))
        rollouts = step_one_rollouts(trainer)
        scored.clear()
        first = trainer.learner.first_update_rows([t.group_id for t in rollouts.trajectories], 1)
        row = trainer.rl_step(1, rollouts)
        assert row["train/updates"] == 2 and len(first) == 2
        results[partial] = (row, [p.detach().clone() for p in trainer.model.parameters()], list(scored))
    (partial_row, partial_params, partial_scored), (plain_row, plain_params, plain_scored) = results[True], results[False]
    # the policy's pass: the batch's 4 rows against the second update's 2; then the frozen reference's, every row
    assert plain_scored == [4, 4] and partial_scored == [2, 4]
    for a, b in zip(partial_params, plain_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for key in ("policy/loss", "rollout/arrival_is_weight_mean", "rollout/arrival_is_weight_max", "train/reward",
                "train/grad_norm"):
        assert partial_row[key] == pytest.approx(plain_row[key], rel=1e-4, abs=1e-5), key
    assert partial_row["rollout/arrival_is_weight_max"] == pytest.approx(1.0, abs=1e-3)


def test_the_learner_refuses_own_proximal_rows_outside_the_steps_first_minibatch(tiny_model_dir, tmp_path):
    """`UpdateInputs.prox_own` may mark only the rows of the step's first minibatch (the only
    update whose pass runs on the weights the step started from): marking a later one's rows is
    a ValueError, not ratios against moved weights."""
    import dataclasses

    import torch

    from keelrl.rollout.trajectory import collate

    cfg = load_config(overrides=[*TINY_RUN, f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "train.steps=1",
                                 "rollout.engine=sync", *FAST, "train.minibatch_size=2"])
    trainer = Trainer(cfg)
    rollouts = step_one_rollouts(trainer)
    group_ids = [t.group_id for t in rollouts.trajectories]
    batch = collate(rollouts.trajectories, trainer.pad_id)
    first = trainer.learner.first_update_rows(group_ids, 1)
    inputs = trainer.advantages(batch, first_update=first).inputs
    assert inputs.prox_own is not None and inputs.prox_own.nonzero().flatten().tolist() == sorted(first)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    later = dataclasses.replace(inputs, prox_own=~inputs.prox_own)
    with pytest.raises(ValueError, match="first minibatch"):
        trainer.learner.update(later, group_ids, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # refused before any update
    assert trainer.learner.update(inputs, group_ids, 1).updates == 2


def test_an_environment_that_raises_costs_its_group_not_the_step(tiny_model_dir, tmp_path):
    """One task's environment raises in step(): its episodes end as env_error with the error kept,
    its group is left out (no baseline), and the step still updates on the other group."""
    cfg = load_config(overrides=[*TINY_RUN, f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "train.steps=1",
                                 "rollout.engine=sync", *FAST])
    trainer = Trainer(cfg)
    doomed = trainer.requests_for(1)[0].task.id
    make = trainer.train_env_factory()

    class Broken:
        def __init__(self):
            self.env = make()

        def reset(self, task):
            self.task = task
            return self.env.reset(task)

        def step(self, action):
            if self.task.id == doomed:
                raise RuntimeError("disk on fire")
            return self.env.step(action)

        def __getattr__(self, name):
            return getattr(self.env, name)

    trainer.train_env_factory = lambda: Broken
    trainer.run()
    row = metrics(tmp_path)[1]
    assert row["train/env_error_frac"] == 0.5 and row["train/env_error_groups_dropped"] == 1
    assert row["train/updates"] >= 1 and row["train/skipped_updates"] == 0
    assert all(isinstance(value, (int, float)) and value == value for key, value in row.items()
               if key.startswith(("train/reward", "policy/")))  # nothing NaN leaked into the update
    assert "disk on fire" in (tmp_path / "samples" / "step_0001.txt").read_text()


def test_minibatches_hold_whole_groups_in_a_shuffled_group_order():
    import random

    from keelrl.train.learner import group_order

    group_ids = [7, 7, 7, 7, 3, 3, 3, 3, 9, 9, 9, 9, 1, 1, 1, 1]  # 4 groups of 4, as collated
    orders = {tuple(group_order(group_ids, random.Random(f"0:minibatch:{step}"))) for step in range(12)}
    assert len(orders) > 1  # the group order is shuffled from step to step
    for order in orders:
        assert sorted(order) == list(range(16))  # every row once
        for start in range(0, 16, 4):  # minibatch_size = group size: each minibatch is one whole group
            minibatch = order[start:start + 4]
            assert len({group_ids[row] for row in minibatch}) == 1 and list(minibatch) == sorted(minibatch)
    # Uneven groups (dynamic sampling can add any) stay contiguous too.
    uneven = [0, 1, 1, 2, 2, 2]
    order = group_order(uneven, random.Random(1))
    runs = [uneven[row] for row in order]
    assert sorted(order) == list(range(6))
    assert [g for i, g in enumerate(runs) if i == 0 or runs[i - 1] != g] == list(dict.fromkeys(runs))  # contiguous


def test_a_run_told_its_start_was_evaluated_elsewhere_skips_the_step_0_evaluation(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    calls = []
    original = Trainer.evaluate

    def counted(self, tasks=None):
        calls.append(self.step)
        return original(self, tasks)

    monkeypatch.setattr(Trainer, "evaluate", counted)
    run_dir = tmp_path / "run"
    summary = Trainer(load_config(overrides=[*TINY_RUN, *FAST, f"run_dir={run_dir}", f"model.path={tiny_model_dir}",
                                             "train.steps=2", "warm_start.demos=0",
                                             "eval.before_rl=false"])).run()
    assert calls == [1]  # the evaluation after step 2 only (the step counter moves after it)
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == [1, 2] and "eval/success" in rows[1]
    assert summary["eval_success_before_rl"] is None and "rl_lift" not in summary
    assert summary["heldout_final"]["tasks"] == 3


def test_adamw_is_fused_on_cpu_and_makes_the_per_tensor_loops_update():
    """keelrl.train.learner.adamw: the fused kernel where the device has one, the same update as
    torch's per-tensor AdamW (float64, three steps with weight decay)."""
    from keelrl.train.learner import adamw

    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=generator, dtype=torch.float64), torch.randn(7, generator=generator,
                                                                                   dtype=torch.float64)]
    grads = [[torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in start] for _ in range(3)]
    results = []
    for make in (lambda ps: adamw(ps, lr=0.1, weight_decay=0.01),
                 lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01, foreach=False)):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = make(params)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            optimizer.step()
        results.append(params)
        if len(results) == 1:
            assert optimizer.defaults["fused"] is True
    for fused, loop in zip(*results):
        torch.testing.assert_close(fused.detach(), loop.detach(), rtol=0, atol=1e-12)
        assert fused._version >= 3  # each step is seen as an in-place write: decoders reload the weights
    assert adamw([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))], lr=0.1, weight_decay=0).defaults["fused"]
