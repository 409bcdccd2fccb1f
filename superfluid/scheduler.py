"""The scheduler: the one thread that owns an engine, and the ticks it runs.

Every public call reaches it as a command; between commands it runs ticks while any generation
is active:

    1. run the commands that arrived (appends, new generations, forks, trims, deletes)
    2. end cancelled and timed-out generations (their lanes are free at once)
    3. admit waiting generations by priority: give each an engine sequence holding the longest
       cached prefix (its own parked KV, a pool entry, or a fork of a live lane), waiting for a
       lane that is prefilling the same prefix rather than prefilling it twice; an interactive
       arrival with no sequence free preempts the lowest lane, whose KV is parked in the pool
    4. one packed step: a decode token for every decoding lane, prefill chunks within the tick's
       token budget (in one forward where the engine mixes them, else decode first)
    5. sample, commit each token to the session log (written before it is reported), stream it
    6. checkpoint lanes that committed enough tokens since they were last parked; sync the log

A lane's engine sequence holds the KV of its session's first `kv` tokens; the tokens after that
(at least the last one: the next forward needs its logits) are fed by the next steps.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.base import StepRequest
from engines.errors import EngineError, NoRoom
from kvpool import DataCorrupt, Pool, PoolError
from superfluid import sampling as sampler
from superfluid.errors import ContextFull, GenerationTimeout, HostClosed
from superfluid.log import Parked, SessionLog, SessionState, Tokens
from superfluid.session import PRIORITIES, Generation, Piece
from superfluid.stats import Counters
from superfluid.stream import TextStream

IDLE_WAIT = 0.05  # seconds a scheduler with nothing to do waits for a command


@dataclass(eq=False)
class Job:
    """One generation: what it asked for and where it is."""

    generation: Generation
    max_tokens: int
    sampling: sampler.Sampling
    stream: TextStream
    deadline: float | None
    priority: int
    arrival: int
    first: int = 0  # position of the first token this generation produces
    keep_logits: bool = False
    ignore_eos: bool = False
    produced: int = 0
    prefilled: int = 0  # tokens this generation fed before its output
    started: bool = False  # admitted at least once (prompt counters set)


@dataclass(eq=False)
class Live:
    """The scheduler's side of a session: its logged state, and its lane in the engine if any."""

    state: SessionState
    seq: int | None = None
    kv: int = 0  # state.tokens[:kv] are in the engine sequence
    entry: int | None = None  # the pool entry holding its parked KV (if not evicted since)
    job: Job | None = None
    last_used: int = 0
    since_park: int = 0  # tokens committed since the last export
    pinned: bool = False  # its parked KV is pinned in the pool (the pin moves with each new park)


class Scheduler:
    """Owns one engine on its own thread; everything that touches the engine runs here."""

    def __init__(self, open_engine: Callable[[], Any], pool: Pool, log: SessionLog, counters: Counters, *,
                 prefill_budget: int, checkpoint_tokens: int, publish_tokens: int, on_context_full: str,
                 watermarks: tuple[float, float] = (0.9, 0.75)) -> None:
        self._open_engine = open_engine
        self.pool, self.log, self.counters = pool, log, counters
        self.prefill_budget, self.checkpoint_tokens = prefill_budget, checkpoint_tokens
        self.publish_tokens, self.on_context_full = publish_tokens, on_context_full
        self.high_watermark, self.low_watermark = watermarks
        self.sessions: dict[str, Live] = {}
        self._commands: queue.Queue = queue.Queue()
        self._clock = itertools.count(1)
        self._stopping = False
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self.handlers: dict[str, Callable] = {}  # command name -> function run on this thread
        self.after_generation: Callable | None = None  # run when a generation ends (the chat turn's close)
        self.thread = threading.Thread(target=self._run, name="superfluid-scheduler", daemon=True)

    # ----------------------------------------------------------------------------- thread

    def start(self) -> None:
        """Start the thread and wait until the engine is loaded (re-raising its load error)."""
        self.thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            self.engine = self._open_engine()
            self.descriptor = self.engine.describe()
        except BaseException as exc:  # handed to start(), which re-raises it in the caller
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stopping:
                self._drain(block=not self._active())
                if self._active():
                    self.tick()
                elif not self._stopping:
                    self.log.sync()  # what idle commands wrote (the "tick" policy's idle tick)
        except BaseException as exc:  # the engine or the pool failed: every waiter hears of it
            self.error = exc
            self._fail_all(exc)
        finally:
            self._drain(block=False, refuse=True)
            self.engine.close()  # idempotent; after a clean close this does nothing
            self.engine.release_thread()  # this thread ends: what the runtime keeps for it goes too

    def alive(self) -> bool:
        """True while the thread runs."""
        return self.thread.is_alive()

    def call(self, name: str, *args) -> Any:
        """Run handler `name` on the scheduler thread and return its result (or raise its error)."""
        if self.error is not None or self._stopping or not self.thread.is_alive():
            raise HostClosed("the host is closed" + (f" (its scheduler failed: {self.error})" if self.error else ""))
        done = threading.Event()
        box: list = []
        self._commands.put((name, args, done, box))
        while not done.wait(0.5):
            if not self.thread.is_alive() and not done.is_set():  # it ended (failed) as this call came in
                raise HostClosed("the host's scheduler stopped before answering"
                                 + (f" (it failed: {self.error!r})" if self.error is not None else ""))
        if box[0] == "error":
            raise box[1]
        return box[1]

    def _drain(self, block: bool, refuse: bool = False) -> None:
        while True:
            try:
                name, args, done, box = self._commands.get(timeout=IDLE_WAIT) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if refuse or self._stopping:  # after close: the engine, log and pool are gone
                box[:] = ["error", HostClosed("the host closed before this call ran")]
            else:
                try:
                    box[:] = ["ok", self.handlers[name](*args)]
                except Exception as exc:  # handed back to the caller's thread
                    box[:] = ["error", exc]
            done.set()

    def stop(self) -> None:
        """Ask the thread to end after the current command (call through `call`)."""
        self._stopping = True

    def _active(self) -> bool:
        return any(live.job is not None for live in self.sessions.values())

    def _fail_all(self, exc: BaseException) -> None:
        for live in self.sessions.values():
            if live.job is not None:
                live.job.generation._finish("error", exc)
                live.job = None

    # ----------------------------------------------------------------------------- one tick

    def tick(self) -> None:
        """Admit, step, sample, commit, stream, checkpoint, sync."""
        now = time.monotonic()
        for live in list(self.sessions.values()):
            job = live.job
            if job is not None and job.generation.cancelled.is_set():
                self.finish(live, "cancelled")
            elif job is not None and job.deadline is not None and now > job.deadline:
                self.finish(live, "timeout", GenerationTimeout(
                    f"session {live.state.id}: the generation ran past its timeout after {job.produced} tokens; "
                    "what it produced is kept in the session"))
        self._admit()
        lanes = [live for live in self.sessions.values() if live.job is not None and live.seq is not None]
        decode = [live for live in lanes if len(live.state.tokens) - live.kv == 1]
        prefill = sorted((live for live in lanes if len(live.state.tokens) - live.kv > 1),
                         key=lambda live: (live.job.priority, live.job.arrival))
        requests, budget = [], self.prefill_budget
        for live in decode:
            requests.append((live, StepRequest(live.seq, live.state.tokens[live.kv:], "last")))
        for live in prefill:
            if budget <= 0:
                break
            pending = live.state.tokens[live.kv:]
            chunk = pending[:budget]
            budget -= len(chunk)
            requests.append((live, StepRequest(live.seq, chunk, "last" if len(chunk) == len(pending) else "none")))
        if not requests:
            return
        if self.descriptor.packing.mixes_prefill_and_decode:
            self._step(requests)
        else:
            self._step([r for r in requests if r[0] in decode])
            self._step([r for r in requests if r[0] not in decode])
        self.relieve_pressure()
        self.log.sync()
        if self.log.should_compact():
            self.log.compact()

    def _step(self, requests: list) -> None:
        if not requests:
            return
        try:
            results = self.engine.step([request for _, request in requests])
        except NoRoom:
            for live, _ in requests:  # a step split into several forwards may have fed part of it
                live.kv = self.engine.length(live.seq)
            if self._make_room(exclude={live for live, _ in requests}):
                return  # the next tick tries again
            if len(requests) > 1:
                for pair in requests:  # one by one, so one lane's lack of room fails only it
                    self._step([pair])
                return
            live = requests[0][0]
            self.finish(live, "error", ContextFull(
                f"session {live.state.id}: the engine's KV cache ({self.descriptor.context_length} cells shared by "
                "every sequence) has no room for it; raise the engine's context (n_ctx) or end other sessions"))
            return
        for (live, request), logits in zip(requests, results):
            fed = len(request.tokens)
            live.kv += fed
            if fed == 1 and live.job.produced:
                self.counters.decode_tokens += 1
            else:
                self.counters.prefill_tokens += fed
                live.job.prefilled += fed
            if request.logits == "none":
                continue
            if live.job.prefilled >= self.publish_tokens and fed > 1:
                self.park(live, keep_lane=True)  # the end of a long prefill: publish it for others
            self._emit(live, logits[-1])

    def _emit(self, live: Live, logits) -> None:
        """Sample the next token from `logits`, commit it, and hand the piece to the generation."""
        job, state = live.job, live.state
        if job.keep_logits:
            job.generation.logits.append(logits.copy())
        position = len(state.tokens)
        token = sampler.sample(logits, job.sampling, position, state.tokens[-job.sampling.repetition_window:])
        self.commit(live, [token])
        job.produced += 1
        end_of_turn = token in self.descriptor.eos_tokens and not job.ignore_eos
        text = "" if end_of_turn else job.stream.feed(self.engine.detokenize([token]))
        job.generation._put(Piece(text, token))
        if end_of_turn or job.stream.stopped is not None:
            self.finish(live, "stop")
        elif job.produced >= job.max_tokens:
            self.finish(live, "length")
        elif self.descriptor.context_length and len(state.tokens) >= self.descriptor.context_length:
            error = None if self.on_context_full == "stop" else ContextFull(
                f"session {state.id} reached the context length ({self.descriptor.context_length} tokens); trim it "
                "(Session.trim), fork a shorter one, or start a new session")
            self.finish(live, "length", error)
        elif live.since_park >= self.checkpoint_tokens:
            self.park(live, keep_lane=True)

    # ----------------------------------------------------------------------------- committing

    def commit(self, live: Live, tokens: list[int]) -> None:
        """Append `tokens` to the session: logged (written) before anyone hears of them."""
        self.log.append(Tokens(live.state.id, len(live.state.tokens), tokens))
        live.since_park += len(tokens)
        live.last_used = next(self._clock)

    def finish(self, live: Live, reason: str, error: BaseException | None = None) -> None:
        """End the session's generation; its lane stays warm until room is needed."""
        job = live.job
        live.job = None
        rest = job.stream.finish() if reason in ("length", "cancelled", "timeout", "closed", "error") else ""
        if rest:
            job.generation._put(Piece(rest, -1))
        self.counters.generations += 1
        if self.after_generation is not None:  # also after an error: the transcript stays whole
            try:
                self.after_generation(live, job)
            except Exception as exc:  # a template that cannot close the turn: the tokens are kept
                error = error or exc
        job.generation.finish_reason = reason
        job.generation._finish(reason, error)

    # ----------------------------------------------------------------------------- lanes

    def _admit(self) -> None:
        waiting = sorted((live for live in self.sessions.values() if live.job is not None and live.seq is None),
                         key=lambda live: (live.job.priority, live.job.arrival))
        for live in waiting:
            source = self._best_source(live)
            if self._prefilling_same_prefix(live, max(source[0], source[2].tokens if source[2] else 0)):
                continue  # another lane is prefilling this prefix: fork from it when it has
            if not self._free_sequence_for(live):
                continue
            if source[1] is not None and source[1].seq is None:
                source = self._best_source(live)  # the lane it would fork was parked to make room
            try:
                self._restore(live, source)
            except EngineError as exc:  # this lane cannot start (no room, a refused state): it alone fails
                if live.seq is not None:
                    self.engine.free_sequence(live.seq)
                    live.seq, live.kv = None, 0
                self.finish(live, "error", exc)

    def _free_sequence_for(self, live: Live) -> bool:
        """True when a sequence can be had for `live`: one is free, an idle lane is parked to free
        one, or a lower-priority generation is preempted."""
        held = [other for other in self.sessions.values() if other.seq is not None]
        if len(held) < self.descriptor.packing.max_sequences:
            return True
        idle = sorted((other for other in held if other.job is None), key=lambda other: other.last_used)
        if idle:
            self.park(idle[0], keep_lane=False)
            return True
        victims = sorted((other for other in held if other.job.priority > live.job.priority),
                         key=lambda other: (-other.job.priority, -other.job.arrival))
        if victims and live.job.priority == PRIORITIES.index("interactive"):
            self.park(victims[0], keep_lane=False)
            self.counters.preemptions += 1
            return True
        return False

    def _make_room(self, exclude: set) -> bool:
        """Free engine cells by parking an idle lane (least recently used first)."""
        idle = sorted((other for other in self.sessions.values()
                       if other.seq is not None and other.job is None and other not in exclude),
                      key=lambda other: other.last_used)
        if not idle:
            return False
        self.park(idle[0], keep_lane=False)
        return True

    def park(self, live: Live, *, keep_lane: bool) -> None:
        """Export the lane's KV into the pool (logged as Parked); free its sequence unless `keep_lane`."""
        if live.seq is not None and live.kv > 0 and not self._parked_as_is(live):
            live.since_park = 0  # also after a failure: retried at the next checkpoint, not every token
            try:
                info = self.engine.export(live.seq, self.pool, live.state.tokens[:live.kv], tag=f"session:{live.state.id}")
            except (PoolError, EngineError):
                self.counters.export_failures += 1  # the pool is full or refused it: the lane keeps its KV
                info = None
            if info is not None:
                self.counters.exports += 1
                self._hold(live, info.id)
                self.pool.release(info.id)  # cached, not held: see _hold
                self.log.append(Parked(live.state.id, info.id, live.kv))
        if not keep_lane and live.seq is not None:
            self.engine.free_sequence(live.seq)
            live.seq, live.kv = None, 0

    def _parked_as_is(self, live: Live) -> bool:
        """True when the pool still holds the session's KV as its lane holds it now."""
        if live.entry is None or live.state.parked is None or live.state.parked[1] != live.kv:
            return False
        try:
            self.pool.info(live.entry)
        except PoolError:
            return False  # evicted since
        return True

    def _hold(self, live: Live, entry: int | None) -> None:
        """Make `entry` the session's parked KV. Sessions hold no reference to it, so under
        pressure it is evicted by cost like any cached entry (the session then prefills from its
        log); only a pinned session's entry stays, and its pin moves to each new park."""
        if live.pinned and entry is not None:
            self.pool.pin(entry)
        if live.pinned and live.entry is not None:
            try:
                self.pool.unpin(live.entry)
            except PoolError:
                pass  # already gone
        live.entry = entry
        if entry is None:
            live.pinned = False

    def relieve_pressure(self) -> int:
        """Past the high watermark, evict cached entries nobody holds down to the low one."""
        used, budget = self.pool.usage()
        if used <= self.high_watermark * budget:
            return 0
        return self.pool.shed(int(self.low_watermark * budget))

    def _best_source(self, live: Live) -> tuple[int, Live | None, object]:
        """The longest cached prefix of `live`'s tokens (all but the last, whose logits the next
        step needs): (tokens a live lane holds, that lane, the pool's best match or None)."""
        tokens = live.state.tokens
        want = len(tokens) - 1
        fork = max(((self._common(other, tokens, want), other) for other in self.sessions.values()
                    if other is not live and other.seq is not None), key=lambda pair: pair[0], default=(0, None))
        match = self.pool.lookup(self.descriptor.identity, tokens[:want]) if want > 0 else None
        return fork[0], fork[1], match

    def _restore(self, live: Live, source: tuple[int, Live | None, object]) -> None:
        """Give `live` a sequence holding the prefix `source` offers: a fork of a live lane when
        it holds at least as much as the pool, else the pool entry imported (one copy)."""
        forked, lane, match = source
        job = live.job
        live.seq = None
        if lane is not None and lane.seq is not None and forked > 0 and forked >= (match.tokens if match else 0):
            live.seq = self.engine.fork(lane.seq)
            live.kv = forked
            if self.engine.length(live.seq) > forked:
                try:
                    self.engine.truncate(live.seq, forked)
                except EngineError:  # a cache that cannot be cut back: start from the pool or nothing
                    self.engine.free_sequence(live.seq)
                    live.seq = None
        if live.seq is None:
            live.seq = self.engine.new_sequence()
            live.kv = 0
            if match is not None and match.tokens > 0:
                live.kv = self._import(live, match.entry_id, match.tokens)
        if not job.started:
            self.counters.cached_tokens += live.kv
            job.started = True
            job.generation.prompt_tokens = len(live.state.tokens)
            job.generation.cached_tokens = live.kv
        live.last_used = next(self._clock)

    def _import(self, live: Live, entry: int, keep: int) -> int:
        try:
            with self.pool.get(entry, verify=False) as view:
                restored = self.engine.import_(live.seq, view)
        except (DataCorrupt, PoolError, EngineError) as exc:  # corrupt, evicted, refused: prefill instead
            self.counters.import_failures += 1
            if isinstance(exc, DataCorrupt):
                try:
                    self.pool.evict(entry)  # nobody should start from it again
                except PoolError:
                    pass  # held elsewhere: the pool counts it corrupt, its holders will find out
            return 0
        self.counters.imports += 1
        if restored > keep:
            try:
                self.engine.truncate(live.seq, keep)
            except EngineError:  # a cache that cannot be cut back (a wrapped ring, recurrent state)
                self.engine.free_sequence(live.seq)
                live.seq = self.engine.new_sequence()
                return 0
        return min(restored, keep)

    def _common(self, other: Live, tokens: list[int], limit: int) -> int:
        """Tokens at the start of `tokens` (up to `limit`) whose KV `other`'s sequence holds."""
        return self._common_tokens(other.state.tokens[:other.kv], tokens, limit)

    def _prefilling_same_prefix(self, live: Live, available: int) -> bool:
        """True when a lane being prefilled will soon hold more of `live`'s prefix than is
        available now: better to wait a tick or two and fork from it than prefill it twice."""
        tokens = live.state.tokens
        for other in self.sessions.values():
            if other is live or other.seq is None or other.job is None or len(other.state.tokens) - other.kv <= 1:
                continue
            target = self._common_tokens(other.state.tokens, tokens, len(tokens) - 1)
            if target > available + self.prefill_budget // 4 and other.kv < target:
                return True
        return False

    @staticmethod
    def _common_tokens(a: list[int], b: list[int], limit: int) -> int:
        common = 0
        for x, y in zip(a[:limit], b[:limit]):
            if x != y:
                break
            common += 1
        return common
