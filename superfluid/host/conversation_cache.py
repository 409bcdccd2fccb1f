"""The tokens of recent conversations' messages, so that a client sending a conversation's whole
history with every request (as OpenAI's chat API asks) costs one rendering per new message.

A session takes chat messages one at a time, each as the difference between the conversation
rendered with it and without it (see chat.py). A request that opens a session with its whole
history would render every message twice, each time with all those before it: work that grows
with the square of the history. For the 80 messages of a 40-turn conversation that took 86 ms on
a busy 2-core CPU, against 0.28 ms for one rendering of the whole. Here each request's messages
are kept with their tokens for a while, and the next request renders only the messages after the
longest history it shares with a recent one: the reply and the new question.

A rendering costs the length of the conversation, so messages are rendered one by one only up to
SEPARATE_RENDERS new ones: past that (a long history no recent request shared) the new messages
are rendered once, together, and tokenized as one piece, so a request's cost stays linear in its
length (20,000 messages rendered one by one took minutes). Each of those messages then ends
where the piece ends, as after a template that rewrites earlier turns.

Kept per namespace (a tenant and its cache salt: superfluid/host/tenants.py): a request that
continues another tenant's history is rendered in full, so the time it takes tells nothing of
what other tenants sent (86 ms against 0.28 ms above would).

Safe from any thread: the server builds prompts on worker threads beside the event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from superfluid.host.chat import ChatTemplate, TemplateRewrites
from superfluid.host.errors import ChatError
from superfluid.host.messages import ChatMessage
from superfluid.host.tools import Tools

Message = ChatMessage
SEPARATE_RENDERS = 8  # new messages rendered one by one; more are rendered once, together


class ConversationCache:
    """The rendering and per-message tokens of the last `conversations` requests' histories."""

    def __init__(self, template: ChatTemplate, tokenize: Callable[[str], list[int]], conversations: int = 32) -> None:
        """`tokenize`: text to token ids, special tokens parsed (as the session's messages are)."""
        self.template, self.tokenize, self.conversations = template, tokenize, conversations
        # (namespace, tools offered, history) -> (its rendering, each message's tokens); the most
        # recently used last. Token lists are shared between a history and those that continue
        # it, never changed.
        self._recent: OrderedDict[tuple[str, Tools | None, tuple[Message, ...]],
                                  tuple[str, tuple[list[int], ...]]] = OrderedDict()
        self.rendered = 0  # messages rendered (the others came from here)
        self._lock = threading.Lock()

    def tokens(self, messages: Sequence[Any], namespace: str = "", tools: Tools | None = None
               ) -> tuple[list[int], ...]:
        """Each message's (any form ChatMessage.of takes) tokens, as appending them one at a time to an empty session offering
        `tools` gives them (from what was kept for `namespace` only). TemplateRewrites when the
        template renders an earlier message differently once a later one is added (nothing is
        kept then)."""
        with self._lock:
            return self._tokens((namespace, tools), tuple(ChatMessage.of(m) for m in messages))

    def _render(self, messages: list[dict], shared: int, text: str, tools: Tools | None,
                one_by_one: bool) -> tuple[list[list[int]], str]:
        """(the tokens of each of `messages` after the first `shared`, rendered after `text`, which
        renders those; the rendering of them all): one by one, or all at once (the earlier ones
        then get no tokens of their own)."""
        added = []
        for n in range(shared + 1, len(messages) + 1) if one_by_one else [len(messages)]:
            addition, text = self.template.extend(text, messages[:n], tools)
            added += [[]] * (n - shared - len(added) - 1)  # messages rendered with the next one: no tokens of their own
            added.append(self.tokenize(addition))
        return added, text

    def _tokens(self, space: tuple[str, Tools | None], history: tuple[Message, ...]) -> tuple[list[int], ...]:
        # the longest kept history of the namespace (and tools) this one continues (comparing
        # with each kept one: trying every prefix of a long history would hash it again and again)
        shared = max((len(kept) for *kept_space, kept in self._recent
                      if tuple(kept_space) == space and len(kept) <= len(history) and history[:len(kept)] == kept),
                     default=0)
        text, pieces = self._recent[(*space, history[:shared])] if shared else ("", ())
        if shared:
            self._recent.move_to_end((*space, history[:shared]))
        tools = space[1]
        as_dicts = [message.as_dict() for message in history]
        # one by one where few are new; else all of them at once (their ends become the piece's)
        one_by_one = len(history) - shared <= SEPARATE_RENDERS
        try:
            added, text = self._render(as_dicts, shared, text, tools, one_by_one)
        except TemplateRewrites:
            # a rendering kept here may be what no longer renders alike (a template that writes
            # today's date): it goes, or every later request would fail on it again
            self._recent.pop((*space, history[:shared]), None)
            raise
        except ChatError:
            if not one_by_one or shared == len(history) - 1:
                raise
            # a template that cannot render the conversation cut short (Llama 3's, offered tools,
            # refuses a system message without the user message that carries them): at once
            added, text = self._render(as_dicts, shared, text, tools, False)
        self.rendered += len(history) - shared
        pieces = (*pieces, *added)
        if history:
            self._recent[(*space, history)] = (text, pieces)
            self._recent.move_to_end((*space, history))
            while len(self._recent) > self.conversations:
                self._recent.popitem(last=False)
        return pieces
