"""Bad input gets a clear error, never a crash or a silent wrong answer.

Property tests (hypothesis) over what users and policies feed keelrl:

(a) the tool-call parser, and the environments that use it, on arbitrary text: a valid call whose
    fields round-trip, or an error observation, nothing else;
(b) the task loader on corrupted JSONL: the error names the line and the field;
(c) config overrides with wrong types and unknown keys: the error names the key, and the nearest
    valid key when there is a close one;
(d) an environment whose reset or step raises: that episode ends with the error recorded, the
    others in the batch complete;
(e) a model path that is not a causal LM, and a tokenizer without a chat template.

Each property runs `FAST` examples in the default suite and 10,000 under `-m slow`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import tempfile
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import limits
from keelrl.config import KeelConfig, load_config
from keelrl.envs.base import CheckResult, Grade, VerifierError
from keelrl.envs.coding import CODING_TOOLS, CodingEnv
from keelrl.envs.guess import GUESS_TOOLS, GuessEnv, GuessTask
from keelrl.envs.tasks import TaskError, load_tasks, save_tasks
from keelrl.envs.tools import OPEN, STOP, ActionError, ToolCall, ToolSpec, parse_action
from keelrl.errors import ConfigError
from keelrl.policy.chat import ChatTemplateError
from keelrl.policy.model import NotCausalLMError, load_policy
from keelrl.policy.tiny import TinyModelSpec, build_tiny_tokenizer, save_tiny_default
from keelrl.rollout.agent_loop import run_episodes, scripted_actor
from task_fixtures import retry_task

FAST, SLOW = 200, 10_000
EXAMPLES = [FAST, pytest.param(SLOW, marks=pytest.mark.slow)]


def run(examples: int, test: Any) -> None:
    """Run the @given function `test` for `examples` examples."""
    settings(max_examples=examples, deadline=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(test)()


# ============================================================== (a) the tool-call parser

PIECES = [OPEN, STOP, "<call", "call>", "</call", "\n", " ", "\t", "\r\n", "\u2028", "\x85", "\x00", "\x1c",
          ">>>", "0", "1", "2", "-1", "٣", "1_0", "9" * 30, "retry.py", "test_retry.py", "../x.py", ".git/config",
          ".", "/etc/passwd", "a" * 300, "\ud800", "read", "replace", "edit", "test", "submit", "guess", "READ"]

action_texts = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=6)), max_size=16).map("".join),
)


def render(call: ToolCall) -> str:
    """A call as the text the module docstring describes; the newline before </call> adds nothing."""
    return f"{OPEN}{' '.join((call.name, *call.args))}\n{call.body}\n{STOP}"


def check_parse(text: str, tools: dict[str, ToolSpec], max_chars: int) -> ToolCall | None:
    """Parse `text`; assert the result is a valid, round-tripping call or an error observation."""
    try:
        call = parse_action(text, tools, max_chars)
    except ActionError as error:
        message = str(error)
        assert message.startswith("error: ") and len(message.splitlines()[0]) > len("error: ")
        return None
    spec = tools[call.name]
    assert len(text) <= max_chars and text.count(OPEN) == 1
    assert spec.min_args <= len(call.args) <= spec.max_args
    assert all(arg and arg.split() == [arg] for arg in call.args)  # whitespace-free words
    assert OPEN not in call.body and STOP not in call.body
    if spec.body == "none":
        assert not call.body.strip()
    if spec.body == "required":
        assert call.body
    start = text.index(OPEN) + len(OPEN)
    head = text[start:text.index(STOP, start)].split("\n", 1)[0]
    assert head.split() == [call.name, *call.args]  # the fields are the text's, not made up
    assert parse_action(render(call), tools, max_chars=len(render(call))) == call
    return call


@pytest.mark.parametrize("tools", [CODING_TOOLS, GUESS_TOOLS], ids=["coding", "guess"])
@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_parser_gives_a_valid_call_or_an_error_observation(examples, tools):
    @given(text=action_texts, max_chars=st.sampled_from([200, 4000]))
    def check(text, max_chars):
        check_parse(text, tools, max_chars)

    run(examples, check)


ARGS = ["retry.py", "test_retry.py", "../x.py", ".git/config", ".", "/etc/passwd", "a" * 300, "a\x00b", "\ud800",
        "0", "1", "2", "-1", "99999", "1_0"]
words = st.one_of(st.sampled_from(ARGS), st.text(min_size=1, max_size=8)).filter(
    lambda word: word.split() == [word] and OPEN not in word and STOP not in word)
free_text = st.text(max_size=60).filter(lambda text: OPEN not in text)


@st.composite
def valid_calls(draw: Any, tools: dict[str, ToolSpec]) -> ToolCall:
    spec = tools[draw(st.sampled_from(sorted(tools)))]
    args = tuple(draw(st.lists(words, min_size=spec.min_args, max_size=spec.max_args)))
    if spec.body == "none":
        body = ""
    else:
        body = draw(st.text(min_size=1 if spec.body == "required" else 0, max_size=60).filter(
            lambda body: OPEN not in body and STOP not in body))
    return ToolCall(spec.name, args, body)


@pytest.mark.parametrize("tools", [CODING_TOOLS, GUESS_TOOLS], ids=["coding", "guess"])
@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_parser_accepts_every_valid_call_amid_reasoning_and_trailing_text(examples, tools):
    """The other half of (a): a parser that rejected everything would pass the test above."""
    @given(data=st.data(), before=free_text, after=free_text)
    def check(data, before, after):
        call = data.draw(valid_calls(tools))
        text = before + render(call) + after
        assert parse_action(text, tools, max_chars=len(text)) == call

    run(examples, check)


@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_coding_env_step_answers_any_text_with_an_observation(examples):
    """CodingEnv.step on arbitrary text: (str, bool, dict), an error observation that changes no
    file when the action is malformed; never an exception (a NUL byte or a 300-character path
    once raised ValueError / OSError from pathlib). `test` runs the sandbox (70 ms): skipped."""
    env, task = CodingEnv(use_git=False, max_turns=1000), retry_task()

    @given(text=st.one_of(action_texts, valid_calls(CODING_TOOLS).map(render)))
    def check(text):
        env.reset(task)
        call = check_parse(text, CODING_TOOLS, env.max_action_chars)
        if call is not None and call.name == "test":
            return
        observation, done, info = env.step(text)
        assert isinstance(observation, str) and observation and isinstance(info, dict)
        assert done == (call is not None and call.name == "submit")
        if call is None:
            assert info["error"] == observation.splitlines()[0] and env.current_files() == task.files
        else:
            assert info.get("tool") == call.name or info["error"].startswith("error: ")
        for name in task.files:
            if (env.workdir / name).exists():
                (env.workdir / name).read_bytes().decode("utf-8")  # files stay UTF-8 (strict)

    try:
        run(examples, check)
    finally:
        env.close()


@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_guess_env_step_answers_any_text_with_an_observation(examples):
    env, task = GuessEnv(max_turns=1000), GuessTask("g", secret=7, n=16)

    @given(text=st.one_of(action_texts, valid_calls(GUESS_TOOLS).map(render)))
    def check(text):
        env.reset(task)
        call = check_parse(text, GUESS_TOOLS, 200)
        observation, done, info = env.step(text)
        assert isinstance(observation, str) and observation
        if call is None:
            assert info["error"] == observation.splitlines()[0] and not done
        elif info.get("tool") == "guess":
            assert observation in ("higher", "lower") or (done and observation.startswith("correct"))
        else:
            assert info["error"].startswith("error: ") and not done

    run(examples, check)


# ============================================================== (b) the task loader

TASK_FIELDS = ["id", "kind", "prompt", "files", "entry_file", "entry_function", "test_file", "visible_tests",
               "hidden_checks", "reference_fix", "wrong_fix", "brittle_phrase"]
OPTIONAL = {"wrong_fix", "brittle_phrase"}
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True))
non_strings = st.one_of(scalars, st.lists(st.integers(), max_size=2),
                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
non_lists = st.one_of(scalars, st.text(max_size=5), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
non_dicts = st.one_of(scalars, st.text(max_size=5), st.lists(st.integers(), max_size=2))
bad_paths = st.sampled_from(["", "/abs.py", "../up.py", "a/../../b.py", ".git/config", ".", "./.git/x", "a\x00b.py"])
not_identifiers = st.text(max_size=8).filter(lambda text: not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text))


def base_lines(count: int) -> list[dict[str, Any]]:
    return [{**json.loads(retry_task().to_json()), "id": f"retry_count_{i}"} for i in range(count)]


@st.composite
def bad_check(draw: Any, check: dict[str, Any]) -> Any:
    """A check (a JSON object of a task's visible_tests or hidden_checks) with one bad part."""
    field = draw(st.sampled_from(["object", "name", "args", "raises", "key", "weight", "unknown"]))
    if field == "object":
        return draw(non_dicts)
    if field == "unknown":
        return {**check, draw(st.text(min_size=1, max_size=5).filter(
            lambda key: key not in {"name", "args", "expected", "raises", "key", "weight"})): 1}
    bad = {"name": st.one_of(non_strings, not_identifiers), "args": non_lists,
           "raises": st.one_of(not_identifiers.filter(bool), st.booleans(), st.integers(), st.lists(st.integers())),
           "key": st.one_of(st.none(), st.integers(), st.text(max_size=3)),
           "weight": st.one_of(st.booleans(), st.floats(max_value=0.0), st.just(math.inf), st.just(math.nan),
                               st.text(max_size=3), st.none(), st.integers(max_value=0))}[field]
    return {**check, field: draw(bad)}


@st.composite
def corrupted_field(draw: Any, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the field named in the error, the task's JSON object with that field made invalid)."""
    task = json.loads(json.dumps(task))
    files = task["files"]
    how = draw(st.sampled_from(["bad value", "missing", "unknown"]))
    if how == "missing":
        field = draw(st.sampled_from([name for name in TASK_FIELDS if name not in OPTIONAL]))
        del task[field]
        return field, task
    if how == "unknown":
        field = draw(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8).filter(
            lambda name: name not in TASK_FIELDS))
        task[field] = draw(scalars)
        return field, task
    field = draw(st.sampled_from(TASK_FIELDS))
    if field in ("id", "kind", "prompt"):
        value = draw(st.one_of(non_strings, st.just("")))
    elif field in ("entry_file", "test_file"):
        value = draw(st.one_of(non_strings, st.just(""), bad_paths, st.text(max_size=8)).filter(
            lambda value: not isinstance(value, str) or value not in files))
    elif field == "entry_function":
        value = draw(st.one_of(non_strings, not_identifiers, st.just("retry_count\n")))
    elif field == "brittle_phrase":
        value = draw(non_strings)
    elif field in ("files", "reference_fix", "wrong_fix"):
        options = [non_dicts, bad_paths.map(lambda path: {**task[field], path: "x = 1\n"}),
                   non_strings.map(lambda text: {**task[field], "extra.py": text})]
        if field == "reference_fix":
            options += [st.just({}), st.just({task["test_file"]: "def test_ok(): pass\n"})]
        value = draw(st.one_of(*options))
    else:  # visible_tests, hidden_checks
        checks = task[field]
        index = draw(st.integers(0, len(checks) - 1))
        options = [non_lists, bad_check(checks[index]).map(lambda check: [*checks[:index], check, *checks[index + 1:]]),
                   st.just([*checks, checks[index]])]  # a duplicate name
        if field == "hidden_checks":
            options.append(st.just([]))
        value = draw(st.one_of(*options))
    task[field] = value
    return field, task


def names_line(message: str, path: Path, line: int) -> bool:
    """True when `message` starts with `path:line` followed by a separator (":12" is not ":1")."""
    return re.match(re.escape(f"{path}:{line}") + r"[ .:]", message) is not None


@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_a_corrupted_field_is_an_error_naming_its_line_and_field(examples):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tasks.jsonl"

        @given(count=st.integers(1, 4), data=st.data())
        def check(count, data):
            lines = base_lines(count)
            bad_line = data.draw(st.integers(0, count - 1))
            field, lines[bad_line] = data.draw(corrupted_field(lines[bad_line]))
            path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
            with pytest.raises(TaskError) as raised:
                load_tasks(path)
            message = str(raised.value)
            assert names_line(message, path, bad_line + 1), message
            assert field in message, message

        run(examples, check)


@st.composite
def mutated_bytes(draw: Any, line: bytes) -> bytes:
    """`line` with a slice deleted, bytes inserted or replaced, or truncated."""
    start = draw(st.integers(0, len(line)))
    end = draw(st.integers(start, min(len(line), start + 40)))
    inserted = draw(st.one_of(st.binary(max_size=8), st.text(max_size=8).map(lambda t: t.encode("utf-8", "surrogatepass")),
                              st.sampled_from([b'"', b"{", b"}", b",", b":", b"\\", b"\n", b"\xff", b"NaN", b"[" * 3000,
                                               b"1" * 5000, "\u2028".encode()])))
    how = draw(st.sampled_from(["delete", "insert", "replace", "truncate"]))
    if how == "delete":
        return line[:start] + line[end:]
    if how == "insert":
        return line[:start] + inserted + line[start:]
    if how == "replace":
        return line[:start] + inserted + line[end:]
    return line[:start]


@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_damaged_bytes_load_or_fail_naming_the_damaged_line(examples):
    """A damaged line loads (the damage kept it valid) or fails with a TaskError naming it; no
    other exception (not UTF-8, nesting too deep, a 5000-digit int each used to escape, and a raw
    U+2028 inside a string split the line in two)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tasks.jsonl"

        @given(count=st.integers(1, 4), data=st.data())
        def check(count, data):
            originals = [json.dumps(line).encode() for line in base_lines(count)]
            bad_line = data.draw(st.integers(0, count - 1))
            damaged = data.draw(mutated_bytes(originals[bad_line]))
            lines = [*originals[:bad_line], damaged, *originals[bad_line + 1:]]
            path.write_bytes(b"".join(line + b"\n" for line in lines))
            try:
                tasks = load_tasks(path)
            except TaskError as error:
                message = str(error)
                found = re.match(re.escape(str(path)) + r":(\d+)[ .:]", message)
                assert found, message
                line = int(found.group(1))
                if "duplicate task id" in message:
                    assert line > bad_line + 1 or line == bad_line + 1 + damaged.count(b"\n")
                else:  # the damaged line, or a piece of it when the damage inserted a newline
                    assert bad_line + 1 <= line <= bad_line + 1 + damaged.count(b"\n"), message
                return
            untouched = [json.loads(line)["id"] for index, line in enumerate(originals) if index != bad_line]
            loaded = {task.id: task for task in tasks}
            assert all(task_id in loaded for task_id in untouched)
            assert len(tasks) in (count, count - 1)  # the damaged line may have become blank
            save_tasks(tasks, path)
            assert load_tasks(path) == tasks

        run(examples, check)


# ============================================================== (c) config overrides

def config_fields(cls: type = KeelConfig, prefix: str = "") -> dict[str, Any]:
    """{dotted key: annotation} of every field, sections included."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        out[key] = hints[field.name]
        if dataclasses.is_dataclass(hints[field.name]):
            out.update(config_fields(hints[field.name], f"{key}."))
    return out


FIELDS = config_fields()
LEAVES = sorted(key for key, tp in FIELDS.items() if not dataclasses.is_dataclass(tp))


def _accepts(tp: Any, value: Any) -> bool:
    """Whether `value` is of annotation `tp` the way config accepts it (int for float; not bool for int)."""
    if typing.get_origin(tp) in (typing.Union, type(int | None)):
        return any(_accepts(option, value) for option in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    if tp is float:
        if isinstance(value, str):
            try:
                float(value)
            except ValueError:
                return False
            return True
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, (list, tuple)) and all(_accepts(item, x) for x in value)
    return isinstance(value, tp)


def _is_nan(value: Any) -> bool:
    try:
        return not isinstance(value, bool) and math.isnan(float(value))
    except (TypeError, ValueError):
        return False


yaml_values = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=False),
    st.text(max_size=10), st.lists(st.one_of(st.integers(), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.text(min_size=1, max_size=3), st.integers(), min_size=1, max_size=2))


def yaml_scalar(value: Any) -> str:
    """`value` written so that the override parser (yaml.safe_load) reads back exactly it."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_a_wrongly_typed_override_is_an_error_naming_its_key(examples):
    @given(key=st.sampled_from(sorted(FIELDS)), value=yaml_values)
    def check(key, value):
        raw = yaml_scalar(value)
        parsed = yaml.safe_load(raw)
        if _accepts(FIELDS[key], parsed) and not _is_nan(parsed):
            return  # the right type: range checks are the next test's (NaN is never right)
        with pytest.raises(ConfigError) as raised:
            load_config(overrides=[f"{key}={raw}"])
        error = raised.value
        assert error.field == key or error.field.startswith(f"{key}["), (key, raw, str(error))
        assert str(error).startswith(f"{error.field}: "), str(error)

    run(examples, check)


@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_any_override_lands_or_fails_with_a_config_error(examples):
    """Any value for a known key: it lands in the config exactly as given (converted to float where
    declared), or a ConfigError in that key's section says why; NaN never lands."""
    @given(key=st.sampled_from(LEAVES), value=st.one_of(yaml_values, st.text(max_size=30)), raw=st.booleans())
    def check(key, value, raw):
        override = f"{key}={value if raw and isinstance(value, str) else yaml_scalar(value)}"
        try:
            cfg = load_config(overrides=[override])
        except ConfigError as error:  # about the section the override touched (a cross-field rule may name a sibling)
            assert error.field.split(".")[0] == key.split(".")[0], (override, str(error))
            assert str(error).startswith(f"{error.field}: "), str(error)
            return
        parsed = yaml.safe_load(override.partition("=")[2]) if override.partition("=")[2] != "" else ""
        landed: Any = cfg
        for part in key.split("."):
            landed = getattr(landed, part)
        if isinstance(landed, float):
            assert not math.isnan(landed)
            assert landed == float(parsed)
        else:
            assert landed == parsed and type(landed) is type(parsed) or (isinstance(landed, list) and landed == list(parsed))

    run(examples, check)


@st.composite
def typos(draw: Any) -> tuple[str, str]:
    """(a valid dotted key, the same key with one edit in one of its parts) - not itself valid."""
    key = draw(st.sampled_from(sorted(FIELDS)))
    parts = key.split(".")
    index = draw(st.integers(0, len(parts) - 1))
    part = parts[index]
    position = draw(st.integers(0, len(part)))
    letter = draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz_"))
    edits = {"delete": part[:position] + part[position + 1:], "insert": part[:position] + letter + part[position:],
             "replace": part[:position] + letter + part[position + 1:], "suffix": part + "_rate"}
    typo = draw(st.sampled_from(sorted(edits)).map(edits.get).filter(lambda typo: typo and typo != part))
    wrong = ".".join([*parts[:index], typo, *parts[index + 1:]])
    return key, wrong


@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_an_unknown_key_is_an_error_naming_it_and_the_nearest_valid_key(examples):
    @given(case=typos())
    def check(case):
        key, wrong = case
        parts, wrong_parts = key.split("."), wrong.split(".")
        first_bad = next(i for i, (a, b) in enumerate(zip(parts, wrong_parts)) if a != b)
        bad_key = ".".join(wrong_parts[:first_bad + 1])  # where the error is: trian.lr -> 'trian'
        if bad_key in FIELDS:
            return  # the edit made another valid key
        with pytest.raises(ConfigError) as raised:
            load_config(overrides=[f"{wrong}=1"])
        message = str(raised.value)
        assert raised.value.field == bad_key and f"unknown key {bad_key!r}" in message, message
        typed, meant = wrong_parts[first_bad], parts[first_bad]
        suggested = re.findall(r"'([^']+)'", message.split("did you mean ", 1)[1].split("?")[0]) \
            if "did you mean" in message else []
        assert all(suggestion in FIELDS for suggestion in suggested), message
        if len(meant) >= 4:  # one edit of a name this long is close enough for difflib (ratio >= 0.6)
            assert suggested, message
            # as close as the key meant (difflib's order of arguments: the ratio is not symmetric)
            ratio = difflib.SequenceMatcher(None, suggested[0].split(".")[-1], typed).ratio()
            assert ratio >= difflib.SequenceMatcher(None, meant, typed).ratio() - 1e-9, message

    run(examples, check)


@pytest.mark.parametrize("override, key, nearest", [
    ("train.lr_rate=1e-4", "train.lr_rate", "'optim.lr' or 'warm_start.lr' or 'prm.lr'"),
    ("lr=1e-4", "lr", "'optim.lr' or 'warm_start.lr' or 'prm.lr'"),
    ("train.eps_high=0.3", "train.eps_high", "'algo.eps_high'"),
    ("trian.steps=3", "trian", "'train'"),
    ("env.max_turn=3", "env.max_turn", "'env.max_turns'"),
])
def test_unknown_keys_suggest_the_nearest_valid_key(override, key, nearest):
    with pytest.raises(ConfigError) as raised:
        load_config(overrides=[override])
    assert raised.value.field == key
    assert f"unknown key {key!r}; did you mean {nearest}?" in str(raised.value)


@pytest.mark.parametrize("override, key", [
    ("seed=" + "1" * 5000, "seed"),  # yaml raised ValueError: more than 4300 digits
    ("run_dir=" + "[" * 3000 + "]" * 3000, "run_dir"),  # yaml raised RecursionError
    ("optim.lr=.nan", "optim.lr"), ("monitor.entropy_floor=.nan", "monitor.entropy_floor"),
    ("optim.lr=.inf", "optim.lr"), ("eval.temperature=-1", "eval.temperature"),
    ("warm_start.mistake_rate=2", "warm_start.mistake_rate"),
])
def test_values_no_check_caught_before_are_errors_naming_their_key(override, key):
    with pytest.raises(ConfigError) as raised:
        load_config(overrides=[override])
    assert raised.value.field == key


# ============================================================== (d) an environment that raises

class ScriptedFailures:
    """An env that submits on turn 3, failing as its task says: 'step@2' raises in the second step,
    'junk@1' returns a 2-tuple from the first, 'reset' raises in reset; 'ok' never fails."""

    max_turns = 5
    closed: list[str] = []

    def reset(self, task: str) -> str:
        self.task, self.turns = task, 0
        if task.startswith("reset"):
            raise ConnectionError("sandbox pool unavailable")
        return f"task {task}"

    def step(self, action: str) -> Any:
        self.turns += 1
        kind, _, at = self.task.partition("@")
        if kind.startswith("step") and self.turns == int(at):
            raise ValueError(f"tool server went away on turn {self.turns}")
        if kind.startswith("junk") and self.turns == int(at):
            return "observation", False
        done = self.turns >= 3
        return f"observation {self.turns}", done, ({"termination": "submitted"} if done else {})

    def grade(self) -> Grade:
        return Grade(reward=1.0, checks=(CheckResult("ran", True),))

    def close(self) -> None:
        ScriptedFailures.closed.append(self.task)


@pytest.fixture(scope="module")
def byte_tokenizer():
    return build_tiny_tokenizer()


def run_batch(tokenizer: Any, tasks: list[str]) -> list[Any]:
    ScriptedFailures.closed = []
    policies = [lambda prompt, turns: "<call>submit</call>"] * len(tasks)
    return run_episodes(ScriptedFailures, tasks, tokenizer, scripted_actor(tokenizer, policies),
                        limits(max_turns=5, max_context_tokens=4096, max_new_tokens=32, env_threads=2))


def test_an_env_that_raises_ends_its_episode_with_the_error_and_the_batch_completes(byte_tokenizer):
    tasks = ["ok", "step@2", "ok-too", "junk@1", "reset"]
    ok, raised, ok_too, junk, reset = run_batch(byte_tokenizer, tasks)
    for good in (ok, ok_too):
        assert (good.termination, good.reward, good.success, good.error) == ("submitted", 1.0, True, "")
        assert len(good.actions) == len(good.observations) == 3
    assert raised.termination == "env_error"
    assert "env.step raised ValueError: tool server went away on turn 2" in raised.error
    assert "test_fuzz.py" in raised.error and "in step" in raised.error  # where it was raised
    assert len(raised.actions) == 2 and raised.observations == ["observation 1"]
    assert junk.termination == "env_error" and "step must return (observation: str, done: bool, info: dict)" in junk.error
    assert reset.termination == "env_error" and "env.reset raised ConnectionError: sandbox pool unavailable" in reset.error
    assert reset.token_ids == [] and reset.actions == []
    for failed in (raised, junk, reset):  # no grade: never a made-up reward of 0
        assert math.isnan(failed.reward) and math.isnan(failed.partial) and not failed.success and not failed.checks
        transcript = failed.to_text(byte_tokenizer)
        assert f"ENVIRONMENT ERROR: {failed.error}" in transcript
        assert transcript.count("ACTION: ") == len(failed.actions)  # the action that broke the env too
    assert sorted(ScriptedFailures.closed) == sorted(tasks)  # failed envs are closed too


@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzz_env_failures_end_only_their_own_episodes(examples, byte_tokenizer):
    failure = st.one_of(st.just("ok"), st.just("reset"), st.integers(1, 3).map(lambda at: f"step@{at}"),
                        st.integers(1, 3).map(lambda at: f"junk@{at}"))

    @given(kinds=st.lists(failure, min_size=1, max_size=6))
    def check(kinds):
        tasks = [f"{kind.split('@')[0]}{i}@{kind.partition('@')[2]}" if "@" in kind else f"{kind}{i}"
                 for i, kind in enumerate(kinds)]
        trajectories = run_batch(byte_tokenizer, tasks)
        assert [t.task_id for t in trajectories] == tasks
        for kind, trajectory in zip(kinds, trajectories):
            if kind == "ok":
                assert trajectory.termination == "submitted" and trajectory.reward == 1.0 and not trajectory.error
                continue
            assert trajectory.termination == "env_error" and math.isnan(trajectory.reward)
            at = 0 if kind == "reset" else int(kind.partition("@")[2])
            assert len(trajectory.actions) == at and len(trajectory.observations) == max(0, at - 1)
            expected = {"reset": "env.reset raised ConnectionError", "step": "env.step raised ValueError",
                        "junk": "env.step raised TypeError: step must return"}[kind.split("@")[0]]
            assert trajectory.error.startswith(expected), trajectory.error
        assert sorted(ScriptedFailures.closed) == sorted(tasks)

    run(examples, check)


def test_a_grade_that_raises_stops_the_run(byte_tokenizer):
    """The verifier failing is not the episode's outcome: no reward is made up, the run stops."""
    class BrokenVerifier(ScriptedFailures):
        def grade(self) -> Grade:
            raise VerifierError("the sandbox cannot start")

    with pytest.raises(VerifierError, match="cannot start"):
        run_episodes(BrokenVerifier, ["ok"], byte_tokenizer,
                     scripted_actor(byte_tokenizer, [lambda prompt, turns: "<call>submit</call>"]),
                     limits(max_turns=5, max_context_tokens=4096, max_new_tokens=32))


# ============================================================== (e) models and tokenizers

def save_encoder(path: Path, with_architectures: bool = True) -> Path:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=264, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)
    BertModel(config).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    if not with_architectures:
        saved = json.loads((path / "config.json").read_text())
        del saved["architectures"]
        (path / "config.json").write_text(json.dumps(saved))
    return path


def test_an_encoder_model_path_says_it_is_not_a_causal_lm(tmp_path):
    """transformers alone would load BertModel as a BertLMHeadModel with a random head."""
    save_encoder(tmp_path)
    with pytest.raises(NotCausalLMError) as raised:
        load_policy(str(tmp_path), "cpu")
    message = str(raised.value)
    assert "holds a BertModel (model_type 'bert'), not a causal language model" in message
    assert "ForCausalLM" in message and "model.path" in message


def test_an_encoder_without_architectures_fails_on_its_missing_head(tmp_path):
    save_encoder(tmp_path, with_architectures=False)
    with pytest.raises(NotCausalLMError, match=r"no weights for \d+ parameters of BertLMHeadModel .*cls\.predictions"):
        load_policy(str(tmp_path), "cpu")


def test_an_encoder_decoder_model_path_says_it_is_not_a_causal_lm(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(T5Config(vocab_size=264, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                        num_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(NotCausalLMError, match="holds a T5ForConditionalGeneration .* not a causal language model"):
        load_policy(str(tmp_path), "cpu")


SMALL = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, max_positions=256)


def test_a_tokenizer_without_a_chat_template_fails_at_load_saying_how_to_fix_it(tmp_path):
    save_tiny_default(tmp_path, SMALL)
    model, tokenizer = load_policy(str(tmp_path), "cpu")  # the tiny model has one
    assert type(model).__name__ == "Qwen2ForCausalLM" and tokenizer.chat_template
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError) as raised:
        load_policy(str(tmp_path), "cpu")
    message = str(raised.value)
    assert f"tokenizer {str(tmp_path)!r} has no chat template" in message
    assert "model.path" in message and "instruct" in message and "chat_template" in message
