"""How an episode is laid out in one model's own chat template.

An episode is a chat: the task prompt as the first user message, each action as an assistant
message, each observation as a tool (or user) message. Models are trained on their own
template, so keelrl renders every episode through it, the same way at warm start, in rollouts
and at evaluation:

    prompt        = template([user: PROMPT], add_generation_prompt)
    action        = what the model generated (or the teacher wrote), as generated
    observation   = template's text between an assistant message's content and the next
                    assistant message's content, with the observation inside

`ChatFormat.of(tokenizer)` finds those pieces by rendering a short conversation with marker
strings in place of the contents and cutting the text at the markers, so any Jinja template
works without knowing its syntax. It also finds whether the template renders tools
(`renders_tools`: apply_chat_template(tools=...) with a probe tool, whose name must appear).

Tools in the prompt (`ChatFormat.prompt(tokenizer, text, tools=..., system=...)`): the tools'
JSON schemas go through the template where it renders tools; elsewhere (SmolLM2's ChatML template
has no tools section) the caller's `system` text, the tool-call format's description of the same
tools, is a system message before the prompt, or the prompt's first paragraph where the template
has no system role. This layer renders what it is given: which format the tools are described in
is the environment's business (keelrl.envs.formats.prompt_tools). An action that ended on the model's own end-of-turn token
already holds it: its observation then starts after that token rather than repeating it.

What this does NOT guarantee: a template that renders a message differently depending on
what comes after it (some drop earlier reasoning, for instance) is not reproduced exactly;
the episode is laid out as the conversation grows, turn by turn, which is what the policy
actually saw when it acted.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

_ACTION, _OBSERVATION = "\x00KEEL-ACTION\x00", "\x00KEEL-OBSERVATION\x00"
_TOOL_PROBE = "keel_probe_tool"
_CACHE: "weakref.WeakKeyDictionary[Any, ChatFormat]" = weakref.WeakKeyDictionary()


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template keelrl can lay an episode out with."""


@dataclass(frozen=True)
class ChatFormat:
    """The text pieces of one tokenizer's chat template around actions and observations."""

    observation_open: str
    """From the end of an action's content to the observation: end of turn + the tool header."""
    observation_close: str
    """From the end of the observation to where the next action begins (the assistant header)."""
    turn_end: str
    """The end-of-turn text the template puts right after an assistant message's content."""
    end_token_ids: tuple[int, ...]
    """Tokens that end an assistant turn when the model generates them (eos, end of turn)."""
    observation_role: str
    """The role observations are rendered as ('tool' where the template renders it, else 'user')."""
    renders_tools: bool = False
    """Whether apply_chat_template(tools=[schemas]) renders the tools (their names appear)."""

    @staticmethod
    def of(tokenizer: Any) -> "ChatFormat":
        """The format of `tokenizer`'s chat template (computed once per tokenizer)."""
        try:
            return _CACHE[tokenizer]
        except (KeyError, TypeError):
            pass
        found = _derive(tokenizer)
        try:
            _CACHE[tokenizer] = found
        except TypeError:  # pragma: no cover - a tokenizer that cannot be weakly referenced
            pass
        return found

    def prompt(self, tokenizer: Any, text: str, *, tools: list[dict[str, Any]] | None = None,
               system: str | None = None) -> list[int]:
        """The task prompt as the first user message, ending with the assistant header.

        `tools`: JSON schemas of tools (OpenAI-style function tools), rendered by the template where
        it renders tools (`renders_tools`). `system`: the system message where they are not, or
        where no tools are given (with tools, it is their description for templates without
        tools); a template without a system role gets it as the prompt's first paragraph.
        ValueError for tools the template cannot render and no `system` to show them in."""
        user = {"role": "user", "content": text}
        if tools and self.renders_tools:
            rendered = tokenizer.apply_chat_template([user], tools=tools, tokenize=False, add_generation_prompt=True)
            return _encode(tokenizer, rendered)
        if tools and not system:
            raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', tokenizer)!r} does not "
                             f"render tools; pass their description as `system`")
        if not system:
            return _encode(tokenizer, _render(tokenizer, [user], True))
        try:
            rendered = _render(tokenizer, [{"role": "system", "content": system}, user], True)
        except Exception:  # noqa: BLE001 - a template without a system role: the paragraph below
            rendered = ""
        if system not in rendered:
            rendered = _render(tokenizer, [{"role": "user", "content": f"{system}\n\n{text}"}], True)
        return _encode(tokenizer, rendered)

    def observation(self, tokenizer: Any, text: str, *, action_end: int | None = None) -> list[int]:
        """An observation's tokens. `action_end`: the end-of-turn token the action itself ended
        with, if it did; the opening then continues after that token instead of repeating it."""
        opening = self.observation_open
        if action_end is not None:
            ended = tokenizer.decode([action_end], skip_special_tokens=False)
            if ended and opening.startswith(ended):
                opening = opening[len(ended):]
        return _encode(tokenizer, opening + text + self.observation_close)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _derive(tokenizer: Any) -> ChatFormat:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template: keelrl lays "
            "every episode out in the model's own chat format (prompt as a user message, actions as "
            "assistant messages). Point model.path at an instruct/chat model, whose tokenizer ships one, "
            "or add one: set tokenizer.chat_template to a Jinja template and save the tokenizer with "
            "save_pretrained (transformers writes it to chat_template.jinja)")
    user = {"role": "user", "content": "P"}
    action = {"role": "assistant", "content": _ACTION}
    last_error: Exception | None = None
    for role in ("tool", "user"):
        try:
            alone = _render(tokenizer, [user, action], False)
            full = _render(tokenizer, [user, action, {"role": role, "content": _OBSERVATION}], True)
        except Exception as error:  # noqa: BLE001 - a template may reject a role: try the next
            last_error = error
            continue
        if full.count(_ACTION) != 1 or full.count(_OBSERVATION) != 1 or alone.count(_ACTION) != 1:
            continue
        after_action = full.split(_ACTION, 1)[1]
        opening, closing = after_action.split(_OBSERVATION, 1)
        turn_end = _common_prefix(alone.split(_ACTION, 1)[1], opening)
        return ChatFormat(observation_open=opening, observation_close=closing, turn_end=turn_end,
                          end_token_ids=_end_tokens(tokenizer, turn_end), observation_role=role,
                          renders_tools=_renders_tools(tokenizer))
    why = f": {last_error!r}" if last_error else ""
    raise ChatTemplateError(
        f"the chat template of {getattr(tokenizer, 'name_or_path', tokenizer)!r} does not render an "
        f"assistant message followed by a tool or user message with their contents intact{why}")


def _renders_tools(tokenizer: Any) -> bool:
    """Whether the template renders a probe tool given as apply_chat_template(tools=[...])."""
    probe = {"type": "function", "function": {"name": _TOOL_PROBE, "description": "a probe",
                                              "parameters": {"type": "object", "properties": {}, "required": []}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "P"}], tools=[probe], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that rejects tools does not render them
        return False
    return isinstance(text, str) and _TOOL_PROBE in text


def _common_prefix(a: str, b: str) -> str:
    size = 0
    while size < min(len(a), len(b)) and a[size] == b[size]:
        size += 1
    return a[:size]


def _end_tokens(tokenizer: Any, turn_end: str) -> tuple[int, ...]:
    """eos, plus the first token of the end-of-turn text when it is a special token of its own."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    stripped = turn_end.strip()
    if stripped:
        pieces = _encode(tokenizer, stripped)
        special = set(getattr(tokenizer, "all_special_ids", []))
        if pieces and pieces[0] in special and pieces[0] not in ids:
            ids.append(pieces[0])
    return tuple(ids)
