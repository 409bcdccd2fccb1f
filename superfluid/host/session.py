"""What an application holds: a Session handle, and the Generation it streams pieces from.

Both are thin: every call is handed to the host's scheduler thread (the only thread that touches
the engine) and waits for its answer, so they are safe from any thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import msgspec

from superfluid.host.constraints import Constraint
from superfluid.host.messages import ChatMessage, ToolCall
from superfluid.host.errors import HostClosed
from superfluid.host.request import GenerateRequest
from superfluid.host.sampling import TokenLogprobs
from superfluid.host.tools import FREE_CHOICES, ToolError, ToolUse, new_seed

T = TypeVar("T")

if TYPE_CHECKING:
    from superfluid.host.host import Host

# A reader that waited this long for a piece checks that the scheduler still runs.
LIVENESS_SECONDS = 0.5


class Piece(NamedTuple):
    """One step of a generation: the text it makes showable (may be empty: a character or a
    possible stop string still incomplete) and the token sampled (-1 for the last piece of a
    generation that ended while text was held back: that text, with no new token); with the
    token's log-probabilities when the generation asked for them."""

    text: str
    token: int
    logprobs: TokenLogprobs | None = None


class SessionInfo(msgspec.Struct, frozen=True):
    """A session as `Host.sessions()` lists it."""

    id: str
    tokens: int
    messages: int
    priority: str
    created: float
    parent: str | None
    parked_tokens: int  # tokens whose KV is parked in the pool (0: none)
    generating: bool


class _Finished(NamedTuple):
    reason: str
    error: BaseException | None


# What a step wakes: the events of the async readers waiting for a piece, by their event loop.
Wakes = dict[asyncio.AbstractEventLoop, list[asyncio.Event]]


def wake_readers(wakes: Wakes) -> None:
    """From the scheduler thread, wake the async readers in `wakes` ({loop: [event, ...]}): one
    call into each loop (one write to its self-pipe) for all of its readers. On 2 cores each
    wake takes a core from the forward in flight, so a step's pieces wake each loop once."""
    for loop, events in wakes.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:
            pass  # the loop has closed: nobody reads any more


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


class Generation:
    """A running generation: iterate it for pieces (it ends when the generation does), with
    `for` in a thread or `async for` in an event loop (no thread waits for it then).

    `finish_reason` is "stop" (an end-of-turn token or a stop string), "length" (max_tokens),
    "cancelled", "timeout" or "closed" once it has ended; `text` is everything emitted; where
    the conversation offers tools, `reply()` tells its text from the calls it made."""

    def __init__(self, session_id: str, tools: ToolUse | None = None) -> None:
        self.session_id = session_id
        self.tools = tools  # how the model may call the conversation's tools (None: it offers none)
        self.call_seed = new_seed()  # what its calls' ids are made from (tools.ToolUse.call_id)
        self._reply: tuple[str | None, list[ToolCall]] | None = None
        self._queue: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.finish_reason: str | None = None
        self.tokens: list[int] = []
        self.text = ""
        self.logits: list = []  # each step's logits, when generate(keep_logits=True) asked for them
        self.prompt_tokens = 0  # tokens the model read before its first output token
        self.cached_tokens = 0  # of those, how many came from cache instead of a prefill
        self._alive = lambda: True
        # an async reader's loop and the event a put it waits for sets (None: read from a thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived: asyncio.Event | None = None
        self._waiting = False  # the async reader may be waiting: the next put wakes it
        self._ended = False  # the scheduler has put the end (the async reader's watch stops)
        self._dead = False  # the watch found the scheduler stopped: a wait raises instead
        # the scheduler's side: pieces not handed to the reader yet, and when the next are due
        # (handoff.py; 0: at once, until a piece with text was handed)
        self._held: list[Piece] = []
        self._due = 0.0

    # -- the scheduler's side
    def _put(self, piece: Piece) -> None:
        """Hand `piece` to the reader now, after any pieces held."""
        self._held.append(piece)
        self._hand(None)

    def _hold(self, piece: Piece) -> None:
        """Keep `piece` for the next hand-over (handoff.Handoff decides when)."""
        self._held.append(piece)

    def _hand(self, wakes: Wakes | None) -> bool:
        """Queue the held pieces for the reader, in order, and wake it: now, or with `wakes`, by
        adding its loop's wake-up there (the caller wakes a step's readers together); True if any
        of them had text."""
        if not self._held:
            return False
        shown = False
        for piece in self._held:
            self._queue.put(piece)
            shown = shown or bool(piece.text)
        self._held.clear()
        self._woken(wakes)
        return shown

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        self._hand(None)  # the end comes after every piece, at once
        self._queue.put(_Finished(reason, error))
        self._ended = True
        self._woken(None)

    def _woken(self, wakes: Wakes | None) -> None:
        # Only a reader that may be waiting is woken (each wake is a write to the event loop's
        # self-pipe): one that is busy with earlier pieces looks at the queue before it waits.
        if self._loop is not None and self._waiting:
            self._waiting = False
            if wakes is None:
                wake_readers({self._loop: [self._arrived]})
            else:
                wakes.setdefault(self._loop, []).append(self._arrived)

    # -- the application's side
    def cancel(self) -> None:
        """Stop generating at the next step; the lane is freed at once."""
        self.cancelled.set()

    def __iter__(self) -> Iterator[Piece]:
        return self

    def __next__(self) -> Piece:
        while True:
            try:
                item = self._queue.get(timeout=LIVENESS_SECONDS)
            except queue.Empty:
                self._check_alive()
                continue
            return self._accept(item, StopIteration)

    def __aiter__(self) -> AsyncIterator[Piece]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # (read again on another loop: its wakes and its watch move there)
            self._arrived = asyncio.Event()
            self._loop = loop
            loop.call_later(LIVENESS_SECONDS, self._watch, loop)
        return self

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        # On the reader's loop, every LIVENESS_SECONDS until the generation has ended: a
        # scheduler that stopped without ending it wakes the reader, which raises HostClosed.
        # One timer a generation, not one a wait: a wait is on the path of every streamed token.
        if self._ended or loop is not self._loop:
            return
        if not self._alive():
            self._dead = True
            self._arrived.set()
            return
        loop.call_later(LIVENESS_SECONDS, self._watch, loop)

    async def __anext__(self) -> Piece:
        if self._loop is None:  # read without `async for`
            self.__aiter__()
        while True:
            # cleared and marked waiting before looking, so a piece put after the look still
            # wakes the wait below
            self._arrived.clear()
            self._waiting = True
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                if self._dead:
                    self._check_alive()
                await self._arrived.wait()
                continue
            self._waiting = False  # busy with this piece: it looks at the queue before it waits again
            return self._accept(item, StopAsyncIteration)

    def pieces_ready(self) -> list[Piece]:
        """The pieces already waiting to be read, taken without waiting (an empty list when none);
        the generation's end is left for the next read."""
        ready = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return ready
            if isinstance(item, _Finished):
                self._queue.put(item)  # the last item: the next read ends the iteration
                return ready
            ready.append(self._accept(item, StopIteration))

    def _accept(self, item: Piece | _Finished, end: type[Exception]) -> Piece:
        """A piece taken from the queue, recorded; `end` raised when the generation is over."""
        if isinstance(item, _Finished):
            self._queue.put(item)  # later reads end too
            self.finish_reason = self.finish_reason or item.reason
            if item.error is not None:
                raise item.error
            raise end
        if item.token >= 0:  # -1: text held back until the end, released with no token
            self.tokens.append(item.token)
        self.text += item.text
        return item

    def _check_alive(self) -> None:
        if not self._alive():
            raise HostClosed("the host's scheduler stopped; its error was raised by the call that saw it") from None

    def collect(self) -> str:
        """Run to the end and return the whole text."""
        for _ in self:
            pass
        return self.text

    def reply(self) -> tuple[str | None, list[ToolCall]]:
        """(the reply's text outside tool calls, None if there is none; the calls it made, in the
        model's format, of the tools offered) once it has ended: the text as it is and no calls
        where the conversation offers no tools or the tool choice is none."""
        if self.tools is None:
            return self.text, []
        if self.finish_reason is None:  # (still running: what it wrote so far, read again next time)
            return self.tools.parse(self.text, self.call_seed)
        if self._reply is None:
            self._reply = self.tools.parse(self.text, self.call_seed)
        return self._reply


class Session:
    """A conversation or token stream kept by a Host (see Host.session), acting as `tenant` (None:
    as the application that embeds the host, which may act on any tenant's sessions)."""

    def __init__(self, host: Host, session_id: str, tenant: str | None = None) -> None:
        self._host = host
        self.id = session_id
        self.tenant = tenant

    def __repr__(self) -> str:
        return f"Session({self.id!r})" if self.tenant is None else f"Session({self.id!r}, tenant={self.tenant!r})"

    def _call(self, command: Callable[..., T], *args: Any) -> T:
        """`command` on this session, as its tenant, on the host's scheduler thread."""
        return self._host.call(command, self.id, *args, tenant=self.tenant)

    def append_message(self, role: str, text: str) -> None:
        """Add a chat message of `role` (system, user or assistant), rendered by the chat template
        (on the calling thread: Host.append_messages)."""
        self._host.append_messages(self.id, [(role, text)], tenant=self.tenant)

    def append_messages(self, *messages: Any) -> None:
        """Add chat messages in turn: (role, text) pairs, dicts in OpenAI's shape (an assistant's
        `tool_calls`, a tool's result with its `tool_call_id`) or messages.ChatMessage."""
        self._host.append_messages(self.id, messages, tenant=self.tenant)

    def append_tool_result(self, tool_call_id: str, content: str, name: str | None = None) -> None:
        """Add what the tool call `tool_call_id` (of the tool `name`) returned."""
        self.append_messages(ChatMessage("tool", content, tool_call_id=tool_call_id, name=name))

    def append_user(self, text: str) -> None:
        """Add a user message, rendered by the model's chat template."""
        self.append_message("user", text)

    def append_assistant(self, text: str) -> None:
        """Add an assistant message (a reply the model did not write here)."""
        self.append_message("assistant", text)

    def append_system(self, text: str) -> None:
        """Add a system message."""
        self.append_message("system", text)

    def append_tokens(self, tokens: Sequence[int]) -> None:
        """Add raw token ids (no template)."""
        self._call(self._host.commands.append_tokens, [int(t) for t in tokens])

    def append_text(self, text: str) -> None:
        """Add text tokenized as it is (no template)."""
        self._call(self._host.commands.append_text, text)

    def generate(self, max_tokens: int = 256, stop: Sequence[str] | str = (), timeout: float | None = None,
                 keep_logits: bool = False, ignore_eos: bool = False, priority: str | None = None,
                 logprobs: int | None = None, constraint: Constraint | None = None,
                 json_schema: dict | None = None, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                 **sampling) -> Generation:
        """Start generating (SessionBusy if this session already is; Overloaded if the host's wait
        queue is full); iterate the result for pieces. It starts when the engine has the cells
        for it. `sampling` overrides the session's defaults for this generation only;
        `keep_logits` keeps each step's logits (float32, one row per token) in
        `Generation.logits`; `ignore_eos` goes on past end-of-turn tokens (for fixed-length
        runs); `priority` ("interactive", "default", "background") overrides the session's;
        `logprobs` (0 to 20) gives each piece its token's log-probability and that many of the
        most likely alternatives (`Piece.logprobs`); `constraint` (a Constraint: a JSON schema, a
        regex, choices, a grammar) or `json_schema` (a schema, as a dict) keeps the output within
        it (superfluid/host/constraints.py), compiled here, on the calling thread. Where the
        session offers tools (Host.session(tools=...)), the model may call them: `tool_choice`
        "auto" (the default), "none", "required" or {"type": "function", "function": {"name":
        ...}} (the last two constrain the reply to calls), `parallel_tool_calls=True` for several
        calls in one reply (unset: one, as llama-server takes it); `Generation.reply()` gives the
        calls made. A bad value is refused here,
        with ValueError (ConstraintError for a constraint, ToolError for tools) naming it, before
        anything reaches the host."""
        tools, constraint = self._tools(tool_choice, parallel_tool_calls, self._compiled(constraint, json_schema))
        request = GenerateRequest.of(max_tokens=max_tokens, stop=stop, timeout=timeout, sampling=sampling,
                                     keep_logits=bool(keep_logits), ignore_eos=bool(ignore_eos), priority=priority,
                                     logprobs=logprobs, constraint=constraint, tools=tools)
        return self._call(self._host.commands.generate, request)

    def complete(self, max_tokens: int = 256, stop: Sequence[str] | str = (), timeout: float | None = None,
                 keep_logits: bool = False, ignore_eos: bool = False, priority: str | None = None,
                 constraint: Constraint | None = None, json_schema: dict | None = None, tool_choice: Any = None,
                 parallel_tool_calls: bool | None = None, **sampling) -> str:
        """generate(), collected into its text. Nobody reads its tokens one by one, so the steps
        it decodes in are bounded by the first-token target alone (GenerateRequest.streamed)."""
        tools, constraint = self._tools(tool_choice, parallel_tool_calls, self._compiled(constraint, json_schema))
        request = GenerateRequest.of(max_tokens=max_tokens, stop=stop, timeout=timeout, sampling=sampling,
                                     keep_logits=bool(keep_logits), ignore_eos=bool(ignore_eos), priority=priority,
                                     streamed=False, constraint=constraint, tools=tools)
        return self._call(self._host.commands.generate, request).collect()

    def _tools(self, choice: Any, parallel: bool | None, constraint: Any) -> tuple[ToolUse | None, Any]:
        """(how the generation may call the session's tools, the constraint it runs under): None
        and `constraint` where neither `choice` nor `parallel` is given (the host reads the reply
        for calls of the session's tools, if it offers any); else the session's tools, fetched,
        with a choice of calls compiled into the constraint. ToolError where the session offers
        none and a call is required, or a constraint is given beside a choice that constrains."""
        if choice is None and parallel is None:
            return None, constraint
        tools = self._call(self._host.commands.tools)
        if tools is None:
            if choice in FREE_CHOICES:
                return None, constraint  # nothing to choose from, and nothing asked of it
            raise ToolError(f"session {self.id!r} offers no tools; give them when making it: "
                            "Host.session(tools=[...])")
        use = self._host.tool_use(tools, choice, parallel)
        if use.constrains:
            if constraint is not None:
                raise ToolError(f"tool_choice {choice!r} makes the reply tool calls; it takes no other constraint")
            constraint = self._host.grammars.compile(use.constraint())
        return use, constraint

    def _compiled(self, constraint: Constraint | None, json_schema: dict | None):
        """The constraint asked for, compiled against the host's model (None: none asked)."""
        if constraint is not None and json_schema is not None:
            raise ValueError("give `constraint` or `json_schema`, not both")
        if json_schema is not None:
            constraint = Constraint.json_schema(json_schema)
        return None if constraint is None else self._host.grammars.compile(constraint)

    def fork(self) -> Session:
        """A new session with this one's tokens and messages, sharing its KV (no KV bytes copied)."""
        return Session(self._host, self._call(self._host.commands.fork), self.tenant)

    def trim(self, n_tokens: int) -> None:
        """Keep the first `n_tokens` tokens (and the chat messages that end within them)."""
        self._call(self._host.commands.trim, n_tokens)

    def pin(self) -> int:
        """Keep this session's KV in the pool, never evicted, until unpin() (or the host closes).
        Its KV as it is now is parked first; later parks move the pin along. PinLimit when the
        host's cap on pinned bytes would be passed. Returns the bytes pinned."""
        return self._call(self._host.commands.pin)

    def unpin(self) -> None:
        """Let this session's parked KV be evicted again under pressure."""
        self._call(self._host.commands.unpin)

    @property
    def tokens(self) -> list[int]:
        """The committed tokens."""
        return self._call(self._host.commands.tokens)

    @property
    def messages(self) -> list[dict]:
        """The chat messages so far."""
        return self._call(self._host.commands.messages)

    def info(self) -> SessionInfo:
        """The session's summary."""
        return self._call(self._host.commands.info)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of `tokens` (special tokens rendered)."""
        return self._host.call(self._host.commands.detokenize, list(tokens))
