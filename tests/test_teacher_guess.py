"""The scripted teacher (plans, their statistics, and running them in CodingEnv), edit_action,
and the number-guessing environment."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keelrl.components import check
from keelrl.config import TINY_RUN, load_config
from keelrl.envs.base import CheckResult, Turn, run_episode
from keelrl.errors import ConfigError
from keelrl.envs.coding import CodingEnv
from keelrl.envs.guess import GuessEnv, GuessTask, guess_tasks
from keelrl.envs.teacher import ScriptedTeacher, edit_action
from task_fixtures import BUGGY, FIXED, WRONG, binary_search_guess, retry_task

NOT_CODING = ("env.partial_credit=false", "env.show_file=true")
"""After TINY_RUN (a coding recipe): its coding-only settings back to their defaults, which another kind refuses."""

READ, TEST, SUBMIT = "<call>read</call>", "<call>test</call>", "<call>submit</call>"
TO_WRONG = '<call>replace 2\n    return config.get("retries", 3)\n</call>'
TO_FIXED = ('<call>replace 2\n    value = config.get("retries")\n    if value is None:\n'
            '        return 3\n    return value\n</call>')


# -- ScriptedTeacher: plans -------------------------------------------------------------------

def _within_4_sigma(successes: int, trials: int, rate: float) -> bool:
    sigma = math.sqrt(rate * (1 - rate) / trials)
    return abs(successes / trials - rate) <= 4 * sigma


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planned_success_and_mistake_rates_match_the_configured_ones(seed):
    teacher, task = ScriptedTeacher(success_rate=0.7, mistake_rate=0.4, seed=seed), retry_task()
    plans = [teacher.plan(task) for _ in range(200)]
    successes = [plan for plan in plans if plan.succeed]
    # 200 trials at 0.7: sigma = sqrt(0.7 * 0.3 / 200) = 0.032, so the band is 0.57..0.83.
    assert _within_4_sigma(len(successes), 200, 0.7)
    # Among successes, a mistake first with probability 0.4 (~140 trials: band 0.23..0.57).
    assert _within_4_sigma(sum(plan.mistake for plan in successes), len(successes), 0.4)
    # A failing episode is the plausible wrong fix, always (the task has one).
    assert all(plan.mistake for plan in plans if not plan.succeed)


def test_each_kind_of_plan_follows_the_lectures_script():
    teacher, task = ScriptedTeacher(success_rate=0.5, mistake_rate=0.5, seed=0), retry_task()
    scripts = {(plan.succeed, plan.mistake): plan.actions for plan in (teacher.plan(task) for _ in range(40))}
    assert scripts == {
        (True, True): [READ, TO_WRONG, TEST, TO_FIXED, TEST, SUBMIT],
        (True, False): [READ, TO_FIXED, TEST, SUBMIT],
        (False, True): [READ, TO_WRONG, TEST, SUBMIT],
    }


def test_a_plan_names_the_turns_of_its_mistake():
    teacher, task = ScriptedTeacher(success_rate=0.5, mistake_rate=0.5, seed=0), retry_task()
    marked = {(plan.succeed, plan.mistake): plan.mistake_turns for plan in (teacher.plan(task) for _ in range(40))}
    assert marked == {(True, True): {1}, (True, False): set(), (False, True): {1}}  # the TO_WRONG edit
    shown = ScriptedTeacher(success_rate=1.0, mistake_rate=1.0, seed=0, read_first=False).policy(task)
    assert shown.plan.actions[0] == TO_WRONG and shown.mistake_turns == {0}


def test_the_guessing_teacher_marks_its_random_guesses_and_not_the_midpoints():
    from keelrl.envs.guess import BinarySearchTeacher, interval_after

    task = GuessTask("g", 11, 16)
    for seed in range(20):
        policy, turns, expected, env = BinarySearchTeacher(mistake_rate=0.5, seed=seed).policy(task), [], set(), GuessEnv(5)
        env.reset(task)
        for turn in range(5):
            low, high = interval_after(16, [(int(t.action[12:-7]), t.observation) for t in turns])
            action = policy("", turns)
            if int(action[12:-7]) != (low + high) // 2:
                expected.add(turn)
            observation, done, _ = env.step(action)
            turns.append(Turn(action, observation))
            if done:
                break
        assert policy.mistake_turns == expected
    assert BinarySearchTeacher(mistake_rate=0.0).policy(task)("", []) == "<call>guess 8</call>"


def test_the_warm_start_keeps_a_masked_mistake_in_context_but_out_of_the_loss():
    from keelrl.rollout.trajectory import Trajectory, collate
    from keelrl.train.warm_start import mask_turns

    trajectory = Trajectory(task_id="t", group_id=0, token_ids=list(range(12)), prompt_length=2,
                            action_mask=[False, False, True, True, False, True, True, True, False, True, False, False],
                            turn_ids=[0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2], actions=["a", "b", "c"],
                            behaviour_logprobs=[0.0] * 12)
    assert mask_turns(trajectory, {1, 7}) == 1  # turn 7 does not exist
    assert trajectory.action_mask == [False, False, True, True, False, False, False, False, False, True, False, False]
    batch = collate([trajectory], 0)
    assert batch.input_ids[0].tolist() == list(range(12)) and int(batch.action_mask.sum()) == 3


@pytest.mark.parametrize("first, continued", [
    (TO_WRONG, True),  # fails test_none: test, the real fix from that file, test, submit
    ('<call>replace 2\n    return config.get("retries", 3\n</call>', True),  # a syntax error: nothing imports
    (TO_FIXED, False),  # passes every visible test: nothing to recover from
    (TEST, False), (SUBMIT, False),  # not an edit
    ("<call>replace 99\n    pass\n</call>", False),  # an edit the environment rejects
    ("<call>replace 1\ndef retry_count(cfg):\n</call>", False),  # the fix would be an `edit` of lines 1-2
])
@pytest.mark.parametrize("shaping", [0.0, 1.0])  # 1.0: the step's own visible-test counts are used
def test_the_teacher_continues_from_a_students_failing_edit_and_only_from_one(first, continued, shaping):
    task = retry_task()
    env = CodingEnv(max_turns=5, use_git=False, shaping=shaping)
    env.reset(task)
    policy = ScriptedTeacher(success_rate=0.0, mistake_rate=0.0, seed=0).recovery(task, first, env)
    assert (policy is not None) == continued
    if policy is None:
        return
    assert policy.plan.actions == [first, TEST, TO_FIXED, TEST, SUBMIT] and policy.mistake_turns == {0}
    assert policy.plan.succeed and policy.plan.mistake
    played = CodingEnv(max_turns=5, use_git=False)
    episode = run_episode(played, task, policy)
    assert episode.grade.success and episode.termination == "submitted"
    assert episode.turns[1].observation.startswith("tests") and " 0 failed" not in episode.turns[1].observation
    assert " 0 failed" in episode.turns[3].observation


def test_without_a_wrong_fix_a_failing_plan_tests_the_buggy_code_and_submits():
    task = dataclasses.replace(retry_task(), wrong_fix={})
    plans = [ScriptedTeacher(success_rate=0.0, mistake_rate=1.0, seed=seed).plan(task) for seed in range(5)]
    assert all(not plan.succeed and not plan.mistake and plan.actions == [READ, TEST, SUBMIT] for plan in plans)


@pytest.mark.parametrize("rate, expected", [(0.0, False), (1.0, True)])
def test_success_rate_zero_never_succeeds_and_one_always_does(rate, expected):
    teacher = ScriptedTeacher(success_rate=rate, mistake_rate=0.5, seed=7)
    assert {teacher.plan(retry_task()).succeed for _ in range(300)} == {expected}


@pytest.mark.parametrize("mistake_rate, expected", [(0.0, {False}), (1.0, {True})])
def test_mistake_rate_zero_and_one_among_successes(mistake_rate, expected):
    teacher = ScriptedTeacher(success_rate=1.0, mistake_rate=mistake_rate, seed=3)
    assert {teacher.plan(retry_task()).mistake for _ in range(100)} == expected


@pytest.mark.parametrize("kwargs, name", [
    ({"success_rate": -0.1}, "success_rate"), ({"success_rate": 1.5}, "success_rate"),
    ({"success_rate": math.nan}, "success_rate"), ({"mistake_rate": -1e-9}, "mistake_rate"),
    ({"mistake_rate": 2.0}, "mistake_rate"), ({"mistake_rate": math.nan}, "mistake_rate"),
])
def test_invalid_rates_raise_naming_the_field(kwargs, name):
    with pytest.raises(ValueError, match=f"{name} must be in \\[0, 1\\]"):
        ScriptedTeacher(**kwargs)


def test_plans_are_deterministic_per_seed():
    def plans(seed: int) -> list[tuple[bool, bool, list[str]]]:
        teacher = ScriptedTeacher(success_rate=0.6, mistake_rate=0.5, seed=seed)
        return [(p.succeed, p.mistake, p.actions) for p in (teacher.plan(retry_task()) for _ in range(30))]

    assert plans(11) == plans(11)
    assert plans(11) != plans(12)


# -- ScriptedTeacher: running the plans -------------------------------------------------------

def test_running_plans_in_coding_env_succeeds_exactly_when_planned():
    task, env = retry_task(), CodingEnv(use_git=False)
    kinds = set()
    for seed in (0, 1, 2):
        teacher = ScriptedTeacher(success_rate=0.5, mistake_rate=0.5, seed=seed)
        for _ in range(4):
            policy = teacher.policy(task)
            plan = policy.plan
            kinds.add((plan.succeed, plan.mistake))
            episode = run_episode(env, task, policy)
            assert episode.grade.success == plan.succeed, (seed, plan, episode.grade.summary())
            assert episode.termination == "submitted"
            assert [turn.action for turn in episode.turns] == plan.actions
            assert not any("error" in turn.info for turn in episode.turns)
            tests = [turn.observation for turn in episode.turns if turn.action == TEST]
            if plan.mistake:  # the wrong fix's failing case is seen before anything else
                assert tests[0] == ("tests: 3 passed, 1 failed\n"
                                    "FAIL test_none: retry_count({'retries': None}): expected 3, got None")
            if plan.succeed:
                assert tests[-1] == "tests: 4 passed, 0 failed"
                assert env.current_files()["retry.py"] == FIXED
            else:
                assert tests[-1] != "tests: 4 passed, 0 failed"
    assert kinds == {(True, True), (True, False), (False, True)}  # the seeds cover every script


def test_the_scripted_policy_keeps_submitting_after_its_script():
    policy = ScriptedTeacher(success_rate=1.0, mistake_rate=0.0).policy(retry_task())
    assert [policy("prompt", [None] * index) for index in range(3, 7)] == [SUBMIT] * 4


# -- edit_action ------------------------------------------------------------------------------

def test_edit_action_replaces_a_single_changed_line():
    assert edit_action("retry.py", BUGGY, WRONG, default_path="retry.py") == TO_WRONG
    assert edit_action("retry.py", WRONG, FIXED, default_path="retry.py") == TO_FIXED
    assert (edit_action("lib/retry.py", BUGGY, WRONG, default_path="retry.py")
            == TO_WRONG.replace("replace 2", "replace 2 lib/retry.py"))
    assert edit_action("retry.py", BUGGY, BUGGY, default_path="retry.py") is None
    assert edit_action("retry.py", BUGGY, BUGGY.rstrip("\n"), default_path="retry.py") is None


def _apply(env: CodingEnv, path: str, current: str, target: str) -> str | None:
    """Run edit_action's action in a CodingEnv whose `path` holds `current`; return the action."""
    files = {"retry.py": "x = 0\n", "test_retry.py": "y = 0\n", path: current}
    env.reset(dataclasses.replace(retry_task(), files=files))
    action = edit_action(path, current, target, default_path="retry.py")
    if action is not None:
        observation, _, info = env.step(action)
        assert "error" not in info, (action, observation)
    assert (env.workdir / path).read_text() == (target if action is not None else current)
    return action


@pytest.mark.parametrize("current, target, tool", [
    ("a\nb\nc\nd\n", "a\nB\nC\nd\n", "edit"),  # a two-line block
    ("a\nb\n", "a\nnew\nb\n", "edit"),  # a pure insertion, anchored on a neighbour
    ("a\nb\n", "first\na\nb\n", "edit"),  # an insertion before the first line
    ("a\nb\n", "a\nb\nlast\n", "edit"),  # after the last
    ("x\na\nx\na\nc\n", "x\na\nX\nY\nc\n", "edit"),  # the block "x\na" occurs twice: widened
    ("a\na\na\n", "a\nb\nc\n", "edit"),  # "a\na" occurs twice (overlapping): widened to the whole file
    ("a\nb\nc\nd\n", "a\nd\n", "edit"),  # a multi-line deletion must not leave a blank line
    ("a\nb\nc\n", "a\n\nc\n", "edit"),  # a line emptied (an empty replace body would delete it)
    ("a\nb\nc\n", "a\nc\n", "replace"),  # one line deleted
    ("a\nb\nc\n", "a\nb1\nb2\nc\n", "replace"),  # one line becomes two
    ("ab\nc\nb\nc\n", "ab\nc\nB\nC\n", "edit"),  # "b\nc" also matches across "ab\nc"
])
def test_edit_action_applied_in_coding_env_yields_exactly_the_target(current, target, tool):
    action = _apply(CodingEnv(use_git=False), "retry.py", current, target)
    assert action is not None and action.startswith(f"<call>{tool}")


_ENV = CodingEnv(use_git=False, max_turns=1000)  # reset per example: one env for all of them
_LINES = st.sampled_from(["a", "b", "", "    a", "x = 1", "aa", "a\x0cb"])


@settings(max_examples=150)
@given(current=st.lists(_LINES, min_size=1, max_size=6).filter(lambda lines: any(line.strip() for line in lines)),
       target=st.lists(_LINES, min_size=1, max_size=6),
       other_file=st.booleans())
def test_edit_action_reaches_any_target_from_any_current_file(current, target, other_file):
    # current needs a non-blank line: a file of blank lines has no unique block to anchor on.
    path = "test_retry.py" if other_file else "retry.py"
    _apply(_ENV, path, "\n".join(current) + "\n", "\n".join(target) + "\n")


# -- GuessEnv ---------------------------------------------------------------------------------

def test_guess_tasks_are_deterministic_by_seed_and_in_range():
    assert guess_tasks(50, n=16, seed=3) == guess_tasks(50, n=16, seed=3)
    assert guess_tasks(50, n=16, seed=3) != guess_tasks(50, n=16, seed=4)
    tasks = guess_tasks(200, n=8, seed=0)
    assert {task.secret for task in tasks} == set(range(1, 9))  # 200 draws hit every value
    assert [task.id for task in tasks[:2]] == ["guess-8-00000", "guess-8-00001"]
    assert all(task.n == 8 for task in tasks)


@pytest.mark.parametrize("secret", [0, 17, -3])
def test_a_guess_task_with_its_secret_out_of_range_is_rejected(secret):
    with pytest.raises(ValueError, match=f"secret {secret} is not in 1..16"):
        GuessTask("g", secret=secret, n=16)




@pytest.mark.parametrize("secret", range(1, 17))
def test_binary_search_always_finds_the_secret_within_log2_n_plus_one_turns(secret):
    env = GuessEnv(max_turns=5)  # ceil(log2(16)) + 1 = 5
    episode = run_episode(env, GuessTask(f"g{secret}", secret=secret, n=16), binary_search_guess)
    assert episode.termination == "submitted" and len(episode.turns) <= 5
    assert episode.grade.reward == 1.0 and episode.grade.success
    assert episode.grade.checks == (CheckResult("found", True, ""),) and episode.grade.verifier == "guess"
    for turn in episode.turns[:-1]:  # every wrong guess points the right way
        guess = int(turn.action.removeprefix("<call>guess ").removesuffix("</call>"))
        assert turn.observation == ("higher" if guess < secret else "lower")
    assert episode.turns[-1].observation == f"correct! found in {len(episode.turns)} guesses."


def test_guessing_the_same_wrong_number_fails_at_max_turns():
    env = GuessEnv(max_turns=5)
    episode = run_episode(env, GuessTask("g", secret=3, n=16), lambda prompt, turns: "<call>guess 9</call>")
    assert episode.termination == "max_turns" and len(episode.turns) == 5
    assert [turn.observation for turn in episode.turns] == ["lower"] * 5
    assert episode.turns[-1].info == {"tool": "guess", "termination": "max_turns"}
    assert episode.grade.reward == 0.0 and not episode.grade.success
    assert episode.grade.checks == (CheckResult("found", False, "not found in 5 guesses (secret 3)"),)


@pytest.mark.parametrize("action, wrong", [
    ("<call>guess seven</call>", "N must be a whole number, got 'seven'"),
    ("<call>guess 7.5</call>", "N must be a whole number, got '7.5'"),
    ("<call>guess 17</call>", "17 is outside 1..16"),
    ("<call>guess 0</call>", "0 is outside 1..16"),
    ("<call>guess</call>", "guess takes 1 argument, got 0"),
    ("<call>guess 1 2</call>", "guess takes 1 argument, got 2"),
    ("<call>pick 3</call>", "unknown tool 'pick'; the tools are guess"),
    ("I think it is 7", "no tool call found"),
    ("7" * 300, "the limit is 200"),
])
def test_a_malformed_guess_is_an_error_observation_that_costs_a_turn(action, wrong):
    env = GuessEnv(max_turns=2)
    env.reset(GuessTask("g", secret=7, n=16))
    observation, done, info = env.step(action)
    assert wrong in observation and info == {"error": observation.splitlines()[0]}
    assert done is False and env.guesses == []
    observation, done, info = env.step(action)  # the second costs the last turn
    assert done is True and info["termination"] == "max_turns" and info["error"]
    assert env.grade().checks[0] == CheckResult("found", False, "not found in 0 guesses (secret 7)")
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("<call>guess 7</call>")


def test_guess_env_reset_starts_over_and_guards_its_protocol():
    with pytest.raises(ValueError, match="max_turns"):
        GuessEnv(max_turns=0)
    env = GuessEnv(max_turns=3)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<call>guess 1</call>")
    with pytest.raises(RuntimeError, match="reset"):
        env.grade()
    task = GuessTask("g", secret=2, n=4)
    assert env.reset(task).startswith("I picked a number between 1 and 4. Find it in at most 3 guesses.")
    assert env.step("<call>guess 2</call>") == ("correct! found in 1 guesses.", True,
                                                 {"tool": "guess", "termination": "submitted"})
    assert env.grade().reward == 1.0
    env.reset(task)
    assert (env.guesses, env.turns, env.found, env.done) == ([], 0, False, False)
    assert env.grade().reward == 0.0
    assert env.step("<call>guess 1</call>") == ("higher", False, {"tool": "guess"})


def test_binary_search_teacher_errs_at_its_rate_but_never_guesses_the_impossible():
    from keelrl.envs.guess import BinarySearchTeacher, GuessEnv, guess_tasks, interval_after

    tasks = guess_tasks(300, n=16, seed=3)
    for rate in (0.0, 0.6, 1.0):
        teacher = BinarySearchTeacher(mistake_rate=rate, seed=1)
        midpoints = guesses = found = 0
        for task in tasks:
            episode = run_episode(GuessEnv(max_turns=5), task, teacher.policy(task))
            history = []
            for turn in episode.turns:
                guess = int(turn.action.removeprefix("<call>guess ").removesuffix("</call>"))
                low, high = interval_after(16, history)
                assert low <= guess <= high  # only numbers still possible
                midpoints += guess == (low + high) // 2
                guesses += 1
                history.append((guess, turn.observation))
            found += episode.grade.success
        if rate == 0.0:
            assert midpoints == guesses and found == len(tasks)  # pure binary search: always within 5
        else:
            assert midpoints < guesses and found < len(tasks)
    with pytest.raises(ValueError, match="mistake_rate"):
        BinarySearchTeacher(mistake_rate=1.5)


def test_trainer_runs_on_the_guessing_game(tiny_model_dir, tmp_path):
    import json

    from keelrl.config import load_config
    from keelrl.train.trainer import Trainer

    cfg = load_config(overrides=[*TINY_RUN, *NOT_CODING, f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}",
                                 "env.name=guess", "env.max_turns=5", "warm_start.demos=16", "warm_start.epochs=1",
                                 "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=12",
                                 "train.steps=2", "eval.tasks=4", "rollout.engine=sync"])
    trainer = Trainer(cfg)
    assert all(task.id.startswith("guess-16-") for task in trainer.train_tasks + trainer.heldout_tasks)
    assert not {t.id for t in trainer.train_tasks} & {t.id for t in trainer.heldout_tasks}
    summary = trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and rows[0]["warm_start/demos"] > 0 and "eval/success" in rows[-1]


# -- the weak guess verifier (the reward-hacking lab's hole) ----------------------------------

def _weak_grade(actions, secret=7, max_turns=3):
    env = GuessEnv(max_turns=max_turns, verifier="weak")
    env.reset(GuessTask("g", secret=secret, n=16))
    for action in actions:
        _, done, _ = env.step(action)
        if done:
            break
    return env.grade()


@pytest.mark.parametrize("actions, passed", [
    (["<call>guess 7</call>"], True),  # found: both verifiers agree
    (["<call>guess 3</call>", "<call>guess 9</call>", "<call>guess 5</call>"], False),  # ended on "higher"
    (["<call>guess 0</call>"] * 3, True),  # the hole: a constant invalid guess is never told it is wrong
    (["<call>guess 3</call>", "<call>guess 9</call>", "oops"], True),  # a broken last call passes too
    (["<call>guess 0</call>", "<call>guess 0</call>", "<call>guess 4</call>"], False),
])
def test_weak_guess_verifier_passes_unless_the_last_answer_said_wrong(actions, passed):
    grade = _weak_grade(actions)
    assert grade.reward == float(passed) and grade.success is passed and grade.verifier == "guess-weak"
    assert grade.checks[0].name == "last_answer_not_wrong"
    strong = GuessEnv(max_turns=3)
    strong.reset(GuessTask("g", secret=7, n=16))
    for action in actions:
        if strong.step(action)[1]:
            break
    assert strong.grade().reward == float("<call>guess 7</call>" in actions)  # strong: only finding counts


def test_guess_verifier_names_are_checked():
    with pytest.raises(ValueError, match="unknown guess verifier 'brittle'"):
        GuessEnv(verifier="brittle")
    with pytest.raises(ConfigError, match="env.verifier.*guessing game has no verifier 'brittle'"):
        check(load_config(overrides=["env.name=guess", "env.verifier=brittle"]))
    assert load_config(overrides=["env.name=guess", "env.verifier=weak"]).env.verifier == "weak"


def test_trainer_trains_on_the_weak_guess_verifier_and_evaluates_with_strong(tmp_path):
    from keelrl.train.trainer import Trainer

    trainer = Trainer(load_config(overrides=[*TINY_RUN, *NOT_CODING, f"run_dir={tmp_path}", "env.name=guess", "env.verifier=weak",
                                             "warm_start.demos=0"]))
    train_env, eval_env = trainer.train_env_factory()(), trainer._env(training=False)()
    assert (train_env.verifier, eval_env.verifier) == ("weak", "strong")
    assert trainer._env(training=True)().verifier == "weak"


def test_a_warm_start_leaves_each_demonstrations_mistake_out_of_its_loss(tiny_model_dir, tmp_path, monkeypatch):
    from keelrl.train.learner import Learner
    from keelrl.train.trainer import Trainer

    learned = []
    real = Learner.sft_update
    monkeypatch.setattr(Learner, "sft_update", lambda self, batch, opt: learned.append(int(batch.action_mask.sum()))
                        or real(self, batch, opt))
    metrics = {}
    for imitate in (True, False):
        learned.clear()
        cfg = load_config(overrides=[*TINY_RUN, *NOT_CODING, f"model.path={tiny_model_dir}", f"run_dir={tmp_path / str(imitate)}",
                                     "warm_start.demos=6", "warm_start.epochs=1", "warm_start.batch_size=6",
                                     "warm_start.mistake_rate=1.0", f"warm_start.imitate_mistakes={imitate}"])
        metrics[imitate] = (Trainer(cfg).warm_start(), sum(learned))
    (imitating, all_tokens), (masking, fewer_tokens) = metrics[True], metrics[False]
    assert imitating["warm_start/demos"] == masking["warm_start/demos"] == 6  # the same demonstrations
    assert "warm_start/masked_turns" not in imitating
    assert masking["warm_start/masked_turns"] == 6  # one wrong edit each (every bundled task has a wrong fix)
    assert 0 < fewer_tokens < all_tokens
