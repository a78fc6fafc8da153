"""Several environments in one run (`env.mix`, keelrl.envs.mix): the entries, the mixed tasks and
environments, the weights the request stream honours, the env section's checks, and a tiny
`keel train` on the guessing game beside the user-style `units` package (examples/units_env)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
from collections import Counter
from dataclasses import dataclass

import pytest

from keelrl.cli import main
from keelrl.components import check
from keelrl.config import load_config
from keelrl.envs.base import CheckResult, Grade, check_env, run_episode
from keelrl.envs.mix import MixEnvFactory, MixPart, MixTask, interleave, mix_spec_fields, parse_entry
from keelrl.envs.registry import EnvSpec, env_spec, settle_env, split_tasks
from keelrl.errors import ConfigError
from keelrl.train.curriculum import weighted_sample
from keelrl.train.requests import RequestStream

pytest.importorskip("keel_units", reason="the user-style environment package: pip install -e examples/units_env")

MIX = "env.mix=[guess:3,units]"


def mixed(*overrides: str):
    """(cfg settled, the mix's spec) of a guess:3 + units mix."""
    cfg = load_config(overrides=[MIX, *overrides])
    spec = check(cfg)
    return settle_env(cfg, spec), spec


# ------------------------------------------------------------------------------ entries

def test_an_entry_is_a_name_with_an_optional_weight_after_its_last_colon():
    assert parse_entry("guess") == ("guess", 1.0)
    assert parse_entry("guess:3") == ("guess", 3.0)
    assert parse_entry(" units:0.25 ") == ("units", 0.25)
    # An import path has a colon of its own: the weight is only what follows the LAST colon, and
    # only when it is a number.
    assert parse_entry("keel_units:UNITS") == ("keel_units:UNITS", 1.0)
    assert parse_entry("keel_units:UNITS:0.5") == ("keel_units:UNITS", 0.5)
    assert parse_entry("keel_units:UNITS:2e1") == ("keel_units:UNITS", 20.0)


@pytest.mark.parametrize("entry", ["guess:0", "guess:-1", "guess:inf", "guess:nan", ":3", "", "  "])
def test_a_bad_weight_or_an_empty_entry_is_a_config_error_naming_env_mix(entry):
    with pytest.raises(ConfigError) as info:
        parse_entry(entry)
    assert info.value.field == "env.mix"


@pytest.mark.parametrize("entries, message", [
    ("[guess:0]", "finite number > 0"),
    ("[guess,nope]", "unknown environment 'nope'"),
    ("[guess,keel_units:UNITZ:2]", "has no attribute 'UNITZ'"),
    ("[guess:2,guess]", "names 'guess' again"),
    ("[units,keel_units:UNITS]", "names 'units' again"),  # the same spec by entry point and import path
])
def test_a_bad_mix_fails_at_config_time_naming_env_mix(entries, message):
    with pytest.raises(ConfigError, match=message) as info:
        check(load_config(overrides=[f"env.mix={entries}"]))
    assert info.value.field == "env.mix"


def test_env_name_is_mix_when_env_mix_is_set():
    cfg = load_config(overrides=[MIX])
    assert cfg.env.name == "mix" and cfg.env.mix == ["guess:3", "units"]  # left at its default: mix
    assert load_config(overrides=["env.name=mix", MIX]).env.name == "mix"
    with pytest.raises(ConfigError, match="list guess in env.mix") as info:
        load_config(overrides=["env.name=guess", MIX])
    assert info.value.field == "env.mix"
    with pytest.raises(ConfigError, match="needs env.mix") as info:
        load_config(overrides=["env.name=mix"])
    assert info.value.field == "env.mix"
    with pytest.raises(ConfigError, match=r"env.mix\[0\]"):  # "guess: 3" with a space is a mapping in YAML
        load_config(overrides=["env.mix=[guess: 3]"])


# ------------------------------------------------------------------------------ tasks and environments

def test_the_tasks_are_each_parts_own_split_tagged_with_unique_ids():
    cfg, spec = mixed()
    train, heldout = spec.tasks(cfg)
    for part in ("guess", "units"):
        own_train, own_heldout = env_spec(part).tasks(cfg)
        assert [t.task for t in train if t.env == part] == list(own_train)  # in the part's own order
        assert [t.task for t in heldout if t.env == part] == list(own_heldout)
    ids = [t.id for t in [*train, *heldout]]
    assert len(set(ids)) == len(ids) and all(i.startswith(("guess/", "units/")) for i in ids)
    assert {t.id for t in train}.isdisjoint(t.id for t in heldout)
    # Train interleaved 3:1, held-out in turn: the warm start's first demos and the first eval.tasks
    # held-out tasks cover both parts.
    assert [t.env for t in train[:8]] == ["guess", "guess", "units", "guess"] * 2
    assert [t.env for t in heldout[:6]] == ["guess", "units"] * 3
    assert {spec.family(t) for t in heldout} == {"guess", "units"}
    assert train[0].kind == "guess"  # the inner task has no kind: the part's name


def test_interleave_keeps_each_groups_order_and_its_share():
    out = interleave([list("aaaaaaaaa"), list("bbb"), list("c")], [3.0, 1.0, 1.0])
    assert "".join(out[:5]) == "abaca" and sorted(out) == sorted("aaaaaaaaabbbc")
    numbered = interleave([[1, 2, 3], [10, 20]], [1.0, 1.0])
    assert numbered == [1, 10, 2, 20, 3]


def test_a_mix_environment_plays_each_part_with_its_own_env_teacher_and_verifier():
    cfg, spec = mixed()
    train, _ = spec.tasks(cfg)
    factory = spec.train_env(cfg)
    assert isinstance(factory, MixEnvFactory) and factory.limits == {"guess": 5, "units": 3}
    teacher = spec.teacher(cfg)
    for task in train[:8]:
        env = factory()
        episode = run_episode(env, task, teacher.policy(task))
        assert episode.grade.success and episode.grade.verifier == task.env  # guess's verifier is "guess"
        # What the rollout's first prompt reads (tools, show_tools, tool_format) is the part env's own.
        assert getattr(env, "tools", None) is getattr(env.current, "tools", None)
        assert hasattr(env, "tools") == (task.env == "guess")  # UnitsEnv has no `tools`
    check_env(factory(), train[2], good_actions=["<call>convert 1 m km</call>"])  # a units task
    again = pickle.loads(pickle.dumps(factory))  # Ray rollout workers build their envs from a pickled factory
    assert again.limits == factory.limits and run_episode(again(), train[2], teacher.policy(train[2])).grade.success
    assert spec.answer_tools == ("guess", "answer") and spec.verifiers == ("strong",)
    assert spec.reference(train[2]) == train[2].task.answer  # units: the task's answer
    assert spec.reference(train[0]) == str(train[0].task.secret)  # guess: its spec's reference


@dataclass(frozen=True)
class Word:
    id: str


class Endless:
    """An environment that never ends an episode itself, with a limit of 2 turns."""

    max_turns = 2

    def reset(self, task: Word) -> str:
        self.turns = 0
        return f"say {task.id}"

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        self.turns += 1
        return "ok", False, {}

    def grade(self) -> Grade:
        return Grade(1.0, (CheckResult("said", True),))


def endless_spec() -> EnvSpec:
    words = [Word(f"w{i}") for i in range(20)]
    return EnvSpec(name="endless", tasks=lambda cfg: split_tasks(words, cfg.env.split_seed, "words"),
                   train_env=lambda cfg: Endless, eval_env=lambda cfg: Endless)


def test_the_mix_ends_each_parts_episode_at_that_parts_own_turn_limit():
    spec = EnvSpec(**mix_spec_fields([MixPart(env_spec("guess")), MixPart(endless_spec())]))
    cfg = load_config(overrides=["env.name=mix", "env.mix=[guess]"])  # the spec is passed, as Trainer(env=...) does
    cfg = settle_env(cfg, spec)
    assert cfg.env.max_turns == 5  # the largest of the parts' own: guess 5, endless 2
    train, _ = spec.tasks(cfg)
    word = next(t for t in train if t.env == "endless")
    episode = run_episode(spec.train_env(cfg)(), word, lambda prompt, turns: "hello")
    assert len(episode.turns) == 2 and episode.termination == "max_turns"  # its own 2, not the mix's 5
    assert spec.teacher is None  # endless has no teacher: the mix has none
    # A fixed limit above a set env.max_turns is an error naming that environment.
    with pytest.raises(ConfigError, match="environments of env.name=endless have max_turns=2") as info:
        settle_env(load_config(overrides=["env.name=mix", "env.mix=[guess]", "env.max_turns=1"]), spec)
    assert info.value.field == "env.max_turns"


def test_env_max_turns_builds_the_parts_that_take_it_and_caps_the_rest():
    cfg, spec = mixed("env.max_turns=4")
    assert cfg.env.max_turns == 4 and spec.train_env(cfg).limits == {"guess": 4, "units": 3}
    with pytest.raises(ConfigError, match="the units environment have max_turns=3"):
        mixed("env.max_turns=2")


# ------------------------------------------------------------------------------ the env section

def test_the_env_section_is_checked_against_the_union_of_the_parts_fields():
    assert check(load_config(overrides=[MIX, "env.guess_n=8", "env.split_seed=3"]))  # guess reads them
    with pytest.raises(ConfigError, match="not read by the mix of guess, units") as info:
        check(load_config(overrides=[MIX, "env.dataset=chain_sum"]))  # no part reads it
    assert info.value.field == "env.dataset" and "reasoning_gym" in str(info.value)
    with pytest.raises(ConfigError, match="no verifier 'weak'") as info:
        check(load_config(overrides=[MIX, "env.verifier=weak"]))  # guess has weak; units has not
    assert info.value.field == "env.verifier"
    assert check(load_config(overrides=["env.mix=[guess,coding]", "env.verifier=weak", "env.shaping=0.5"]))
    # Each part's own checks run: reasoning gym needs its dataset.
    with pytest.raises(ConfigError, match="needs env.dataset") as info:
        check(load_config(overrides=["env.mix=[guess,reasoning_gym]"]))
    assert info.value.field == "env.dataset"


def test_a_mix_with_the_coding_environment_reports_each_family_under_its_part():
    cfg, spec = mixed("env.mix=[coding,guess]", "env.tasks=bundled,agent")
    _, heldout = spec.tasks(cfg)
    families = {spec.family(task) for task in heldout}
    assert families == {"coding/templated", "coding/agent", "guess"}
    assert spec.test_tool == "test" and spec.hidden_paths is not None and spec.teacher is not None
    # The own-mistakes round: the coding teacher continues its tasks from a student's wrong edit
    # (played in the coding part's env), the guessing game's teacher none.
    teacher = spec.teacher(dataclasses.replace(cfg, warm_start=dataclasses.replace(cfg.warm_start, mistake_rate=1.0)))
    assert teacher.recovery_turns == 5
    train, _ = spec.tasks(cfg)
    env = spec.train_env(cfg)()
    continued = []
    for task in [t for t in train if t.env == "coding"][:5]:
        env.reset(task)
        continued.append(teacher.recovery(task, teacher.policy(task).plan.actions[0], env))
    assert any(policy is not None for policy in continued)
    env.reset(guess := next(t for t in train if t.env == "guess"))
    assert teacher.recovery(guess, "<call>guess 3</call>", env) is None
    env.close()


# ------------------------------------------------------------------------------ weights

def test_the_request_stream_honours_the_weights_and_groups_never_mix_environments():
    cfg, spec = mixed("rollout.tasks_per_step=8")
    train, _ = spec.tasks(cfg)
    stream = RequestStream(cfg, train, None, has_teacher=False, weights=spec.weights(train))
    steps = [stream.for_step(step) for step in range(1, 401)]
    for requests in steps:
        assert len({r.task.id for r in requests}) == len(requests) == 8  # distinct tasks within a step
        assert all(isinstance(r.task, MixTask) for r in requests)  # a group is one task: one environment
    shares = Counter(r.task.env for requests in steps for r in requests)
    # 3200 groups drawn 3:1; the binomial standard error of the share is sqrt(.75 * .25 / 3200) = 0.0077
    assert shares["guess"] / 3200 == pytest.approx(0.75, abs=0.025)
    assert stream.for_step(7) == stream.for_step(7)  # seeded: a resumed run repeats it
    extra = stream.extra(3, 0, 800)
    assert Counter(r.task.env for r in extra)["guess"] / 800 == pytest.approx(0.75, abs=0.05)
    assert stream.extra(3, 5, 10) == stream.extra(3, 0, 15)[5:]  # the first groups do not depend on count


def test_with_a_curriculum_the_weights_multiply_its_own():
    from keelrl.train.curriculum import Curriculum

    cfg, spec = mixed("rollout.tasks_per_step=8")
    train, _ = spec.tasks(cfg)
    # units at level 1: not admitted yet (curriculum weight 0), whatever its mix weight
    curriculum = Curriculum([int(t.env == "units") for t in train], cfg.curriculum, seed=cfg.seed)
    stream = RequestStream(cfg, train, curriculum, has_teacher=False, weights=spec.weights(train))
    assert all(r.task.env == "guess" for step in range(1, 51) for r in stream.for_step(step))
    curriculum.finish()  # every task at curriculum weight 1: the mix's weights alone
    shares = Counter(r.task.env for step in range(1, 201) for r in stream.for_step(step))
    assert shares["guess"] / 1600 == pytest.approx(0.75, abs=0.035)


def test_without_weights_the_stream_draws_as_before():
    cfg = load_config(overrides=["env.name=guess", "rollout.tasks_per_step=8"])
    train, _ = env_spec("guess").tasks(cfg)
    stream = RequestStream(cfg, train, None, has_teacher=False)
    for step in (1, 2, 9):
        expected = random.Random(f"{cfg.seed}:step:{step}").sample(list(train), 8)
        assert [r.task for r in stream.for_step(step)] == expected


def test_weighted_sample_draws_in_proportion_without_replacement():
    # weights 3, 1, 0: the first draw is index 0 with probability 3/4; index 2 is never drawn
    firsts = Counter(weighted_sample([3.0, 1.0, 0.0], 1, random.Random(seed))[0] for seed in range(4000))
    assert firsts[0] / 4000 == pytest.approx(0.75, abs=0.025) and 2 not in firsts
    assert sorted(weighted_sample([3.0, 1.0, 0.0], 5, random.Random(0))) == [0, 1]


# ------------------------------------------------------------------------------ a run

def test_keel_train_on_a_mix_reports_each_environment(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "env.mix=[guess,units]", f"model.path={tiny_model_dir}", f"run_dir={run}",
                 "algo.preset=grpo", "warm_start.demos=8", "warm_start.epochs=1", "warm_start.batch_size=8",
                 "rollout.tasks_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=16",
                 "rollout.engine=sync", "train.steps=1", "train.minibatch_size=8", "eval.tasks=4",
                 "perf.learner_precision=float32", "eval.dtype=float32"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    final = summary["heldout_final"]
    assert final["tasks"] == 4 and set(final["by_family"]) == {"guess", "units"}
    assert all(block["tasks"] == 2 for block in final["by_family"].values())
    assert set(summary["rl_lift"]["by_family"]) == {"guess", "units"}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/success_units" in row and "eval/success_guess" in row for row in rows)
    episodes = [json.loads(line) for line in (run / "episodes" / "step_0001.jsonl").read_text().splitlines()]
    by_group: dict[int, set[str]] = {}
    for episode in episodes:
        by_group.setdefault(episode["group_id"], set()).add(episode["task_id"].split("/")[0])
    assert all(len(parts) == 1 for parts in by_group.values())  # a group never mixes environments
    config = (run / "config.yaml").read_text()
    assert "name: mix" in config and "- guess" in config and "max_turns: 5" in config


def test_the_guides_mix_example_runs():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "guide-environment.md").read_text(encoding="utf-8")
    blocks = [block for block in page.split("```python\n")[1:] if block.startswith("# docs-test: mix\n")]
    assert len(blocks) == 1, "docs/guide-environment.md needs one python block starting '# docs-test: mix'"
    exec(compile(blocks[0].split("```")[0], "docs/guide-environment.md", "exec"), {})
