"""reasoning-gym datasets as keelrl environments: real entries, the dataset's own scoring, the
teacher, the split, the lazy import, and the tiny model trained on one dataset end to end.

The tested dataset is basic_arithmetic: generated offline in microseconds, and scored by
reasoning-gym's default scorer (exact match 1; an answer that merely contains the reference
gets len(reference) / len(answer)), so partial credit shows up."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

pytest.importorskip("reasoning_gym")

import reasoning_gym  # noqa: E402

from keelrl.components import check
from keelrl.config import TINY_RUN, load_config  # noqa: E402
from keelrl.envs.base import VerifierError, check_env, run_episode  # noqa: E402
from keelrl.envs.reasoning_gym import (ReasoningGymEnv, ReasoningGymEnvFactory, ReferenceAnswerTeacher,  # noqa: E402
                                       answer_action, answer_text, rg_tasks)
from keelrl.envs.registry import resolve_env  # noqa: E402
from keelrl.envs.tasks import split_of  # noqa: E402
from keelrl.envs.tools import ActionError  # noqa: E402
from keelrl.errors import ConfigError  # noqa: E402

NOT_CODING = ("env.partial_credit=false", "env.show_file=true")
"""After TINY_RUN (a coding recipe): its coding-only settings back to their defaults, which another kind refuses."""

DATASET = "basic_arithmetic"
RG = ["env.name=reasoning_gym", f"env.dataset={DATASET}", "env.rg_size=40"]


@pytest.fixture(scope="module")
def tasks():
    return rg_tasks(DATASET, 40, seed=3)


@pytest.fixture(scope="module")
def dataset():
    return reasoning_gym.create_dataset(DATASET, size=40, seed=3)


def graded(env: ReasoningGymEnv, task, *actions: str):
    env.reset(task)
    for action in actions:
        observation, done, info = env.step(action)
        if done:
            break
    return env.grade()


def test_tasks_are_the_datasets_entries(tasks, dataset):
    assert len(tasks) == 40 and len({t.id for t in tasks}) == 40
    for index in (0, 17, 39):
        entry = dataset[index]
        assert tasks[index].id == f"rg-{DATASET}-3-{index:05d}" and tasks[index].kind == DATASET
        assert (tasks[index].question, tasks[index].answer) == (entry["question"], entry["answer"])
        assert tasks[index].entry == entry


def test_the_prompt_is_the_question_and_the_answer_format(tasks, dataset):
    prompt = ReasoningGymEnv(dataset).reset(tasks[0])
    assert prompt.startswith(tasks[0].question) and "<call>answer ANSWER</call>" in prompt


def test_the_reward_is_the_datasets_own_score(tasks, dataset):
    env = ReasoningGymEnv(dataset)
    task = tasks[5]
    reference = task.answer
    assert reference
    for answer in (reference, "0" if reference != "0" else "1", f"{reference} or so", f"x{reference}", "seven"):
        grade = graded(env, task, answer_action(answer))
        expected = dataset.score_answer(answer, task.entry)
        assert grade.reward == expected and grade.partial == expected
        assert grade.success is (expected == 1.0)
        assert grade.verifier == f"reasoning_gym:{DATASET}"
    contains = graded(env, task, answer_action(f"{reference} or so"))
    # The default scorer: the reference inside a longer answer, len(reference) / len(answer).
    assert contains.reward == pytest.approx(len(reference) / len(f"{reference} or so"))
    assert [(c.name, c.passed) for c in contains.checks] == [("answer_credit", True), ("answer_shortfall", False)]
    assert sum(c.weight for c in contains.checks) == 1.0
    wrong = graded(env, task, answer_action("seven"))
    assert [(c.name, c.passed, c.weight) for c in wrong.checks] == [("answer_shortfall", False, 1.0)]
    assert reference in wrong.checks[0].detail  # says what was expected


def test_surrounding_white_space_is_stripped_before_scoring(tasks, dataset):
    task = tasks[1]
    # reasoning-gym itself gives the padded answer partial credit only ...
    assert dataset.score_answer(f"  {task.answer}\n", task.entry) < 1.0
    # ... the env hands it the answer without the padding.
    for action in (f"<call>answer    {task.answer}   </call>", f"<call>answer\n  {task.answer}\n</call>",
                   f"Let me compute this.\n<call>answer {task.answer}</call>"):
        assert graded(ReasoningGymEnv(dataset), task, action).reward == 1.0, action


def test_answer_text_keeps_the_inside_and_multiple_lines():
    assert answer_text("<call>answer 1  2</call>") == "1  2"
    assert answer_text("<call>answer\n1 2\n3 4\n</call>") == "1 2\n3 4"
    assert answer_text("<call>answer 1 2\n3 4</call>") == "1 2\n3 4"
    for bad, message in (("42", "no tool call"), ("<call>answer</call>", "the answer is empty"),
                         ("<call>guess 4</call>", "unknown tool 'guess'"), ("<call>answer 4", "not closed"),
                         ("<call>answer 1</call><call>answer 2</call>", "more than one"),
                         ("<call>answer " + "9" * 20_000 + "</call>", "the limit is 16000")):
        with pytest.raises(ActionError, match=message):
            answer_text(bad)


def test_a_malformed_action_is_an_error_observation_and_costs_a_turn(tasks, dataset):
    env = ReasoningGymEnv(dataset, max_turns=3)
    env.reset(tasks[2])
    observation, done, info = env.step("the answer is 4")
    assert not done and info["error"].startswith("error: no tool call") and "<call>answer ANSWER</call>" in observation
    observation, done, info = env.step("<call>answer </call>")
    assert not done and "empty" in info["error"]
    observation, done, info = env.step("<call>answr 4</call>")
    assert done and info["termination"] == "max_turns" and "unknown tool" in info["error"]
    grade = env.grade()
    assert grade.reward == 0.0 and not grade.success and grade.checks[0].detail == "no answer given"
    env.reset(tasks[2])  # the next episode starts afresh, and an answer ends it at once
    observation, done, info = env.step(answer_action(tasks[2].answer))
    assert done and info == {"tool": "answer", "termination": "submitted"} and env.grade().success
    with pytest.raises(RuntimeError, match="the episode is over"):
        env.step(answer_action("1"))


def test_check_env_passes(tasks, dataset):
    for max_turns in (1, 3):
        check_env(ReasoningGymEnv(dataset, max_turns=max_turns), tasks[0],
                  good_actions=[answer_action(tasks[0].answer)])


def test_the_teachers_answer_scores_full_marks_on_every_task(tasks):
    env = ReasoningGymEnvFactory(DATASET, 40, 3)()
    teacher = ReferenceAnswerTeacher()
    for task in tasks:
        episode = run_episode(env, task, teacher.policy(task))
        assert episode.grade.reward == 1.0 and episode.grade.success, task.id
        assert episode.termination == "submitted" and len(episode.turns) == 1


def test_a_teacher_needs_a_reference_answer(tasks):
    from dataclasses import replace

    with pytest.raises(ValueError, match="gives no reference answer .* set warm_start.demos=0"):
        ReferenceAnswerTeacher().policy(replace(tasks[0], answer=None))


def test_a_scorer_that_fails_is_a_verifier_error_not_a_zero(tasks):
    class Raising:
        def score_answer(self, answer, entry):
            raise KeyError("metadata")

    class OutOfRange:
        def score_answer(self, answer, entry):
            return 1.5

    with pytest.raises(VerifierError, match="score_answer raised KeyError"):
        graded(ReasoningGymEnv(Raising()), tasks[0], answer_action("1"))
    with pytest.raises(VerifierError, match="returned 1.5 .* expected a number in \\[0, 1\\]"):
        graded(ReasoningGymEnv(OutOfRange()), tasks[0], answer_action("1"))


@pytest.mark.parametrize("score, reward", [(1.0000000000000002, 1.0), (0.9999999999999999, 1.0), (-1e-12, 0.0),
                                           (0.25, 0.25)])
def test_a_score_off_by_rounding_counts_as_its_whole_number(tasks, score, reward):
    """spell_backward adds 1/n n times: a perfect prefix scores 1.0000000000000002 or 0.9999999999999999."""
    class Rounding:
        def score_answer(self, answer, entry):
            return score

    grade = graded(ReasoningGymEnv(Rounding()), tasks[0], answer_action("1"))
    assert grade.reward == reward and grade.success is (reward == 1.0)


def test_the_split_is_deterministic_by_task_id(tmp_path):
    cfg = load_config(overrides=[*RG, f"run_dir={tmp_path}"])
    spec = resolve_env(cfg)
    train, heldout = spec.tasks(cfg)
    again_train, again_heldout = spec.tasks(cfg)
    assert [t.id for t in train] == [t.id for t in again_train] and [t.id for t in heldout] == [t.id for t in again_heldout]
    assert len(train) + len(heldout) == 40 and not {t.id for t in train} & {t.id for t in heldout}
    assert all(split_of(t.id, 0) == "train" for t in train) and all(split_of(t.id, 0) == "heldout" for t in heldout)
    other = spec.tasks(load_config(overrides=[*RG, "env.split_seed=1"]))
    assert {t.id for t in other[1]} != {t.id for t in heldout}  # another split seed, another split
    assert train[0].question == rg_tasks(DATASET, 40, 0)[int(train[0].id[-5:])].question  # entries by rg_seed


def test_the_factory_pickles_without_its_dataset(tasks):
    factory = ReasoningGymEnvFactory(DATASET, 40, 3, max_turns=2)
    factory()  # builds the dataset
    copy = pickle.loads(pickle.dumps(factory))
    assert copy._data is None and factory._data is not None
    env = copy()
    assert env.max_turns == 2 and graded(env, tasks[3], answer_action(tasks[3].answer)).success


def test_config_names_the_dataset_and_lists_valid_names():
    with pytest.raises(ConfigError) as info:
        check(load_config(overrides=["env.name=reasoning_gym", "env.dataset=basic_arithmatic"]))
    assert info.value.field == "env.dataset"
    assert "unknown reasoning-gym dataset 'basic_arithmatic'" in str(info.value)
    assert "did you mean basic_arithmetic" in str(info.value) and "leg_counting" in str(info.value)
    with pytest.raises(ConfigError, match="env.dataset: env.name=reasoning_gym needs env.dataset=NAME"):
        check(load_config(overrides=["env.name=reasoning_gym"]))
    with pytest.raises(ConfigError, match="env.verifier: .* has no verifier 'weak'; valid names: strong"):
        check(load_config(overrides=[*RG, "env.verifier=weak"]))
    with pytest.raises(ConfigError, match="env.rg_size"):
        load_config(overrides=[*RG, "env.rg_size=0"])


def test_without_reasoning_gym_installed_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now raises ImportError
    with pytest.raises(ConfigError) as info:
        check(load_config(overrides=RG))
    assert info.value.field == "env.name" and "pip install 'keelrl[reasoning-gym]'" in str(info.value)
    assert check(load_config(overrides=["env.name=guess"])).name == "guess"  # other environments do not need it


def test_keelrl_does_not_import_reasoning_gym_until_asked():
    code = ("import sys, keelrl.envs.registry, keelrl.envs.reasoning_gym, keelrl.train.trainer, keelrl.cli\n"
            "from keelrl.config import load_config\n"
            "load_config(overrides=['env.name=guess'])\n"
            "print('reasoning_gym' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_tiny_model_trains_on_a_dataset_end_to_end(tiny_model_dir, tmp_path):
    from keelrl.train.trainer import Trainer

    class Recording(Trainer):
        """Keeps each step's rollouts, to check their rewards against the dataset's scoring."""

        def rl_step(self, step, rollouts, started=None):
            self.seen.append(list(rollouts.trajectories))
            return super().rl_step(step, rollouts, started)

    cfg = load_config(overrides=[*TINY_RUN, *NOT_CODING, *RG, f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}",
                                 "env.max_turns=2", "warm_start.demos=8", "warm_start.epochs=1",
                                 "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=32",
                                 "train.steps=2", "eval.tasks=4", "eval.every=2", "rollout.engine=sync"])
    trainer = Recording(cfg)
    trainer.seen = []
    assert trainer._answer_tools == ("answer",)
    summary = trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and [row["step"] for row in rows] == [0, 1, 2]
    assert rows[0]["warm_start/demos"] == 8  # every reference answer scored 1 through the trainer's env
    assert rows[-1]["eval/tasks"] == 4 and 0.0 <= rows[-1]["eval/partial"] <= 1.0
    dataset = reasoning_gym.create_dataset(DATASET, size=40, seed=0)
    by_id = {task.id: task for task in trainer.train_tasks}
    for row, trajectories in zip(rows[1:], trainer.seen):
        assert len(trajectories) == 4 and all(t.termination != "env_error" for t in trajectories)
        for t in trajectories:
            answered = [a for a, o in zip(t.actions, t.observations) if o == "answer recorded."]
            expected = dataset.score_answer(answer_text(answered[0]), by_id[t.task_id].entry) if answered else 0.0
            assert t.reward == expected and t.partial == expected and t.success is (expected == 1.0)
        assert row["train/reward"] == pytest.approx(sum(t.reward for t in trajectories) / 4)
