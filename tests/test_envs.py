"""The environment layer: the tool-call parser, CodingEnv on the lecture's retry_count task,
git hygiene, test tampering, `check_env` and `run_episode`.

Sandboxed runs (`test`, `grade()`) cost ~70 ms each, so only the tests that are about test
results or grading run them; the rest use `CodingEnv(use_git=False)` where git is beside the
point, since `git init` + commit costs ~20 ms a reset.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from keelrl.envs.base import CheckResult, EnvCheckError, Grade, check_env, run_episode
from keelrl.envs.coding import CODING_TOOLS, CodingEnv, count_occurrences, split_lines
from keelrl.envs.formats import PromptTools, prompt_tools
from keelrl.envs.guess import GuessEnv, GuessTask
from keelrl.envs.tools import ActionError, describe_tools, parse_action
from task_fixtures import BUGGY, CONSTANT_ZERO, FIXED, WRONG, binary_search_guess, retry_task

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

TOOL_LIST = describe_tools(CODING_TOOLS)
WRONG_LINE = '    return config.get("retries", 3)'
# What the agent writes in the lecture's second fix: distinctive text that must never be in git.
FIX_LINES = '    value = config.get("retries")\n    return 3 if value is None else value'


def _git(workdir: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=workdir, capture_output=True, text=True, errors="replace", check=True,
                          env={"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(workdir),
                               "GIT_CONFIG_NOSYSTEM": "1"}).stdout


def _whole_file_edit(path: str, old_text: str, new_text: str) -> str:
    """An edit action replacing a file's whole text (without its final newline)."""
    return f"<call>edit {path}\n{old_text.rstrip(chr(10))}\n>>>\n{new_text.rstrip(chr(10))}</call>"


# -- parser -----------------------------------------------------------------------------------

def test_parser_ignores_reasoning_before_the_call_and_text_after_it():
    call = parse_action("Line 2 is wrong, let me look.\n<call>read retry.py</call> and then", CODING_TOOLS)
    assert (call.name, call.args, call.body) == ("read", ("retry.py",), "")


def test_parser_splits_args_on_whitespace_and_keeps_a_multi_line_body_verbatim():
    call = parse_action(f"<call>replace  2   retry.py\n{FIX_LINES}</call>", CODING_TOOLS)
    assert (call.name, call.args) == ("replace", ("2", "retry.py"))
    assert call.body == FIX_LINES  # indentation and the inner newline kept


@pytest.mark.parametrize("text", ["<call>replace 2</call>", "<call>replace 2\n</call>"])
def test_parser_accepts_an_empty_optional_body(text):
    assert parse_action(text, CODING_TOOLS).body == ""


def test_parser_gives_the_edit_body_with_its_separator():
    call = parse_action("<call>edit\nold\n>>>\nnew</call>", CODING_TOOLS)
    assert (call.name, call.args, call.body) == ("edit", (), "old\n>>>\nnew")


@pytest.mark.parametrize("text, wrong, accepted", [
    ("I would read the file.", "no tool call found", TOOL_LIST),
    ("<call>read", "not closed with </call>", TOOL_LIST),
    ("<call>read</call><call>test</call>", "more than one tool call", TOOL_LIST),
    ("<call>read <call>test</call>", "more than one tool call", TOOL_LIST),
    ("<call></call>", "empty tool call", TOOL_LIST),
    ("<call>  \nbody</call>", "empty tool call", TOOL_LIST),
    ("<call>run pytest</call>", "unknown tool 'run'", "the tools are read, replace, edit, test, submit"),
    ("<call>READ</call>", "unknown tool 'READ'", TOOL_LIST),
    ("<call>replace</call>", "replace takes 1 to 2 arguments, got 0", CODING_TOOLS["replace"].usage),
    ("<call>replace 1 retry.py extra\nx</call>", "replace takes 1 to 2 arguments, got 3",
     CODING_TOOLS["replace"].usage),
    ("<call>test now</call>", "test takes 0 arguments, got 1", CODING_TOOLS["test"].usage),
    ("<call>read a.py b.py</call>", "read takes 0 to 1 arguments, got 2", CODING_TOOLS["read"].usage),
    ("<call>test\nimport os</call>", "test takes no body", CODING_TOOLS["test"].usage),
    ("<call>submit\ndone</call>", "submit takes no body", CODING_TOOLS["submit"].usage),
    ("<call>edit</call>", "edit needs a body", CODING_TOOLS["edit"].usage),
    ("x" * 4001 + "<call>read</call>", "4018 characters long; the limit is 4000", TOOL_LIST),
])
def test_parser_errors_say_what_was_wrong_and_what_is_accepted(text, wrong, accepted):
    with pytest.raises(ActionError) as raised:
        parse_action(text, CODING_TOOLS)
    message = str(raised.value)
    assert message.startswith("error: ")
    assert wrong in message
    assert accepted in message


def test_parser_length_limit_is_the_callers():
    parse_action("x" * 4001 + "<call>read</call>", CODING_TOOLS, max_chars=5000)
    with pytest.raises(ActionError, match="the limit is 10"):
        parse_action("<call>read</call>", CODING_TOOLS, max_chars=10)


# -- CodingEnv: the lecture's trajectory ------------------------------------------------------

@needs_git
def test_the_lectures_trajectory_observation_by_observation():
    env, task = CodingEnv(), retry_task()
    prompt = env.reset(task)
    assert task.prompt in prompt and "retry_count in retry.py" in prompt
    # show_tools (on by default here): the rollout puts the tool list in the prompt, not the observation
    assert TOOL_LIST not in prompt and prompt_tools(env) == PromptTools(schemas=None, description=TOOL_LIST)

    observation, done, info = env.step("First I read the code.\n<call>read</call>")
    assert observation == 'retry.py\n1| def retry_count(config):\n2|     return config.get("retries") or 3'
    assert (done, info) == (False, {"tool": "read"})

    observation, done, info = env.step(f"<call>replace 2\n{WRONG_LINE}</call>")
    assert observation == f"retry.py\n1| def retry_count(config):\n2| {WRONG_LINE}"
    assert (done, info) == (False, {"tool": "replace"})
    assert (env.workdir / "retry.py").read_text() == WRONG

    # The plausible fix repairs 0 but breaks None; the test tool shows the failing value.
    observation, done, info = env.step("<call>test</call>")
    assert observation == ("tests: 3 passed, 1 failed\n"
                           "FAIL test_none: retry_count({'retries': None}): expected 3, got None")
    assert (done, info) == (False, {"tool": "test", "tests_passed": 3, "tests_failed": 1})

    observation, done, info = env.step(f"<call>edit\n{WRONG_LINE}\n>>>\n{FIX_LINES}</call>")
    assert observation == ("retry.py\n1| def retry_count(config):\n2|     value = config.get(\"retries\")\n"
                           "3|     return 3 if value is None else value")
    assert (done, info) == (False, {"tool": "edit"})

    observation, done, info = env.step("<call>test</call>")
    assert observation == "tests: 4 passed, 0 failed"

    observation, done, info = env.step("<call>submit</call>")
    assert (observation, done, info) == ("submitted.", True, {"tool": "submit", "termination": "submitted"})

    grade = env.grade()
    assert grade.reward == 1.0 and grade.success and grade.verifier == "strong"
    assert [(check.name, check.passed) for check in grade.checks] == [
        ("missing", True), ("none", True), ("zero", True), ("two", True)]
    assert grade.summary() == "reward 1, 4/4 checks passed"
    assert env.grade() is grade  # a finished episode is graded once
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("<call>read</call>")


def test_replace_with_an_empty_body_deletes_the_line_and_read_numbers_wide_files():
    task = dataclasses.replace(retry_task(), files={
        "retry.py": "".join(f"line{number}\n" for number in range(1, 12)), "test_retry.py": "\n"})
    env = CodingEnv(use_git=False)
    env.reset(task)
    observation, _, info = env.step("<call>replace 3</call>")
    assert "error" not in info
    assert observation.splitlines()[1:4] == [" 1| line1", " 2| line2", " 3| line4"]
    assert observation.splitlines()[-1] == "10| line11"


def test_replace_changes_exactly_one_line_even_next_to_a_form_feed():
    # str.splitlines() would split "a\x0cb" too and rewrite it as two lines.
    task = dataclasses.replace(retry_task(), files={"retry.py": "x = 'a\x0cb'\ny = 1\n", "test_retry.py": "\n"})
    env = CodingEnv(use_git=False)
    env.reset(task)
    assert env.step("<call>read</call>")[0] == "retry.py\n1| x = 'a\x0cb'\n2| y = 1"
    env.step("<call>replace 2\ny = 2</call>")
    assert (env.workdir / "retry.py").read_text() == "x = 'a\x0cb'\ny = 2\n"


# -- CodingEnv: bad actions -------------------------------------------------------------------

BAD_ACTIONS = [
    ("<call>replace two\nx</call>", "LINE must be a line number, got 'two'"),
    ("<call>replace 2.0\nx</call>", "LINE must be a line number, got '2.0'"),
    ("<call>replace 0\nx</call>", "line 0 is out of range; retry.py has 2 lines"),
    ("<call>replace 3\nx</call>", "line 3 is out of range; retry.py has 2 lines"),
    ("<call>replace -1\nx</call>", "line -1 is out of range"),
    ("<call>edit\nreturn config.get('retries')\n>>>\nx</call>", "OLD occurs 0 times in retry.py"),
    ("<call>edit\nconfig\n>>>\ncfg</call>", "OLD occurs 2 times in retry.py; it must occur exactly once"),
    ("<call>edit\nor 3\nand 3</call>", "separate OLD and NEW with a line holding only >>>"),
    ("<call>edit\n>>>\nx</call>", "OLD is empty"),
    ("<call>read ../x</call>", "'../x' is outside the repository; files: retry.py, test_retry.py"),
    ("<call>replace 1 ../retry.py\nx</call>", "'../retry.py' is outside the repository"),
    ("<call>read /etc/passwd</call>", "'/etc/passwd' is outside the repository"),
    ("<call>edit /etc/hostname\na\n>>>\nb</call>", "'/etc/hostname' is outside the repository"),
    ("<call>read .</call>", "'.' is outside the repository"),
    ("<call>read .git/config</call>", "'.git/config' is git metadata"),
    ("<call>replace 1 .git/HEAD\nref: refs/heads/evil</call>", "'.git/HEAD' is git metadata"),
    ("<call>read tests</call>", "'tests' is not a file of the task"),
    ("<call>read missing.py</call>", "'missing.py' is not a file of the task; files: retry.py, test_retry.py"),
    ("<call>replace 1 missing.py\nx</call>", "'missing.py' is not a file of the task"),
    ("<call>edit missing.py\na\n>>>\nb</call>", "'missing.py' is not a file of the task"),
    ("<call>read</call><call>submit</call>", "more than one tool call"),
    ("<call>submit now</call>", "submit takes 0 arguments, got 1"),
    ("x" * 5000, "the limit is 4000"),
]


@needs_git
@pytest.mark.parametrize("action, wrong", BAD_ACTIONS, ids=[wrong[:40] for _, wrong in BAD_ACTIONS])
def test_a_bad_action_is_an_error_observation_that_costs_a_turn_and_changes_nothing(action, wrong):
    env, task = CodingEnv(), retry_task()
    env.reset(task)
    git_files = {path: _git(env.workdir, "show", f"HEAD:{path}") for path in task.files}
    observation, done, info = env.step(action)
    assert wrong in observation
    assert info["error"] == observation.splitlines()[0] and info["error"].startswith("error: ")
    assert done is False and env.turn == 1
    assert env.current_files() == task.files
    assert _git(env.workdir, "rev-list", "--all", "--count").strip() == "1"
    assert {path: _git(env.workdir, "show", f"HEAD:{path}") for path in task.files} == git_files


def test_text_that_cannot_be_written_as_utf8_is_an_error_observation():
    env = CodingEnv(use_git=False)
    env.reset(retry_task())
    observation, done, info = env.step("<call>replace 2\n    return '\ud800'</call>")
    assert "not valid Unicode" in observation and info["error"] and not done
    assert env.current_files()["retry.py"] == BUGGY
    env.step("<call>replace 2\n    return 'é'</call>")  # non-ASCII is fine, whatever the locale
    assert env.current_files()["retry.py"].endswith("return 'é'\n")


def test_an_overlapping_occurrence_makes_old_ambiguous():
    # str.count("a\na") on "a\na\na\n" says 1; the edit would then silently hit the first pair.
    assert count_occurrences("a\na\na\n", "a\na") == 2
    assert count_occurrences("a\nb\n", "a\nb") == 1 and count_occurrences("a\nb\n", "c") == 0
    task = dataclasses.replace(retry_task(), files={"retry.py": "a\na\na\n", "test_retry.py": "\n"})
    env = CodingEnv(use_git=False)
    env.reset(task)
    observation, _, info = env.step("<call>edit\na\na\n>>>\nb\nc</call>")
    assert "OLD occurs 2 times" in observation and info["error"]
    assert (env.workdir / "retry.py").read_text() == "a\na\na\n"


def test_split_lines_splits_on_newlines_only():
    assert split_lines("a\nb\n") == ["a", "b"] == split_lines("a\nb")
    assert split_lines("") == [] and split_lines("\n") == [""] and split_lines("a\n\n") == ["a", ""]
    assert split_lines("a\x0cb\u2028c\n") == ["a\x0cb\u2028c"]


def test_the_episode_ends_at_max_turns_even_on_bad_actions():
    env = CodingEnv(max_turns=3, use_git=False)
    env.reset(retry_task())
    assert env.step("<call>read</call>")[1] is False
    assert env.step("<call>nonsense</call>")[1] is False
    observation, done, info = env.step("<call>read 9</call>")
    assert done is True and info["termination"] == "max_turns" and info["error"]
    assert observation.endswith("turn limit (3) reached; the episode ends.")
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("<call>submit</call>")


def test_submitting_on_the_last_turn_counts_as_a_submission():
    env = CodingEnv(max_turns=1, use_git=False)
    env.reset(retry_task())
    assert env.step("<call>submit</call>") == ("submitted.", True, {"tool": "submit", "termination": "submitted"})


def test_step_and_grade_before_reset_raise():
    env = CodingEnv(use_git=False)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<call>read</call>")
    with pytest.raises(RuntimeError, match="reset"):
        env.grade()
    with pytest.raises(ValueError, match="max_turns"):
        CodingEnv(max_turns=0)


@needs_git
def test_reset_starts_clean_in_a_fresh_workdir_and_removes_the_old_one():
    env, task = CodingEnv(max_turns=3), retry_task()
    env.reset(task)
    first = env.workdir
    env.step(f"<call>replace 2\n{WRONG_LINE}</call>")
    env.step("<call>replace 1 test_retry.py\nimport os</call>")
    env.step("<call>read</call>")
    assert env.done

    prompt = env.reset(task)
    assert env.workdir != first and not first.exists()
    assert env.current_files() == task.files and (env.turn, env.done) == (0, False)
    assert _git(env.workdir, "rev-list", "--all", "--count").strip() == "1"
    assert env.step("<call>read</call>")[0].endswith("2|     return config.get(\"retries\") or 3")
    assert task.prompt in prompt
    second = env.workdir
    env.close()
    assert env.workdir is None and not second.exists()


# -- git hygiene ------------------------------------------------------------------------------

@needs_git
def test_the_workdir_repository_holds_only_the_buggy_base_commit():
    env, task = CodingEnv(), retry_task()
    env.reset(task)
    workdir = env.workdir
    assert _git(workdir, "rev-list", "--all", "--count").strip() == "1"
    assert sorted(_git(workdir, "ls-tree", "-r", "--name-only", "HEAD").split()) == sorted(task.files)
    assert _git(workdir, "show", "HEAD:retry.py") == BUGGY
    assert _git(workdir, "status", "--porcelain") == ""
    history = _git(workdir, "log", "--all", "-p")
    assert "or 3" in history  # the log really shows the diff...
    assert "is None" not in history and "value = config.get" not in history  # ...and not the fix
    # Not even as an unreachable object: every object in the store, by content.
    everything = _git(workdir, "cat-file", "--batch-all-objects", "--batch")
    assert "is None" not in everything and FIXED not in everything and WRONG not in everything


PROBE = '''import os, subprocess
try:
    _run = subprocess.run(["git", "log", "--all", "-p"], capture_output=True, text=True, timeout=5)
    GIT = f"rc={_run.returncode} log={_run.stdout[:40]!r}"
except OSError as error:
    GIT = f"no git: {type(error).__name__}"
_cwd = os.path.abspath(".")
DOTGIT = [d for d in [_cwd, os.path.dirname(_cwd)] if os.path.exists(os.path.join(d, ".git"))]
LISTING = sorted(os.listdir("."))

def retry_count(config):
    return f"PROBE listing={LISTING} dotgit={DOTGIT} git={GIT}"
'''


@needs_git
def test_sandboxed_runs_do_not_see_the_git_repository():
    env, task = CodingEnv(), retry_task()
    env.reset(task)
    assert (env.workdir / ".git").is_dir()
    (env.workdir / "retry.py").write_text(PROBE)  # what a few edits would write, in one go
    observation = env.step("<call>test</call>")[0]
    graded = env.grade()
    for seen in [observation, graded.checks[0].detail]:
        assert "PROBE listing=" in seen  # the probe really ran and reported
        assert ".git" not in seen.split("dotgit=")[0] and "dotgit=[]" in seen
        assert "rc=0" not in seen and "retries" not in seen.split("git=")[1]


# -- test tampering ---------------------------------------------------------------------------

@needs_git
def test_rewriting_the_tests_fools_the_test_tool_but_not_the_grade():
    env, task = CodingEnv(), retry_task()
    env.reset(task)
    env.step(_whole_file_edit("test_retry.py", task.files["test_retry.py"], "def test_ok(): pass"))
    assert env.step("<call>test</call>")[0] == "tests: 1 passed, 0 failed"
    env.step("<call>submit</call>")
    grade = env.grade()
    assert grade.reward == 0.0 and not grade.success
    assert {check.name: check.passed for check in grade.checks} == {
        "missing": True, "none": True, "zero": False, "two": True}
    assert "expected 0, got 3" in grade.summary()


@needs_git
def test_grading_restores_the_test_file_even_when_the_code_depends_on_the_tampered_one():
    # The tampered tests carry a correct helper and the code imports it. The test tool (the
    # working copy as it is) is satisfied; grading restores the original test file, which
    # imports retry, so the import goes round in a circle and every check fails.
    tampered = "def test_ok(): pass\n\ndef helper(config):\n" + FIX_LINES + "\n"
    env, task = CodingEnv(), retry_task()
    env.reset(task)
    env.step(_whole_file_edit("test_retry.py", task.files["test_retry.py"], tampered))
    env.step(_whole_file_edit("retry.py", BUGGY, "from test_retry import helper as retry_count"))
    assert env.step("<call>test</call>")[0] == "tests: 1 passed, 0 failed"
    grade = env.grade()
    assert grade.reward == 0.0 and not any(check.passed for check in grade.checks)
    assert "could not import retry.py" in grade.checks[0].detail


@needs_git
def test_deleting_the_test_file_does_not_break_grading():
    env, task = CodingEnv(max_turns=40), retry_task()
    env.reset(task)
    for _ in split_lines(task.files["test_retry.py"]):
        _, _, info = env.step("<call>replace 1 test_retry.py</call>")
        assert "error" not in info
    assert (env.workdir / "test_retry.py").read_text() == "\n"
    assert env.step("<call>test</call>")[0] == "tests: 0 passed, 0 failed"
    buggy_grade = env.grade()  # the episode is not over: grade() looks at the files as they are
    assert not buggy_grade.success and len(buggy_grade.checks) == 4
    env.step(_whole_file_edit("retry.py", BUGGY, FIXED))
    env.step("<call>submit</call>")
    assert env.grade().success and env.grade().reward == 1.0


@needs_git
def test_a_constant_zero_patch_fails_strong_grading():
    env, task = CodingEnv("strong"), retry_task()
    env.reset(task)
    env.step("<call>replace 2\n    return 0</call>")
    assert env.current_files()["retry.py"] == CONSTANT_ZERO
    assert env.step("<call>test</call>")[0].startswith("tests: 1 passed, 3 failed\n")
    env.step("<call>submit</call>")
    grade = env.grade()
    assert grade.reward == 0.0
    assert {check.name: check.passed for check in grade.checks} == {
        "missing": False, "none": False, "zero": True, "two": False}


# -- check_env --------------------------------------------------------------------------------

@needs_git
def test_check_env_accepts_coding_env():
    check_env(CodingEnv(), retry_task(), good_actions=["<call>read</call>", "<call>test</call>", "<call>submit</call>"])


@pytest.mark.parametrize("max_turns", [1, 3, 12])
def test_check_env_accepts_envs_whose_turn_limit_a_bad_action_reaches(max_turns):
    # With max_turns <= the three bad actions, the last of them ends the episode legitimately.
    check_env(CodingEnv(max_turns=max_turns, use_git=False), retry_task(),
              good_actions=["<call>read</call>", "<call>submit</call>"])
    check_env(GuessEnv(max_turns=max_turns), GuessTask("g", secret=5, n=16), good_actions=["<call>guess 5</call>"])


def test_check_env_accepts_guess_env():
    check_env(GuessEnv(), GuessTask("g", secret=5, n=16),
              good_actions=["<call>guess 8</call>", "<call>guess 4</call>", "<call>guess 5</call>"],
              bad_actions=["", "<call>guess five</call>", "<call>guess 17</call>", "<call>pick 3</call>"])


class ToyEnv:
    """A correct one-tool env: `<call>done</call>` ends the episode."""

    max_turns = 4

    def reset(self, task):
        self.turns = 0
        return "say <call>done</call>"

    def step(self, action_text):
        self.turns += 1
        if action_text == "<call>done</call>":
            return "ok", True, {}
        return "error: say <call>done</call>", self.turns >= self.max_turns, {"error": "bad action"}

    def grade(self):
        return Grade(reward=1.0, checks=(CheckResult("done", True),))


class RaisesOnMalformed(ToyEnv):
    def step(self, action_text):
        if action_text != "<call>done</call>":
            raise ValueError("cannot parse")
        return super().step(action_text)


class EndsOnMalformed(ToyEnv):
    def step(self, action_text):
        observation, _, info = super().step(action_text)
        return observation, True, info


class NoErrorInfo(ToyEnv):
    def step(self, action_text):
        observation, done, _ = super().step(action_text)
        return observation, done, {}


class FloatGrade(ToyEnv):
    def grade(self):
        return 1.0


class NaNReward(ToyEnv):
    def grade(self):
        return Grade(reward=math.nan, checks=())


class InfReward(ToyEnv):
    def grade(self):
        return Grade(reward=-math.inf, checks=())


class BadChecks(ToyEnv):
    def grade(self):
        return Grade(reward=1.0, checks=(("done", True),))


class GradeRaises(ToyEnv):
    def grade(self):
        raise KeyError("no verifier")


class EmptyPrompt(ToyEnv):
    def reset(self, task):
        super().reset(task)
        return ""


class NoReset(ToyEnv):
    reset = None


class ZeroTurns(ToyEnv):
    max_turns = 0


class RejectsGoodAction(ToyEnv):
    def step(self, action_text):
        observation, done, info = super().step(action_text)
        return observation, done, {**info, "error": "rejected"}


class RaisesAndFloatGrade(RaisesOnMalformed):
    def grade(self):
        return 0


BROKEN_ENVS = [
    (RaisesOnMalformed(), ["step('') raised ValueError('cannot parse'); it must return an error observation",
                           "step('not a tool call') raised"]),
    (EndsOnMalformed(), ["step('') ended the episode; a malformed action must not"]),
    (NoErrorInfo(), ["step('') did not set info['error']"]),
    (FloatGrade(), ["grade() returned float, expected Grade"]),
    (NaNReward(), ["grade().reward is not a finite number: nan"]),
    (InfReward(), ["grade().reward is not a finite number: -inf"]),
    (BadChecks(), ["grade().checks must be CheckResult instances"]),
    (GradeRaises(), ["grade() raised KeyError('no verifier')"]),
    (EmptyPrompt(), ["reset() returned str, expected a non-empty str"]),
    (NoReset(), ["missing method reset()"]),
    (ZeroTurns(), ["max_turns must be a positive int"]),
    (RejectsGoodAction(), ["step('<call>done</call>') was rejected: ok"]),
    (RaisesAndFloatGrade(), ["step('') raised", "grade() returned int, expected Grade"]),
]


@pytest.mark.parametrize("env, problems", BROKEN_ENVS, ids=[type(env).__name__ for env, _ in BROKEN_ENVS])
def test_check_env_lists_every_problem_of_a_broken_env(env, problems):
    check_env(ToyEnv(), None, good_actions=["<call>done</call>"])  # the base is correct
    with pytest.raises(EnvCheckError) as raised:
        check_env(env, None, good_actions=["<call>done</call>"])
    for problem in problems:
        assert problem in str(raised.value)


# -- run_episode ------------------------------------------------------------------------------



def test_run_episode_records_a_submitted_episode():
    env = GuessEnv(max_turns=5)
    episode = run_episode(env, GuessTask("guess-a", secret=11, n=16), binary_search_guess)
    assert episode.termination == "submitted" and episode.task_id == "guess-a"
    assert episode.prompt.startswith("I picked a number between 1 and 16")
    # 8 -> higher, 12 -> lower, 10 -> higher, 11 -> correct
    assert [(turn.action, turn.observation) for turn in episode.turns] == [
        ("<call>guess 8</call>", "higher"), ("<call>guess 12</call>", "lower"),
        ("<call>guess 10</call>", "higher"), ("<call>guess 11</call>", "correct! found in 4 guesses.")]
    assert episode.turns[-1].info == {"tool": "guess", "termination": "submitted"}
    assert episode.grade.reward == 1.0
    assert all(turn.seconds >= 0 for turn in episode.turns)
    assert episode.seconds >= sum(turn.seconds for turn in episode.turns)


def test_run_episode_reports_max_turns_when_the_env_stops_at_its_own_limit():
    # CodingEnv ends the episode itself (done=True) at its turn limit: not a submission.
    episode = run_episode(CodingEnv(max_turns=3, use_git=False), retry_task(), lambda prompt, turns: "<call>read</call>")
    assert episode.termination == "max_turns" and len(episode.turns) == 3
    assert episode.task_id == "retry_count"
    assert [turn.info.get("tool") for turn in episode.turns] == ["read"] * 3


def test_run_episode_stops_an_env_that_never_ends_after_max_turns():
    class Endless(ToyEnv):
        max_turns = 3

        def step(self, action_text):
            return "again", False, {}

    seen = []
    episode = run_episode(Endless(), "endless", lambda prompt, turns: seen.append(len(turns)) or "x")
    assert episode.termination == "max_turns" and len(episode.turns) == 3 and seen == [0, 1, 2]
    assert episode.task_id == "endless" and episode.grade.reward == 1.0
    assert episode.seconds >= 0 and all(turn.seconds >= 0 for turn in episode.turns)


def test_a_newline_before_the_closing_tag_ends_the_line_instead_of_adding_one():
    from keelrl.envs.coding import CODING_TOOLS
    from keelrl.envs.tools import parse_action

    assert parse_action("<call>replace 2\n    x\n</call>", CODING_TOOLS).body == "    x"
    assert parse_action("<call>replace 2\n    x</call>", CODING_TOOLS).body == "    x"
    assert parse_action("<call>replace 2\n    x\n\n</call>", CODING_TOOLS).body == "    x\n"


def test_show_file_puts_the_numbered_file_in_the_prompt_so_one_turn_is_a_whole_attempt():
    from keelrl.envs.teacher import ScriptedTeacher

    task = retry_task()
    env = CodingEnv(max_turns=1, show_file=True)
    prompt = env.reset(task)
    assert prompt.endswith(env._read(env.workdir / task.entry_file))
    assert "1| def retry_count(config):" in prompt
    assert "| def retry_count" not in CodingEnv(show_file=False).reset(task)
    plan = ScriptedTeacher(success_rate=1.0, mistake_rate=0.0, seed=0, read_first=False).plan(task)
    assert not plan.actions[0].startswith("<call>read")
    observation, done, info = env.step(plan.actions[0])
    assert done and info["termination"] == "max_turns"
    assert env.grade().success
