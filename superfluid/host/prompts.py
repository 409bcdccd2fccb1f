"""A one-shot request's prompt, built on the caller's thread: the chat template rendered and the
text tokenized there, so the scheduler thread only commits the tokens and steps.

The scheduler thread is what every decoding lane and every arrival waits for; rendering a long
conversation (jinja, in Python) and tokenizing it are work in proportion to the request, so they
happen beside it: on the thread that calls the Host, or on a worker thread beside the server's
event loop. The tokenizer is the engine's thread-safe one (`Engine.tokenizer()`), which never
touches the engine's context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from superfluid.host.chat import ChatTemplate, TemplateRewrites
from superfluid.host.conversation_cache import SEPARATE_RENDERS, ConversationCache
from superfluid.host.errors import ChatError
from superfluid.host.messages import ChatMessage
from superfluid.host.request import Prompt
from superfluid.host.tools import Tools


class PreparedPrompt(msgspec.Struct, frozen=True):
    """A prompt as the request lane will hold it: its tokens, its chat messages with the position
    where each ends, and the tokens that open the assistant's turn (empty for a text prompt)."""

    tokens: list[int]
    messages: list[dict]
    message_ends: list[int]
    opening: list[int]
    warmed: int | None = None  # the pool entry Host.prepare read in from disk for it, if any


class PromptBuilder:
    """Prompts of one model: its chat template, its tokenizer and the recent conversations'
    tokens (safe from any thread)."""

    def __init__(self, descriptor: Any, tokenizer: Any) -> None:
        """`descriptor`: the engine's (chat template, BOS); `tokenizer`: `Engine.tokenizer()`."""
        self.descriptor, self.tokenizer = descriptor, tokenizer
        self.template = chat_template(descriptor, tokenizer)
        self.conversations = ConversationCache(self.template, self.tokenize)

    def tokenize(self, text: str) -> list[int]:
        """`text`'s tokens, special tokens parsed (any thread)."""
        return self.tokenizer.tokenize(text, special=True)

    def build(self, prompt: Prompt, namespace: str = "") -> PreparedPrompt:
        """`prompt`'s tokens as an empty lane takes them: the chat messages rendered as appending
        them in turn would (a long new history at once), or the text after a BOS where the model
        asks for one; renderings are reused within `namespace` only (conversation_cache.py).
        ChatError for messages the template refuses."""
        if prompt.messages:
            given = tuple(ChatMessage.of(m) for m in prompt.messages)
            messages = [m.as_dict() for m in given]
            tools = prompt.tools
            try:
                pieces = self.conversations.tokens(given, namespace, tools)
                tokens, ends = [], []
                for piece in pieces:
                    tokens += piece
                    ends.append(len(tokens))
            except TemplateRewrites:  # a template that rewrites earlier turns: the whole, rendered once
                tokens = self.tokenize(self.template.render(messages, tools=tools))
                ends = [len(tokens)] * len(messages)
            opening = self.tokenize(self.template.opening(messages, tools))
        else:
            tokens, messages, ends, opening = [], [], [], []
        if prompt.text is not None:
            text = self.tokenize(prompt.text)
            bos = self.descriptor.bos_token
            if bos is not None and not tokens and text[:1] != [bos]:
                text = [bos, *text]
            tokens += text
        return PreparedPrompt(tokens, messages, ends, opening)


def appended_pieces(template: ChatTemplate, tokenize: Callable[[str], list[int]], before: Sequence[dict],
                    added: Sequence[dict], tools: Tools | None = None) -> list[list[int]]:
    """The tokens that messages `added` add after a conversation of `before`: one piece per
    message (each ends where its piece does), or past SEPARATE_RENDERS of them one piece for all
    (rendered once: one at a time costs the square of their number; each then ends where they all
    end), or where the template cannot render them one at a time. TemplateRewrites where the template renders earlier turns otherwise once these follow.
    Pure: any thread may call it (on the caller's side for a session, Host.append_messages)."""
    if len(added) <= SEPARATE_RENDERS:
        pieces, messages = [], list(before)
        try:
            for message in added:
                pieces.append(tokenize(template.turn(messages, message, tools)))
                messages.append(message)
            return pieces
        except TemplateRewrites:
            raise
        except ChatError:
            if len(messages) == len(before) + len(added) - 1:
                raise  # the last message itself is refused
            # a template that cannot render the conversation cut short (Llama 3's, offered tools,
            # refuses a system message without the user message that carries them): at once
    text, _ = template.extend(template.render(before, tools=tools) if before else "", [*before, *added], tools)
    return [tokenize(text)]


def chat_template(descriptor: Any, tokenizer: Any) -> ChatTemplate:
    """The model's chat template, with the text of its special tokens."""
    def special(token: int | None) -> str:
        return tokenizer.detokenize([token]).decode(errors="replace") if token is not None else ""

    return ChatTemplate(descriptor.chat_template, special(descriptor.bos_token),
                        special(descriptor.eos_tokens[0] if descriptor.eos_tokens else None))
