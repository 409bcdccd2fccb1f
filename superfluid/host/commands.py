"""What each Host and Session call does, run on the scheduler thread.

The Host submits these as typed calls (`host.call(host.commands.trim, session_id, 10)`) and waits
on a future; nothing here may be called from another thread, since it touches the engine, the
session log and the pool.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from engines.errors import EngineError
from kvpool import EntryNotFound
from superfluid.host import sampling as sampler
from superfluid.host.chat import ChatTemplate, TemplateRewrites
from superfluid.host.conversation_cache import ConversationCache
from superfluid.host.errors import ContextFull, SessionBusy, SessionNotFound, SuperfluidError
from superfluid.host.lane import Job, Live
from superfluid.host.log import Deleted, Opened, SessionLog, Tokens, Trimmed, Turn
from superfluid.host.scheduler import Scheduler
from superfluid.host.session import PRIORITIES, Generation, SessionInfo
from superfluid.host.stats import Counters, HostStats
from superfluid.host.stream import TextStream


@dataclass(frozen=True)
class OneShot:
    """A request that is its own session (an OpenAI chat or completion): what to put in it and
    how to generate."""

    sampling: dict
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    text: str | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    priority: str | None = None
    logprobs: int | None = None  # alternatives per token's logprobs (None: none)


class Commands:
    """The scheduler-thread side of every session call."""

    def __init__(self, scheduler: Scheduler, log: SessionLog, counters: Counters) -> None:
        self.scheduler, self.log, self.counters = scheduler, log, counters
        self.kv = scheduler.kv
        self.engine, self.descriptor = scheduler.engine, scheduler.descriptor
        self.sessions = scheduler.sessions
        self._chat: ChatTemplate | None = None
        self._conversations: ConversationCache | None = None

    def _live(self, session_id: str, *, idle: bool = False) -> Live:
        live = self.sessions.get(session_id)
        if live is None:
            raise SessionNotFound(f"no session {session_id!r} (see Host.sessions())")
        if idle and live.job is not None and live.job.generation.cancelled.is_set():
            self.scheduler.finish(live, "cancelled")  # cancelled but not yet seen by a tick
        if idle and live.job is not None:
            raise SessionBusy(f"session {session_id!r} is generating; wait for it to finish or cancel it first")
        return live

    def template(self) -> ChatTemplate:
        """The model's chat template, with the text of its special tokens (made on first use)."""
        if self._chat is None:
            info = self.descriptor
            special = lambda token: self.engine.detokenize([token]).decode(errors="replace") if token is not None else ""  # noqa: E731
            self._chat = ChatTemplate(info.chat_template, special(info.bos_token),
                                      special(info.eos_tokens[0] if info.eos_tokens else None))
        return self._chat

    def conversations(self) -> ConversationCache:
        """Recent requests' histories as tokens (made on first use)."""
        if self._conversations is None:
            self._conversations = ConversationCache(self.template(), lambda text: self.engine.tokenize(text, special=True))
        return self._conversations

    # ----------------------------------------------------------------------------- lifecycle

    def recover(self) -> None:
        """Sessions from the replayed log, each with the KV it had parked if the segment still
        holds it (any other cached prefix is found by the pool's prefix index when it resumes)."""
        for state in self.log.states.values():
            live = Live(state)
            if state.parked is not None:
                entry, tokens = state.parked
                try:
                    info = self.kv.pool.info(entry)
                except EntryNotFound:
                    info = None
                # A recreated pool numbers entries from 1 again: the tag (this session's, or the
                # parent's for a fork that shared its parent's parked KV) tells them apart.
                owners = {f"session:{state.id}", f"session:{state.parent}"}
                if (info is not None and info.identity == self.descriptor.identity and info.tokens == tokens
                        and info.tag in owners):
                    live.entry = entry
            self.sessions[state.id] = live

    def create(self, session_id: str | None, system: str | None, settings: sampler.Sampling, priority: str) -> str:
        """A new session; its id."""
        session_id = session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            raise SuperfluidError(f"a session {session_id!r} exists already; resume it with Host.session(id=...)")
        self.log.append(Opened(session_id, time.time(), settings, priority))
        self.sessions[session_id] = Live(self.log.states[session_id])
        if system is not None:
            self.append_message(session_id, "system", system)
        return session_id

    def close(self) -> None:
        """End every generation, park every lane, close the log, the engine and the pool."""
        scheduler = self.scheduler
        scheduler.stop()  # commands queued behind this one are refused
        try:
            for live in list(self.sessions.values()):
                if live.job is not None:
                    scheduler.finish(live, "closed")
                try:
                    self.kv.park(live, keep_lane=False)
                except EngineError:  # this lane's KV is lost; its tokens are in the log
                    pass
        finally:
            self.log.close()
            self.engine.close()
            self.kv.pool.close()

    # ----------------------------------------------------------------------------- appending

    def append_message(self, session_id: str, role: str, content: str) -> None:
        """A chat message, rendered by the model's template."""
        live = self._live(session_id, idle=True)
        message = {"role": role, "content": content}
        try:
            text = self.template().turn(live.state.messages, message)
        except TemplateRewrites:
            self._rerender(live, message)
            return
        tokens = self.engine.tokenize(text, special=True)
        self.scheduler.commit(live, tokens, Turn(session_id, role, content, len(live.state.tokens) + len(tokens)))

    def _rerender(self, live: Live, message: dict) -> None:
        """Add `message` under a template that rewrites earlier turns: the whole conversation is
        rendered and tokenized, the session keeps its longest common token prefix with that (and
        the KV of it), and the rest replaces what followed, as llama-server reuses a cached prompt.
        Raw tokens appended between messages are not part of any rendering, so they go too."""
        state = live.state
        messages = [*state.messages, message]
        tokens = self.engine.tokenize(self.template().render(messages), special=True)
        keep = next((i for i, (a, b) in enumerate(zip(tokens, state.tokens)) if a != b), min(len(tokens),
                                                                                             len(state.tokens)))
        records = []
        if keep < len(state.tokens):
            self.kv.cut(live, keep)
            records.append(Trimmed(state.id, keep))
        kept = sum(1 for end in state.message_ends if end <= keep)  # the messages the cut leaves whole
        # where a rewritten message ends inside the new text is unknown: each ends with the whole
        records += [Turn(state.id, m["role"], m["content"], len(tokens)) for m in messages[kept:]]
        self.scheduler.commit(live, tokens[keep:], *records, at=keep)  # one log append: all or nothing
        if state.parked is None:
            self.kv.hold(live, None)

    def append_tokens(self, session_id: str, tokens: list[int]) -> None:
        """Raw token ids (ValueError for ids outside the vocabulary)."""
        live = self._live(session_id, idle=True)
        vocab = self.descriptor.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside this model's vocabulary (0..{vocab - 1})")
        self.scheduler.commit(live, list(tokens))

    def append_text(self, session_id: str, text: str) -> None:
        """Text tokenized as it is; at the start of a session, after a BOS where the model asks
        for one (as llama-cpp-python and llama-server tokenize a raw prompt)."""
        tokens = self.engine.tokenize(text, special=True)
        bos = self.descriptor.bos_token
        if bos is not None and not self._live(session_id, idle=True).state.tokens and tokens[:1] != [bos]:
            tokens = [bos, *tokens]
        self.append_tokens(session_id, tokens)

    # ----------------------------------------------------------------------------- generating

    def generate(self, session_id: str, max_tokens: int, stop, timeout: float | None, overrides: dict,
                 keep_logits: bool = False, ignore_eos: bool = False, priority: str | None = None,
                 logprobs: int | None = None) -> Generation:
        """Queue a generation for the session (Overloaded when the wait queue is full)."""
        live = self._live(session_id, idle=True)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r}: must be a whole number >= 1")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: must be a number of seconds > 0")
        if priority is not None and priority not in PRIORITIES:
            raise ValueError(f"priority {priority!r}: use one of {', '.join(PRIORITIES)}")
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                     or not 0 <= logprobs <= sampler.MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs={logprobs!r}: must be a whole number of alternatives in "
                             f"[0, {sampler.MAX_TOP_LOGPROBS}], or None for no logprobs")
        settings = sampler.Sampling(**{**{f: getattr(live.state.sampling, f) for f in sampler.Sampling.__struct_fields__},
                                       **overrides})
        opening = []
        if live.state.messages:
            opening = self.engine.tokenize(self.template().opening(live.state.messages), special=True)
        total, limit = len(live.state.tokens) + len(opening), self.scheduler.context_limit()
        if not total:
            raise SuperfluidError(f"session {session_id!r} holds no tokens to generate from; append a message or text")
        if limit and total >= limit:
            raise ContextFull(f"session {session_id!r} holds {total} tokens with the assistant's opening; the engine "
                              f"holds at most {limit} for one session; trim it or start a new session")
        self.scheduler.check_capacity(live)
        opened_at = len(live.state.tokens)
        if opening:  # only once the generation is sure to start
            self.scheduler.commit(live, opening)
        tokens = live.state.tokens
        self.kv.cut(live, len(tokens) - 1)  # the last token's logits are needed
        generation = Generation(session_id)
        generation._alive = self.scheduler.alive
        deadline = None if timeout is None else self.scheduler.clock() + timeout
        job = Job(generation, max_tokens, settings, TextStream(stop), deadline,
                  PRIORITIES.index(priority or live.state.priority), self.scheduler.next_order(),
                  self.scheduler.clock(), self.scheduler.fed, first=len(tokens), opened_at=opened_at,
                  keep_logits=bool(keep_logits), ignore_eos=bool(ignore_eos), logprobs=logprobs)
        self.scheduler.enqueue(live, job)
        return generation

    def start_one_shot(self, request: OneShot) -> tuple[str, Generation]:
        """A new session holding `request`'s messages or text, generating; (its id, the generation).
        On any refusal (Overloaded, ContextFull, a bad value) the session is deleted again."""
        session_id = self.create(None, None, sampler.Sampling(**request.sampling), "default")
        try:
            if request.messages:
                self._open_conversation(session_id, request.messages)
            if request.text is not None:
                self.append_text(session_id, request.text)
            return session_id, self.generate(session_id, request.max_tokens, list(request.stop), None, {},
                                             ignore_eos=request.ignore_eos, priority=request.priority,
                                             logprobs=request.logprobs)
        except BaseException:
            self.delete(session_id)
            raise

    def _open_conversation(self, session_id: str, messages: tuple[tuple[str, str], ...]) -> None:
        """A new session's whole history, as `append_message` one at a time would add it, in one
        log append, rendering only what recent requests did not (see ConversationCache)."""
        live = self._live(session_id, idle=True)
        try:
            pieces = self.conversations().tokens(messages)
        except TemplateRewrites:  # each message in turn, the history rendered again where it must be
            for role, content in messages:
                self.append_message(session_id, role, content)
            return
        tokens, turns, start = [], [], len(live.state.tokens)
        for (role, content), piece in zip(messages, pieces):
            tokens += piece
            turns.append(Turn(session_id, role, content, start + len(tokens)))
        self.scheduler.commit(live, tokens, *turns)

    def close_turn(self, live: Live, job: Job) -> None:
        """After a chat generation: the assistant's message, and the template's end-of-turn text."""
        if not live.state.messages:
            return
        produced = live.state.tokens[job.first:]
        eos = self.descriptor.eos_tokens
        ended = bool(produced) and produced[-1] in eos
        reply = self.engine.detokenize(produced[:-1] if ended else produced).decode(errors="replace")
        try:
            closing = self.template().closing(live.state.messages, reply)
        except TemplateRewrites:  # the reply renders otherwise than it was written (a template that
            # strips reasoning, or trims the reply): the session takes what the template renders
            self._rerender(live, {"role": "assistant", "content": job.stream.text})
            return
        if ended:
            mark = self.engine.detokenize([produced[-1]]).decode(errors="replace")
            closing = closing[len(mark):] if closing.startswith(mark) else closing
        tokens = self.engine.tokenize(closing, special=True) if closing else []
        self.scheduler.commit(live, tokens, Turn(live.state.id, "assistant", job.stream.text,
                                                 len(live.state.tokens) + len(tokens)))

    # ----------------------------------------------------------------------------- shaping

    def fork(self, session_id: str, child_id: str | None = None) -> str:
        """A child session (`child_id`, or a fresh id) with the parent's tokens and messages,
        sharing its KV; its id."""
        parent = self._live(session_id)
        child_id = child_id or uuid.uuid4().hex
        if child_id in self.sessions:
            raise SuperfluidError(f"a session {child_id!r} exists already; fork into a new id")
        state = parent.state
        records = [Opened(child_id, time.time(), state.sampling, state.priority, session_id)]
        records += [Turn(child_id, m["role"], m["content"], end) for m, end in zip(state.messages, state.message_ends)]
        records.append(Tokens(child_id, 0, list(state.tokens)))
        self.log.append(*records)
        child = Live(self.log.states[child_id])
        child.last_used, child.idle_since = self.scheduler.next_order(), self.scheduler.clock()
        self.kv.fork(parent, child)
        self.sessions[child_id] = child
        return child_id

    def trim(self, session_id: str, n_tokens: int) -> None:
        """Keep the session's first `n_tokens` tokens."""
        live = self._live(session_id, idle=True)
        if not isinstance(n_tokens, int) or not 0 <= n_tokens <= len(live.state.tokens):
            raise ValueError(f"trim({n_tokens!r}): session {session_id!r} holds {len(live.state.tokens)} tokens")
        self.kv.cut(live, n_tokens)
        self.log.append(Trimmed(session_id, n_tokens))
        if live.state.parked is None:
            self.kv.hold(live, None)

    def delete(self, session_id: str) -> None:
        """Remove the session (cancelling its generation); its parked KV becomes evictable."""
        live = self._live(session_id)
        if live.job is not None:
            self.scheduler.finish(live, "cancelled")
        self.kv.drop(live)
        self.log.append(Deleted(session_id))
        del self.sessions[session_id]

    def retire(self, session_id: str) -> None:
        """Park the session's KV (cached for later requests with its prefix), then delete it."""
        live = self._live(session_id)
        if live.job is not None:
            self.scheduler.finish(live, "cancelled")
        self.kv.park(live, keep_lane=False)
        self.delete(session_id)

    def pin(self, session_id: str) -> int:
        """Pin the session's parked KV (see Session.pin); the bytes pinned."""
        return self.kv.pin(self._live(session_id))

    def unpin(self, session_id: str) -> None:
        """Let the session's parked KV be evicted again."""
        self.kv.unpin(self._live(session_id))

    # ----------------------------------------------------------------------------- reading

    def tokens(self, session_id: str) -> list[int]:
        """The session's committed tokens."""
        return list(self._live(session_id).state.tokens)

    def messages(self, session_id: str) -> list[dict]:
        """The session's chat messages."""
        return [dict(m) for m in self._live(session_id).state.messages]

    def info(self, session_id: str) -> SessionInfo:
        """The session's summary."""
        live = self._live(session_id)
        state = live.state
        return SessionInfo(state.id, len(state.tokens), len(state.messages), state.priority, state.created,
                           state.parent, state.parked[1] if state.parked else 0, live.job is not None)

    def list(self) -> list[SessionInfo]:
        """Every session's summary."""
        return [self.info(session_id) for session_id in self.sessions]

    def detokenize(self, tokens: list[int]) -> str:
        """The text of `tokens`."""
        return self.engine.detokenize(tokens).decode(errors="replace")

    def stats(self) -> HostStats:
        """A snapshot of the counters, the pool and the engine's cells."""
        pool, engine, c, kv = self.kv.pool.stats(), self.engine.stats(), self.counters, self.kv
        lives = self.sessions.values()
        return HostStats(c.prefill_tokens, c.decode_tokens, c.cached_tokens, c.generations, c.exports, c.imports,
                         c.import_failures, c.export_failures, c.preemptions, pool.bytes_copied + engine.bytes_copied,
                         pool.bytes_copied, engine.bytes_copied, pool.evictions, pool.bytes_used, pool.entries,
                         len(lives), len(kv.lanes), sum(1 for live in lives if live.job),
                         waiting=self.scheduler.waiting(), parked_sessions=sum(
                             1 for live in lives if live.seq is None and live.entry is not None),
                         idle_parks=c.idle_parks, rejected=c.rejected, cells_total=kv.cells_total,
                         cells_used=kv.cells_used(), cells_reserved=kv.cells_reserved(),
                         cell_price=self.descriptor.cell_price, pool_budget_bytes=pool.budget_bytes)
