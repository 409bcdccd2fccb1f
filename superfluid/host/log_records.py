"""The session log's records: what each says, and how it changes a session's state.

A record is a msgspec struct (msgpack on disk, framed by log_format.py). Replay applies them in
order to one `SessionState` per session (`apply`, which refuses a record that contradicts its
session); a batch whose write fails is undone (`undo_of`); each record has a number within its
session (`counter`), so a record missing from the middle of the log is a gap its reader sees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

import msgspec

from superfluid.host import tenants
from superfluid.host.errors import LogCorrupt
from superfluid.host.sampling import Sampling
from superfluid.host.tools import ToolError, Tools

# The most tokens one Tokens record carries (at most 5 bytes each in msgpack: 5 MiB, far below
# the size a reader accepts): a snapshot splits a longer session's tokens.
TOKENS_PER_RECORD = 1 << 20


class Opened(msgspec.Struct, tag="open", omit_defaults=True):
    """A session was created (a fork names its parent) by `tenant` ("" the unnamed one: every
    session of a log written before tenants), whose `cache_salt` has digest `salt` (tenants.py),
    offering `tools` to the model (OpenAI's shape; None: none; format 3 on)."""

    session: str
    created: float
    sampling: Sampling
    priority: str
    parent: str | None = None
    tenant: str = ""
    salt: str = ""
    tools: list[dict] | None = None


class Tokens(msgspec.Struct, tag="tokens"):
    """Tokens committed to a session, starting at position `start`. `opens_turn`: they are the
    assistant's opening a generation committed; the turn is open until a Turn record closes it
    (a log that ends with it open was cut short by a crash: recovery closes it)."""

    session: str
    start: int
    tokens: list[int]
    opens_turn: bool = False


class Turn(msgspec.Struct, tag="turn", omit_defaults=True):
    """A chat message added to a session's conversation, whose tokens end at position `end`
    (they come in Tokens records): an assistant's `tool_calls`, or the call a tool message
    answers (`tool_call_id`, and the tool's `name`), in OpenAI's shape (format 3 on)."""

    session: str
    role: str
    content: str
    end: int
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @classmethod
    def of(cls, session: str, message: dict, end: int) -> Turn:
        """The record of `message` (as a session keeps it: messages.ChatMessage.as_dict)."""
        return cls(session, message["role"], message["content"], end, message.get("tool_calls"),
                   message.get("tool_call_id"), message.get("name"))

    def message(self) -> dict:
        """The message as a session keeps it."""
        out = {"role": self.role, "content": self.content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class Trimmed(msgspec.Struct, tag="trim"):
    """A session cut back to its first `length` tokens (and the messages that end within them)."""

    session: str
    length: int


class Parked(msgspec.Struct, tag="park"):
    """The KV of a session's first `tokens` tokens is in pool entry `entry` (tagged with the session id)."""

    session: str
    entry: int
    tokens: int


class Deleted(msgspec.Struct, tag="delete"):
    """A session was deleted."""

    session: str


Record = Union[Opened, Tokens, Turn, Trimmed, Parked, Deleted]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


@dataclass
class SessionState:
    """What the log says about one session."""

    id: str
    created: float
    sampling: Sampling
    priority: str
    parent: str | None = None
    tokens: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    message_ends: list[int] = field(default_factory=list)  # token position where each message ends
    parked: tuple[int, int] | None = None  # (pool entry, tokens it covers)
    tenant: str = ""  # its owner (tenants.py)
    salt: str = ""  # the digest of its creator's cache_salt ("" without one)
    open_turn: tuple[int, int] | None = None  # [start, end) of the opening of an assistant turn not closed yet
    tools: Tools | None = None  # the tools its conversation offers the model

    @property
    def namespace(self) -> str:
        """Whose cached KV it may start from, and who may start from its own (tenants.py)."""
        return tenants.namespace(self.tenant, self.salt)

    def snapshot(self) -> list[Record]:
        """The records that recreate this state."""
        records: list[Record] = [Opened(self.id, self.created, self.sampling, self.priority, self.parent,
                                        self.tenant, self.salt, None if self.tools is None else self.tools.as_dicts())]
        records += [Turn.of(self.id, m, end) for m, end in zip(self.messages, self.message_ends)]
        # a long session's tokens in several records, so none nears the size a reader accepts;
        # an open turn's opening in one of its own, marked as it was
        cuts = set(range(0, len(self.tokens), TOKENS_PER_RECORD)) | set(self.open_turn or ())
        if self.open_turn is not None:  # never inside the opening: its record is all of it
            cuts = {cut for cut in cuts if not self.open_turn[0] < cut < self.open_turn[1]}
        bounds = sorted(cut for cut in cuts | {len(self.tokens)} if cut <= len(self.tokens))
        for start, end in zip(bounds, bounds[1:]):
            opens = self.open_turn is not None and start == self.open_turn[0]
            records.append(Tokens(self.id, start, self.tokens[start:end], opens_turn=opens))
        if self.parked is not None:
            records.append(Parked(self.id, *self.parked))
        return records


def check(record: Record, length: int | None, where: str = "") -> None:
    """LogCorrupt when `record` contradicts its session, which holds `length` tokens (None: no
    such session)."""
    if isinstance(record, (Opened, Deleted)):
        return
    if length is None:
        raise LogCorrupt(f"session log{where}: a {type(record).__name__} record for session {record.session!r}, which "
                         "was never opened; the log is not one superfluid wrote in order. Move it aside to start empty")
    if isinstance(record, Tokens) and record.start != length:
        raise LogCorrupt(f"session log{where}: session {record.session!r} has {length} tokens but a "
                         f"record continues it at {record.start}; move the log aside to start empty")


def apply(states: dict[str, SessionState], record: Record, where: str = "") -> None:
    """Apply one record to the replayed states (LogCorrupt when it contradicts them)."""
    state = states.get(record.session)
    check(record, None if state is None else len(state.tokens), where)
    if isinstance(record, Opened):
        states[record.session] = SessionState(record.session, record.created, record.sampling, record.priority,
                                              record.parent, tenant=record.tenant, salt=record.salt,
                                              tools=_tools(record, where))
        return
    state = states.get(record.session)
    if state is None:
        return  # a deletion of a session already gone
    if isinstance(record, Tokens):
        if record.opens_turn:
            state.open_turn = (record.start, record.start + len(record.tokens))
        state.tokens.extend(record.tokens)
    elif isinstance(record, Turn):
        state.messages.append(record.message())
        state.message_ends.append(record.end)
        state.open_turn = None  # (what closes a turn is a message)
    elif isinstance(record, Trimmed):
        if state.open_turn is not None and state.open_turn[1] > record.length:
            state.open_turn = None  # cut into its opening: no turn is open
        del state.tokens[record.length:]
        kept = sum(1 for end in state.message_ends if end <= record.length)
        del state.messages[kept:], state.message_ends[kept:]
        if state.parked is not None and state.parked[1] > record.length:
            state.parked = None
    elif isinstance(record, Parked):
        state.parked = (record.entry, record.tokens)
    elif isinstance(record, Deleted):
        del states[record.session]


def _tools(record: Opened, where: str) -> Tools | None:
    """The tools an Opened record offers (LogCorrupt where they are not tools)."""
    try:
        return None if record.tools is None else Tools.of(record.tools)
    except ToolError as exc:
        raise LogCorrupt(f"session log{where}: session {record.session!r} opens with tools that are not ({exc}); "
                         "the log is not one superfluid wrote. Move it aside to start empty") from None


def undo_of(states: dict[str, SessionState], record: Record) -> Callable[[], None]:
    """What puts `states` back as they are now once `record` is applied to them."""
    state = states.get(record.session)
    if isinstance(record, Opened):
        return lambda: states.pop(record.session, None)
    if state is None:
        return lambda: None
    if isinstance(record, Deleted):
        return lambda: states.__setitem__(record.session, state)
    open_turn = state.open_turn
    if isinstance(record, Tokens):
        length = len(state.tokens)

        def drop_tokens() -> None:
            del state.tokens[length:]
            state.open_turn = open_turn
        return drop_tokens
    if isinstance(record, Turn):
        count = len(state.messages)

        def drop_turn() -> None:
            del state.messages[count:], state.message_ends[count:]
            state.open_turn = open_turn
        return drop_turn
    parked = state.parked
    if isinstance(record, Parked):
        return lambda: setattr(state, "parked", parked)
    # Trimmed: what the cut takes, kept to be put back
    tokens, messages, ends = list(state.tokens), list(state.messages), list(state.message_ends)

    def untrim() -> None:
        state.tokens[:], state.messages[:], state.message_ends[:], state.parked = tokens, messages, ends, parked
        state.open_turn = open_turn
    return untrim


def decode_record(payload: bytes, where: str) -> Record:
    """The record a frame carries; LogCorrupt when an intact frame holds no record this code knows
    (a log another version of superfluid wrote)."""
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LogCorrupt(f"session log{where}: an intact frame holds no record this superfluid reads ({exc}); "
                         "was the log written by a newer superfluid?") from None


def counter(numbers: dict[str, int]) -> Callable[[Record], int]:
    """Numbers records in the order they are written, session by session, into `numbers` (each
    session's next; a deletion ends its count)."""
    def number(record: Record) -> int:
        given = numbers.get(record.session, 0)
        if isinstance(record, Deleted):
            numbers.pop(record.session, None)
        else:
            numbers[record.session] = given + 1
        return given
    return number
