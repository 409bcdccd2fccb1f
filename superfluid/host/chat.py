"""Chat messages to text with the model's own chat template, one turn at a time.

A session's tokens only ever grow, so each turn is rendered as the difference between the whole
conversation rendered with it and without it:

    render([system, user])                       = "<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n"
    render([system, user], generation prompt)    = the same + "<|im_start|>assistant\\n"
    append_user(text)  -> the text the new user turn adds
    generate()         -> the generation prompt, then what the model writes
    after generating   -> what the template puts after the assistant's words ("<|im_end|>\\n"),
                          less the end-of-turn token the model already wrote

A template that rewrites earlier turns when a later one arrives (Qwen3 drops the reasoning of
past assistant turns) cannot grow this way: `turn` and `closing` raise TemplateRewrites, and the
host renders the whole conversation instead and keeps the longest common token prefix.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from superfluid.host import tools as tool_calls
from superfluid.host.errors import ChatError
from superfluid.host.messages import ROLES, for_template
from superfluid.host.tools import Tools, ToolUse

# Used when a model ships no template (the tiny test models ship this one too).
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class TemplateRewrites(ChatError):
    """The template renders earlier turns differently once a later one is added."""


def _raise(message: str):
    raise ChatError(f"the chat template refused the conversation: {message}")


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML and writes non-ASCII as \u escapes; the
    # templates were written against transformers, whose tojson is plain json.dumps without them.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with
    it for training masks; rendering keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser):
        """The block's body, rendered unchanged."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class ChatTemplate:
    """A model's chat template, rendered in a sandbox (templates come with model files)."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        """`source`: the Jinja template (None: ChatML); the special tokens' text for templates that use them."""
        # The environment transformers' apply_chat_template renders in, which the templates that
        # ship with models are written against: loop controls, its tojson, strftime_now,
        # raise_exception and the generation tag.
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation])
        environment.filters["tojson"] = _tojson
        environment.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        try:
            self._template = environment.from_string(source or CHATML)
            reads_tools = "tools" in jinja2.meta.find_undeclared_variables(environment.parse(source or CHATML))
        except jinja2.TemplateError as exc:
            raise ChatError(f"the model's chat template does not parse: {exc}") from None
        self.thinks = "<think>" in (source or "")  # it may write an (empty) reasoning block before a reply
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self.messages_rendered = 0  # messages handed to the template so far, every rendering together
        # A template that reads `tools` and shows its model writing calls in a format read here
        # renders them itself; the others get them described (tools.as_plain_messages)
        shown = reads_tools and tool_calls.format_shown(self._probe())
        self.takes_tools, self.tool_format = bool(shown), shown or "hermes"

    def _probe(self) -> str:
        """How the template renders a call of a tool and its result ("" where it refuses)."""
        try:
            return self._template.render(messages=[for_template(m) for m in tool_calls.PROBE_CONVERSATION],
                                         tools=tool_calls.PROBE_TOOLS, add_generation_prompt=True, **self._tokens)
        except Exception:  # noqa: BLE001 - whatever the model's template raises, it shows no format here
            return ""

    def tool_use(self, tools: Any, choice: Any, parallel: bool | None, markers: dict[str, int]) -> ToolUse:
        """How a generation may call `tools` (ToolUse.of's fields) in this template's format;
        `markers`: the format's marks that are special tokens (tools.special_marks)."""
        return ToolUse.of(tools, choice, parallel, format=self.tool_format, markers=markers, thinks=self.thinks)

    @property
    def special_tokens(self) -> dict[str, str]:
        """The text of the special tokens the template is rendered with (bos_token, eos_token)."""
        return dict(self._tokens)

    def render(self, messages: Sequence[dict], generation_prompt: bool = False, tools: Tools | None = None) -> str:
        """The conversation as text, ending with the assistant's opening when `generation_prompt`;
        `tools`: those the conversation offers (rendered by the template where it takes them,
        else described in a system message: tools.as_plain_messages)."""
        for message in messages:
            if message.get("role") not in ROLES or not isinstance(message.get("content"), str):
                raise ChatError(f"a chat message needs a role ({', '.join(ROLES)}) and text content; got {message!r}")
        self.messages_rendered += len(messages)
        if self.takes_tools:
            given = [for_template(m) for m in messages]
            offered = None if tools is None else tools.as_dicts()
        else:
            given, offered = tool_calls.as_plain_messages(messages, tools), None
        try:  # (tools=None where none are offered: as transformers renders, `tools is defined` holds)
            return self._template.render(messages=given, add_generation_prompt=generation_prompt, tools=offered,
                                         **self._tokens)
        except ChatError:
            raise  # the template's own refusal (raise_exception), in its words
        except jinja2.TemplateError as exc:
            raise ChatError(f"the chat template failed to render: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the template is the model's code: whatever it
            # raises on these messages (a TypeError adding text to a missing field, an index past
            # the list) is its refusal of the conversation, not a fault of the server's
            raise ChatError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from None

    def turn(self, messages: Sequence[dict], message: dict, tools: Tools | None = None) -> str:
        """The text `message` adds after `messages`."""
        # Before the first message nothing is rendered yet; and real templates cannot render an
        # empty conversation (Llama 3's and Qwen's read messages[0]).
        return self.extend(self.render(messages, tools=tools) if messages else "", [*messages, message], tools)[0]

    def extend(self, before: str, messages: Sequence[dict], tools: Tools | None = None) -> tuple[str, str]:
        """(the text the last of `messages` adds, the rendering of them all), where `before` is
        the rendering of the others ("" for none)."""
        after = self.render(messages, tools=tools)
        return self._difference(before, after), after

    def opening(self, messages: Sequence[dict], tools: Tools | None = None) -> str:
        """The text that opens the assistant's turn after `messages`."""
        return self._difference(self.render(messages, tools=tools), self.render(messages, True, tools))

    def closing(self, messages: Sequence[dict], reply: str, tools: Tools | None = None,
                message: dict | None = None) -> str:
        """The text the template puts after the assistant's `reply` (its end-of-turn marks);
        `message`: the assistant's message as kept, where it is not the reply as text (its calls)."""
        opened = self.render(messages, True, tools) + reply
        message = {"role": "assistant", "content": reply} if message is None else message
        return self._difference(opened, self.render([*messages, message], tools=tools))

    @staticmethod
    def _difference(before: str, after: str) -> str:
        if not after.startswith(before):
            raise TemplateRewrites("this chat template renders earlier turns differently once a later one is added")
        return after[len(before):]
