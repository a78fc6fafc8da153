"""The environment registry: built-in specs, registration, name checks, and a user's EnvSpec
plugged into the Trainer without a registered name."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from keelrl.components import check
from keelrl.cli import main
from keelrl.config import TINY_RUN, load_config
from keelrl.envs import ENVIRONMENTS, CheckResult, EnvSpec, Grade, check_env, env_spec, register_env
from keelrl.envs.coding import PATCH_TOOLS, CodingEnv, CodingEnvFactory
from keelrl.envs.guess import BinarySearchTeacher, GuessEnvFactory
from keelrl.envs.registry import coding_hidden_paths, resolve_env, runs_own_mistakes, split_tasks
from keelrl.envs.teacher import ScriptedTeacher
from keelrl.envs.tools import ActionError, ToolSpec, parse_action
from keelrl.errors import ConfigError


# -- a user's environment: say the word you are shown --------------------------------------

@dataclass(frozen=True)
class WordTask:
    id: str
    word: str


SAY = {"say": ToolSpec("say", "<call>say WORD</call>", "say the word", 1, 1)}


class SayEnv:
    """Reward 1 when the first well-formed call says the task's word."""

    max_turns = 1

    def reset(self, task: WordTask) -> str:
        self.task, self.said = task, None
        return f"Say {task.word}."

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        try:
            self.said = parse_action(action_text, SAY).args[0]
        except ActionError as error:
            return str(error), True, {"error": str(error), "termination": "max_turns"}
        return "ok", True, {"tool": "say"}

    def grade(self) -> Grade:
        passed = self.said == self.task.word
        return Grade(float(passed), (CheckResult("said", passed, "" if passed else f"said {self.said!r}"),), "say")


class SayFactory:
    def __init__(self, max_turns: int = 1) -> None:
        self.max_turns = max_turns

    def __call__(self) -> SayEnv:
        env = SayEnv()
        env.max_turns = self.max_turns
        return env


class SayTeacher:
    def policy(self, task: WordTask) -> Any:
        return lambda prompt, turns: f"<call>say {task.word}</call>"


WORDS = [WordTask(f"word-{i:03d}", word) for i, word in enumerate(["ab", "cd", "ef", "gh"] * 10)]


def say_spec(**changes: Any) -> EnvSpec:
    fields: dict[str, Any] = dict(name="say", tasks=lambda cfg: split_tasks(WORDS, cfg.env.split_seed, "WORDS"),
                                  train_env=lambda cfg: SayFactory(cfg.env.max_turns),
                                  eval_env=lambda cfg: SayFactory(cfg.env.max_turns),
                                  teacher=lambda cfg: SayTeacher(), answer_tools=("say",), max_turns=1,
                                  fields=("split_seed",))
    fields.update(changes)
    return EnvSpec(**fields)


@pytest.fixture
def registry():
    """ENVIRONMENTS as it is, restored after the test (names the test registered are removed)."""
    saved = ENVIRONMENTS.names()
    yield ENVIRONMENTS
    for name in ENVIRONMENTS:
        if name not in saved:
            ENVIRONMENTS.unregister(name)
    assert ENVIRONMENTS.names() == saved


# -- the registry ---------------------------------------------------------------------------

def test_the_built_in_environments_are_registered():
    assert list(ENVIRONMENTS)[:3] == ["coding", "guess", "reasoning_gym"]
    assert env_spec("guess").answer_tools == ("guess",) and env_spec("coding").answer_tools == PATCH_TOOLS
    assert env_spec("guess").verifiers == ("strong", "weak")
    assert env_spec("coding").verifiers == ("strong", "weak", "brittle")


def test_a_duplicate_name_fails(registry):
    register_env(say_spec())
    assert env_spec("say").answer_tools == ("say",)
    with pytest.raises(ValueError, match="duplicate environment name 'say'"):
        register_env(say_spec())
    with pytest.raises(ValueError, match="duplicate environment name 'guess'"):
        register_env(say_spec(name="guess"))
    assert ENVIRONMENTS["guess"].title == "the guessing game"  # the built-in is untouched


def test_a_spec_needs_a_name_and_the_strong_verifier():
    with pytest.raises(ValueError, match="non-empty str name"):
        say_spec(name="")
    with pytest.raises(ValueError, match="must include 'strong'"):
        say_spec(verifiers=("weak",))


def test_an_unknown_name_fails_at_lookup_listing_the_registered_names(registry, capsys):
    cfg = load_config(overrides=["env.name=nope"])  # loads: Trainer(cfg, env=spec) may bring the spec
    with pytest.raises(ConfigError) as info:
        resolve_env(cfg)
    assert info.value.field == "env.name"
    assert "unknown environment 'nope'" in str(info.value)
    assert "valid names: coding, guess, reasoning_gym" in str(info.value)
    register_env(say_spec())  # the list is read from the registry
    with pytest.raises(ConfigError, match="valid names: coding, guess, reasoning_gym, say"):
        resolve_env(cfg)
    assert main(["config", "env.name=nope"]) == 2
    err = capsys.readouterr().err
    assert "env.name: unknown environment 'nope'" in err and "coding, guess, reasoning_gym, say" in err


def test_the_trainer_rejects_an_unknown_name_before_loading_any_model(tmp_path):
    from keelrl.train.trainer import Trainer

    cfg = load_config(overrides=["env.name=nope", f"run_dir={tmp_path / 'run'}", "model.path=/no/such/model"])
    with pytest.raises(ConfigError, match="env.name: unknown environment 'nope'"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


def test_a_registered_spec_validates_the_config_where_it_is_resolved(registry):
    def at_most_two_turns(env: Any) -> None:
        if env.max_turns > 2:
            raise ConfigError("max_turns", f"say takes at most 2 turns, got {env.max_turns}")

    register_env(say_spec(validate=at_most_two_turns, verifiers=("strong", "lenient"), teacher=None))
    assert check(load_config(overrides=["env.name=say", "env.verifier=lenient", "warm_start.demos=0",
                                        "env.max_turns=2"])).name == "say"
    for override, field, message in (("env.max_turns=3", "env.max_turns", "at most 2 turns"),
                                     ("env.verifier=brittle", "env.verifier", "has no verifier 'brittle'"),
                                     ("warm_start.demos=4", "warm_start.demos", "no scripted teacher")):
        with pytest.raises(ConfigError) as info:
            check(load_config(overrides=["env.name=say", "warm_start.demos=0", "env.max_turns=2", override]))
        assert info.value.field == field and message in str(info.value)


def test_a_passed_spec_is_validated_by_the_trainer_before_any_model_loads(tmp_path):
    from keelrl.train.trainer import Trainer

    base = [f"run_dir={tmp_path / 'run'}", "model.path=/no/such/model"]
    with pytest.raises(ConfigError, match="warm_start.demos: env.name=say has no scripted teacher"):
        Trainer(load_config(overrides=[*base, "env.name=say"]), env=say_spec(teacher=None))
    with pytest.raises(ConfigError, match="env.verifier: env.name=say has no verifier 'weak'"):
        Trainer(load_config(overrides=[*base, "env.name=say", "env.verifier=weak"]), env=say_spec())
    # the spec passed names the run's environment: env.name (coding here) becomes its name
    with pytest.raises(ConfigError, match="warm_start.demos: env.name=say has no scripted teacher"):
        Trainer(load_config(overrides=base), env=say_spec(teacher=None))
    assert not (tmp_path / "run").exists()


# -- the built-ins behave as the hard-coded branches did --------------------------------------

def test_coding_factories_take_the_config_and_evaluate_with_strong(tmp_path):
    cfg = load_config(overrides=[f"run_dir={tmp_path}", "env.verifier=weak", "env.partial_credit=true",
                                 "env.key_check_weight=3", "env.max_turns=4", "env.show_file=false"])
    spec = resolve_env(cfg)
    train, held = spec.train_env(cfg), spec.eval_env(cfg)
    assert isinstance(train, CodingEnvFactory) and isinstance(held, CodingEnvFactory)
    assert (train.verifier, train.partial_credit, train.key_weight, train.max_turns) == ("weak", True, 3.0, 4)
    assert (held.verifier, held.partial_credit, held.key_weight, held.max_turns) == ("strong", False, 1.0, 4)
    assert train.hidden_paths == coding_hidden_paths(cfg) and str(Path(tmp_path).resolve()) in train.hidden_paths
    assert pickle.loads(pickle.dumps(train)).verifier == "weak"  # Ray workers unpickle it
    env = held()
    assert isinstance(env, CodingEnv) and env.verifier.name == "strong" and not env.show_file
    teacher = spec.teacher(cfg)
    assert isinstance(teacher, ScriptedTeacher) and teacher.read_first and teacher.success_rate == 1.0


def test_the_own_mistakes_round_needs_a_teacher_that_can_continue_within_the_turns_and_a_count_of_zero_or_more(
        tmp_path):
    base = [f"run_dir={tmp_path}"]
    coding = load_config(overrides=[*base, "warm_start.own_mistakes=8"])
    assert runs_own_mistakes(coding, resolve_env(coding).teacher(coding))
    with pytest.raises(ConfigError, match="warm_start.own_mistakes: the guessing game's teacher cannot continue"):
        resolve_env(load_config(overrides=[*base, "env.name=guess", "warm_start.own_mistakes=8", "env.max_turns=3"]))
    with pytest.raises(ConfigError, match="warm_start.own_mistakes: the teacher's continuations take at least 5 "
                                          "turns, and env.max_turns is 4"):
        resolve_env(load_config(overrides=[*base, "warm_start.own_mistakes=8", "env.max_turns=4"]))
    with pytest.raises(ConfigError, match="own_mistakes: must be >= 0, got -1"):
        load_config(overrides=["warm_start.own_mistakes=-1"])
    # the default (128) is not a setting: where the teacher cannot continue, there is no round
    assert load_config().warm_start.own_mistakes == 128
    for overrides in (["env.name=guess", "env.max_turns=3"], ["env.max_turns=4"], ["env.max_turns=1"]):
        cfg = load_config(overrides=[*base, *overrides])
        assert not runs_own_mistakes(cfg, resolve_env(cfg).teacher(cfg)), overrides
    for overrides in (["warm_start.own_mistakes=0"], ["warm_start.demos=0", "warm_start.own_mistakes=8"]):
        cfg = load_config(overrides=[*base, *overrides])
        assert resolve_env(cfg) and not runs_own_mistakes(cfg, ScriptedTeacher())
    assert runs_own_mistakes(load_config(overrides=base), ScriptedTeacher())


def test_guess_factories_and_teacher(tmp_path):
    cfg = load_config(overrides=[f"run_dir={tmp_path}", "env.name=guess", "env.verifier=weak", "env.max_turns=3",
                                 "warm_start.mistake_rate=0.25", "seed=5"])
    spec = resolve_env(cfg)
    train, held = spec.train_env(cfg), spec.eval_env(cfg)
    assert isinstance(train, GuessEnvFactory) and (train.max_turns, train.verifier) == (3, "weak")
    assert (held.max_turns, held.verifier) == (3, "strong")
    teacher = spec.teacher(cfg)
    assert isinstance(teacher, BinarySearchTeacher) and teacher.mistake_rate == 0.25
    assert teacher.rng.random() == BinarySearchTeacher(0.25, seed=5).rng.random()
    train_tasks, heldout = spec.tasks(cfg)
    assert len(train_tasks) + len(heldout) == cfg.env.guess_tasks and all(t.id.startswith("guess-16-")
                                                                            for t in train_tasks)


def test_a_spec_without_answer_tools_counts_every_action_as_the_answer():
    from keelrl.alarms import distinct_patches
    from keelrl.rollout.trajectory import Trajectory

    def trajectory(*actions: str) -> Trajectory:
        t = Trajectory("t", 0)
        t.actions = list(actions)
        return t

    assert say_spec(answer_tools=()).answer_tools == ()
    group = [trajectory("<call>say ab</call>"), trajectory("<call>say ab</call> "), trajectory("ab"),
             trajectory("cd")]
    for t in group:  # what the environment made of each action
        t.turn_info = [{"tool": "say"} if t.actions[0].startswith("<call>") else {"error": "no tool call"}]
    assert distinct_patches([group], ()) == 3.0
    assert distinct_patches([group], ("say",)) == 2.0  # "ab" and "cd" were rejected: both empty answers
    assert distinct_patches([group], PATCH_TOOLS) == 1.0  # the coding tools: no edits anywhere


def test_split_tasks_names_the_source_when_a_side_is_empty():
    with pytest.raises(ValueError, match="WORDS gives 1 train and 0 held-out tasks"):
        split_tasks(WORDS[:1], 0, "WORDS")


# -- a user's spec through the Trainer, no name registered ------------------------------------

def test_a_user_env_spec_trains_through_the_trainer(tiny_model_dir, tmp_path):
    from keelrl.train.trainer import Trainer

    check_env(SayEnv(), WORDS[0], good_actions=["<call>say ab</call>"])
    assert "say" not in ENVIRONMENTS
    cfg = load_config(overrides=[*TINY_RUN, f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}",
                                 "env.name=say", "env.max_turns=1", "env.partial_credit=false", "env.show_file=true",
                                 "warm_start.demos=8", "warm_start.epochs=1",
                                 "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=12",
                                 "train.steps=2", "eval.tasks=2", "eval.every=2", "rollout.engine=sync"])
    trainer = Trainer(cfg, env=say_spec())
    assert trainer.env_spec.name == "say" and trainer._answer_tools == ("say",)
    assert {t.id for t in trainer.train_tasks} | {t.id for t in trainer.heldout_tasks} == {t.id for t in WORDS}
    assert isinstance(trainer.train_env_factory(), SayFactory)
    summary = trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and rows[0]["warm_start/demos"] == 8  # every teacher episode said its word
    assert [row["step"] for row in rows] == [0, 1, 2] and "eval/success" in rows[-1]
    assert all(0.0 <= row["train/reward"] <= 1.0 for row in rows[1:])
    transcript = (tmp_path / "run" / "samples" / "step_0001.txt").read_text()
    assert "Say " in transcript  # the rollouts ran in SayEnv


def test_a_field_of_another_environment_kind_is_an_error():
    for overrides, field, other in ((["env.guess_n=8"], "env.guess_n", "guess"),
                                    (["env.name=guess", "env.dataset=chain_sum"], "env.dataset", "reasoning_gym"),
                                    (["env.name=guess", "env.tasks=mine.jsonl"], "env.tasks", "coding"),
                                    (["env.name=guess", "env.shaping=0.5"], "env.shaping", "coding")):
        with pytest.raises(ConfigError) as info:
            check(load_config(overrides=overrides))
        assert info.value.field == field and f"it is a setting of env.name={other}" in str(info.value), overrides
    # Its own fields, and the fields every kind reads, are fine; so is another kind's field at its default.
    assert check(load_config(overrides=["env.name=guess", "env.guess_n=8", "env.max_turns=3", "env.guess_tasks=2000"]))
    # A value that turns another kind's feature off (EnvSpec.off) is not a setting either: the tiny
    # recipe switches the coding environment's shaping off, and the guessing game still runs on it.
    assert check(load_config(overrides=["env.name=guess", "env.shaping=0", "env.malformed_cost=0"]))
