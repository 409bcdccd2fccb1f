"""The owner of sessions: every change to a session's state, and every record of the session log,
is made here and nowhere else.

Two kinds of state live here:

- **Sessions** (`Host.session`, `/v1/sessions`): durable. Each change is a log record, written
  before anyone hears of it, and replayed into the same state after a restart.
- **Request lanes** (an OpenAI chat or text completion): ephemeral. The client holds the
  conversation, so nothing of them is logged and nobody else can list, read, fork or delete them.
  They take the same records, applied in memory only; their KV is parked in the pool under its
  prefix when they end, as a session's is, so the next request of that conversation (and the same
  request after a restart) starts from it.

Chat turns are rendered here too (a session's tokens are its messages as the template renders
them), and read back when a generation ends (the assistant's turn is closed).

Everything here runs on the scheduler thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvpool import EntryNotFound, Pool
from superfluid.host import log_records
from superfluid.host.chat import ChatTemplate, TemplateRewrites
from superfluid.host.errors import ChatError, ContextFull, SessionNotFound, SuperfluidError
from superfluid.host.lane import Job, Live
from superfluid.host.log import SessionLog
from superfluid.host.log_records import Deleted, Opened, Parked, Record, SessionState, Tokens, Trimmed, Turn
from superfluid.host.messages import ChatMessage, as_dicts
from superfluid.host.prompts import PreparedPrompt, appended_pieces, chat_template
from superfluid.host.sampling import Sampling
from superfluid.host.tools import Tools, ToolUse, special_marks
from superfluid.host.session import SessionInfo

if TYPE_CHECKING:
    from superfluid.host.kv import KVManager

LOG = logging.getLogger(__name__)
REQUEST_PREFIX = "request-"  # ids of request lanes (never a session's: those are minted as hex or by a worker name)


class Sessions:
    """Every session and request lane of one host: their state, their records, their chat turns."""

    def __init__(self, log: SessionLog, engine: Any, order: Callable[[], int], clock: Callable[[], float],
                 context_limit: Callable[[], int]) -> None:
        """`context_limit`: the most tokens one session can hold (the engine's, asked when appending)."""
        self.log, self.engine, self.order, self.clock = log, engine, order, clock
        self.context_limit = context_limit
        self.descriptor = engine.describe()
        self.durable: dict[str, Live] = {}  # by id: the sessions the log holds
        self.requests: dict[str, Live] = {}  # by id: request lanes, in memory only
        self.parked_count = 0  # sessions whose state records parked KV (kept as they change: stats never walk them)
        self.owned: Counter[str] = Counter()  # sessions by tenant (kept as they change, for the same reason)
        self.kv: KVManager | None = None  # set once the KV manager exists (it records parks here)
        self._request_ids = itertools.count(1)
        self._chat: ChatTemplate | None = None
        self._marks: dict[str, int] | None = None  # the tool call formats' marks that are special tokens
        self.turns_closed = 0  # assistant turns a crash left open, closed at recovery

    # ----------------------------------------------------------------------------- finding

    def get(self, session_id: str, tenant: str | None = None) -> Live:
        """The session of that id (SessionNotFound: none, a request lane, which is nobody's to
        touch, or one of another tenant than `tenant`, when given: to that tenant it does not exist)."""
        live = self.durable.get(session_id)
        if live is None or (tenant is not None and live.state.tenant != tenant):
            raise SessionNotFound(f"no session {session_id!r} (see Host.sessions())")
        return live

    def __iter__(self) -> Iterator[Live]:
        """Every session and request lane."""
        return itertools.chain(self.durable.values(), self.requests.values())

    # ----------------------------------------------------------------------------- writing

    def record(self, live: Live, *records: Record) -> None:
        """Apply `records` to `live`'s state: for a session written to the log first (one write:
        all or nothing), for a request lane in memory only."""
        if any(not isinstance(record, Parked) for record in records):
            live.version += 1  # its tokens or messages change (a park moves only its KV)
        if live.durable:
            was_parked = live.state.parked is not None
            self.log.append(*records)
            live.active_at = self.clock()
            self.parked_count += (live.state.parked is not None) - was_parked
            return
        states = {live.state.id: live.state}
        for record in records:
            log_records.apply(states, record)

    def commit(self, live: Live, tokens: list[int], *records: Record, at: int | None = None,
               opens_turn: bool = False) -> None:
        """Append `tokens` to `live` (after `records`): logged before anyone hears of them. `at`:
        where they start when `records` change the length (a trim); `opens_turn`: they are the
        assistant's opening a generation adds (the turn stays open until its closing is logged)."""
        start = len(live.state.tokens) if at is None else at
        self.record(live, *records, Tokens(live.state.id, start, tokens, opens_turn=opens_turn))
        live.since_park += len(tokens)
        live.last_used = self.order()

    def parked(self, live: Live, entry: int, tokens: int) -> None:
        """Record that pool entry `entry` holds the KV of `live`'s first `tokens` tokens (the KV
        manager, which put it there, holds it). A disk that refuses the record loses nothing: the
        pool's prefix index still finds the entry, and the session prefills what it cannot."""
        try:
            self.record(live, Parked(live.state.id, entry, tokens))
        except OSError as exc:
            LOG.warning("the session log could not record session %r's parked KV (%s)", live.state.id, exc)

    # ----------------------------------------------------------------------------- lifecycle

    def open(self, session_id: str | None, settings: Sampling, priority: str, tenant: str = "", salt: str = "",
             tools: Tools | None = None) -> Live:
        """A new session (`session_id`, or a fresh id) of `tenant`, its cache salt's digest `salt`,
        its conversation offering `tools`."""
        session_id = self._new_id(session_id, "resume it with Host.session(id=...)")
        self.log.append(Opened(session_id, time.time(), settings, priority, tenant=tenant, salt=salt,
                               tools=None if tools is None else tools.as_dicts()))
        live = self.durable[session_id] = Live(self.log.states[session_id])
        self.owned[tenant] += 1
        live.last_used, live.idle_since = self.order(), self.clock()
        live.active_at = live.idle_since
        return live

    def open_request(self, tenant: str = "", salt: str = "") -> Live:
        """A new request lane of `tenant` (its salt's digest `salt`): a session's state that is
        never logged and never listed."""
        request_id = f"{REQUEST_PREFIX}{next(self._request_ids)}"
        live = Live(SessionState(request_id, time.time(), Sampling(), "default", tenant=tenant, salt=salt),
                    durable=False)
        live.last_used, live.idle_since = self.order(), self.clock()
        self.requests[request_id] = live
        return live

    def fork(self, parent: Live, child_id: str | None) -> Live:
        """A child session with `parent`'s tokens and messages (its KV is the KV manager's to share)."""
        child_id = self._new_id(child_id, "fork into a new id")
        state = parent.state
        # the parent's state as records under the child's id: its tenant, its messages, its tokens
        # (split as a long session's are, a turn a generation has open still marked open)
        as_child = dataclasses.replace(state, id=child_id, created=time.time(), parent=state.id, parked=None)
        self.log.append(*as_child.snapshot())
        child = self.durable[child_id] = Live(self.log.states[child_id])
        self.owned[state.tenant] += 1
        child.last_used, child.idle_since = self.order(), self.clock()
        child.active_at = child.idle_since
        return child

    def _new_id(self, session_id: str | None, otherwise: str) -> str:
        """`session_id` (or a fresh one) for a new session; SuperfluidError when it is taken or
        has the form of a request lane's."""
        session_id = session_id or uuid.uuid4().hex
        if session_id in self.durable:
            raise SuperfluidError(f"a session {session_id!r} exists already; {otherwise}")
        if session_id.startswith(REQUEST_PREFIX):
            raise SuperfluidError(f"session ids starting {REQUEST_PREFIX!r} are the host's own; choose another")
        return session_id

    def trim(self, live: Live, n_tokens: int) -> None:
        """Keep `live`'s first `n_tokens` tokens (and the messages that end within them)."""
        self.kv.cut(live, n_tokens)
        self.record(live, Trimmed(live.state.id, n_tokens))
        self.kv.follow_pin(live)  # a parked KV reaching past the cut is not the session's now

    def remove(self, live: Live) -> None:
        """Forget a session (logged as deleted) or a request lane; its KV is the KV manager's to drop."""
        if live.durable:
            self.log.append(Deleted(live.state.id))
            del self.durable[live.state.id]
            self.owned[live.state.tenant] -= 1
            if not self.owned[live.state.tenant]:
                del self.owned[live.state.tenant]
            self.parked_count -= live.state.parked is not None
        else:
            del self.requests[live.state.id]

    def expire_idle(self, now: float, expiry: float) -> int:
        """Delete the sessions idle for `expiry` seconds at `now` (never a pinned one, nor one
        generating), their KV with them; how many. A disk that refuses a deletion leaves that
        session whole, and the rest for the next look."""
        expired = []
        for live in [live for live in self.durable.values()
                     if live.job is None and not live.pinned and now - live.active_at >= expiry]:
            try:
                self.remove(live)  # logged first
            except OSError as exc:
                LOG.warning("expiring session %r: the session log refused its deletion (%s)", live.state.id, exc)
                break
            self.kv.drop(live)
            expired.append(live)
        self.kv.erase(expired, self.durable.values())
        return len(expired)

    def cut_back(self, live: Live, length: int) -> None:
        """Cut `live` back to its first `length` tokens (what a generation that never ran had
        added). A disk that refuses the record leaves the session and its lane as they are, and
        the cut owed: it is made before the session's next command (`settle`)."""
        try:
            self.record(live, Trimmed(live.state.id, length))
        except OSError as exc:
            live.owed_cut = length
            LOG.warning("session %r: the session log refused a cut (%s); it is made before its next command",
                        live.state.id, exc)
            return
        live.owed_cut = None
        self.kv.cut(live, length)

    def settle(self, live: Live) -> None:
        """Before a command on idle `live`: the cut it owes (OSError while the disk still refuses
        it: the command waits with it), and the turn a refused closing record left open."""
        if live.owed_cut is not None:
            self.record(live, Trimmed(live.state.id, live.owed_cut))
            self.kv.cut(live, live.owed_cut)
            live.owed_cut = None
        self.close_left_open(live)

    def recount_parked(self) -> None:
        """Count the sessions whose state records parked KV again (after the log put states back)."""
        self.parked_count = sum(1 for live in self.durable.values() if live.state.parked is not None)

    def recover(self, pool: Pool) -> None:
        """Sessions from the replayed log, each with the KV it had parked if the segment still
        holds it (any other cached prefix is found by the pool's prefix index when it resumes)."""
        for state in self.log.states.values():
            if state.parked is not None:
                entry, tokens = state.parked
                try:
                    info = pool.info(entry)
                except EntryNotFound:
                    info = None
                # A recreated pool numbers entries from 1 again: the tag (this session's, or the
                # parent's for a fork that shared its parent's parked KV) tells them apart.
                owners = {f"session:{state.id}", f"session:{state.parent}"}
                if (info is None or info.identity != self.descriptor.identity or info.tokens != tokens
                        or info.tag not in owners or info.namespace != state.namespace):
                    state.parked = None  # the record names KV the segment no longer holds
            live = self.durable[state.id] = Live(state, active_at=self.clock())  # idle from this start on
            self.owned[state.tenant] += 1
            self.parked_count += state.parked is not None
            self.turns_closed += self.close_left_open(live)

    # ----------------------------------------------------------------------------- chat

    def template(self) -> ChatTemplate:
        """The model's chat template, with the text of its special tokens (made on first use)."""
        if self._chat is None:
            self._chat = chat_template(self.descriptor, self.engine)
        return self._chat

    def tool_use(self, tools: Tools, choice: Any = None, parallel: bool | None = None) -> ToolUse:
        """How a generation may call `tools` (ToolUse.of's fields), in the format of the model's
        template, with the format's marks that are special tokens of the vocabulary."""
        if self._marks is None:  # (the vocabulary's: the same every time)
            self._marks = special_marks(self._tokenize)
        return self.template().tool_use(tools, choice, parallel, self._marks)

    def chat_view(self, live: Live) -> tuple[int, tuple[dict, ...], Tools | None]:
        """What appending messages renders against: (`live`'s version, its messages, the tools its
        conversation offers). A caller renders on its own thread and hands the tokens to
        `append_rendered` with that version."""
        return live.version, tuple(live.state.messages), live.state.tools

    def append_messages(self, live: Live, messages: Sequence[Any]) -> None:
        """Chat messages (messages.ChatMessage, or their pair or dict forms) in turn, rendered here
        (`appended_pieces`: a long list at once), in one record."""
        added = as_dicts(messages)
        try:
            pieces = appended_pieces(self.template(), self._tokenize, live.state.messages, added, live.state.tools)
        except TemplateRewrites:
            self._rerender(live, *added)
            return
        self._commit_messages(live, added, pieces)

    def append_rendered(self, live: Live, version: int, messages: Sequence[dict], pieces: list[list[int]]) -> bool:
        """Messages (as a session keeps them) rendered by the caller against `chat_view`'s
        `version`: committed if `live` has not changed since (True), else nothing (False: render again)."""
        if live.version != version:
            return False
        self._commit_messages(live, list(messages), pieces)
        return True

    def _commit_messages(self, live: Live, added: list[dict], pieces: list[list[int]]) -> None:
        """Commit `pieces` (one per message of `added`, or one for them all) with their Turns."""
        state, tokens, ends = live.state, [], []
        for piece in pieces:
            tokens += piece
            ends.append(len(state.tokens) + len(tokens))
        if len(pieces) != len(added):  # rendered at once: each ends where they all end
            ends = [ends[-1]] * len(added)
        self._check_room(live, len(tokens), f"{len(added)} message(s) of ")
        self.commit(live, tokens, *(Turn.of(state.id, m, end) for m, end in zip(added, ends)))

    def _tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(text, special=True)

    def _rerender(self, live: Live, *added: dict) -> None:
        """Add the messages `added` under a template that rewrites earlier turns: the whole
        conversation is rendered and tokenized, the session keeps its longest common token prefix
        with that (and the KV of it), and the rest replaces what followed, as llama-server reuses
        a cached prompt. Raw tokens appended between messages are not part of any rendering, so
        they go too."""
        state = live.state
        messages = [*state.messages, *added]
        tokens = self.engine.tokenize(self.template().render(messages, tools=state.tools), special=True)
        keep = next((i for i, (a, b) in enumerate(zip(tokens, state.tokens)) if a != b), min(len(tokens),
                                                                                             len(state.tokens)))
        records = []
        kept = sum(1 for end in state.message_ends if end <= keep)  # the messages the cut leaves whole
        # where a rewritten message ends inside the new text is unknown: each ends with the whole
        records += [Turn.of(state.id, m, len(tokens)) for m in messages[kept:]]
        self._check_room(live, len(tokens) - len(state.tokens), f"{len(added)} message(s) of ")
        if keep < len(state.tokens):
            self.kv.cut(live, keep)
            records.insert(0, Trimmed(state.id, keep))
        self.commit(live, tokens[keep:], *records, at=keep)  # one log append: all or nothing
        self.kv.follow_pin(live)

    def append_tokens(self, live: Live, tokens: list[int]) -> None:
        """Raw token ids (ValueError for ids outside the vocabulary)."""
        vocab = self.descriptor.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside this model's vocabulary (0..{vocab - 1})")
        self._check_room(live, len(tokens), "")
        self.commit(live, list(tokens))

    def _check_room(self, live: Live, added: int, what: str) -> None:
        """ContextFull, before anything is appended, when `added` more tokens would take `live` past
        what one session can hold: every later generation, fork or snapshot of it would fail."""
        limit, held = self.context_limit(), len(live.state.tokens)
        if limit and held + added > limit:
            raise ContextFull(f"session {live.state.id!r} holds {held} tokens; appending {what}{added} tokens would "
                              f"pass the {limit} one session can hold; nothing was appended: trim the session, or "
                              "start a new one")

    def append_text(self, live: Live, text: str) -> None:
        """Text tokenized as it is; at the start of a session, after a BOS where the model asks
        for one (as llama-cpp-python and llama-server tokenize a raw prompt)."""
        tokens = self.engine.tokenize(text, special=True)
        bos = self.descriptor.bos_token
        if bos is not None and not live.state.tokens and tokens[:1] != [bos]:
            tokens = [bos, *tokens]
        self.append_tokens(live, tokens)

    def fill_request(self, live: Live, prompt: PreparedPrompt) -> None:
        """Give a new request lane its prompt, built on the caller's side: in memory, in one go
        (a request lane writes no records, so a long conversation costs a list extension here)."""
        assert not live.durable and not live.state.tokens, "only a new request lane is filled this way"
        state = live.state
        state.tokens.extend(prompt.tokens)
        state.messages.extend(prompt.messages)
        state.message_ends.extend(prompt.message_ends)
        live.since_park += len(prompt.tokens)
        live.warmed = prompt.warmed
        live.last_used = self.order()

    def opening(self, live: Live) -> list[int]:
        """The tokens that open the assistant's turn in a chat session (none outside a chat)."""
        if not live.state.messages:
            return []
        return self.engine.tokenize(self.template().opening(live.state.messages, live.state.tools), special=True)

    def close_turn(self, live: Live, job: Job) -> None:
        """After a chat generation: the assistant's message, and the template's end-of-turn text.
        Not for a request lane: its conversation goes on, if at all, in the client's next request,
        which brings the reply with it (and its KV is parked without the closing, never fed)."""
        if not live.state.messages or not live.durable:
            return
        message = None
        use = job.request.tools
        if use is not None and use.reads_calls:  # the calls it made are kept as calls (OpenAI's shape)
            content, calls = use.parse(job.stream.text, job.generation.call_seed)  # (the ids its reader sees)
            if calls:
                message = ChatMessage("assistant", content or "", tuple(calls)).as_dict()
        produced = live.state.tokens[job.first:]
        try:
            self._close(live, produced, job.stream.text, message)
        except ChatError:
            if message is None:
                raise
            # the template refuses the calls as they were made (an id it does not take, say):
            # the turn is kept as the text the model wrote, which it rendered as it is
            self._close(live, produced, job.stream.text)

    def _close(self, live: Live, produced: list[int], text: str, message: dict | None = None) -> None:
        """Close the assistant's turn whose tokens since its opening are `produced` and whose reply
        (as its reader saw it: stop strings held back) is `text`; `message`: the assistant's
        message as kept, where it is more than that text (the calls it made)."""
        eos = self.descriptor.eos_tokens
        ended = bool(produced) and produced[-1] in eos
        reply = self.engine.detokenize(produced[:-1] if ended else produced).decode(errors="replace")
        message = {"role": "assistant", "content": text} if message is None else message
        try:
            closing = self.template().closing(live.state.messages, reply, live.state.tools, message)
        except TemplateRewrites:  # the reply renders otherwise than it was written (a template that
            # strips reasoning, or trims the reply; calls laid out otherwise): the session takes
            # what the template renders
            self._rerender(live, message)
            return
        if ended:
            mark = self.engine.detokenize([produced[-1]]).decode(errors="replace")
            closing = closing[len(mark):] if closing.startswith(mark) else closing
        tokens = self.engine.tokenize(closing, special=True) if closing else []
        self.commit(live, tokens, Turn.of(live.state.id, message, len(live.state.tokens) + len(tokens)))

    def close_left_open(self, live: Live) -> bool:
        """Close the assistant's turn a crash or a refused write left open (a generation's opening
        and reply were logged, the record closing it was not): the partial reply becomes the
        assistant's message, so the conversation goes on (a template that requires alternating
        roles would refuse every later message otherwise). True if there was one. Only a turn a
        generation opened is closed: tokens a caller appended raw (an assistant's reply begun by
        the application, say) are its own to go on from."""
        state = live.state
        if state.open_turn is None or live.job is not None:
            return False
        produced = state.tokens[state.open_turn[1]:]
        text = self.engine.detokenize([t for t in produced if t not in self.descriptor.eos_tokens]).decode(
            errors="replace")
        self._close(live, produced, text)
        return True

    # ----------------------------------------------------------------------------- reading

    @staticmethod
    def info(live: Live) -> SessionInfo:
        """A session's summary."""
        state = live.state
        return SessionInfo(state.id, len(state.tokens), len(state.messages), state.priority, state.created,
                           state.parent, state.parked[1] if state.parked else 0, live.job is not None)
