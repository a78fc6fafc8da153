"""Chat-completions messages to the policy's tokens, and its completions back to messages.

A request's `messages` and `tools` are rendered through the model's own chat template (the
tools' schemas go through the template where it renders tools, else the tool-call format's
description of them is the system message, as keelrl's own loop does: `ChatFormat.prompt`).
Assistant messages the harness sends back are matched against the replies this endpoint gave
in the same session (`Reply`): a match is rendered as the exact text that was sampled, not as
the template would write the harness's copy, whose tool-call JSON may be spaced otherwise.

Token in, token out (`continuation`). When a call's history is the previous call's history
plus that call's reply plus new messages, and the template renders that history as it did
before (the text before the reply is the previous prompt's text exactly), the new context is
the previous context's tokens, the reply's tokens as sampled, then the new messages' tokens
(the template's text after the reply: end of turn, tool header, tool output, assistant
header). Nothing sampled is re-tokenised. Anything else (a compacted history, a message
edited, earlier reasoning stripped by the harness or by the template) is not a continuation:
the caller starts a new sample from the whole history rendered afresh.

What this does NOT do: `n` > 1, continuing a final assistant message, images or audio parts,
or tool-call formats other than the JSON ones (hermes, json), which an API's `tool_calls`
carry by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from keelrl.envs.formats import JsonCallFormat, format_of
from keelrl.policy.chat import ChatFormat

ROLES = ("system", "developer", "user", "assistant", "tool")
_MARK = "\x00KEEL-REPLY-{}\x00"


class RequestError(ValueError):
    """A request the endpoint refuses: 400 (or `status`), in the OpenAI error shape, naming `param`."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Message:
    """One message, checked and in one shape: content text, tool calls as {"name", "arguments"}."""

    role: str
    content: str
    tool_calls: tuple[tuple[str, str], ...] = ()
    """(name, arguments as canonical JSON) per call."""
    tool_call_id: str = ""

    def calls(self) -> list[dict[str, Any]]:
        return [{"name": name, "arguments": json.loads(arguments)} for name, arguments in self.tool_calls]


def _canonical(arguments: Any) -> str:
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: text only
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}; "
                                   f"this endpoint takes text only", param=f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where}.content must be a string, a list of text parts or null, got "
                       f"{type(value).__name__}", param=f"{where}.content")


def parse_messages(messages: Any) -> list[Message]:
    """The request's `messages` checked (RequestError naming the bad field) and made `Message`s."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of messages", param="messages")
    out = []
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise RequestError(f"{where} must be an object with a role and content", param=where)
        role = raw.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        calls = []
        raw_calls = raw.get("tool_calls") or []
        if raw_calls and role != "assistant":
            raise RequestError(f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
        if not isinstance(raw_calls, list):
            raise RequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
        for j, call in enumerate(raw_calls):
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or not name:
                raise RequestError(f"{where}.tool_calls[{j}].function.name must be a non-empty string",
                                   param=f"{where}.tool_calls")
            arguments = function.get("arguments", "{}")  # type: ignore[union-attr]  # a dict: checked above
            try:
                parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            except (ValueError, RecursionError):
                raise RequestError(f"{where}.tool_calls[{j}].function.arguments is not valid JSON",
                                   param=f"{where}.tool_calls") from None
            if not isinstance(parsed, dict):
                raise RequestError(f"{where}.tool_calls[{j}].function.arguments must be a JSON object",
                                   param=f"{where}.tool_calls")
            calls.append((name, _canonical(parsed)))
        content = _content(raw.get("content"), where)
        tool_call_id = raw.get("tool_call_id") or ""
        if not isinstance(tool_call_id, str):
            raise RequestError(f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
        out.append(Message(role=role, content=content, tool_calls=tuple(calls), tool_call_id=tool_call_id))
    if out[-1].role == "assistant":
        raise RequestError("the last message is an assistant message: continuing one is not supported; end "
                           "the list with a user, tool or system message", param=f"messages[{len(out) - 1}]")
    return out


def parse_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's `tools` checked: OpenAI function tools, as schemas the template may render."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}",
                               param=f"tools[{i}]")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", param=f"tools[{i}]")
        schema: dict[str, Any] = {"name": function["name"], "description": str(function.get("description", "")),
                                  "parameters": parameters}
        out.append({"type": "function", "function": schema})
    return out


@dataclass(frozen=True)
class Reply:
    """One completion this endpoint sampled: its tokens, and the message it was returned as."""

    token_ids: tuple[int, ...]
    text: str
    """The completion's text as sampled, without a final end-of-turn token (the template adds its own)."""
    end_id: int | None
    """The end-of-turn token the completion ended on, if it did."""
    message: Message
    """The assistant message it was returned as (what a harness sends back)."""


@dataclass
class Rendered:
    """A request rendered: the prompt's text and tokens, and whether it continues the last call."""

    text: str
    token_ids: list[int]
    continues: bool
    """The tokens are the previous context, the previous reply's tokens, then `new_tokens`."""
    new_tokens: list[int] = field(default_factory=list)


class Renderer:
    """Renders requests for one tokenizer and tool-call format (see the module docstring)."""

    def __init__(self, tokenizer: Any, tool_format: str = "hermes") -> None:
        fmt = format_of(tool_format)
        if not isinstance(fmt, JsonCallFormat):
            raise ValueError(f"tool format {tool_format!r} has no JSON call objects; an OpenAI-style endpoint "
                             f"speaks hermes or json")
        self.tokenizer, self.fmt, self.chat = tokenizer, fmt, ChatFormat.of(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    # ------------------------------------------------------------------ requests to text
    def text(self, messages: Sequence[Message], tools: list[dict[str, Any]], replies: Sequence[Reply] = (),
             marker_at: int | None = None) -> str:
        """The prompt's text: `messages` in the template, ending with the assistant header. An assistant
        message equal to one of `replies` is written as that reply's sampled text; the one at
        `marker_at` as a marker (`_MARK`), for `continuation` to cut at."""
        native = bool(tools) and self.chat.renders_tools and self.fmt.native
        rendered_messages: list[dict[str, Any]] = []
        pins: dict[str, str] = {}
        for i, message in enumerate(messages):
            role = self.chat.observation_role if message.role == "tool" else message.role
            role = "system" if role == "developer" else role
            entry: dict[str, Any] = {"role": role, "content": message.content}
            if message.role == "assistant":
                reply = next((r for r in reversed(replies) if same_message(r.message, message)), None)
                if i == marker_at or reply is not None:
                    mark = _MARK.format(i)
                    if i != marker_at:
                        pins[mark] = reply.text  # type: ignore[union-attr]
                    entry["content"] = mark
                elif message.tool_calls and native:
                    entry["tool_calls"] = [{"type": "function", "function": call} for call in message.calls()]
                elif message.tool_calls:
                    written = self.fmt.write_calls(message.calls())
                    entry["content"] = f"{message.content}\n{written}" if message.content else written
            rendered_messages.append(entry)
        if tools and not native:
            description = self.fmt.describe_schemas(tools)
            if rendered_messages[0]["role"] == "system":
                first = rendered_messages[0]
                rendered_messages[0] = {**first, "content": f"{description}\n\n{first['content']}"}
            else:
                rendered_messages.insert(0, {"role": "system", "content": description})
        try:
            text = self.tokenizer.apply_chat_template(rendered_messages, tools=tools if native else None,
                                                      tokenize=False, add_generation_prompt=True)
        except Exception as error:  # noqa: BLE001 - the template's own refusal, passed on to the caller
            raise RequestError(f"the model's chat template cannot render these messages: {error}",
                               param="messages") from None
        if tools and not native and self.fmt.describe_schemas(tools) not in text:
            raise RequestError("the model's chat template renders no system message to describe the tools in",
                               param="tools")
        for mark, pinned in pins.items():
            text = text.replace(mark, pinned)
        return text

    def prompt(self, messages: Sequence[Message], tools: list[dict[str, Any]], replies: Sequence[Reply] = ()) -> Rendered:
        """A request rendered afresh (a new sample)."""
        text = self.text(messages, tools, replies)
        return Rendered(text=text, token_ids=self.encode(text), continues=False)

    def continuation(self, messages: Sequence[Message], tools: list[dict[str, Any]], replies: Sequence[Reply],
                     previous_text: str, previous_context: Sequence[int]) -> Rendered:
        """The request as a continuation of the previous call (whose prompt text was `previous_text`
        and whose context, prompt then reply, is `previous_context`), or rendered afresh when it is
        not one (the module docstring)."""
        last = replies[-1] if replies else None
        at = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=None)
        if last is None or at is None or not same_message(messages[at], last.message):
            return self.prompt(messages, tools, replies)
        marked = self.text(messages, tools, replies, marker_at=at)
        if marked.count(_MARK.format(at)) != 1:  # a template that drops or escapes the reply's content
            return self.prompt(messages, tools, replies)
        before, after = marked.split(_MARK.format(at), 1)
        if before != previous_text:
            return self.prompt(messages, tools, replies)
        if last.end_id is not None:
            ended = self.decode([last.end_id])
            if ended and after.startswith(ended):
                after = after[len(ended):]
        new_tokens = self.encode(after)
        text = before + last.text + marked.split(_MARK.format(at), 1)[1]
        return Rendered(text=text, token_ids=list(previous_context) + new_tokens, continues=True, new_tokens=new_tokens)

    # ------------------------------------------------------------------ completions to messages
    def reply(self, token_ids: Sequence[int], end_ids: Sequence[int], tools: list[dict[str, Any]]) -> Reply:
        """The message a completion is returned as: tool calls where the format finds well-formed ones
        (and tools were offered), else plain content."""
        end_id = token_ids[-1] if token_ids and token_ids[-1] in end_ids else None
        body = token_ids[:-1] if end_id is not None else token_ids
        text = self.decode(body)
        visible = self.tokenizer.decode(list(body), skip_special_tokens=True)
        found = self.fmt.calls_in(visible) if tools else None
        if found is None:
            message = Message(role="assistant", content=visible)
        else:
            content, calls = found
            message = Message(role="assistant", content=content,
                              tool_calls=tuple((c["name"], _canonical(c["arguments"])) for c in calls))
        return Reply(token_ids=tuple(token_ids), text=text, end_id=end_id, message=message)


def same_message(a: Message, b: Message) -> bool:
    """Equal as a harness would echo it: content compared without surrounding whitespace."""
    return (a.role, a.content.strip(), a.tool_calls) == (b.role, b.content.strip(), b.tool_calls)
