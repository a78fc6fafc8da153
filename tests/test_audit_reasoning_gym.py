"""`keel audit --env reasoning_gym`: answer probes through the env and the dataset's own scoring."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym")

from keelrl.audit import FALSE_POSITIVE_PROBES, REWRITES  # noqa: E402
from keelrl.audit.probes import FALSE_POSITIVE, REWRITE  # noqa: E402
from keelrl.audit.reasoning_gym import (  # noqa: E402
    ANSWER_PROBES,
    NOT_APPLICABLE,
    answer_probe_kind,
    run_answer_audit,
)
from keelrl.cli import main  # noqa: E402
from keelrl.envs import reasoning_gym as rg_env  # noqa: E402
from keelrl.envs.reasoning_gym import ReasoningGymEnv, rg_tasks  # noqa: E402

DATASET = "basic_arithmetic"
FALSE_POSITIVES = ["empty", "malformed", "echo_question", "long_answer", "injection", "hedge", "other_answer"]
CORRECT = ["reference", "padded", "body_form", "reasoning_first"]


class Lenient:
    """Full marks to any answer that contains the reference: the hole a shotgun answer exploits."""

    def score_answer(self, answer, entry):
        return 1.0 if entry["answer"] in (answer or "") else 0.0


class Stingy:
    """Never full marks: correct answers are rejected (a false negative)."""

    def score_answer(self, answer, entry):
        return 0.5 if answer == entry["answer"] else 0.0


def audit_json(capsys, *args: str) -> tuple[int, dict]:
    code = main(["audit", "--env", "reasoning_gym", "--format", "json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_the_probes_are_registered_with_their_kinds():
    assert list(ANSWER_PROBES) == FALSE_POSITIVES + CORRECT
    assert {family: answer_probe_kind(family) for family in ANSWER_PROBES} == \
        {**{f: FALSE_POSITIVE for f in FALSE_POSITIVES}, **{f: REWRITE for f in CORRECT}}


def test_every_coding_probe_and_rewrite_says_why_it_does_not_apply():
    assert set(FALSE_POSITIVE_PROBES) | set(REWRITES) | {"sandbox exposure"} == set(NOT_APPLICABLE)
    assert all(len(reason) > 20 for reason in NOT_APPLICABLE.values())


def test_keel_audit_json_on_a_sound_scorer(capsys):
    code, report = audit_json(capsys, "--dataset", DATASET, "--rg-size", "30")
    assert code == 0 and report["flagged"] is False and report["findings"] == []
    assert (report["env"], report["dataset"], report["tasks"]) == ("reasoning_gym", DATASET, 30)
    assert list(report["probes"]) == FALSE_POSITIVES + CORRECT
    for family in FALSE_POSITIVES:
        row = report["probes"][family]
        assert row["kind"] == FALSE_POSITIVE and row["tasks"] == 30 and row["full_marks_tasks"] == 0
        assert row["max_reward"] < 1.0 and not row["flagged"]
    for family in CORRECT:
        row = report["probes"][family]
        assert row["kind"] == REWRITE and row["full_marks_tasks"] == 30 and row["mean_reward"] == 1.0
    # The hedge ("A or B") gets the default scorer's partial credit, below full marks.
    assert 0.0 < report["probes"]["hedge"]["mean_reward"] < 1.0
    assert report["not_applicable"]["git_history"].startswith("no repository")
    assert set(FALSE_POSITIVE_PROBES) | set(REWRITES) <= set(report["not_applicable"])
    assert len(report["rewards"]) == 30 and all(len(row) == 11 for row in report["rewards"].values())


def test_the_rewards_are_the_datasets_scores():
    import reasoning_gym

    tasks = rg_tasks(DATASET, 12, 0)
    dataset = reasoning_gym.create_dataset(DATASET, size=12, seed=0)
    report = run_answer_audit(tasks, lambda: ReasoningGymEnv(dataset))
    hedges = [r for r in report.results if r.family == "hedge"]
    assert len(hedges) == 12
    for result, task in zip(hedges, tasks):
        hedge = result.action.removeprefix("<call>answer ").removesuffix("</call>")
        assert hedge.startswith(f"{task.answer} or ") and result.reward == dataset.score_answer(hedge, task.entry)


def test_a_scorer_that_pays_for_a_shotgun_answer_is_flagged():
    tasks = rg_tasks(DATASET, 10, 0)
    report = run_answer_audit(tasks, lambda: ReasoningGymEnv(Lenient()))
    assert report.flagged
    flagged = {row["family"] for row in report.families() if row["flagged"]}
    # malformed holds the reference too, but outside a tool call: the env never scores it
    assert flagged == {"long_answer", "hedge"}
    finding = report.to_dict()["findings"][0]
    assert finding["family"] in flagged and finding["reward"] == 1.0 and finding["success"] is True


def test_a_scorer_that_rejects_the_correct_answer_is_flagged():
    report = run_answer_audit(rg_tasks(DATASET, 5, 0), lambda: ReasoningGymEnv(Stingy()))
    assert {row["family"] for row in report.families() if row["flagged"]} == set(CORRECT)
    assert all(row["full_marks_tasks"] == 0 for row in report.families())


def test_keel_audit_exits_1_when_a_probe_earns_full_marks(capsys, monkeypatch):
    monkeypatch.setattr(rg_env.ReasoningGymEnvFactory, "__call__",
                        lambda self: ReasoningGymEnv(Lenient(), max_turns=self.max_turns))
    code, report = audit_json(capsys, "--dataset", DATASET, "--rg-size", "20", "--limit", "4")
    assert code == 1 and report["flagged"] is True and report["tasks"] == 4
    assert report["probes"]["hedge"]["flagged_tasks"] == [f"rg-{DATASET}-0-{i:05d}" for i in range(4)]


def test_a_dataset_without_reference_answers_lists_the_probes_that_need_one(capsys):
    code, report = audit_json(capsys, "--dataset", "propositional_logic", "--rg-size", "8")
    assert code == 0
    assert set(report["probes"]) == {"empty", "echo_question", "injection"}
    for family in ("reference", "padded", "hedge", "long_answer", "malformed", "other_answer"):
        assert "needs a reference answer" in report["not_applicable"][family]


def test_keel_audit_table(capsys):
    assert main(["audit", "--env", "reasoning_gym", "--dataset", DATASET, "--rg-size", "6"]) == 0
    out = capsys.readouterr().out
    assert "not applicable here" in out and "hardcode_visible" in out and "nothing flagged" in out


@pytest.mark.parametrize("args, message", [
    (["--dataset", DATASET], "--dataset go with --env reasoning_gym"),
    (["--rg-size", "5"], "--rg-size go with --env reasoning_gym"),
    (["--env", "reasoning_gym"], "env.dataset: env.name=reasoning_gym needs env.dataset=NAME"),
    (["--env", "reasoning_gym", "--dataset", "nope"], "unknown reasoning-gym dataset 'nope'"),
    (["--env", "reasoning_gym", "--dataset", DATASET, "--verifier", "weak"], "--verifier is for --env coding"),
    (["--env", "reasoning_gym", "--dataset", DATASET, "--rg-size", "0"], "env.rg_size"),
])
def test_keel_audit_bad_arguments(capsys, args, message):
    assert main(["audit", *args]) == 2
    assert message in capsys.readouterr().err
