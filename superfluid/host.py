"""The Host: one model in this process, its scheduler thread, the shared KV pool and the session log.

    host = Host("model.gguf")                     # the runtime follows the file, or runtime="mlx"
    s = host.session(system="You are terse.")
    s.append_user("What is the capital of France?")
    for piece in s.generate(max_tokens=32):
        print(piece.text, end="")
    host.close()                                  # parks every lane, syncs the log, keeps the pool

Every method is safe from any thread: it runs as a command on the scheduler thread, the only one
that touches the engine. A restarted Host with the same `log_dir` and `pool_name` finds every
session where it was committed, and the KV it had parked still in the shared segment.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from engines import registry
from engines.errors import EngineError, ModelLoadError
from kvpool import Budget, EntryNotFound, Pool, PoolError, PoolNotFound, host_memory_available, segment
from superfluid import sampling as sampler
from superfluid.chat import ChatTemplate
from superfluid.errors import ContextFull, PinLimit, SessionBusy, SessionNotFound, SuperfluidError
from superfluid.log import Deleted, Opened, Parked, SessionLog, Tokens, Trimmed, Turn
from superfluid.scheduler import Job, Live, Scheduler
from superfluid.session import PRIORITIES, Generation, Session, SessionInfo
from superfluid.stats import Counters, HostStats
from superfluid.stream import TextStream

DEFAULT_POOL_BYTES = 512 << 20
CONTEXT_POLICIES = ("error", "stop")


def default_log_dir(pool_name: str) -> Path:
    """Where a host keeps its session log unless told: ~/.cache/superfluid/sessions/<pool name>."""
    base = Path(os.environ.get("SUPERFLUID_CACHE", Path.home() / ".cache" / "superfluid"))
    return base / "sessions" / pool_name


class Host:
    """A model hosted in this process, with sessions that share, park and survive in a KV pool."""

    def __init__(self, model: str | os.PathLike, *, runtime: str | None = None, pool_name: str = "superfluid",
                 pool_bytes: int = DEFAULT_POOL_BYTES, log_dir: str | os.PathLike | None = None,
                 log_sync: str = "tick", prefill_budget: int = 512, checkpoint_tokens: int = 256,
                 publish_tokens: int = 256, on_context_full: str = "error", high_watermark: float = 0.9,
                 low_watermark: float = 0.75, max_pinned_fraction: float = 0.5, export_budget: int | None = None,
                 **runtime_options: Any) -> None:
        """Load `model` with `runtime` (default: the one the file calls for), attach or create the
        pool `pool_name`, replay the session log in `log_dir`. Runtime options are passed as
        `<runtime>_<option>=value` (for example llamacpp_threads=2, mlx_prefill_chunk=256)."""
        self.runtime = runtime or registry.runtime_for(model)
        options = _runtime_options(self.runtime, runtime_options)
        if on_context_full not in CONTEXT_POLICIES:
            raise ValueError(f"on_context_full={on_context_full!r}: use one of {', '.join(CONTEXT_POLICIES)}")
        for name, value in (("prefill_budget", prefill_budget), ("checkpoint_tokens", checkpoint_tokens),
                            ("publish_tokens", publish_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a whole number >= 1")
        if not 0 < low_watermark <= high_watermark <= 1 or not 0 <= max_pinned_fraction <= 1:
            raise ValueError(f"watermarks must satisfy 0 < low ({low_watermark}) <= high ({high_watermark}) <= 1, and "
                             f"max_pinned_fraction ({max_pinned_fraction}) lie in [0, 1]")
        self.max_pinned_fraction = max_pinned_fraction
        adapter = registry.adapter(self.runtime)
        self._log = SessionLog(log_dir or default_log_dir(pool_name), log_sync)
        self._counters = Counters()
        self._scheduler = Scheduler(lambda: adapter(model, **options), None, self._log, self._counters,
                                    prefill_budget=prefill_budget, checkpoint_tokens=checkpoint_tokens,
                                    publish_tokens=publish_tokens, on_context_full=on_context_full,
                                    watermarks=(high_watermark, low_watermark))
        try:
            self._scheduler.start()
        except BaseException:
            self._log.close()
            raise
        self.descriptor = self._scheduler.descriptor
        try:
            try:
                self.pool = Pool.attach(pool_name)
            except PoolNotFound:
                left = host_memory_available()  # with the weights and the engine's KV cache loaded now
                if pool_bytes > left:
                    raise ModelLoadError(f"the KV pool ({pool_bytes / 2**30:.2f} GiB) does not fit in the "
                                         f"{left / 2**30:.2f} GiB of memory left once the model and its KV cache "
                                         "are loaded; give a smaller pool_bytes (--pool-bytes) or a smaller context")
                budget = None if export_budget is None else Budget(int(export_budget), None, "set by export_budget")
                self.pool = Pool.create(pool_name, pool_bytes, device=self.descriptor.device, budget=budget)
        except BaseException:  # no pool (busy, full /dev/shm, ...): nothing may stay open
            self._scheduler.stop()
            self._scheduler.thread.join()
            self._log.close()
            raise
        self._scheduler.pool = self.pool
        handlers = {name[len("_on_"):]: getattr(self, name) for name in dir(self) if name.startswith("_on_")}
        self._scheduler.handlers.update(handlers)
        self._scheduler.after_generation = self._close_turn
        try:
            self._call("recover")
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------- public

    def session(self, *, id: str | None = None, system: str | None = None, priority: str = "default",
                **sampling: Any) -> Session:
        """A new session (sampling defaults: temperature, top_k, top_p, min_p, repetition_penalty,
        seed), or with `id` alone the existing one of that id (also after a restart)."""
        if id is not None and system is None and not sampling:
            self._call("info", id)  # SessionNotFound if there is none
            return Session(self, id)
        if priority not in PRIORITIES:
            raise ValueError(f"priority {priority!r}: use one of {', '.join(PRIORITIES)}")
        settings = sampler.Sampling(**sampling)
        return Session(self, self._call("create", id, system, settings, priority))

    def sessions(self) -> list[SessionInfo]:
        """Every session the log holds."""
        return self._call("list")

    def delete(self, session_id: str) -> None:
        """Remove a session (cancelling its generation); its parked KV becomes evictable."""
        self._call("delete", session_id)

    def retire(self, session_id: str) -> None:
        """Park a session's KV in the pool (cached for any later request with the same prefix),
        then delete the session: what a server does with a request's session when it is done."""
        self._call("retire", session_id)

    def stats(self) -> HostStats:
        """Counters for tests, benchmarks and the server."""
        return self._call("stats")

    def close(self, *, remove_pool: bool = False) -> None:
        """Park every live lane, sync and close the log, release the engine and the pool. Its
        segment stays for the next Host unless `remove_pool` (then parked KV is gone, and a
        restarted Host prefills its sessions from the log). Idempotent."""
        scheduler = self._scheduler
        if scheduler.alive():
            try:
                self._call("close")
            finally:
                scheduler.stop()
                scheduler.thread.join()
        else:  # the scheduler failed: what it could not close
            self._log.close()
            try:
                self.pool.close()  # idempotent
            except PoolError:
                pass  # views left open by the failed scheduler: the segment stays for the next Host
        if remove_pool and self.pool.name in segment.list_pool_names():
            segment.unlink(self.pool.name)

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, name: str, *args) -> Any:
        return self._scheduler.call(name, *args)

    # ----------------------------------------------------------------------------- handlers (scheduler thread)

    def _live(self, session_id: str, *, idle: bool = False) -> Live:
        live = self._scheduler.sessions.get(session_id)
        if live is None:
            raise SessionNotFound(f"no session {session_id!r} (see Host.sessions())")
        if idle and live.job is not None and live.job.generation.cancelled.is_set():
            self._scheduler.finish(live, "cancelled")  # cancelled but not yet seen by a tick
        if idle and live.job is not None:
            raise SessionBusy(f"session {session_id!r} is generating; wait for it to finish or cancel it first")
        return live

    def _on_recover(self) -> None:
        """Sessions from the replayed log, each with the KV it had parked if the segment still
        holds it (any other cached prefix is found by the pool's prefix index when it resumes)."""
        for state in self._log.states.values():
            live = Live(state)
            if state.parked is not None:
                entry, tokens = state.parked
                try:
                    info = self.pool.info(entry)
                except EntryNotFound:
                    info = None
                # A recreated pool numbers entries from 1 again: the tag (this session's, or the
                # parent's for a fork that shared its parent's parked KV) tells them apart.
                owners = {f"session:{state.id}", f"session:{state.parent}"}
                if (info is not None and info.identity == self.descriptor.identity and info.tokens == tokens
                        and info.tag in owners):
                    live.entry = entry
            self._scheduler.sessions[state.id] = live

    def _on_create(self, session_id, system, settings, priority) -> str:
        session_id = session_id or uuid.uuid4().hex
        if session_id in self._scheduler.sessions:
            raise SuperfluidError(f"a session {session_id!r} exists already; resume it with Host.session(id=...)")
        self._log.append(Opened(session_id, time.time(), settings, priority))
        self._scheduler.sessions[session_id] = Live(self._log.states[session_id])
        if system is not None:
            self._on_append_message(session_id, "system", system)
        return session_id

    def _template(self) -> ChatTemplate:
        if not hasattr(self, "_chat"):
            engine, info = self._scheduler.engine, self.descriptor
            special = lambda token: engine.detokenize([token]).decode(errors="replace") if token is not None else ""  # noqa: E731
            self._chat = ChatTemplate(info.chat_template, special(info.bos_token),
                                      special(info.eos_tokens[0] if info.eos_tokens else None))
        return self._chat

    def _commit(self, live: Live, tokens: list[int], *records) -> None:
        self._log.append(*records, Tokens(live.state.id, len(live.state.tokens), tokens))
        live.since_park += len(tokens)

    def _on_append_message(self, session_id, role, content) -> None:
        live = self._live(session_id, idle=True)
        message = {"role": role, "content": content}
        text = self._template().turn(live.state.messages, message)
        tokens = self._scheduler.engine.tokenize(text, special=True)
        self._commit(live, tokens, Turn(session_id, role, content, len(live.state.tokens) + len(tokens)))

    def _on_append_tokens(self, session_id, tokens) -> None:
        live = self._live(session_id, idle=True)
        vocab = self.descriptor.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside this model's vocabulary (0..{vocab - 1})")
        self._commit(live, list(tokens))

    def _on_append_text(self, session_id, text) -> None:
        self._on_append_tokens(session_id, self._scheduler.engine.tokenize(text, special=True))

    def _on_generate(self, session_id, max_tokens, stop, timeout, overrides, keep_logits=False,
                     ignore_eos=False) -> Generation:
        live = self._live(session_id, idle=True)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r}: must be a whole number >= 1")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: must be a number of seconds > 0")
        settings = sampler.Sampling(**{**{f: getattr(live.state.sampling, f) for f in sampler.Sampling.__struct_fields__},
                                       **overrides})
        opening = []
        if live.state.messages:
            opening = self._scheduler.engine.tokenize(self._template().opening(live.state.messages), special=True)
        total, limit = len(live.state.tokens) + len(opening), self.descriptor.context_length
        if not total:
            raise SuperfluidError(f"session {session_id!r} holds no tokens to generate from; append a message or text")
        if limit and total >= limit:
            raise ContextFull(f"session {session_id!r} holds {total} tokens with the assistant's opening, the context "
                              f"length is {limit}; trim it or start a new session")
        if opening:  # only once the generation is sure to start
            self._commit(live, opening)
        tokens = live.state.tokens
        if live.seq is not None and live.kv > len(tokens) - 1:
            self._scheduler.engine.truncate(live.seq, len(tokens) - 1)  # the last token's logits are needed
            live.kv = len(tokens) - 1
        generation = Generation(session_id)
        generation._alive = self._scheduler.alive
        deadline = None if timeout is None else time.monotonic() + timeout
        live.job = Job(generation, max_tokens, settings, TextStream(stop), deadline,
                       PRIORITIES.index(live.state.priority), next(self._scheduler._clock), first=len(tokens),
                       keep_logits=bool(keep_logits), ignore_eos=bool(ignore_eos))
        if live.seq is not None:
            generation.prompt_tokens, generation.cached_tokens = len(tokens), live.kv
            live.job.started = True
            self._counters.cached_tokens += live.kv
        return generation

    def _close_turn(self, live: Live, job: Job) -> None:
        """After a chat generation: the assistant's message, and the template's end-of-turn text."""
        if not live.state.messages:
            return
        produced = live.state.tokens[job.first:]
        eos = self.descriptor.eos_tokens
        ended = bool(produced) and produced[-1] in eos
        engine = self._scheduler.engine
        reply = engine.detokenize(produced[:-1] if ended else produced).decode(errors="replace")
        closing = self._template().closing(live.state.messages, reply)
        if ended:
            mark = engine.detokenize([produced[-1]]).decode(errors="replace")
            closing = closing[len(mark):] if closing.startswith(mark) else closing
        tokens = engine.tokenize(closing, special=True) if closing else []
        self._commit(live, tokens, Turn(live.state.id, "assistant", job.stream.text, len(live.state.tokens) + len(tokens)))

    def _on_fork(self, session_id) -> str:
        parent = self._live(session_id)
        child_id = uuid.uuid4().hex
        state = parent.state
        records = [Opened(child_id, time.time(), state.sampling, state.priority, session_id)]
        records += [Turn(child_id, m["role"], m["content"], end) for m, end in zip(state.messages, state.message_ends)]
        records.append(Tokens(child_id, 0, list(state.tokens)))
        self._log.append(*records)
        child = Live(self._log.states[child_id])
        held = sum(1 for other in self._scheduler.sessions.values() if other.seq is not None)
        if parent.seq is not None and held < self.descriptor.packing.max_sequences:
            child.seq, child.kv = self._scheduler.engine.fork(parent.seq), parent.kv
        elif parent.entry is not None and state.parked is not None:
            child.entry = parent.entry  # the same parked KV: nothing copied, nothing referenced
            self._log.append(Parked(child_id, *state.parked))
        self._scheduler.sessions[child_id] = child
        return child_id

    def _on_trim(self, session_id, n_tokens) -> None:
        live = self._live(session_id, idle=True)
        if not isinstance(n_tokens, int) or not 0 <= n_tokens <= len(live.state.tokens):
            raise ValueError(f"trim({n_tokens!r}): session {session_id!r} holds {len(live.state.tokens)} tokens")
        if live.seq is not None and live.kv > n_tokens:
            try:
                self._scheduler.engine.truncate(live.seq, n_tokens)
                live.kv = n_tokens
            except EngineError:  # a cache that cannot be cut back: the lane goes; the log has the tokens
                self._scheduler.engine.free_sequence(live.seq)
                live.seq, live.kv = None, 0
        self._log.append(Trimmed(session_id, n_tokens))
        if live.state.parked is None:
            self._scheduler._hold(live, None)

    def _on_delete(self, session_id) -> None:
        live = self._live(session_id)
        if live.job is not None:
            self._scheduler.finish(live, "cancelled")
        if live.seq is not None:
            self._scheduler.engine.free_sequence(live.seq)
            live.seq = None
        self._scheduler._hold(live, None)
        self._log.append(Deleted(session_id))
        del self._scheduler.sessions[session_id]

    def _on_pin(self, session_id) -> int:
        live = self._live(session_id)
        if live.pinned:
            return self.pool.info(live.entry).stored_bytes
        self._scheduler.park(live, keep_lane=True)  # its KV as it is now goes to the pool first
        if live.entry is None:
            raise SuperfluidError(f"session {session_id!r} has no KV to pin yet (nothing was prefilled, or the pool "
                                  "had no room); generate first")
        stats, size = self.pool.stats(), self.pool.info(live.entry).stored_bytes
        cap = int(self.max_pinned_fraction * stats.budget_bytes)
        if self.pool.pinned_bytes() + size > cap:
            raise PinLimit(f"pinning session {session_id!r} ({size} bytes) would pin {self.pool.pinned_bytes() + size} "
                           f"bytes, over the cap of {cap} ({self.max_pinned_fraction:.0%} of the pool's budget); unpin "
                           "other sessions or raise max_pinned_fraction")
        self.pool.pin(live.entry)
        live.pinned = True
        return size

    def _on_unpin(self, session_id) -> None:
        live = self._live(session_id)
        if live.pinned:
            live.pinned = False
            try:
                self.pool.unpin(live.entry)
            except PoolError:
                pass  # already gone

    def _on_retire(self, session_id) -> None:
        live = self._live(session_id)
        if live.job is not None:
            self._scheduler.finish(live, "cancelled")
        self._scheduler.park(live, keep_lane=False)
        self._on_delete(session_id)

    def _on_tokens(self, session_id) -> list[int]:
        return list(self._live(session_id).state.tokens)

    def _on_messages(self, session_id) -> list[dict]:
        return [dict(m) for m in self._live(session_id).state.messages]

    def _on_info(self, session_id) -> SessionInfo:
        live = self._live(session_id)
        state = live.state
        return SessionInfo(state.id, len(state.tokens), len(state.messages), state.priority, state.created,
                           state.parent, state.parked[1] if state.parked else 0, live.job is not None)

    def _on_list(self) -> list[SessionInfo]:
        return [self._on_info(session_id) for session_id in self._scheduler.sessions]

    def _on_detokenize(self, tokens) -> str:
        return self._scheduler.engine.detokenize(tokens).decode(errors="replace")

    def _on_stats(self) -> HostStats:
        pool, engine, c = self.pool.stats(), self._scheduler.engine.stats(), self._counters
        lives = self._scheduler.sessions.values()
        return HostStats(c.prefill_tokens, c.decode_tokens, c.cached_tokens, c.generations, c.exports, c.imports,
                         c.import_failures, c.export_failures, c.preemptions, pool.bytes_copied + engine.bytes_copied, pool.bytes_copied,
                         engine.bytes_copied, pool.evictions, pool.bytes_used, pool.entries, len(lives),
                         sum(1 for live in lives if live.seq is not None), sum(1 for live in lives if live.job))

    def _on_close(self) -> None:
        scheduler = self._scheduler
        scheduler.stop()  # commands queued behind this one are refused
        try:
            for live in list(scheduler.sessions.values()):
                if live.job is not None:
                    scheduler.finish(live, "closed")
                try:
                    scheduler.park(live, keep_lane=False)
                except EngineError:  # this lane's KV is lost; its tokens are in the log
                    pass
        finally:
            self._log.close()
            scheduler.engine.close()
            self.pool.close()


def _runtime_options(runtime: str, given: dict[str, Any]) -> dict[str, Any]:
    """`<runtime>_<name>` keyword arguments as the runtime's options; others refused by name."""
    options = {}
    for key, value in given.items():
        owner = next((r for r in registry.RUNTIMES if key.startswith(f"{r}_")), None)
        if owner is None:
            raise TypeError(f"Host() got an unexpected keyword argument {key!r} (runtime options are written "
                            f"<runtime>_<option>, for example {runtime}_...)")
        if owner != runtime:
            raise ValueError(f"option {key} is for the {owner} runtime; this host runs {runtime}")
        options[key[len(owner) + 1:]] = value
    return options

