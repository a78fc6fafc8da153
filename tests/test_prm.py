"""The process reward model: labels from hidden-check deltas, the hidden states it reads, its
fit and accuracy, its per-turn advantage term, and a trainer run that uses it.

Labels are checked against independent gradings of the files each turn leaves (the fixture's
hand-written retry_count task: buggy 3/4 checks, the plausible wrong fix 3/4, returning 0 1/4,
the real fix 4/4). The advantage term is checked against a loop over turns in float64.
"""

from __future__ import annotations

import dataclasses

import json

import pytest
import torch
from conftest import float64_model, limits

from keelrl.config import TINY_RUN, load_config
from keelrl.envs.coding import CodingEnv
from keelrl.errors import ConfigError
from keelrl.policy.model import load_policy
from keelrl.policy.prefix import chunked_token_logprobs
from keelrl.rollout.agent_loop import run_episodes, scripted_actor
from keelrl.rollout.scheduler import step_labels
from keelrl.rollout.trajectory import Batch, collate
from keelrl.sandbox import Sandbox
from keelrl.train.prm import ProcessRewardModel, classification_metrics, labelled_turns, process_advantages
from keelrl.envs.verifiers import DEFAULT_LIMITS, make_verifier
from task_fixtures import BUGGY, CONSTANT_ZERO, FIXED, WRONG, retry_task


def replace_all(text: str) -> str:
    """A one-call rewrite of retry.py (edit OLD >>> NEW of the whole buggy file)."""
    return f"<call>edit\n{BUGGY.rstrip()}\n>>>\n{text.rstrip()}\n</call>"


def test_labels_come_from_pass_count_deltas():
    assert step_labels([3, 3, 3, 3, 4], [True, True, False, True]) == [0, 0, -1, 1]
    assert step_labels([2, 1, 4], [True, True]) == [0, 1]  # a drop is not progress; the recovery is
    with pytest.raises(ValueError, match="3 counts for 3 turns"):
        step_labels([1, 2, 3], [True, True, True])


def test_rollouts_label_each_code_changing_turn_by_its_hidden_check_delta(tiny_model_dir):
    _, tokenizer = load_policy(str(tiny_model_dir), "cpu")
    task = retry_task()
    verifier = make_verifier("strong", Sandbox(DEFAULT_LIMITS))

    def passes(text: str) -> int:
        return sum(check.passed for check in verifier.grade(task, {**task.files, "retry.py": text}).checks)

    assert [passes(text) for text in (BUGGY, WRONG, CONSTANT_ZERO, FIXED)] == [3, 3, 1, 4]
    scripts = [
        ["<call>read</call>", replace_all(WRONG), "<call>test</call>",
         f"<call>edit\n{WRONG.rstrip()}\n>>>\n{FIXED.rstrip()}\n</call>", "<call>submit</call>"],
        ["not a tool call", replace_all(CONSTANT_ZERO),
         f"<call>edit\n{CONSTANT_ZERO.rstrip()}\n>>>\n{FIXED.rstrip()}\n</call>"],  # then submits
    ]
    policies = [lambda prompt, turns, s=script: s[len(turns)] if len(turns) < len(s) else "<call>submit</call>"
                for script in scripts]
    cfg = limits(max_turns=5, label_steps=True, max_new_tokens=64, max_context_tokens=4096)
    read_only, malformed = -1, 0
    first, second = run_episodes(lambda: CodingEnv(verifier), [task, task], tokenizer,
                                 scripted_actor(tokenizer, policies), cfg)
    assert first.action_errors == 0 and first.success
    assert first.step_passes == [3, 3, 3, 3, 4, 4]
    assert first.step_labels == [read_only, 0, read_only, 1, read_only]
    assert second.step_passes == [3, 3, 1, 4, 4] and second.success
    assert second.step_labels == [malformed, 0, 1, read_only]
    # Without label_steps nothing is graded mid-episode and no labels are made.
    [plain] = run_episodes(lambda: CodingEnv(verifier), [task], tokenizer, scripted_actor(tokenizer, policies[:1]),
                           limits(max_turns=5, max_new_tokens=64, max_context_tokens=4096))
    assert plain.step_labels == [] and plain.step_passes == []
    # collate puts each label at its turn's last action token.
    batch = collate([first, second], tokenizer.pad_token_id)
    for row, trajectory in enumerate([first, second]):
        where = (batch.step_labels[row] >= 0).nonzero().squeeze(-1).tolist()
        want = []
        for turn, label in enumerate(trajectory.step_labels):
            if label >= 0:
                last = max(i for i, (a, t) in enumerate(zip(trajectory.action_mask, trajectory.turn_ids))
                           if a and t == turn)
                want.append(last)
                assert int(batch.step_labels[row, last]) == label
        assert where == want
        assert bool(batch.action_mask[row, where].all())


def test_hidden_states_at_positions_equal_the_plain_pass_with_and_without_a_shared_prompt():
    model = float64_model(40).eval()
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, 40, (6,), generator=generator)
    lengths = [5, 8, 3, 7]
    ids = torch.zeros(4, 14, dtype=torch.long)
    attention = torch.zeros_like(ids)
    positions = torch.zeros(4, 14, dtype=torch.bool)
    for row, n in enumerate(lengths):
        ids[row, :6 + n] = torch.cat([prompt, torch.randint(2, 40, (n,), generator=generator)])
        attention[row, :6 + n] = 1
        positions[row, 6:6 + n] = True
    where = torch.zeros_like(positions)
    for row, n in enumerate(lengths):
        where[row, 6 + n - 1] = True
        where[row, 7] = row % 2 == 0
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    want = hidden[where]
    for budget in (1, 20, 1000):
        for keys in (None, torch.tensor([0, 0, 0, 0])):
            got = chunked_token_logprobs(model, ids, attention, max_tokens=budget, positions=positions, keys=keys,
                                         hidden_at=where)["hidden_at"]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_scorer_fits_separable_turns_and_metrics_count_both_classes():
    generator = torch.Generator().manual_seed(0)
    direction = torch.randn(16, generator=generator)
    features = torch.randn(200, 16, generator=generator)
    labels = (features @ direction > 1.0).long()  # about 16% positive
    prm = ProcessRewardModel(16, torch.device("cpu"), lr=0.05, fit_steps=300, buffer=150)
    before = classification_metrics(prm.scores(features), labels, "x/")
    assert before["x/balanced_accuracy"] == pytest.approx(0.5)  # P = 0.5 everywhere: every turn predicted 0
    metrics = prm.fit(features[:150], labels[:150])
    assert metrics["prm/buffer"] == 150
    held_out = classification_metrics(prm.scores(features[150:]), labels[150:], "x/")
    assert held_out["x/balanced_accuracy"] > 0.85 and held_out["x/accuracy"] > 0.85
    prm.fit(features[150:], labels[150:])
    assert len(prm.labels) == 150 and torch.equal(prm.features[-50:], features[150:])  # the newest 150 kept
    scores, truth = torch.tensor([0.9, 0.2, 0.7, 0.4, 0.1]), torch.tensor([1, 1, 0, 0, 0])
    metrics = classification_metrics(scores, truth, "m/")
    assert metrics == {"m/accuracy": pytest.approx(3 / 5), "m/balanced_accuracy": pytest.approx((1 / 2 + 2 / 3) / 2),
                       "m/positive_frac": pytest.approx(2 / 5), "m/turns": 5.0}
    assert classification_metrics(scores[:0], truth[:0], "m/") == {"m/turns": 0.0}


def test_process_advantages_centre_each_turns_score_in_its_group():
    generator = torch.Generator().manual_seed(2)
    rows, width = 5, 15
    mask = torch.zeros(rows, width, dtype=torch.bool)
    turns = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), -1)
    for row in range(rows):  # prompt 2 tokens, then turns of 3 action + 1 observation tokens
        for turn in range(min(row + 1, 2) + (row == 4)):
            start = 2 + 4 * turn
            mask[row, start:start + 3] = True
            turns[row, start:start + 4] = turn
            if (row + turn) % 3 != 2:  # some turns are unlabelled (reads, tests)
                labels[row, start + 2] = int(torch.randint(0, 2, (), generator=generator))
    batch = Batch(torch.zeros(rows, width, dtype=torch.long), mask.long(), mask, torch.zeros(rows, width), turns,
                  torch.zeros(rows), torch.tensor([0, 0, 1, 1, 2]), None, labels)
    where, flat_labels = labelled_turns(batch)
    scores = torch.rand(len(flat_labels), generator=generator, dtype=torch.float64)
    got = process_advantages(scores.float(), where, batch, weight=0.5)
    want = torch.zeros(rows, width, dtype=torch.float64)
    located = where.nonzero().tolist()
    for index, (row, position) in enumerate(located):
        siblings = [scores[i] for i, (r, _) in enumerate(located) if int(batch.group_ids[r]) == int(batch.group_ids[row])]
        term = 0.5 * (scores[index] - sum(siblings) / len(siblings))
        for column in range(width):
            if mask[row, column] and turns[row, column] == turns[row, position]:
                want[row, column] = term
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    assert float(want.abs().sum()) > 0.1
    assert torch.equal(process_advantages(scores[:0], torch.zeros_like(mask), batch, 0.5), torch.zeros(rows, width))


def test_good_turn_credit_counts_good_turns_of_failed_episodes_by_their_mean_advantage():
    """Trajectory B by hand. Row 0 failed (reward 0): turn 0 raised the hidden pass count (label 1)
    and its tokens' advantages -1, 3 average to +1 > 0; turn 1 (label 0) does not count. Row 1
    failed: its good turn 1 has advantages 0.5, -2 (mean -0.75). Row 2 succeeded (reward 1): its
    good turn is not a failed episode's. So 2 good turns, 1 of them credited: share 1/2."""
    from keelrl.train.advantage import good_turn_credit

    # prompt 1 token, then turns of 2 action tokens + 1 observation token
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0]] * 3, dtype=torch.bool)
    turns = torch.tensor([[0, 0, 0, 0, 1, 1, 1]] * 3)
    labels = torch.full((3, 7), -1)
    labels[0, 2], labels[0, 5] = 1, 0
    labels[1, 5] = 1
    labels[2, 2] = 1
    advantages = torch.tensor([[0, -1, 3, 0, -5, -5, 0],
                               [0, 9, 9, 0, 0.5, -2, 0],
                               [0, -4, -4, 0, 1, 1, 0]], dtype=torch.float32)
    batch = Batch(torch.zeros(3, 7, dtype=torch.long), torch.ones(3, 7, dtype=torch.long), mask, torch.zeros(3, 7),
                  turns, torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0, 0, 0]), None, labels)
    assert good_turn_credit(advantages, batch) == {"credit/good_turns": 2.0, "credit/good_turn_positive_frac": 0.5}
    advantages[1, 4] = 3.0  # row 1's good turn now averages (3 - 2) / 2 = 0.5 > 0
    assert good_turn_credit(advantages, batch)["credit/good_turn_positive_frac"] == 1.0
    batch.rewards[:] = 1.0  # every episode solved: no good turn of a failed one
    assert good_turn_credit(advantages, batch) == {"credit/good_turns": 0.0}
    batch.step_labels = torch.full((3, 7), -1)  # no turn labelled (prm off): nothing to measure
    assert good_turn_credit(advantages, batch) == {}
    batch.step_labels = None
    assert good_turn_credit(advantages, batch) == {}


def test_rejected_turn_credit_counts_malformed_turns_an_update_makes_more_likely():
    """By hand, from trajectories. Group of 3 on one task; each episode: a prompt token, then two
    turns of 2 action tokens and 1 observation token (episode 2's second action is 3 tokens, so
    the others are padded). Episode 0 solved it with its turn 0 rejected (a malformed call);
    episode 1 failed with its turn 1 rejected; episode 2 failed cleanly. GRPO (scores 1, 0, 0;
    mean 1/3, std 0.577): episode 0's tokens get +1.155, episode 1's -0.577, so the two rejected
    turns are credited +1.155 and -0.577: 2 rejected turns, share 1/2. The share reads a turn's
    mean advantage, not its last token's; a row the loss does not read (the overlong filter's
    mask) does not count."""
    from keelrl.algos import AlgoConfig, compute_advantages, outcome_to_token_rewards
    from keelrl.rollout.trajectory import Trajectory, collate
    from keelrl.train.advantage import rejected_turn_credit

    trajectories = []
    for reward, refused, last in ((1.0, 0, [6, 7]), (0.0, 1, [6, 7]), (0.0, None, [6, 7, 7])):
        t = Trajectory("task", 0, reward=reward)
        t.extend([5], action=False, turn=0)
        for turn in (0, 1):
            action = last if turn == 1 else [6, 7]
            t.extend(action, action=True, turn=turn, logprobs=[-1.0] * len(action))
            t.extend([8], action=False, turn=turn)
            t.turn_info.append({"error": "error: the tool call is not closed"} if turn == refused else {"tool": "test"})
        trajectories.append(t)
    batch = collate(trajectories, pad_id=0)
    assert batch.rejected is not None
    assert batch.rejected.tolist() == [[False, True, True, False, False, False, False, False],
                                       [False, False, False, False, True, True, False, False],
                                       [False] * 8]
    token_rewards = outcome_to_token_rewards(batch.rewards, batch.action_mask)
    advantages = compute_advantages(token_rewards=token_rewards, mask=batch.action_mask, group_ids=batch.group_ids,
                                    cfg=AlgoConfig(preset="grpo")).advantages
    assert float(advantages[0, 1]) == pytest.approx(2 / 3 / (1 / 3) ** 0.5, rel=1e-3)
    assert rejected_turn_credit(advantages, batch) == {"credit/rejected_turns": 2.0,
                                                       "credit/rejected_turn_positive_frac": 0.5}
    charged = advantages.clone()
    charged[0, 1] = -3.0  # the solved episode's rejected turn now averages (-3 + 1.155) / 2 < 0,
    assert rejected_turn_credit(charged, batch)["credit/rejected_turn_positive_frac"] == 0.0  # its last token > 0
    masked = dataclasses.replace(batch, action_mask=batch.action_mask.clone())
    masked.action_mask[0] = False  # row 0 left out of the loss: its rejected turn is not the update's
    assert rejected_turn_credit(advantages, masked) == {"credit/rejected_turns": 1.0,
                                                        "credit/rejected_turn_positive_frac": 0.0}
    batch.rejected = torch.zeros_like(batch.rejected)  # nothing rejected: measured, none
    assert rejected_turn_credit(advantages, batch) == {"credit/rejected_turns": 0.0}
    batch.rejected = None  # a batch built without it: not measured
    assert rejected_turn_credit(advantages, batch) == {}


def test_bad_prm_settings_are_named():
    with pytest.raises(ConfigError, match="weight"):
        load_config(overrides=["prm.weight=0.5"])
    with pytest.raises(ConfigError, match="fit_steps"):
        load_config(overrides=["prm.fit_steps=0"])
    with pytest.raises(ConfigError, match="lr"):
        load_config(overrides=["prm.lr=-1"])
    with pytest.raises(ConfigError, match="scorer"):
        load_config(overrides=["prm.enabled=true", "prm.scorer=false", "prm.weight=0.5"])


def test_labels_without_the_scorer_keep_trajectory_b_and_drop_the_separate_pass(tiny_model_dir, tmp_path):
    from keelrl.inference import SamplingParams
    from keelrl.rollout.agent_loop import model_actor
    from keelrl.train.trainer import Trainer

    base = [*TINY_RUN, f"model.path={tiny_model_dir}", "rollout.engine=sync", "eval.tasks=3", "warm_start.demos=4",
            "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "env.max_turns=2",
            "train.steps=1", "train.epochs=1", "train.minibatch_size=64", "prm.enabled=true"]
    labels_only = Trainer(load_config(overrides=[*base, "prm.scorer=false", f"run_dir={tmp_path / 'labels'}"]))
    labels_only.run()
    rows = [json.loads(line) for line in (tmp_path / "labels" / "metrics.jsonl").read_text().splitlines()]
    step = next(row for row in rows if "train/success" in row)
    assert labels_only.prm is None and "credit/good_turns" in step  # the turns are still labelled and measured
    assert not any(key.startswith(("prm/", "eval/prm_")) for row in rows for key in row)
    trajectories = run_episodes(labels_only._env(training=True), labels_only.train_tasks[:2], labels_only.tokenizer,
                                model_actor(labels_only.model, labels_only.tokenizer, SamplingParams(1.0, 1.0, 16)),
                                labels_only._limits(), seed=1, group_ids=[0, 0])
    batch = collate(trajectories, labels_only.pad_id)
    assert batch.step_labels is not None and labels_only.advantages.prox_from_update(batch)
    with_scorer = Trainer(load_config(overrides=[*base, f"run_dir={tmp_path / 'scorer'}"]))
    assert with_scorer.prm is not None and not with_scorer.advantages.prox_from_update(batch)  # it needs the pass


def test_a_run_trains_the_scorer_uses_it_and_resumes_it(tiny_model_dir, tmp_path):
    from keelrl.train.trainer import Trainer

    base = [*TINY_RUN, f"model.path={tiny_model_dir}", "rollout.engine=sync", "eval.every=2", "eval.tasks=3",
            "warm_start.demos=4", "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
            "env.max_turns=2", "train.steps=2", "output.checkpoint_every=1", "prm.enabled=true", "prm.weight=0.5"]
    run = tmp_path / "full"
    trainer = Trainer(load_config(overrides=[*base, f"run_dir={run}"]))
    trainer.run()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "prm/turns" in row]
    assert len(steps) == 2 and all(row["prm/turns"] >= 4 for row in steps)  # 4 episodes, at least 1 turn each
    assert steps[-1]["prm/buffer"] == sum(row["prm/turns"] for row in steps)
    assert all(0 <= row["prm/accuracy"] <= 1 for row in steps)
    assert all(row["credit/good_turns"] >= 0 for row in steps)  # trajectory B is measured whenever turns are labelled
    evaluated = [row for row in rows if "eval/prm_turns" in row]
    assert evaluated and all(row["eval/prm_turns"] >= 3 for row in evaluated)
    assert 0 <= evaluated[-1]["eval/prm_balanced_accuracy"] <= 1
    # The surrogate value moves the advantages by exactly the process term of the scores.
    from keelrl.inference import SamplingParams
    from keelrl.rollout.agent_loop import model_actor

    trajectories = run_episodes(trainer._env(training=True), trainer.train_tasks[:3], trainer.tokenizer,
                                model_actor(trainer.model, trainer.tokenizer, SamplingParams(1.0, 1.0, 16)),
                                trainer._limits(), seed=5, group_ids=[0, 0, 1])
    batch = collate(trajectories, trainer.pad_id)
    where, _ = labelled_turns(batch)
    assert int(where.sum()) >= 3
    features = chunked_token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, max_tokens=10_000,
                                      hidden_at=where)["hidden_at"]
    scores = trainer.prm.scores(features)
    trainer.prm.fit_steps = 0  # hold the scorer still between the two calls: nothing to refit
    with_term = trainer.advantages(batch).inputs.advantages
    trainer.cfg.prm.weight = 0.0
    without = trainer.advantages(batch).inputs.advantages
    torch.testing.assert_close(with_term - without, process_advantages(scores, where, batch, 0.5).to(with_term.dtype),
                               rtol=1e-4, atol=1e-5)
    # Killed after step 1 and resumed: the scorer, its optimizer and its buffer come back.
    part = tmp_path / "part"
    stopped = Trainer(load_config(overrides=[*base, f"run_dir={part}"]))
    stopped.run(stop_after=1)
    resumed = Trainer(load_config(part / "config.yaml"))
    resumed.load_checkpoint()
    assert float(stopped.prm.linear.weight.detach().abs().sum()) > 0  # fitted, not the zero start
    assert torch.equal(resumed.prm.linear.weight, stopped.prm.linear.weight)
    assert torch.equal(resumed.prm.labels, stopped.prm.labels) and len(resumed.prm.labels) == steps[0]["prm/turns"]
    assert resumed.prm.optimizer.state_dict()["state"]  # Adam's moments too
