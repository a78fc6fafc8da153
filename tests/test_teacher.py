"""Learning from a teacher inside the trainer: distillation losses and advantage terms, the
self-distillation teacher's privileged view, the observation loss.

References are independent of the code under test: full [B, T, V] logits from one plain HF
forward of each float64 model, divergences written with torch.distributions, gradients by
autograd of those.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import FAST_RUN, SMALL, float64_model, step_one_rollouts
from torch.distributions import Categorical, kl_divergence

from keelrl.algos.config import AlgoConfig
from keelrl.config import TINY_RUN, DistillConfig, load_config
from keelrl.errors import ConfigError
from keelrl.policy.model import token_logprobs
from keelrl.policy.tiny import build_tiny_tokenizer, save_tiny_default
from keelrl.rollout.trajectory import Batch, collate
from keelrl.train.distill import Teacher, VocabularyMismatchError, check_same_vocabulary, privileged_hint
from keelrl.train.learner import Learner, UpdateInputs
from keelrl.train.trainer import Trainer

VOCAB = 40
LENGTHS = [12, 9, 12, 7]


def make_batch() -> Batch:
    """Prompt 4 tokens, then action (3) / observation (2) / action (rest) per row."""
    generator = torch.Generator().manual_seed(0)
    rows, width = len(LENGTHS), max(LENGTHS)
    ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    action = torch.zeros(rows, width, dtype=torch.bool)
    observation = torch.zeros(rows, width, dtype=torch.bool)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = torch.randint(2, VOCAB, (n,), generator=generator)
        attention[row, :n] = 1
        action[row, 4:7] = True
        observation[row, 7:min(9, n)] = True
        action[row, 9:n] = True
    behaviour = torch.full(ids.shape, -3.0, dtype=torch.float64) * action
    return Batch(ids, attention, action, behaviour, torch.zeros_like(ids), torch.zeros(rows), torch.arange(rows) // 2,
                 observation)


def full_log_probs(model, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """[B, T, V]: position t holds log pi(. | tokens before t) (position 0 unused)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / temperature
    log_probs = torch.log_softmax(logits, -1)
    return torch.cat([torch.zeros_like(log_probs[:, :1]), log_probs[:, :-1]], 1)


def learner(model, batch: Batch, distill: DistillConfig, teacher_model=None, budget: int = 30):
    algo = AlgoConfig(preset="grpo", kl_coef=0.0, entropy_coef=0.0, kl_in_reward=False)
    namespace = SimpleNamespace(
        cfg=SimpleNamespace(algo=algo, distill=distill, rollout=SimpleNamespace(temperature=1.0),
                            perf=SimpleNamespace(micro_batch_tokens=budget, share_prefix=False,
                                                  gradient_checkpointing=False)),
        model=model.train(), value_head=None, autocast=contextlib.nullcontext, loss_teacher=None, view=None)
    if teacher_model is not None:
        tokenizer = build_tiny_tokenizer()
        namespace.loss_teacher = Teacher(distill, model, tokenizer, student_name="student", device=torch.device("cpu"),
                                         model=teacher_model, model_tokenizer=tokenizer)
        namespace.view = namespace.loss_teacher.view(batch, [], 0)
    namespace.distill_loss = lambda *args: Learner.distill_loss(namespace, *args)
    return namespace, algo


def run_update(namespace, batch: Batch, advantages: torch.Tensor):
    model = namespace.model
    model.zero_grad(set_to_none=True)
    rows = torch.arange(batch.input_ids.shape[0])
    inputs = UpdateInputs(batch, advantages, torch.zeros_like(advantages), None, None, batch.behaviour_logprobs,
                          teacher_view=namespace.view)
    result = Learner.accumulate_gradients(namespace, inputs, rows)
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    sampled = torch.full(batch.input_ids.shape, float("nan"), dtype=torch.float64)  # the teacher's, where scored
    for micro_rows, width, logp in result.teacher_logp:
        sampled[micro_rows, :width] = logp
    namespace.teacher_sampled = sampled
    return result.metrics, grads


@pytest.mark.parametrize("divergence,beta,top_k", [("reverse_kl", 0.5, 0), ("forward_kl", 0.5, 0),
                                                   ("forward_kl", 0.5, 5), ("jsd", 0.3, 0)])
def test_distillation_loss_and_its_gradient_match_a_float64_reference(divergence, beta, top_k):
    student, teacher = float64_model(VOCAB, seed=0), float64_model(VOCAB, seed=1)
    batch = make_batch()
    coef = 0.7
    distill = DistillConfig(mode="on_policy", teacher="in memory", form="loss", divergence=divergence, beta=beta,
                            top_k=top_k, coef=coef)
    namespace, _ = learner(student, batch, distill, teacher)
    metrics, grads = run_update(namespace, batch, torch.zeros(batch.input_ids.shape, dtype=torch.float64))

    log_s = full_log_probs(student, batch)
    with torch.no_grad():
        log_t = full_log_probs(teacher, batch)
    mask = batch.action_mask
    s, t = Categorical(logits=log_s[mask]), Categorical(logits=log_t[mask])
    if divergence == "reverse_kl":
        per_token = kl_divergence(s, t)
    elif top_k == 0 and divergence == "forward_kl":
        per_token = kl_divergence(t, s)
    elif divergence == "forward_kl":  # teacher's top k and one bucket for the rest
        index = log_t[mask].topk(top_k, -1).indices
        p, q = log_t[mask].exp().gather(-1, index), log_s[mask].exp().gather(-1, index)
        p, q = torch.cat([p, 1 - p.sum(-1, keepdim=True)], -1), torch.cat([q, 1 - q.sum(-1, keepdim=True)], -1)
        per_token = kl_divergence(Categorical(probs=p), Categorical(probs=q))
    else:
        mixture = Categorical(probs=beta * t.probs + (1 - beta) * s.probs)
        per_token = beta * kl_divergence(t, mixture) + (1 - beta) * kl_divergence(s, mixture)
    # grpo aggregates seq_mean_token_mean: each row's token mean, then the mean over rows.
    row_of = mask.nonzero()[:, 0]
    row_means = torch.zeros(mask.shape[0], dtype=torch.float64).index_add(0, row_of, per_token) / mask.sum(1)
    want_loss = coef * row_means.mean()
    want_grads = torch.autograd.grad(want_loss, list(student.parameters()))
    assert metrics["distill/loss"] == pytest.approx(float(want_loss.detach()), rel=1e-9)
    assert metrics["distill/kl"] == pytest.approx(float(per_token.detach().mean()), rel=1e-9)
    differs = (log_s[mask].argmax(-1) != log_t[mask].argmax(-1)).double().mean()
    assert metrics["distill/top_token_differs"] == pytest.approx(float(differs)) and float(want_loss.detach()) > 0
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    # the teacher's log-prob of each sampled action token, read from the logits the loss used (0 elsewhere)
    sampled_t = log_t.gather(-1, batch.input_ids.unsqueeze(-1)).squeeze(-1) * mask
    got = namespace.teacher_sampled
    assert not got[mask].isnan().any()  # every micro-batch gave its rows (each cut to its longest row)
    torch.testing.assert_close(got.nan_to_num(0.0), sampled_t, rtol=1e-9, atol=1e-12)
    assert float(sampled_t.abs().min()) == 0 and float(sampled_t[mask].abs().min()) > 0


def test_observation_tokens_get_loss_only_from_the_observation_loss():
    model = float64_model(VOCAB, seed=0)
    batch = make_batch()
    everywhere = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    # Off: advantages at observation (and prompt) positions change nothing; the update is the action tokens' alone.
    namespace, _ = learner(model, batch, DistillConfig())
    _, noisy = run_update(namespace, batch, everywhere)
    _, clean = run_update(namespace, batch, everywhere * batch.action_mask)
    for a, b in zip(noisy, clean):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    _, none = run_update(namespace, batch, torch.zeros_like(everywhere))
    assert all(float(g.abs().max()) == 0 for g in none)  # nothing else in this objective
    # On: exactly coef x the mean next-token loss over observation tokens.
    namespace, _ = learner(model, batch, DistillConfig(observation_coef=0.3))
    metrics, grads = run_update(namespace, batch, torch.zeros_like(everywhere))
    log_p = full_log_probs(model, batch).gather(-1, batch.input_ids.unsqueeze(-1)).squeeze(-1)
    nll = -log_p[batch.observation_mask].mean()
    want = torch.autograd.grad(0.3 * nll, list(model.parameters()))
    assert metrics["train/observation_nll"] == pytest.approx(float(nll.detach()), rel=1e-9)
    assert metrics["train/observation_tokens"] == int(batch.observation_mask.sum())
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-12)


def test_a_teacher_with_another_vocabulary_is_refused_naming_both():
    tokenizer = build_tiny_tokenizer()
    other = build_tiny_tokenizer()
    other.add_tokens(["<|extra|>"])
    check_same_vocabulary(tokenizer, build_tiny_tokenizer(), "a", "b")
    with pytest.raises(VocabularyMismatchError, match=r"'teacher-dir' has a 265-token vocabulary and the student "
                                                      r"'student-dir' a 264-token one.*<\|extra\|>"):
        check_same_vocabulary(tokenizer, other, "student-dir", "teacher-dir")


def test_distill_settings_are_checked_before_any_work():
    with pytest.raises(ConfigError, match="distill.teacher"):
        load_config(overrides=["distill.mode=on_policy"])
    with pytest.raises(ConfigError, match="distill.mode"):
        load_config(overrides=["distill.mode=offline"])
    with pytest.raises(ConfigError, match="distill.beta"):
        load_config(overrides=["distill.beta=2"])
    with pytest.raises(ConfigError, match="distill.mode: self-distillation .* env.name='guess'"):
        load_config(overrides=["distill.mode=self", "env.name=guess"])


FAST = [*TINY_RUN, *FAST_RUN,
        "warm_start.epochs=6", "warm_start.batch_size=16",  # TINY_RUN's warm start, not FAST_RUN's single epoch
        "rollout.engine=sync", "train.steps=1", "eval.every=1", "eval.tasks=2", "algo.preset=grpo"]


def test_on_policy_advantage_term_is_minus_coef_times_the_sampled_reverse_kl(tiny_model_dir, tmp_path):
    from keelrl.rollout.agent_loop import model_actor, run_episodes
    from keelrl.inference import SamplingParams

    cfg = load_config(overrides=[*FAST, f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "distill.mode=on_policy",
                                 f"distill.teacher={tiny_model_dir}", "distill.coef=0.5"])
    trainer = Trainer(cfg)
    with torch.no_grad():  # a student that differs from its teacher
        for p in trainer.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    trajectories = run_episodes(trainer._env(training=True), trainer.train_tasks[:2], trainer.tokenizer,
                                model_actor(trainer.model, trainer.tokenizer, SamplingParams(1.0, 1.0, 16)),
                                trainer._limits(), seed=5)
    batch = collate(trajectories, trainer.pad_id)
    view = trainer.teacher.view(batch, trajectories, trainer.pad_id)
    estimated = trainer.advantages(batch, view)
    with_term, prox, stats = estimated.inputs.advantages, estimated.inputs.prox_logp, estimated.stats
    trainer.cfg.distill.coef = 0.0
    without = trainer.advantages(batch, view).inputs.advantages
    teacher_logp = token_logprobs(trainer.teacher.model, batch.input_ids, batch.attention_mask)["logp"]
    mask = batch.action_mask
    sampled_kl = (prox - teacher_logp) * mask
    torch.testing.assert_close(with_term - without, -0.5 * sampled_kl.to(with_term.dtype), rtol=1e-4, atol=1e-5)
    assert stats["distill/sampled_kl"] == pytest.approx(float(sampled_kl.sum() / mask.sum()), rel=1e-4, abs=1e-6)
    assert float(sampled_kl.abs().max()) > 1e-3  # the student really differs from the teacher


def test_a_loss_form_teacher_leaves_the_pre_update_passes_to_the_update(tiny_model_dir, tmp_path, monkeypatch):
    """distill.form=loss, two updates a step: the teacher runs no pass of its own before the
    updates (its term reads its logits in the update), the policy's no-grad pass scores only the
    second update's rows (the first's pi_prox is that update's own pass), and the step's
    distill/sampled_kl is the pre-update policy's log-probs minus the teacher's over the
    batch's action tokens, as a separate pass of each computes it. The step's weights and losses
    are those of a step whose no-grad pass scored every row."""
    from keelrl.train import advantage as advantage_module
    from keelrl.train.advantage import AdvantageStage

    teacher_dir = save_tiny_default(tmp_path / "teacher", replace(SMALL, seed=7))
    overrides = [*FAST, f"model.path={tiny_model_dir}", "distill.mode=on_policy", f"distill.teacher={teacher_dir}",
                 "distill.form=loss", "train.minibatch_size=2", "eval.every=5", "rollout.temperature=0.6"]
    scored, teacher_passes = [], []
    real = advantage_module.chunked_token_logprobs
    monkeypatch.setattr(advantage_module, "chunked_token_logprobs",
                        lambda model, ids, *a, **k: scored.append(ids.shape[0]) or real(model, ids, *a, **k))
    real_teacher = Teacher.logprobs
    monkeypatch.setattr(Teacher, "logprobs", lambda *a, **k: teacher_passes.append(1) or real_teacher(*a, **k))
    results = {}
    for partial in (True, False):
        if not partial:
            monkeypatch.setattr(AdvantageStage, "update_gives_prox", lambda self: False)
        trainer = Trainer(load_config(overrides=[*overrides, f"run_dir={tmp_path / str(partial)}"]))
        rollouts = step_one_rollouts(trainer)
        batch = collate(rollouts.trajectories, trainer.pad_id)
        view = trainer.teacher.view(batch, rollouts.trajectories, trainer.pad_id)
        with torch.no_grad():  # independent passes on the weights the step starts from
            prox = token_logprobs(trainer.model.eval(), batch.input_ids, batch.attention_mask,
                                  temperature=trainer.cfg.rollout.temperature)["logp"]
            teacher_logp = real_teacher(trainer.teacher, view, batch.action_mask, None)
        mask = batch.action_mask
        want = float(((prox - teacher_logp) * mask).sum() / mask.sum())
        scored.clear()
        teacher_passes.clear()
        row = trainer.rl_step(1, rollouts)
        assert row["train/updates"] == 2 and not teacher_passes
        assert row["distill/sampled_kl"] == pytest.approx(want, rel=1e-4, abs=1e-5)
        assert abs(want) > 1e-3  # the two models differ
        results[partial] = (row, [p.detach().clone() for p in trainer.model.parameters()], list(scored))
    (partial_row, partial_params, partial_scored), (plain_row, plain_params, plain_scored) = results[True], results[False]
    assert partial_scored[0] == 2 and plain_scored[0] == 4  # the policy's pass; the frozen reference's follows, if any
    assert partial_scored[1:] == plain_scored[1:]
    for a, b in zip(partial_params, plain_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for key in ("policy/loss", "distill/loss", "distill/kl", "rollout/arrival_is_weight_mean"):
        assert partial_row[key] == pytest.approx(plain_row[key], rel=1e-4, abs=1e-5), key


def test_the_self_teacher_reads_the_reference_fix_and_scores_the_students_tokens(tiny_model_dir, tmp_path):
    from keelrl.rollout.agent_loop import model_actor, run_episodes
    from keelrl.inference import SamplingParams
    from keelrl.rollout.scheduler import prompt_tokens

    cfg = load_config(overrides=[*FAST, f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "distill.mode=self"])
    trainer = Trainer(cfg)
    tasks = trainer.train_tasks[:2]
    trajectories = run_episodes(trainer._env(training=True), tasks, trainer.tokenizer,
                                model_actor(trainer.model, trainer.tokenizer, SamplingParams(1.0, 1.0, 16)),
                                trainer._limits(), seed=5)
    batch = collate(trajectories, trainer.pad_id)
    view = trainer.teacher.view(batch, trajectories, trainer.pad_id)
    got = trainer.teacher.logprobs(view, batch.action_mask, None)
    for row, trajectory in enumerate(trajectories):
        task = next(t for t in tasks if t.id == trajectory.task_id)
        hint = privileged_hint(task)
        assert next(iter(task.reference_fix.values())).strip().splitlines()[0] in hint
        privileged = prompt_tokens(trainer.tokenizer, hint + trajectory.prompt)
        sequence = privileged + trajectory.token_ids[trajectory.prompt_length:]
        logp = token_logprobs(trainer.model, torch.tensor([sequence]), torch.ones(1, len(sequence), dtype=torch.long),
                              temperature=cfg.rollout.temperature)["logp"][0]
        shift = len(privileged) - trajectory.prompt_length
        for position, is_action in enumerate(trajectory.action_mask):
            want = float(logp[position + shift].detach()) if is_action else 0.0
            assert float(got[row, position]) == pytest.approx(want, abs=1e-5)


def test_a_run_with_each_teacher_mode_trains_and_logs_its_metrics(tiny_model_dir, tmp_path):
    runs = {"self-loss": ["distill.mode=self", "distill.form=loss", "distill.observation_coef=0.1"],
            "teacher-advantage": ["distill.mode=on_policy", f"distill.teacher={tiny_model_dir}"]}
    for name, overrides in runs.items():
        run_dir = tmp_path / name
        Trainer(load_config(overrides=[*FAST, f"run_dir={run_dir}", f"model.path={tiny_model_dir}", *overrides])).run()
        row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[1])
        assert row["train/updates"] == 1 and row["distill/sampled_kl"] == row["distill/sampled_kl"]  # finite
        if name == "self-loss":
            assert row["distill/kl"] >= 0 and 0 <= row["distill/top_token_differs"] <= 1
            assert row["train/observation_tokens"] > 0 and row["train/observation_nll"] > 0


def test_teacher_sampled_steps_distil_on_the_teachers_histories_without_an_rl_term(tiny_model_dir, tmp_path):
    """GKD's student share: with distill.student_share=0 every step's histories are the teacher's
    samples (its log-probs as behaviour), on the step's own tasks, and the update is the
    distillation loss alone (zero advantages, old log-probs the student's own)."""
    with pytest.raises(ConfigError, match="student_share"):
        load_config(overrides=["distill.mode=on_policy", "distill.teacher=x", "distill.student_share=0.5"])
    teacher_dir = save_tiny_default(tmp_path / "teacher", replace(SMALL, seed=7))
    cfg = load_config(overrides=[*FAST, f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}",
                                 "distill.mode=on_policy", f"distill.teacher={teacher_dir}", "distill.form=loss",
                                 "distill.divergence=forward_kl", "distill.student_share=0", "train.steps=2"])
    trainer = Trainer(cfg)
    assert trainer.requests.teacher_samples(1) and trainer.requests.teacher_samples(2)
    rollouts = trainer.teacher_rollouts(1)
    tasks = [request.task.id for request in trainer.requests_for(1) for _ in range(request.group_size)]
    assert [t.task_id for t in rollouts.trajectories] == tasks
    for trajectory in rollouts.trajectories[:2]:
        ids = torch.tensor([trajectory.token_ids])
        for model, should_match in ((trainer.teacher.model, True), (trainer.model, False)):
            logp = token_logprobs(model, ids, torch.ones_like(ids), temperature=cfg.rollout.temperature)["logp"][0]
            actions = torch.tensor(trajectory.action_mask)
            matches = torch.allclose(logp[actions], torch.tensor(trajectory.behaviour_logprobs)[actions], atol=1e-4)
            assert matches == should_match
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    for row in rows:
        assert row["distill/teacher_histories"] == 1.0 and row["distill/kl"] > 0
        assert row["policy/loss"] == pytest.approx(0.0, abs=1e-6) and row["distill/loss"] > 0
        assert row["rollout/arrival_is_weight_max"] == 1.0 and "distill/sampled_kl" not in row
