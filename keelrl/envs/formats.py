"""Tool-call formats, registered by name: how an action's text holds one tool call (`env.tool_format`).

A format turns text into a `ToolCall` and back, for tools declared once as `ToolSpec`s
(keelrl.envs.tools):

    call     keelrl's own:   <call>replace 2
                             return 3</call>
    hermes   Hermes / Qwen:  <tool_call>
                             {"name": "replace", "arguments": {"line": 2, "code": "return 3"}}
                             </tool_call>
    json     a bare object:  {"name": "replace", "arguments": {"line": 2, "code": "return 3"}}

Each registered format has a `name`; `stop`, the sampler's stop strings (the decoder also stops
on the chat template's end-of-turn token); `parse(text, tools, max_chars)`, the `ToolCall` or
`ActionError`, whose str is the error observation (what was wrong, then the accepted form);
`render(call, tools)`, the text a scripted teacher writes (parse(render(call)) == call for every
valid call); `describe(tools)`, the tools as a system prompt shows them; `accepted(tools)`, the
shorter list error observations end with; `usage(spec)`, one tool's form; and `native`: whether
chat templates that render tools describe this syntax (hermes, json), so that the tools' schemas
can go through the template (`prompt_tools`).

The call format is `parse_action`, unchanged. In the JSON formats the arguments are an object
keyed by the ToolSpec's `params` (the positional arguments, in order) and `body_param` (the
body); a string, a number or a boolean is accepted for any of them (a number becomes its JSON
text: `"line": 2` is the argument "2"), null counts as absent, and an absent optional body is the
empty body. Rejected, each with its own error observation: no call, an unclosed block (hermes),
more than one call, invalid JSON (with the line and column), duplicate keys, a key other than
name and arguments, arguments that are not an object, an unknown tool, an unknown or missing
parameter, an array or object where a value is expected, a non-finite number, a positional
argument given without the ones before it, an empty required body.

Text around the call: hermes, like call, ignores text before the block (the model's reasoning)
and after it (generation stops at `</tool_call>`). json takes the action to be the object alone:
text before it is rejected, so the policy learns the bare form; text after it is ignored (the
decoder stops on the end-of-turn token, whose text ends the action), unless it starts another
object, which is a second call. json also accepts "parameters" in place of "arguments", the key
Llama 3's template asks for.

What a format does NOT do: check an argument's type against the schema (the environment does:
`replace` says when LINE is not a line number), or make a chat template's own instructions match
it: a template that renders tools describes its model's native syntax, so pick the format the
model was trained on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from keelrl.envs.tools import OPEN, STOP, ActionError, ToolCall, ToolSpec, describe_tools, parse_action
from keelrl.registry import Registry

CALL_SHAPE = '{"name": <function-name>, "arguments": <args-json-object>}'


class ToolFormat:
    """One way of writing a tool call in an action's text (see the module docstring)."""

    name: str = ""
    stop: tuple[str, ...] = ()
    """Stop strings for the sampler: the text that ends a call."""
    native: bool = False
    """Whether chat templates that render tools (apply_chat_template(tools=...)) describe this syntax."""
    summary: str = ""

    def parse(self, text: str, tools: Mapping[str, ToolSpec], max_chars: int = 4000) -> ToolCall:
        """The one tool call in `text`, or ActionError whose str is the error observation."""
        raise NotImplementedError

    def render(self, call: ToolCall, tools: Mapping[str, ToolSpec]) -> str:
        """The action text of `call`; ValueError for a call that is not valid for its tool."""
        raise NotImplementedError

    def usage(self, spec: ToolSpec) -> str:
        """One tool's call in this format, with placeholders for its arguments."""
        raise NotImplementedError

    def describe(self, tools: Mapping[str, ToolSpec]) -> str:
        """The tools as a system prompt shows them (for templates that do not render tools)."""
        raise NotImplementedError

    def accepted(self, tools: Mapping[str, ToolSpec]) -> str:
        """The tool list error observations end with: one usage line and description per tool."""
        lines = ["Act with exactly one tool call per turn:"]
        lines += [f"  {self.usage(spec)}  - {spec.description}" for spec in tools.values()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


FORMATS: Registry[ToolFormat] = Registry("tool-call format")
"""Registered tool-call formats by name (`register_format`), in registration order."""


def register_format(fmt: ToolFormat) -> ToolFormat:
    """Register `fmt` under `fmt.name` (a duplicate name raises ValueError); returns it."""
    return FORMATS.add(fmt.name, fmt, summary=fmt.summary)


def format_of(name: str) -> ToolFormat:
    """The format registered as `name`; UnknownNameError (a ConfigError) listing the valid names."""
    return FORMATS.get(name)


def _check_call(call: ToolCall, spec: ToolSpec) -> None:
    """ValueError unless `call` is a valid call of `spec` (argument count and body)."""
    problem = ""
    if not spec.min_args <= len(call.args) <= spec.max_args:
        problem = f"{len(call.args)} arguments, not {spec.min_args} to {spec.max_args}"
    elif spec.body == "none" and call.body:
        problem = "a body, which the tool does not take"
    elif spec.body == "required" and not call.body:
        problem = "no body, which the tool requires"
    if problem:
        raise ValueError(f"cannot render {call!r}: it has {problem}")


# ------------------------------------------------------------------------------ call

class CallFormat(ToolFormat):
    """keelrl's own `<call>NAME ARGS\\nBODY</call>` (keelrl.envs.tools)."""

    name, stop, native = "call", (STOP,), False
    summary = "<call>NAME ARGS\\nBODY</call>, keelrl's own"

    def parse(self, text: str, tools: Mapping[str, ToolSpec], max_chars: int = 4000) -> ToolCall:
        return parse_action(text, tools, max_chars)

    def render(self, call: ToolCall, tools: Mapping[str, ToolSpec]) -> str:
        """`<call>NAME ARGS</call>`; a tool that takes a body gets it on the lines after, even an
        empty one (`<call>replace 3\\n\\n</call>` deletes line 3), then a newline before </call>."""
        spec = tools[call.name]
        _check_call(call, spec)
        words = (call.name, *call.args)
        if any(not word or word.split() != [word] for word in words) or any(
                OPEN in piece or STOP in piece for piece in (*words, call.body)):
            raise ValueError(f"cannot render {call!r} in the call format: the name and arguments must be words "
                             f"without white space, and nothing may hold {OPEN} or {STOP}")
        head = " ".join(words)
        return f"{OPEN}{head}\n{call.body}\n{STOP}" if spec.body != "none" else f"{OPEN}{head}{STOP}"

    def usage(self, spec: ToolSpec) -> str:
        return spec.usage

    def describe(self, tools: Mapping[str, ToolSpec]) -> str:
        return describe_tools(tools)

    def accepted(self, tools: Mapping[str, ToolSpec]) -> str:
        return describe_tools(tools)


# ------------------------------------------------------------------------------ the JSON formats

class _Duplicate(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; _Duplicate for a key given twice (json would keep the last)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _Duplicate(key)
        found[key] = value
    return found


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_no_constant)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", type(None): "null"}.get(type(value), type(value).__name__)


class JsonCallFormat(ToolFormat):
    """What the JSON formats share: the object {"name": ..., "arguments": {...}} and its mapping
    onto ToolCall through the ToolSpec's named parameters (the module docstring)."""

    argument_keys: tuple[str, ...] = ("arguments",)
    """The keys the arguments may come under (json also takes Llama 3's "parameters")."""

    def decode(self, text: str, tools: Mapping[str, ToolSpec], where: str) -> tuple[Any, int]:
        """(the JSON value at the start of `text`, where it ends); ActionError naming the line and column."""
        try:
            return _DECODER.raw_decode(text)
        except _Duplicate as error:
            problem = f"the key {error.args[0]!r} appears twice in one object"
        except json.JSONDecodeError as error:
            problem = f"invalid JSON {where}: {error.msg} (line {error.lineno}, column {error.colno})"
        except RecursionError:
            problem = f"invalid JSON {where}: nested too deeply"
        except ValueError as error:  # NaN, Infinity, an integer of more digits than Python converts
            problem = f"invalid JSON {where}: {error}"
        raise ActionError(f"error: {problem}.\n{self.accepted(tools)}")

    def call_of(self, value: Any, tools: Mapping[str, ToolSpec]) -> ToolCall:
        """The ToolCall a decoded call object stands for, or ActionError."""
        listing = self.accepted(tools)
        if not isinstance(value, dict):
            raise ActionError(f"error: the tool call must be a JSON object {CALL_SHAPE}, got {_kind(value)}.\n"
                              f"{listing}")
        unknown = [key for key in value if key not in ("name", *self.argument_keys)]
        if unknown:
            raise ActionError(f"error: unknown key {unknown[0]!r} in the tool call; it has only \"name\" and "
                              f"\"arguments\".\n{listing}")
        name = value.get("name")
        if not isinstance(name, str):
            raise ActionError(f"error: the tool call's \"name\" must be a string naming a tool, got {_kind(name)}.\n"
                              f"{listing}")
        spec = tools.get(name)
        if spec is None:
            raise ActionError(f"error: unknown tool {name!r}; the tools are {', '.join(tools)}.\n{listing}")
        given = [key for key in self.argument_keys if key in value]
        if len(given) > 1:
            raise ActionError(f"error: give the arguments once, under \"arguments\"; usage: {self.usage(spec)}")
        arguments = value[given[0]] if given else {}
        if not isinstance(arguments, dict):
            raise ActionError(f"error: the arguments of {name} must be a JSON object, got {_kind(arguments)}; "
                              f"usage: {self.usage(spec)}")
        return _call_from_arguments(spec, arguments, self.usage(spec))

    def object_of(self, call: ToolCall, tools: Mapping[str, ToolSpec]) -> dict[str, Any]:
        """The call object of a valid `call` (numbers for integer, number and boolean parameters
        where the argument is such a value written canonically, so that it parses back the same)."""
        spec = tools[call.name]
        _check_call(call, spec)
        arguments = {key: _typed(spec.param_type(key), value) for key, value in spec.arguments(call).items()}
        return {"name": call.name, "arguments": arguments}

    def usage(self, spec: ToolSpec) -> str:
        required = spec.required()
        fields = []
        for name in spec.param_names():
            optional = "" if name in required else ", optional"
            fields.append(f'"{name}": <{spec.param_type(name)}{optional}>')
        return f'{{"name": "{spec.name}", "arguments": {{{", ".join(fields)}}}}}'

    def schemas(self, tools: Mapping[str, ToolSpec]) -> str:
        """One JSON schema (ToolSpec.schema) per line."""
        return dump_schemas([spec.schema() for spec in tools.values()])

    def describe(self, tools: Mapping[str, ToolSpec]) -> str:
        return self.describe_schemas([spec.schema() for spec in tools.values()])

    def describe_schemas(self, schemas: list[dict[str, Any]]) -> str:
        """`describe` for tools given as OpenAI-style function schemas (an API request's `tools`):
        the same text `describe` gives for ToolSpecs with those schemas."""
        raise NotImplementedError

    def calls_in(self, text: str) -> tuple[str, list[dict[str, Any]]] | None:
        """The tool calls an action's text holds, leniently, as an API reply gives them: (the text
        before them, [{"name": ..., "arguments": {...}}, ...]); None when the text holds no well-formed
        call object (the reply is then plain content). No ToolSpec is checked: the caller's harness
        validates its own arguments."""
        raise NotImplementedError

    def write_calls(self, calls: list[dict[str, Any]]) -> str:
        """The text of `calls` ({"name", "arguments"} objects) in this format, for an assistant
        message a chat template does not render tool calls of."""
        raise NotImplementedError


def dump_schemas(schemas: list[dict[str, Any]]) -> str:
    """One JSON schema per line, as the JSON formats' tool descriptions list them."""
    return "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)


def _call_object(value: Any, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """{"name", "arguments"} of a decoded call object, or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    given = [key for key in keys if key in value]
    arguments = value[given[0]] if given else {}
    if not isinstance(arguments, dict) or set(value) - {"name", *keys} or len(given) > 1:
        return None
    return {"name": value["name"], "arguments": arguments}


def _call_from_arguments(spec: ToolSpec, arguments: dict[str, Any], usage: str) -> ToolCall:
    names = spec.param_names()
    if len(spec.params) < spec.min_args:  # the environment's declaration, not the policy's mistake
        raise ValueError(f"tool {spec.name!r} takes {spec.min_args} or more arguments but names {len(spec.params)} "
                         f"(ToolSpec.params): the JSON formats pass arguments by name")
    unknown = [key for key in arguments if key not in names]
    if unknown:
        has = f"its parameters are {', '.join(names)}" if names else "it takes none"
        raise ActionError(f"error: unknown parameter {unknown[0]!r} for {spec.name}; {has}; usage: {usage}")
    values: dict[str, str] = {}
    for key, value in arguments.items():
        if value is None:
            continue
        if isinstance(value, (dict, list)):
            raise ActionError(f"error: parameter {key!r} of {spec.name} must be a string or a number, got "
                              f"{_kind(value)}; usage: {usage}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ActionError(f"error: parameter {key!r} of {spec.name} is {value}, not a finite number; usage: {usage}")
        values[key] = value if isinstance(value, str) else json.dumps(value)
    missing = [key for key in spec.required() if key not in values]
    if missing:
        raise ActionError(f"error: {spec.name} needs the parameter {missing[0]!r}; usage: {usage}")
    present = [key in values for key in spec.params]
    if any(later and not earlier for earlier, later in zip(present, present[1:])):
        gap = spec.params[present.index(False)]
        raise ActionError(f"error: {spec.name} is given a parameter after {gap!r} but not {gap!r}; give it too "
                          f"(the arguments are positional); usage: {usage}")
    args = tuple(values[key] for key in spec.params if key in values)
    body = values.get(spec.body_param, "") if spec.body != "none" else ""
    if spec.body == "required" and not body:
        raise ActionError(f"error: {spec.name} needs a non-empty {spec.body_param!r}; usage: {usage}")
    return ToolCall(name=spec.name, args=args, body=body)


def _typed(json_type: str, value: str) -> Any:
    """`value` as the JSON value of its type when it is that value's canonical text, else the string."""
    try:
        if json_type == "integer" and str(int(value)) == value:
            return int(value)
        if json_type == "number":
            number = json.loads(value)
            if type(number) in (int, float) and math.isfinite(number) and json.dumps(number) == value:
                return number
    except (ValueError, RecursionError):
        pass
    if json_type == "boolean" and value in ("true", "false"):
        return value == "true"
    return value


class HermesFormat(JsonCallFormat):
    """The Hermes / Qwen block: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>."""

    name, native = "hermes", True
    open, close = "<tool_call>", "</tool_call>"
    stop = (close,)
    summary = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>, as Hermes and Qwen models write'

    def parse(self, text: str, tools: Mapping[str, ToolSpec], max_chars: int = 4000) -> ToolCall:
        listing = self.accepted(tools)
        if len(text) > max_chars:
            raise ActionError(f"error: the action is {len(text)} characters long; the limit is {max_chars}.\n{listing}")
        start = text.find(self.open)
        if start < 0:
            raise ActionError(f"error: no tool call found; write it as {self.open}{CALL_SHAPE}{self.close}.\n"
                              f"{listing}")
        end = text.find(self.close, start)
        if end < 0:
            raise ActionError(f"error: the tool call is not closed with {self.close}.\n{listing}")
        inner = text[start + len(self.open):end]
        if self.open in inner or text.find(self.open, end) >= 0:
            raise ActionError(f"error: more than one tool call; make exactly one per turn.\n{listing}")
        stripped = inner.strip()
        if not stripped:
            raise ActionError(f"error: empty tool call; write {CALL_SHAPE} inside it.\n{listing}")
        value, used = self.decode(stripped, tools, "in the tool call")
        if stripped[used:].strip():
            raise ActionError(f"error: text after the JSON object in the tool call; write one object per call.\n"
                              f"{listing}")
        return self.call_of(value, tools)

    def render(self, call: ToolCall, tools: Mapping[str, ToolSpec]) -> str:
        """The block around the call object; a tag inside a string is written with "<" escaped
        (\\u003c), so the block holds no other tag."""
        text = json.dumps(self.object_of(call, tools), ensure_ascii=False)
        text = text.replace(self.open, "\\u003c" + self.open[1:]).replace(self.close, "\\u003c" + self.close[1:])
        return f"{self.open}\n{text}\n{self.close}"

    def usage(self, spec: ToolSpec) -> str:
        return f"{self.open}{super().usage(spec)}{self.close}"

    def describe_schemas(self, schemas: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nAct by calling exactly one function per turn. The functions, as JSON schemas "
                f"within <tools></tools>:\n<tools>\n{dump_schemas(schemas)}\n</tools>\n\n"
                "Write the call as a JSON object holding the function's name and arguments, within "
                f"{self.open}{self.close} tags:\n{self.open}\n{CALL_SHAPE}\n{self.close}")


    def calls_in(self, text: str) -> tuple[str, list[dict[str, Any]]] | None:
        calls, cursor = [], 0
        first = text.find(self.open)
        while True:
            start = text.find(self.open, cursor)
            if start < 0:
                break
            end = text.find(self.close, start)
            if end < 0:
                return None
            try:
                value = json.loads(text[start + len(self.open):end].strip())
            except (ValueError, RecursionError):
                return None
            call = _call_object(value, self.argument_keys)
            if call is None:
                return None
            calls.append(call)
            cursor = end + len(self.close)
        return (text[:first].strip(), calls) if calls else None

    def write_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{self.open}\n{json.dumps(call, ensure_ascii=False)}\n{self.close}" for call in calls)


class JsonFormat(JsonCallFormat):
    """The call object alone as the action: {"name": ..., "arguments": {...}}."""

    name, native, stop = "json", True, ()
    argument_keys = ("arguments", "parameters")
    summary = '{"name": ..., "arguments": {...}} as the whole action'

    def parse(self, text: str, tools: Mapping[str, ToolSpec], max_chars: int = 4000) -> ToolCall:
        listing = self.accepted(tools)
        if len(text) > max_chars:
            raise ActionError(f"error: the action is {len(text)} characters long; the limit is {max_chars}.\n{listing}")
        stripped = text.lstrip()
        if not stripped.startswith("{"):
            where = "found text before it" if "{" in stripped else "found none"
            raise ActionError(f"error: the action must be one JSON object {CALL_SHAPE} and nothing before it; "
                              f"{where}.\n{listing}")
        value, used = self.decode(stripped, tools, "in the action")
        if stripped[used:].lstrip().startswith("{"):
            raise ActionError(f"error: more than one tool call; make exactly one per turn.\n{listing}")
        return self.call_of(value, tools)

    def render(self, call: ToolCall, tools: Mapping[str, ToolSpec]) -> str:
        return json.dumps(self.object_of(call, tools), ensure_ascii=False)

    def calls_in(self, text: str) -> tuple[str, list[dict[str, Any]]] | None:
        try:
            value = json.loads(text.strip())
        except (ValueError, RecursionError):
            return None
        call = _call_object(value, self.argument_keys)
        return None if call is None else ("", [call])

    def write_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(json.dumps(call, ensure_ascii=False) for call in calls)

    def describe_schemas(self, schemas: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nAct by calling exactly one function per turn. The functions, as JSON schemas:\n"
                f"{dump_schemas(schemas)}\n\nReply with the call alone, a JSON object holding the function's name "
                f"and arguments:\n{CALL_SHAPE}")


register_format(CallFormat())
register_format(HermesFormat())
register_format(JsonFormat())


# ------------------------------------------------------------------------------ tools in the prompt

@dataclass(frozen=True)
class PromptTools:
    """How an environment's tools reach its first prompt (`keelrl.policy.chat.ChatFormat.prompt`)."""

    schemas: list[dict[str, Any]] | None
    """The tools' JSON schemas for templates that render tools; None: the format is not native."""
    description: str
    """The format's describe(tools): the system message where the template renders no tools."""


def prompt_tools(env: Any) -> PromptTools | None:
    """The tools to put in `env`'s first prompt: None unless `env.show_tools` is true and the
    environment has `tools` (name -> ToolSpec); written in `env.tool_format` (default call).
    An environment that sets show_tools leaves the tools out of its own first observation: the
    rollout adds them here, through the chat template."""
    tools = getattr(env, "tools", None)
    if not getattr(env, "show_tools", False) or not tools:
        return None
    fmt = format_of(getattr(env, "tool_format", "call"))
    schemas = [spec.schema() for spec in tools.values()] if fmt.native else None
    return PromptTools(schemas=schemas, description=fmt.describe(tools))
