"""The tool-call format of keelrl's text environments, and its parser.

An action is free text containing exactly one tool call:

    <call>NAME ARGS
    BODY</call>

The first line inside the tags is the tool's name followed by its arguments on that line
(split on whitespace); everything after the first newline, up to </call>, is the body (it
may span lines, e.g. replacement code). Text before <call> is allowed and ignored (the
policy's reasoning); text after </call> is ignored too, since generation stops at </call>
(`STOP` is the stop string for samplers). One newline right before </call> ends the body's
last line rather than adding an empty one. Examples:

    <call>read</call>
    <call>replace 2
        return 3 if config.get("retries") is None else config["retries"]</call>
    <call>test</call>
    <call>submit</call>

`parse_action` returns a `ToolCall` or raises `ActionError` whose message says what was
wrong and what is accepted, ready to be shown to the policy as an error observation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

OPEN, STOP = "<call>", "</call>"


class ActionError(ValueError):
    """A malformed or unknown tool call; str() is the error observation for the policy."""


@dataclass(frozen=True)
class ToolSpec:
    """A tool's name, its usage line (shown in errors and prompts) and its argument count."""

    name: str
    usage: str
    description: str
    min_args: int = 0
    max_args: int = 0
    body: str = "none"
    """none (no body allowed) | optional | required."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: tuple[str, ...]
    body: str


def describe_tools(tools: Mapping[str, ToolSpec]) -> str:
    """The tool list as the agent sees it in the prompt and in error observations."""
    lines = ["Act with exactly one tool call per turn:"]
    lines += [f"  {spec.usage}  - {spec.description}" for spec in tools.values()]
    return "\n".join(lines)


def parse_action(text: str, tools: Mapping[str, ToolSpec], max_chars: int = 4000) -> ToolCall:
    """Parse one tool call out of `text` (see the module docstring) or raise ActionError."""
    if len(text) > max_chars:
        raise ActionError(f"error: the action is {len(text)} characters long; the limit is {max_chars}.\n"
                          + describe_tools(tools))
    start = text.find(OPEN)
    if start < 0:
        raise ActionError(f"error: no tool call found; wrap it as {OPEN}NAME ...{STOP}.\n" + describe_tools(tools))
    end = text.find(STOP, start)
    if end < 0:
        raise ActionError(f"error: the tool call is not closed with {STOP}.\n" + describe_tools(tools))
    inner = text[start + len(OPEN):end]
    if OPEN in inner or text.find(OPEN, end) >= 0:
        raise ActionError("error: more than one tool call; make exactly one per turn.\n" + describe_tools(tools))
    head, _, body = inner.partition("\n")
    if body.endswith("\n"):  # "...last line\n</call>": the newline ends the line, it adds none
        body = body[:-1]
    words = head.split()
    if not words:
        raise ActionError("error: empty tool call; name a tool.\n" + describe_tools(tools))
    name, args = words[0], tuple(words[1:])
    spec = tools.get(name)
    if spec is None:
        raise ActionError(f"error: unknown tool {name!r}; the tools are {', '.join(tools)}.\n" + describe_tools(tools))
    if not spec.min_args <= len(args) <= spec.max_args:
        raise ActionError(f"error: {name} takes {_count(spec)}, got {len(args)}; usage: {spec.usage}")
    if spec.body == "none" and body.strip():
        raise ActionError(f"error: {name} takes no body after its first line; usage: {spec.usage}")
    if spec.body == "required" and not body:
        raise ActionError(f"error: {name} needs a body on the lines after its name; usage: {spec.usage}")
    return ToolCall(name=name, args=args, body=body)


def _count(spec: ToolSpec) -> str:
    if spec.min_args == spec.max_args:
        return f"{spec.min_args} argument{'s' if spec.min_args != 1 else ''}"
    return f"{spec.min_args} to {spec.max_args} arguments"
