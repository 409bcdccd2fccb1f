"""One generation's request: what it asks for, validated once where it enters the host and carried
unchanged into its job.

`Session.generate`'s keywords and an HTTP request's fields both become a `GenerateRequest` on the
caller's thread; the scheduler thread only resolves the sampling overrides against the session's
defaults. A `Prompt` is what a one-shot request (an OpenAI chat or text completion) brings with it:
the messages or the text it starts from.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from superfluid.host.sampling import MAX_TOP_LOGPROBS, Sampling


# A prompt with at least this many times more left to feed than another is long beside it: a
# short arrival may swap it out of its sequence (the KV manager), and a step that ends the short
# one leaves it for the next step (the planner). Swapping costs a copy of the long one's KV out
# and back in (memcpy speed, milliseconds), and a step of its own for the short one costs the
# long one that step (tens of milliseconds), against the short one's wait for seconds of the
# long one's prefill; the margin keeps prompts of similar length from taking turns.
SHORT_FACTOR = 4


class Priority(enum.IntEnum):
    """A generation's class, most urgent first (the value orders admission and prefill)."""

    INTERACTIVE = 0
    DEFAULT = 1
    BACKGROUND = 2

    @classmethod
    def named(cls, name: str | Priority) -> Priority:
        """The class called `name` ("interactive", "default", "background"); ValueError naming
        the choices for anything else."""
        if isinstance(name, Priority):
            return name
        if isinstance(name, str) and name.upper() in cls.__members__:
            return cls[name.upper()]
        raise ValueError(f"priority {name!r}: use one of {', '.join(PRIORITIES)}")

    def __str__(self) -> str:
        return self.name.lower()


PRIORITIES = tuple(str(p) for p in Priority)  # the names, most urgent first


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """How one generation runs. `sampling` holds overrides of the session's defaults (any of
    Sampling's fields); `priority` None takes the session's class. `streamed` False says the
    caller takes the reply whole (`Session.complete`, an HTTP request without `stream`): the time
    between its tokens is then nobody's wait, so the decode-step target does not bound the steps
    it decodes in (the first-token target still does), and prompts beside it are fed in the
    larger chunks the engine runs at full speed."""

    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    timeout: float | None = None
    sampling: Mapping[str, Any] = msgspec.field(default_factory=dict)
    keep_logits: bool = False
    ignore_eos: bool = False
    priority: Priority | None = None
    logprobs: int | None = None  # alternatives each piece's logprobs list (None: no logprobs)
    streamed: bool = True
    constraint: Any = None  # a constraints.Compiled the output must match (compiled by the caller), or None
    tools: Any = None  # a tools.ToolUse: the reply is read for calls of them (None: no tools)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be a whole number >= 1")
        if self.timeout is not None and not (isinstance(self.timeout, (int, float)) and self.timeout > 0
                                             and math.isfinite(self.timeout)):
            raise ValueError(f"timeout={self.timeout!r}: must be a number of seconds > 0")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: give strings (an empty one stops nothing)")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r}: must be a whole number of alternatives in "
                             f"[0, {MAX_TOP_LOGPROBS}], or None for no logprobs")
        unknown = set(self.sampling) - set(Sampling.__struct_fields__)
        if unknown:
            raise TypeError(f"unknown sampling setting(s) {', '.join(sorted(unknown))}; use any of "
                            f"{', '.join(Sampling.__struct_fields__)}")
        Sampling(**self.sampling)  # each value in its range (SamplingError naming one that is not)

    @classmethod
    def of(cls, *, max_tokens: int = 256, stop: Sequence[str] | str = (), priority: str | Priority | None = None,
           **fields: Any) -> GenerateRequest:
        """A request from `Session.generate`'s keywords: `stop` one string or several, `priority`
        by name (ValueError naming what is wrong)."""
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        return cls(max_tokens=max_tokens, stop=stops, priority=None if priority is None else Priority.named(priority),
                   **fields)

    def settings(self, defaults: Sampling) -> Sampling:
        """The sampling this generation runs with: the session's `defaults` with the overrides."""
        if not self.sampling:
            return defaults
        return msgspec.structs.replace(defaults, **self.sampling)


class Prompt(msgspec.Struct, frozen=True):
    """What a one-shot request starts from: chat messages (ChatMessage, or (role, content)
    pairs, or dicts in OpenAI's shape), rendered by the model's template with the `tools` the
    conversation offers (a tools.Tools), or a text tokenized as it is."""

    messages: tuple[Any, ...] = ()
    text: str | None = None
    tools: Any = None

    def __post_init__(self) -> None:
        if not self.messages and self.text is None:
            raise ValueError("a prompt needs messages or a text")
