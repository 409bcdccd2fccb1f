"""A chat message: its role, its text, and the tool calls an assistant message makes or the call a
tool message answers.

Three forms of the same message meet here:

- what callers give: a (role, text) pair, a dict in OpenAI's shape, or a ChatMessage;
- `ChatMessage`, frozen and hashable (a conversation is a key of the conversation cache);
- the dict a session keeps and its log records (`as_dict`: OpenAI's shape, arguments as JSON
  text, keys present only where they say something), which is also what a chat template is
  given, once `for_template` has turned each call's arguments into the object templates read
  (`tool_call.arguments | tojson` in Qwen's, Llama's and Mistral's templates renders a JSON text
  as a quoted string otherwise; llama-server and vLLM hand them objects too).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from superfluid.host.errors import ChatError

ROLES = ("system", "user", "assistant", "tool")


class ToolCall(msgspec.Struct, frozen=True):
    """A call of the tool `name` with `arguments` (a JSON text, as OpenAI sends and returns them),
    known by `id` to the tool message that answers it."""

    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict:
        """OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}}."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    @classmethod
    def of(cls, value: Any) -> ToolCall:
        """A call from OpenAI's shape (ChatError naming what is missing)."""
        if isinstance(value, ToolCall):
            return value
        function = value.get("function") if isinstance(value, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatError(f"a tool call needs {{\"function\": {{\"name\": ..., \"arguments\": ...}}}}; got {value!r}")
        if value.get("type", "function") != "function":
            raise ChatError(f"tool call type {value.get('type')!r}: only \"function\" calls are taken")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):  # an object given as one: kept as its JSON text
            arguments = json.dumps(arguments, ensure_ascii=False)
        call_id = value.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise ChatError(f"a tool call needs an `id` (the tool message answering it names it); got {value!r}")
        return cls(call_id, function["name"], arguments)


class ChatMessage(msgspec.Struct, frozen=True):
    """One message of a conversation. `tool_calls`: the calls an assistant message makes;
    `tool_call_id` (and `name`, the tool's): the call a tool message answers."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ChatError(f"a chat message's role is one of {', '.join(ROLES)}; got {self.role!r}")
        if not isinstance(self.content, str):
            raise ChatError(f"a chat message's content is text; got {self.content!r}")
        if self.tool_calls and self.role != "assistant":
            raise ChatError(f"only an assistant message makes tool calls, not a {self.role} message")
        if self.tool_call_id is not None and self.role != "tool":
            raise ChatError(f"only a tool message answers a tool call (`tool_call_id`), not a {self.role} message")

    @classmethod
    def of(cls, value: Any) -> ChatMessage:
        """A message from a (role, text) pair, a dict in OpenAI's shape, or a ChatMessage
        (ChatError naming what is wrong)."""
        if isinstance(value, ChatMessage):
            return value
        if isinstance(value, Mapping):
            calls = value.get("tool_calls") or ()
            if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
                raise ChatError(f"`tool_calls` is a list of calls; got {calls!r}")
            content = value.get("content")
            return cls(value.get("role"), "" if content is None else content, tuple(ToolCall.of(c) for c in calls),
                       value.get("tool_call_id"), value.get("name"))
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(*value)
        raise ChatError(f"a chat message is a (role, text) pair or a dict with `role` and `content`; got {value!r}")

    def as_dict(self) -> dict:
        """The message as a session keeps it and its log records it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def as_dicts(messages: Sequence[Any]) -> list[dict]:
    """Messages in any form, as the dicts a session keeps (ChatError for a malformed one)."""
    return [ChatMessage.of(m).as_dict() for m in messages]


def for_template(message: Mapping) -> dict:
    """A kept message as a chat template reads it: each call's arguments an object where they are
    one (a text that is not a JSON object stays text: the template says what it makes of it)."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    parsed = []
    for call in calls:
        arguments = call["function"]["arguments"]
        try:
            value = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            value = arguments
        parsed.append({**call, "function": {**call["function"], "arguments": value}})
    return {**message, "tool_calls": parsed}
