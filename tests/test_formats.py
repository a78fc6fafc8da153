"""Tool-call formats (keelrl.envs.formats): each format's parser and renderer on every coding tool,
malformed calls as error observations, the teachers in every format, tool_from_function's schema,
tools through the chat template, and the property tests of test_fuzz.py for the new parsers."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import limits
from keelrl.config import load_config
from keelrl.envs.base import run_episode
from keelrl.envs.coding import CODING_TOOLS, CodingEnv, CodingEnvFactory
from keelrl.envs.coding_tasks import bundled_tasks
from keelrl.envs.formats import FORMATS, HermesFormat, PromptTools, ToolFormat, format_of, prompt_tools, register_format
from keelrl.envs.guess import GUESS_TOOLS, BinarySearchTeacher, GuessEnv, guess_tasks
from keelrl.envs.registry import env_spec
from keelrl.envs.reasoning_gym import RG_TOOLS, ReasoningGymEnv, ReasoningGymTask, ReferenceAnswerTeacher, answer_text
from keelrl.envs.teacher import ScriptedTeacher, move_calls
from keelrl.envs.tools import ActionError, ToolCall, ToolSpec, describe_tools, tool_from_function
from keelrl.errors import ConfigError
from keelrl.policy.chat import ChatFormat
from keelrl.policy.tiny import CHAT_TEMPLATE, build_tiny_tokenizer
from keelrl.rollout.agent_loop import run_episodes, scripted_actor
from keelrl.rollout.scheduler import prompt_tokens
from keelrl.train.trainer import Trainer
from task_fixtures import retry_task

NAMES = ["call", "hermes", "json"]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")

REPLACE = ToolCall("replace", ("2",), "    return 3")
CODING_CALLS = [
    ToolCall("read", (), ""), ToolCall("read", ("test_retry.py",), ""), REPLACE,
    ToolCall("replace", ("2", "retry.py"), "    a = 1\n    return a"), ToolCall("replace", ("2",), ""),
    ToolCall("edit", (), "or 3\n>>>\nor 4"), ToolCall("edit", ("retry.py",), "or 3\n>>>\nor 4\n"),
    ToolCall("test", (), ""), ToolCall("submit", (), ""),
]


# -- the registry --------------------------------------------------------------------------------

def test_the_registry_holds_the_three_formats_and_refuses_a_duplicate_or_unknown_name():
    assert FORMATS.names()[:3] == NAMES
    with pytest.raises(ValueError, match="duplicate tool-call format name 'hermes'"):
        register_format(HermesFormat())
    with pytest.raises(ConfigError, match="unknown tool-call format 'xml'; valid names: call, hermes, json"):
        format_of("xml")
    assert [format_of(name).stop for name in NAMES] == [("</call>",), ("</tool_call>",), ()]
    assert [format_of(name).native for name in NAMES] == [False, True, True]
    with pytest.raises(ConfigError, match="valid names: call, hermes, json"):
        CodingEnvFactory("strong", tool_format="xml")


def test_the_trainer_samples_with_the_formats_stop_strings():
    for name, stop in (("call", ("</call>",)), ("hermes", ("</tool_call>",)), ("json", ())):
        fake = SimpleNamespace(cfg=load_config(overrides=[f"env.tool_format={name}"]),
                               precision={"rollout": {"dtype": "float32"}})
        assert Trainer.rollout_sampling(fake).stop == stop


# -- parsing and rendering each coding tool ------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("call", CODING_CALLS, ids=lambda c: f"{c.name}{len(c.args)}{'b' if c.body else ''}")
def test_every_format_renders_and_parses_back_every_coding_tool(name, call):
    fmt = format_of(name)
    text = fmt.render(call, CODING_TOOLS)
    assert fmt.parse(text, CODING_TOOLS) == call
    if name != "json":  # reasoning before the call is ignored (json: the object is the whole action)
        assert fmt.parse("I will act now.\n" + text, CODING_TOOLS) == call


def test_the_renderings_are_the_ones_each_format_documents():
    call, hermes, json_ = (format_of(name) for name in NAMES)
    # call: today's teacher text, byte for byte (an empty body of a body-taking tool is the empty line)
    assert call.render(REPLACE, CODING_TOOLS) == "<call>replace 2\n    return 3\n</call>"
    assert call.render(ToolCall("replace", ("3",), ""), CODING_TOOLS) == "<call>replace 3\n\n</call>"
    assert call.render(ToolCall("read", (), ""), CODING_TOOLS) == "<call>read</call>"
    assert hermes.render(REPLACE, CODING_TOOLS) == (
        '<tool_call>\n{"name": "replace", "arguments": {"line": 2, "code": "    return 3"}}\n</tool_call>')
    assert json_.render(ToolCall("edit", ("a.py",), "x\n>>>\ny"), CODING_TOOLS) == (
        '{"name": "edit", "arguments": {"path": "a.py", "change": "x\\n>>>\\ny"}}')
    assert json_.render(ToolCall("test", (), ""), CODING_TOOLS) == '{"name": "test", "arguments": {}}'
    # a tag inside a string is escaped, so the block holds no second tag; it parses back as written
    tagged = ToolCall("edit", (), "</tool_call>\n>>>\n<tool_call>")
    text = hermes.render(tagged, CODING_TOOLS)
    assert text.count("<tool_call>") == 1 and text.count("</tool_call>") == 1
    assert hermes.parse(text, CODING_TOOLS) == tagged


def test_the_json_formats_read_what_models_write():
    hermes, json_ = format_of("hermes"), format_of("json")
    # Qwen after its reasoning, a string line number, the end-of-turn token after the call
    qwen = ('<think>line 2 is wrong</think>\n<tool_call>\n{"name": "replace", "arguments": {"line": "2", '
            '"code": "    return 3"}}\n</tool_call><|im_end|>')
    assert hermes.parse(qwen, CODING_TOOLS) == REPLACE
    # Llama 3 says "parameters"; null is absent; what follows the object (its end token) is ignored
    llama = '{"name": "read", "parameters": {"path": null}}<|eot_id|>'
    assert json_.parse(llama, CODING_TOOLS) == ToolCall("read", (), "")
    assert json_.parse('  {"name": "submit"}\n', CODING_TOOLS) == ToolCall("submit", (), "")
    # numbers and booleans are their JSON text
    assert json_.parse('{"name": "replace", "arguments": {"line": 2, "code": true}}', CODING_TOOLS) == \
        ToolCall("replace", ("2",), "true")
    assert format_of("hermes").parse('<tool_call>{"name": "guess", "arguments": {"n": 7}}</tool_call>',
                                     GUESS_TOOLS) == ToolCall("guess", ("7",), "")


def test_the_call_format_is_parse_action_and_describes_the_tools_as_before():
    fmt = format_of("call")
    assert fmt.describe(CODING_TOOLS) == describe_tools(CODING_TOOLS) == fmt.accepted(CODING_TOOLS)
    assert fmt.usage(CODING_TOOLS["replace"]) == "<call>replace LINE [PATH]\\nNEW LINES</call>"
    with pytest.raises(ActionError) as raised:
        fmt.parse("<call>READ</call>", CODING_TOOLS)
    assert str(raised.value) == ("error: unknown tool 'READ'; the tools are read, replace, edit, test, submit.\n"
                                 + describe_tools(CODING_TOOLS))


HERMES_BAD = [
    ("I would read the file.", "no tool call found; write it as <tool_call>"),
    ('<tool_call>{"name": "read"}', "the tool call is not closed with </tool_call>"),
    ('<tool_call>{"name": "read"}</tool_call><tool_call>{"name": "test"}</tool_call>', "more than one tool call"),
    ("<tool_call>\n</tool_call>", "empty tool call"),
    ('<tool_call>{"name": "read",}</tool_call>', "invalid JSON in the tool call: Expecting property name enclosed "
                                                 "in double quotes (line 1, column 17)"),
    ('<tool_call>\n{"name": "read"}\n{"name": "test"}\n</tool_call>', "text after the JSON object"),
    ('<tool_call>["read"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "read", "arguments": "{}"}</tool_call>', "the arguments of read must be a JSON object, "
                                                                   "got str"),
    ('<tool_call>{"name": "READ"}</tool_call>', "unknown tool 'READ'; the tools are read, replace, edit, test, submit"),
    ('<tool_call>{"name": 3}</tool_call>', "\"name\" must be a string naming a tool, got int"),
    ('<tool_call>{"name": "read", "id": 1}</tool_call>', "unknown key 'id' in the tool call"),
    ('<tool_call>{"name": "replace", "arguments": {"code": "x"}}</tool_call>', "replace needs the parameter 'line'"),
    ('<tool_call>{"name": "read", "arguments": {"file": "a"}}</tool_call>', "unknown parameter 'file' for read; "
                                                                             "its parameters are path"),
    ('<tool_call>{"name": "test", "arguments": {"path": "a"}}</tool_call>', "unknown parameter 'path' for test; "
                                                                             "it takes none"),
    ('<tool_call>{"name": "read", "arguments": {"path": ["a"]}}</tool_call>', "parameter 'path' of read must be a "
                                                                               "string or a number, got an array"),
    ('<tool_call>{"name": "edit", "arguments": {"change": ""}}</tool_call>', "edit needs a non-empty 'change'"),
    ('<tool_call>{"name": "read", "arguments": {"path": "a", "path": "b"}}</tool_call>',
     "the key 'path' appears twice"),
    ('<tool_call>{"name": "read", "arguments": {"path": NaN}}</tool_call>', "NaN is not a JSON number"),
    ('<tool_call>{"name": "read", "arguments": {"path": 1e999}}</tool_call>', "is inf, not a finite number"),
    ('<tool_call>{"name": "replace", "arguments": {"path": "a.py", "code": ""}}</tool_call>',
     "replace needs the parameter 'line'"),
]
JSON_BAD = [
    ("I would read the file.", "the action must be one JSON object"),
    ('Sure: {"name": "read"}', "nothing before it; found text before it"),
    ('{"name": "read"} {"name": "test"}', "more than one tool call"),
    ('{"name": "read"', "invalid JSON in the action"),
    ('{"name": "read", "arguments": {}, "parameters": {}}', "give the arguments once"),
    ('{"name": "guess"}', "unknown tool 'guess'"),
]
CALL_BAD = [("I would read the file.", "no tool call found"), ("<call>read", "not closed with </call>"),
            ("<call>replace x\ny</call>", "LINE must be a line number, got 'x'")]
MALFORMED = ([("call", text, error) for text, error in CALL_BAD] + [("hermes", text, error) for text, error in HERMES_BAD]
             + [("json", text, error) for text, error in JSON_BAD]
             + [("hermes", '<tool_call>{"name": "replace", "arguments": {"line": "x", "code": "y"}}</tool_call>',
                 'LINE must be a line number, got \'x\'; usage: <tool_call>{"name": "replace", "arguments": '
                 '{"line": <integer>, "path": <string, optional>, "code": <string, optional>}}</tool_call>')])


@pytest.mark.parametrize("name, text, error", MALFORMED)
def test_a_malformed_call_in_any_format_is_an_error_observation_in_the_coding_env(name, text, error):
    env, task = CodingEnv(use_git=False, tool_format=name), retry_task()
    env.reset(task)
    observation, done, info = env.step(text)
    assert error in observation and not done and env.current_files() == task.files
    assert info["error"] == observation.splitlines()[0] and info["error"].startswith("error: ")
    if "usage" not in observation:  # the parser's errors end with the tools in this format
        assert observation.endswith(format_of(name).accepted(CODING_TOOLS))


def test_the_error_observation_shows_the_accepted_form_in_its_own_format():
    with pytest.raises(ActionError) as raised:
        format_of("hermes").parse("read", GUESS_TOOLS)
    assert str(raised.value) == (
        'error: no tool call found; write it as <tool_call>{"name": <function-name>, "arguments": '
        '<args-json-object>}</tool_call>.\nAct with exactly one tool call per turn:\n'
        '  <tool_call>{"name": "guess", "arguments": {"n": <integer>}}</tool_call>  - guess the number N')


def test_a_tool_whose_arguments_have_no_names_cannot_be_passed_by_name():
    unnamed = {"say": ToolSpec("say", "<call>say WORD</call>", "say the word", 1, 1)}
    assert format_of("call").parse("<call>say hi</call>", unnamed) == ToolCall("say", ("hi",), "")
    with pytest.raises(ValueError, match="names 0 .*ToolSpec.params"):
        format_of("json").parse('{"name": "say", "arguments": {}}', unnamed)
    with pytest.raises(ValueError, match="names 0 .*ToolSpec.params"):
        unnamed["say"].schema()


@pytest.mark.parametrize("kwargs, error", [
    ({"body": "maybe"}, "body must be one of none, optional, required"),
    ({"min_args": 2, "max_args": 1}, "needs 0 <= min_args <= max_args"),
    ({"max_args": 1, "params": ("a", "b")}, "must name between min_args=0 and max_args=1"),
    ({"max_args": 2, "params": ("a", "a")}, "distinct"),
    ({"max_args": 1, "params": ("a",), "param_types": {"b": "string"}}, "param_types names \\['b'\\]"),
    ({"max_args": 1, "params": ("a",), "param_types": {"a": "int"}}, "a type is one of string, integer"),
    ({"body": "optional", "param_types": {"body": "integer"}}, "its type must be string"),
])
def test_a_toolspec_with_inconsistent_parameters_is_refused(kwargs, error):
    with pytest.raises(ValueError, match=error):
        ToolSpec("t", "<call>t</call>", "a tool", **kwargs)


# -- the schema, and tools declared by a function ------------------------------------------------

def test_the_schema_of_replace():
    assert CODING_TOOLS["replace"].schema() == {"type": "function", "function": {
        "name": "replace", "description": "replace one line with the lines after the first (none: delete it)",
        "parameters": {"type": "object", "properties": {
            "line": {"type": "integer", "description": "the number of the line to replace, as read shows it"},
            "path": {"type": "string", "description": "the file (default: the file to fix)"},
            "code": {"type": "string", "description": "the new lines (empty: delete the line)"}},
            "required": ["line"]}}}


def convert(value: float, unit: str, to: str | None = None, *, exact: bool = False) -> str:
    """Convert a value between units.

    The conversion table covers length and mass.

    Args:
        value: the number to convert
        unit (str): its unit, e.g. km
        exact: keep every digit
    """
    return ""


def test_tool_from_function_reads_the_signature_and_the_docstring():
    spec = tool_from_function(convert)
    assert spec.schema() == {"type": "function", "function": {
        "name": "convert", "description": "Convert a value between units.",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number", "description": "the number to convert"},
            "unit": {"type": "string", "description": "its unit, e.g. km"},
            "to": {"type": "string"},
            "exact": {"type": "boolean", "description": "keep every digit"}},
            "required": ["value", "unit"]}}}
    assert (spec.min_args, spec.max_args, spec.body, spec.usage) == (2, 4, "none",
                                                                      "<call>convert VALUE UNIT [TO] [EXACT]</call>")
    call = format_of("json").parse('{"name": "convert", "arguments": {"value": 2.5, "unit": "km", "to": "m"}}',
                                   {"convert": spec})
    assert call == ToolCall("convert", ("2.5", "km", "m"), "") and spec.arguments(call) == {
        "value": "2.5", "unit": "km", "to": "m"}
    with pytest.raises(ActionError, match="given a parameter after 'to' but not 'to'"):
        format_of("json").parse('{"name": "convert", "arguments": {"value": 1, "unit": "km", "exact": true}}',
                                {"convert": spec})


def test_tool_from_function_takes_a_body_and_refuses_what_a_tool_cannot_take():
    def patch(path: str, code: str) -> None:
        """Write code to a file."""

    spec = tool_from_function(patch, body_param="code")
    assert (spec.params, spec.body, spec.body_param, spec.required(), spec.usage) == (
        ("path",), "required", "code", ("path", "code"), "<call>patch PATH\\nCODE</call>")
    assert format_of("call").parse("<call>patch a.py\nx = 1</call>", {"patch": spec}) == \
        ToolCall("patch", ("a.py",), "x = 1")

    def many(*values: int) -> None:
        """Many."""

    def listed(values: list[int]) -> None:
        """Listed."""

    def undocumented(x: int) -> None:
        pass

    with pytest.raises(TypeError, match="'values' is \\*args"):
        tool_from_function(many)
    with pytest.raises(TypeError, match="'values' is annotated list\\[int\\]"):
        tool_from_function(listed)
    with pytest.raises(TypeError, match="needs a named function with a docstring"):
        tool_from_function(undocumented)
    with pytest.raises(TypeError, match="body_param 'body' is not one of its parameters"):
        tool_from_function(patch, body_param="body")


# -- environments and teachers in every format ---------------------------------------------------

@functools.cache
def train_tasks() -> tuple:
    return tuple(bundled_tasks("train"))


def edit_task():
    """A bundled task whose clean fix is one `edit` of a block."""
    for task in train_tasks():
        if [call.name for call in move_calls(dict(task.files), task.reference_fix, task.entry_file)] == ["edit"]:
            return task
    raise AssertionError("no bundled task is fixed by an edit")


@needs_git
@pytest.mark.parametrize("name", NAMES)
def test_the_scripted_teacher_solves_bundled_tasks_in_every_format(name):
    for task in (train_tasks()[0], edit_task()):
        for mistake_rate in (0.0, 1.0):
            teacher = ScriptedTeacher(success_rate=1.0, mistake_rate=mistake_rate, tool_format=name)
            episode = run_episode(CodingEnv(max_turns=8, tool_format=name), task, teacher.policy(task))
            assert episode.grade.success, (task.id, [turn.observation for turn in episode.turns])
            assert all("error" not in turn.info for turn in episode.turns)
            assert episode.termination == "submitted"


@needs_git
def test_the_teachers_recovery_continues_in_hermes():
    task, hermes = retry_task(), format_of("hermes")
    first = hermes.render(ToolCall("replace", ("2",), '    return config.get("retries", 3)'), CODING_TOOLS)
    env = CodingEnv(max_turns=8, use_git=False, tool_format="hermes")
    env.reset(task)
    policy = ScriptedTeacher(success_rate=0.0, mistake_rate=0.0, tool_format="hermes").recovery(task, first, env)
    assert policy is not None and [hermes.parse(a, CODING_TOOLS).name for a in policy.plan.actions] == [
        "replace", "test", "replace", "test", "submit"]
    episode = run_episode(CodingEnv(max_turns=8, use_git=False, tool_format="hermes"), task, policy)
    assert episode.grade.success and policy(episode.prompt, episode.turns * 2) == hermes.render(
        ToolCall("submit", (), ""), CODING_TOOLS)


def test_the_guessing_teacher_finds_every_number_in_hermes():
    hermes = format_of("hermes")
    teacher, env = BinarySearchTeacher(tool_format="hermes"), GuessEnv(max_turns=5, tool_format="hermes")
    assert env.reset(guess_tasks(1)[0]).endswith(hermes.describe(GUESS_TOOLS))
    # 1..16 halves to one number in at most 5 guesses (16 -> 8 -> 4 -> 2 -> 1)
    for task in guess_tasks(40, n=16, seed=1):
        episode = run_episode(env, task, teacher.policy(task))
        assert episode.grade.success and all(turn.action.startswith("<tool_call>\n") for turn in episode.turns)
    assert teacher.policy(guess_tasks(1)[0])("", []) == (
        '<tool_call>\n{"name": "guess", "arguments": {"n": 8}}\n</tool_call>')
    assert teacher.guessed("<call>guess 8</call>") is None  # another format is not a guess in this one


class ExactMatch:
    """A reasoning-gym dataset's scorer, in miniature: 1 for the reference answer, else 0."""

    def score_answer(self, answer: str, entry: dict[str, Any]) -> float:
        return float(answer == entry["answer"])


def test_the_reference_answer_teacher_answers_in_hermes():
    task = ReasoningGymTask("rg-t-0-00000", "t", 0, "What is 6 x 7?", "4 2\n1", {"answer": "4 2\n1"})
    env = ReasoningGymEnv(ExactMatch(), tool_format="hermes")
    prompt = env.reset(task)
    assert prompt.endswith('Give your final answer as <tool_call>\n{"name": "answer", "arguments": '
                           '{"answer": "ANSWER"}}\n</tool_call>.')
    action = ReferenceAnswerTeacher("hermes").policy(task)("", [])
    assert action == '<tool_call>\n{"name": "answer", "arguments": {"answer": "4 2\\n1"}}\n</tool_call>'
    assert run_episode(env, task, lambda prompt, turns: action).grade.success
    assert answer_text('<tool_call>{"name": "answer", "arguments": {"answer": "  42 "}}</tool_call>',
                       tool_format="hermes") == "42"
    with pytest.raises(ActionError, match="the answer is empty"):
        answer_text('<tool_call>{"name": "answer", "arguments": {}}</tool_call>', tool_format="hermes")
    assert answer_text("<call>answer 1  2</call>") == "1  2"  # the call format keeps the text as written


# -- tools in the prompt -------------------------------------------------------------------------

TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>Functions:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}<|end|>"
    "{% endif %}" + CHAT_TEMPLATE)
NO_SYSTEM_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' %}"
                      "{{ raise_exception('no system role') }}{% endif %}{% endfor %}" + CHAT_TEMPLATE)


def tokenizer_with(template: str):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def test_the_tiny_template_renders_no_tools_so_the_description_is_a_system_message():
    tokenizer, hermes = build_tiny_tokenizer(), format_of("hermes")
    chat = ChatFormat.of(tokenizer)
    assert not chat.renders_tools
    schemas = [spec.schema() for spec in CODING_TOOLS.values()]
    description = hermes.describe(CODING_TOOLS)
    text = tokenizer.decode(chat.prompt(tokenizer, "Fix it.", tools=schemas, system=description))
    assert text == f"<|system|>{description}<|end|><|user|>Fix it.<|end|><|assistant|>"
    assert all(f'"name": "{name}"' in text for name in CODING_TOOLS)
    with pytest.raises(ValueError, match="does not render tools; pass their description as `system`"):
        chat.prompt(tokenizer, "Fix it.", tools=schemas)


def test_a_template_that_renders_tools_gets_the_schemas():
    tokenizer = tokenizer_with(TOOLS_TEMPLATE)
    chat = ChatFormat.of(tokenizer)
    assert chat.renders_tools
    schemas = [spec.schema() for spec in CODING_TOOLS.values()]
    text = tokenizer.decode(chat.prompt(tokenizer, "Fix it.", tools=schemas, system="UNUSED"))
    assert text == ("<|system|>Functions: read replace edit test submit<|end|><|user|>Fix it.<|end|>"
                    "<|assistant|>")


def test_a_template_without_a_system_role_gets_the_description_as_the_first_paragraph():
    tokenizer = tokenizer_with(NO_SYSTEM_TEMPLATE)
    text = tokenizer.decode(prompt_tokens(tokenizer, "Fix it.", system="The tools."))
    assert text == "<|user|>The tools.\n\nFix it.<|end|><|assistant|>"


def test_prompt_tools_reads_the_environments_attributes():
    assert prompt_tools(CodingEnv(show_tools=False)) is None and prompt_tools(GuessEnv()) is None
    assert prompt_tools(CodingEnv(tool_format="call")) == PromptTools(None, describe_tools(CODING_TOOLS))
    shown = prompt_tools(CodingEnv(tool_format="json"))
    assert shown is not None and shown.description == format_of("json").describe(CODING_TOOLS)
    assert shown.schemas == [spec.schema() for spec in CODING_TOOLS.values()]
    assert prompt_tools(SimpleNamespace(show_tools=True, tools=RG_TOOLS)) == PromptTools(None, describe_tools(RG_TOOLS))


def rollout_prompt(factory, tokenizer) -> tuple[str, list[int]]:
    """(the first observation, the prompt tokens) of one scripted episode of `factory`'s env."""
    task = retry_task()
    [trajectory] = run_episodes(factory, [task], tokenizer,
                                scripted_actor(tokenizer, [lambda prompt, turns: "<call>submit</call>"]),
                                limits(max_turns=1))
    return trajectory.prompt, trajectory.token_ids[:trajectory.prompt_length]


def test_the_default_runs_prompt_tokens_are_the_template_of_the_observation_alone(tmp_path):
    """env.tool_format=call with env.show_tools off (the defaults): the prompt is the first
    observation as the one user message, exactly as before tool formats existed."""
    tokenizer = build_tiny_tokenizer()
    cfg = load_config(overrides=[f"run_dir={tmp_path}"])
    assert (cfg.env.tool_format, cfg.env.show_tools, cfg.env.show_file) == ("call", False, True)
    text, tokens = rollout_prompt(env_spec("coding").train_env(cfg), tokenizer)
    task = retry_task()
    assert text == (f"{task.prompt}\nThe function to fix is retry_count in retry.py. Files: retry.py, test_retry.py."
                    '\nretry.py\n1| def retry_count(config):\n2|     return config.get("retries") or 3')
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    assert tokens == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(tokens) == f"<|user|>{text}<|end|><|assistant|>"


@pytest.mark.parametrize("template, name", [(CHAT_TEMPLATE, "call"), (CHAT_TEMPLATE, "hermes"),
                                            (TOOLS_TEMPLATE, "hermes"), (TOOLS_TEMPLATE, "call")])
def test_with_show_tools_the_rollout_puts_the_tools_in_the_prompt(template, name):
    tokenizer = tokenizer_with(template)
    factory = CodingEnvFactory("strong", show_tools=True, tool_format=name)
    text, tokens = rollout_prompt(factory, tokenizer)
    prompt = tokenizer.decode(tokens)
    description = format_of(name).describe(CODING_TOOLS)
    if template == TOOLS_TEMPLATE and name == "hermes":  # the template's own tools section
        assert prompt == f"<|system|>Functions: read replace edit test submit<|end|><|user|>{text}<|end|><|assistant|>"
    else:  # the call format is keelrl's own, so a template's tools section would describe another syntax
        assert prompt == f"<|system|>{description}<|end|><|user|>{text}<|end|><|assistant|>"


# -- property tests, as tests/test_fuzz.py does for parse_action ---------------------------------

FAST, SLOW = 200, 10_000
EXAMPLES = [FAST, pytest.param(SLOW, marks=pytest.mark.slow)]
TOOLSETS = {"coding": CODING_TOOLS, "guess": GUESS_TOOLS, "answer": RG_TOOLS}


def run(examples: int, test: Any) -> None:
    settings(max_examples=examples, deadline=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(test)()


PIECES = ["<tool_call>", "</tool_call>", "<tool_call", "<call>", "</call>", "{", "}", "[", "]", ":", ",", '"', "\\",
          "\\u003c", "\\ud800", '"name"', '"arguments"', '"parameters"', '"read"', '"replace"', '"edit"', '"guess"',
          '"answer"', '"path"', '"line"', '"code"', '"change"', '"n"', "null", "true", "NaN", "Infinity", "1e999",
          "9" * 30, "-0", "0.5", '"retry.py"', '">>>"', "\n", " ", "\x00", "\ud800", "<|im_end|>"]
action_texts = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=6)), max_size=24).map("".join),
    st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
                 lambda inner: st.one_of(st.lists(inner, max_size=3),
                                         st.dictionaries(st.sampled_from(["name", "arguments", "path", "line", "code",
                                                                          "n", "answer", "x"]), inner, max_size=3)),
                 max_leaves=8).map(lambda value: json.dumps(value)).flatmap(
        lambda body: st.sampled_from([body, f"<tool_call>{body}</tool_call>", f"<tool_call>\n{body}\n</tool_call>"])),
)


@pytest.mark.parametrize("name", ["hermes", "json"])
@pytest.mark.parametrize("tools", list(TOOLSETS), ids=str)
@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_the_json_parsers_give_a_valid_call_or_an_error_observation(examples, tools, name):
    fmt, specs = format_of(name), TOOLSETS[tools]

    @given(text=action_texts, max_chars=st.sampled_from([200, 4000]))
    def check(text, max_chars):
        try:
            call = fmt.parse(text, specs, max_chars)
        except ActionError as error:
            assert str(error).startswith("error: ") and len(str(error).splitlines()[0]) > len("error: ")
            return
        spec = specs[call.name]
        assert len(text) <= max_chars and spec.min_args <= len(call.args) <= len(spec.params)
        assert spec.body != "none" or not call.body
        assert spec.body != "required" or call.body
        assert fmt.parse(fmt.render(call, specs), specs) == call

    run(examples, check)


@st.composite
def valid_calls(draw: Any, tools: dict[str, ToolSpec], name: str) -> ToolCall:
    spec = tools[draw(st.sampled_from(sorted(tools)))]
    if name == "call":  # whitespace-free words; nothing holding the tags
        text = st.text(min_size=1, max_size=8).filter(lambda w: w.split() == [w] and "<call>" not in w
                                                      and "</call>" not in w)
        body = st.text(max_size=60).filter(lambda b: "<call>" not in b and "</call>" not in b)
        most = min(spec.max_args, 4)
    else:  # any text: JSON escapes it
        numbers = st.integers(-10**6, 10**6).map(str)
        text = st.one_of(st.text(max_size=12), numbers, st.sampled_from(["03", "-0", "1_0", "+3", "true", "2.50"]))
        body = st.text(max_size=60)
        most = len(spec.params)
    args = tuple(draw(st.lists(text, min_size=spec.min_args, max_size=most)))
    if spec.body == "none":
        return ToolCall(spec.name, args, "")
    drawn = draw(body)
    if spec.body == "required" and not drawn:
        drawn = "x"
    return ToolCall(spec.name, args, drawn)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tools", list(TOOLSETS), ids=str)
@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_every_format_parses_what_it_renders(examples, tools, name):
    fmt, specs = format_of(name), TOOLSETS[tools]

    @given(data=st.data(), before=st.text(max_size=30).filter(lambda t: "<call>" not in t and "<tool_call>" not in t))
    def check(data, before):
        call = data.draw(valid_calls(specs, name))
        text = fmt.render(call, specs)
        assert fmt.parse(text, specs, max_chars=len(text)) == call
        if name != "json":  # reasoning before the call is ignored (json: the object must come first)
            assert fmt.parse(before + text, specs, max_chars=len(before + text)) == call

    run(examples, check)


def test_a_format_registered_by_a_user_reaches_the_environment():
    class Upper(ToolFormat):
        """The call format, shouted: a stand-in for a user's own format."""

        name, stop = "upper-test", ("</CALL>",)

        def parse(self, text, tools, max_chars=4000):
            return format_of("call").parse(text.lower(), tools, max_chars)

        def render(self, call, tools):
            return format_of("call").render(call, tools).upper()

        def usage(self, spec):
            return spec.usage.upper()

        def describe(self, tools):
            return describe_tools(tools).upper()

    register_format(Upper())
    try:
        env, task = GuessEnv(tool_format="upper-test"), dataclasses.replace(guess_tasks(1)[0], secret=8)
        assert env.reset(task).endswith("<CALL>GUESS N</CALL>  - GUESS THE NUMBER N")
        action = BinarySearchTeacher(tool_format="upper-test").policy(task)("", [])
        assert action == "<CALL>GUESS 8</CALL>" and env.step(action)[0] == "correct! found in 1 guesses."
    finally:
        FORMATS.unregister("upper-test")


@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_the_coding_env_answers_any_hermes_call_with_an_observation(examples):
    """Arguments the call format cannot write (white space, NUL bytes, 300 characters, a line
    number of 30 digits) reach the tools through JSON: an observation, never an exception, and no
    file changed by a rejected one. `test` runs the sandbox: skipped."""
    env, task, hermes = CodingEnv(use_git=False, max_turns=1000, tool_format="hermes"), retry_task(), HermesFormat()
    odd = st.sampled_from(["retry.py", " retry.py", "retry.py\n", "a\x00b", "../x.py", ".git/config", "a" * 300,
                           "9" * 30, " 2", "2 ", "-1", "0", "\ud800"])

    @given(call=st.one_of(valid_calls(CODING_TOOLS, "hermes"), st.builds(
        lambda name, args, body: ToolCall(name, args, body), st.sampled_from(["read", "replace", "edit"]),
        st.lists(odd, min_size=1, max_size=2).map(tuple), st.sampled_from(["", "x", "\ud800", "or 3\n>>>\nor 4"]))))
    def check(call):
        spec = CODING_TOOLS[call.name]
        if call.name == "test" or not spec.min_args <= len(call.args) <= len(spec.params) or (
                spec.body == "required" and not call.body) or (spec.body == "none" and call.body):
            return  # not a call of the tool
        env.reset(task)
        observation, done, info = env.step(hermes.render(call, CODING_TOOLS))
        assert isinstance(observation, str) and observation and done == (call.name == "submit")
        assert info.get("tool") == call.name or info["error"] == observation.splitlines()[0]
        if "error" in info:
            assert env.current_files() == task.files

    try:
        run(examples, check)
    finally:
        env.close()
