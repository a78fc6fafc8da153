"""Task sources (`env.tasks`): named families combined by commas, each task in its family's split."""

from __future__ import annotations

import collections

import pytest

from keelrl.config import load_config
from keelrl.envs.coding_tasks import AGENT_KINDS, KINDS, bundled_tasks, generate_tasks
from keelrl.envs.real_tasks import real_split, real_tasks, source_of
from keelrl.envs.registry import env_spec
from keelrl.envs.task_sources import family_of, interleave, is_file_source, load_source, source_split, task_split
from keelrl.envs.tasks import TaskError, save_tasks, split_of
from keelrl.errors import ConfigError


def test_bundled_is_the_default_tasks_unchanged():
    assert load_source("bundled") == generate_tasks(0) == bundled_tasks(None)
    assert source_split("bundled", "heldout", seed=3) == bundled_tasks("heldout", seed=3)


def test_agent_tasks_are_those_generated_after_the_default_kinds():
    agent = load_source("agent")
    assert {task.kind for task in agent} == set(AGENT_KINDS)
    both = load_source("bundled,agent")
    assert [task for task in both if task.kind in AGENT_KINDS] == agent
    assert [task for task in both if task.kind not in AGENT_KINDS] == generate_tasks(0)
    combined = generate_tasks(0, kinds=KINDS + AGENT_KINDS)
    assert sorted(task.to_json() for task in combined) == sorted(task.to_json() for task in both)
    assert sorted(task.to_json() for task in load_source("agent,bundled")) == sorted(task.to_json() for task in both)


def test_interleave_spreads_each_part_in_proportion():
    # a part of 4 at (i + 1/2)/4 = .125 .375 .625 .875, a part of 2 at .25 .75
    assert interleave([["a0", "a1", "a2", "a3"], ["b0", "b1"]]) == ["a0", "b0", "a1", "a2", "b1", "a3"]
    assert interleave([["b0", "b1"], ["a0", "a1", "a2", "a3"]]) == ["a0", "b0", "a1", "a2", "b1", "a3"]
    assert interleave([["x", "y", "z"]]) == ["x", "y", "z"]
    assert interleave([[], ["x"]]) == ["x"]
    # ties go in the order of the parts
    assert interleave([["a0", "a1"], ["b0", "b1"]]) == ["a0", "b0", "a1", "b1"]


def test_the_first_training_tasks_of_combined_sources_hold_each_family_in_its_share():
    # the warm start plays the first `warm_start.demos` training tasks: with the sources one after
    # the other, 128 of bundled,real would all be templated
    train = source_split("bundled,real", "train")
    real = sum(family_of(task) == "real" for task in train)
    first = collections.Counter(family_of(task) for task in train[:128])
    share = 128 * real / len(train)
    # interleaved before the split, which holds out whole real functions: near the share, not on it
    assert real > 100 and abs(first["real"] - share) <= 4, (first, share)


def test_real_tasks_keep_their_family_split_through_a_file(tmp_path):
    real = load_source("real")
    assert real == real_tasks(0)
    for task in real:
        assert task_split(task) == real_split(task)
    heldout = source_split("real", "heldout")
    # whole functions are held out, which split_of by task id would not do
    assert {source_of(task).slug for task in heldout}.isdisjoint(
        {source_of(task).slug for task in source_split("real", "train")})
    assert [task_split(task) for task in heldout] != [split_of(task.id) for task in heldout]
    path = tmp_path / "real.jsonl"
    save_tasks(real, path)
    assert is_file_source(str(path)) and not is_file_source("bundled,real")
    assert source_split(str(path), "heldout") == heldout


def test_family_of_each_source():
    counts = collections.Counter(family_of(task) for task in load_source("bundled,agent,real"))
    assert counts == {"templated": len(generate_tasks(0)), "agent": len(load_source("agent")),
                      "real": len(real_tasks(0))}


@pytest.mark.parametrize("source, message", [
    ("bundeld", "'bundeld' is neither one of bundled, agent, real nor an existing tasks .jsonl file"),
    ("bundled,rael", "'rael' is not one of bundled, agent, real"),
    ("bundled,tasks.jsonl", "'tasks.jsonl' is not one of"),
    ("real,real", "names a source twice"),
    ("", "non-empty string"),
])
def test_a_bad_source_names_itself_and_the_valid_ones(source, message):
    with pytest.raises(TaskError, match=message.replace("(", r"\(")):
        load_source(source)


def test_the_run_config_reads_combined_sources_and_reports_a_bad_one_on_env_tasks():
    spec = env_spec("coding")
    cfg = load_config(None, ["env.tasks=bundled,real"])
    train, heldout = spec.tasks(cfg)
    assert {task.id for task in train}.isdisjoint(task.id for task in heldout)
    assert {spec.family(task) for task in heldout} == {"templated", "real"}
    assert [task for task in heldout if spec.family(task) == "real"] == real_tasks(0, split="heldout")
    assert [task for task in heldout if spec.family(task) == "templated"] == bundled_tasks("heldout")
    with pytest.raises(ConfigError, match="env.tasks.*'bundeld'"):
        spec.tasks(load_config(None, ["env.tasks=bundeld"]))
