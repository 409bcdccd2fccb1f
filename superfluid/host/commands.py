"""What each Host and Session call does, run on the scheduler thread.

The Host submits these as typed calls (`host.call(host.commands.trim, session_id, 10)`) and waits
on a future; nothing here may be called from another thread, since it touches the engine, the
session log and the pool. Each command checks what it is given and hands the work to its owner:
sessions' state and records to `Sessions`, KV to the KV manager, generations to the scheduler.
"""

from __future__ import annotations

import copy

import msgspec

from engines.errors import EngineError
from superfluid.host.errors import ContextFull, EmptySession, SessionBusy, TooManySessions
from superfluid.host.lane import Job, Live
from superfluid.host.prompts import PreparedPrompt
from superfluid.host.request import GenerateRequest, Priority
from superfluid.host.sampling import Sampling
from superfluid.host.engine_thread import EngineThread
from superfluid.host.session import Generation, SessionInfo
from superfluid.host.stats import HostStats
from superfluid.host.stream import TextStream
from superfluid.host.tenants import UNNAMED, check_tenant, salt_digest
from superfluid.host.tools import Tools, ToolUse


class Commands:
    """The scheduler-thread side of every session call."""

    def __init__(self, thread: EngineThread) -> None:
        self.thread = thread
        self.scheduler = scheduler = thread.scheduler
        self.sessions, self.kv, self.counters = scheduler.sessions, scheduler.kv, scheduler.counters
        self.engine, self.descriptor = scheduler.engine, scheduler.descriptor

    def _live(self, session_id: str, tenant: str | None, *, idle: bool = False) -> Live:
        """The session `session_id` of `tenant` (None: of any tenant, the embedding application's
        view); `idle`: SessionBusy while it generates, and what it owes settled first."""
        live = self.sessions.get(session_id, tenant)
        if idle:
            self._idle(live)
            # what a record the disk refused left undone (a cut, a reply's closing), first
            self.sessions.settle(live)
        return live

    def _idle(self, live: Live) -> None:
        """SessionBusy unless `live` has no generation running (one cancelled but not yet seen by
        a tick is ended here)."""
        if live.job is not None and live.job.generation.cancelled.is_set():
            self.scheduler.finish(live, "cancelled")
        if live.job is not None:
            raise SessionBusy(f"session {live.state.id!r} is generating; wait for it to finish or cancel it first")

    def template(self):
        """The model's chat template (see Sessions.template)."""
        return self.sessions.template()

    # ----------------------------------------------------------------------------- lifecycle

    def recover(self) -> None:
        """Sessions from the replayed log, with the KV they had parked where the pool still holds it."""
        self.sessions.recover(self.kv.pool)

    def create(self, session_id: str | None, system: str | None, settings: Sampling, priority: str, *,
               tenant: str = UNNAMED, cache_salt: str | None = None, tools: Tools | None = None) -> str:
        """A new session of `tenant` whose prompts share cached KV only with sessions of the same
        tenant and `cache_salt` (tenants.py), its conversation offering `tools`; its id
        (TooManySessions at the cap)."""
        salt = salt_digest(cache_salt)
        self._check_session_cap()
        live = self.sessions.open(session_id, settings, priority, check_tenant(tenant), salt, tools)
        if system is not None:
            try:
                self.sessions.append_messages(live, [("system", system)])
            except BaseException:  # (a template that refuses it: Llama 3's, offered tools, wants the
                # user message that carries them too): no session is left behind
                self.kv.drop(live)
                self.sessions.remove(live)
                raise
        return live.state.id

    def close(self) -> None:
        """End every generation, park every lane, close the log, the engine and the pool."""
        scheduler = self.scheduler
        self.thread.stop()  # commands queued behind this one are refused
        try:
            for live in list(self.sessions):
                if live.job is not None:
                    scheduler.finish(live, "closed")
                try:
                    self.kv.park(live, keep_lane=False)
                except EngineError:  # this lane's KV is lost; its tokens are in the log
                    pass
        finally:
            self.sessions.log.close()
            self.engine.close()
            self.kv.warming.stop()  # (a pool does not close while a caller's thread reads into it)
            self.kv.pool.close()

    # ----------------------------------------------------------------------------- appending

    def append_messages(self, session_id: str, messages: list, *, tenant: str | None = None) -> None:
        """Chat messages (any form messages.ChatMessage.of takes) in turn, rendered here; a long list at once
        (Host.append_messages renders them on the caller's thread instead)."""
        self.sessions.append_messages(self._live(session_id, tenant, idle=True), messages)

    def chat_view(self, session_id: str, *, tenant: str | None = None) -> tuple[int, tuple[dict, ...], Tools | None]:
        """(version, messages, tools) of an idle session, to render appended messages against."""
        return self.sessions.chat_view(self._live(session_id, tenant, idle=True))

    def append_rendered(self, session_id: str, version: int, messages: list[dict],
                        pieces: list[list[int]], *, tenant: str | None = None) -> bool:
        """Messages rendered by the caller against `chat_view`'s version; False if the session
        changed since (nothing is appended: render again)."""
        return self.sessions.append_rendered(self._live(session_id, tenant, idle=True), version, messages, pieces)

    def append_tokens(self, session_id: str, tokens: list[int], *, tenant: str | None = None) -> None:
        """Raw token ids (ValueError for ids outside the vocabulary)."""
        self.sessions.append_tokens(self._live(session_id, tenant, idle=True), tokens)

    def append_text(self, session_id: str, text: str, *, tenant: str | None = None) -> None:
        """Text tokenized as it is (after a BOS at the start, where the model asks for one)."""
        self.sessions.append_text(self._live(session_id, tenant, idle=True), text)

    # ----------------------------------------------------------------------------- generating

    def generate(self, session_id: str, request: GenerateRequest, *, tenant: str | None = None) -> Generation:
        """Queue a generation of the session as `request` asks (Overloaded when the wait queue is
        full). Where the session offers tools and the request says nothing of them, the model may
        call them (tool choice auto: its reply is read for calls)."""
        live = self._live(session_id, tenant, idle=True)
        if request.tools is None and live.state.tools is not None:
            request = msgspec.structs.replace(request, tools=self.tool_use(live.state.tools))
        return self._start(live, request)

    def tools(self, session_id: str, *, tenant: str | None = None) -> Tools | None:
        """The tools the session's conversation offers (None: none)."""
        return self._live(session_id, tenant).state.tools

    def tool_use(self, tools: Tools, choice=None, parallel: bool | None = None) -> ToolUse:
        """How a generation may call `tools` (ToolUse.of's fields), in the model's own format."""
        return self.sessions.tool_use(tools, choice, parallel)

    def _start(self, live: Live, request: GenerateRequest, opening: list[int] | None = None) -> Generation:
        """Queue `live`'s generation; `opening`: the assistant's opening, where it was tokenized
        already (None: rendered here, for a chat)."""
        opening = self.sessions.opening(live) if opening is None else opening
        total, limit = len(live.state.tokens) + len(opening), self.scheduler.context_limit()
        name = f"session {live.state.id!r}" if live.durable else "the request"
        if not total:
            raise EmptySession(f"{name} holds no tokens to generate from; append a message or text")
        if limit and total >= limit:
            raise ContextFull(f"{name} holds {total} tokens with the assistant's opening; the engine holds at most "
                              f"{limit} for one session; trim it or start a new session")
        self.scheduler.check_capacity(live)
        opened_at = len(live.state.tokens)
        if opening:  # only once the generation is sure to start
            self.sessions.commit(live, opening, opens_turn=True)
        tokens = live.state.tokens
        self.kv.cut(live, len(tokens) - 1)  # the last token's logits are needed
        generation = Generation(live.state.id, request.tools)
        generation._alive = self.thread.alive
        now = self.thread.arrived  # (the caller's wait for the step in flight counts)
        job = Job(generation, request, request.settings(live.state.sampling),
                  request.priority if request.priority is not None else Priority.named(live.state.priority),
                  TextStream(list(request.stop)), None if request.timeout is None else now + request.timeout,
                  self.scheduler.next_order(), now, self.scheduler.fed, first=len(tokens), opened_at=opened_at,
                  matching=None if request.constraint is None else request.constraint.start())
        self.scheduler.enqueue(live, job)
        return generation

    def start_request(self, prompt: PreparedPrompt, request: GenerateRequest, *, tenant: str = UNNAMED,
                      cache_salt: str | None = None) -> tuple[str, Generation]:
        """A one-shot request (an OpenAI chat or text completion) of `tenant` on a request lane of
        its own: never logged, never listed, forked or deleted by anyone; its prompt built on the
        caller's side (Host.prepare); starting from cached KV of its tenant and `cache_salt` only.
        (The lane's id for `end_request`, the generation.) On any refusal (Overloaded,
        ContextFull) the lane is gone again."""
        live = self.sessions.open_request(check_tenant(tenant), salt_digest(cache_salt))
        try:
            self.sessions.fill_request(live, prompt)
            return live.state.id, self._start(live, request, prompt.opening)
        except BaseException:
            self.kv.drop(live)
            self.sessions.remove(live)
            raise

    def end_request(self, request_id: str) -> None:
        """End a one-shot request now (cancelled if it still runs). A request lane ends with its
        generation: its KV parked in the pool under its prefix for later requests, its lane gone
        (so after the generation's end this does nothing)."""
        live = self.sessions.requests.get(request_id)
        if live is not None:
            self.scheduler.finish(live, "cancelled")

    def _retire(self, live: Live) -> None:
        if live.job is not None:
            self.scheduler.finish(live, "cancelled")
        self.kv.park(live, keep_lane=False)
        self.kv.drop(live)
        self.sessions.remove(live)

    # ----------------------------------------------------------------------------- shaping

    def fork(self, session_id: str, child_id: str | None = None, *, tenant: str | None = None) -> str:
        """A child session (`child_id`, or a fresh id) with the parent's tokens and messages,
        sharing its KV; its id."""
        parent = self._live(session_id, tenant)
        self._check_session_cap()
        child = self.sessions.fork(parent, child_id)
        self.kv.fork(parent, child)
        return child.state.id

    def trim(self, session_id: str, n_tokens: int, *, tenant: str | None = None) -> None:
        """Keep the session's first `n_tokens` tokens."""
        live = self._live(session_id, tenant, idle=True)
        if not isinstance(n_tokens, int) or not 0 <= n_tokens <= len(live.state.tokens):
            raise ValueError(f"trim({n_tokens!r}): session {session_id!r} holds {len(live.state.tokens)} tokens")
        self.sessions.trim(live, n_tokens)

    def _check_session_cap(self) -> None:
        cap = self.scheduler.policy.max_sessions
        if cap is not None and len(self.sessions.durable) >= cap:
            raise TooManySessions(f"the host holds {cap} sessions, its max_sessions (serve's --max-sessions); delete "
                                  "sessions you no longer need, or raise the cap")

    def delete(self, session_id: str, *, tenant: str | None = None) -> None:
        """Remove the session (cancelling its generation) and erase its parked KV, from memory
        (where nobody holds it) and from disk; what a fork still starts from stays."""
        live = self._live(session_id, tenant)
        if live.job is not None:
            self.scheduler.finish(live, "cancelled")
        self.kv.drop(live)
        self.sessions.remove(live)
        self.kv.erase([live], self.sessions.durable.values())

    def retire(self, session_id: str, *, tenant: str | None = None) -> None:
        """Park the session's KV (cached for later requests with its prefix), then delete it."""
        self._retire(self._live(session_id, tenant))

    def pin(self, session_id: str, *, tenant: str | None = None) -> int:
        """Pin the session's parked KV (see Session.pin); the bytes pinned."""
        return self.kv.pin(self._live(session_id, tenant))

    def unpin(self, session_id: str, *, tenant: str | None = None) -> None:
        """Let the session's parked KV be evicted again."""
        self.kv.unpin(self._live(session_id, tenant))

    # ----------------------------------------------------------------------------- reading

    def tokens(self, session_id: str, *, tenant: str | None = None) -> list[int]:
        """The session's committed tokens."""
        return list(self._live(session_id, tenant).state.tokens)

    def messages(self, session_id: str, *, tenant: str | None = None) -> list[dict]:
        """The session's chat messages (copies: their tool calls too)."""
        return copy.deepcopy(self._live(session_id, tenant).state.messages)

    def info(self, session_id: str, *, tenant: str | None = None) -> SessionInfo:
        """The session's summary."""
        return self.sessions.info(self._live(session_id, tenant))

    def list(self, *, tenant: str | None = None) -> list[SessionInfo]:
        """Every session's summary, or `tenant`'s sessions' only (request lanes are nobody's to list)."""
        return [self.sessions.info(live) for live in self.sessions.durable.values()
                if tenant is None or live.state.tenant == tenant]

    def detokenize(self, tokens: list[int]) -> str:
        """The text of `tokens`."""
        return self.engine.detokenize(tokens).decode(errors="replace")

    def stats(self) -> HostStats:
        """A snapshot of the counters, the pool and the engine's cells."""
        return self.scheduler.stats()
