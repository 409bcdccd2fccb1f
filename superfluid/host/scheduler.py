"""The scheduler: what the engine's thread does with the engine, one tick at a time.

The thread (superfluid/host/engine_thread.py) runs the commands other threads queue, then a tick
while any generation is active:

    1. run the commands that arrived (appends, new generations, forks, trims, deletes)
    2. end cancelled and timed-out generations; refuse those that waited past max_wait_seconds
    3. admit waiting generations, most urgent first: by priority class, then the least uncached
       prompt (aged, so a long prompt cannot starve); each gets a lane holding its longest cached
       prefix when its cells fit, else it waits (swap makes room where the class allows)
    4. park idle lanes (the KV manager: past idle_park_seconds, or at once in a unified cache
       while others generate), after admission so that a waiting generation may fork them first
    5. one packed step, planned as a token budget (superfluid/host/planner.py): a decode token for
       every decoding lane (never held back by prefill), then prefill chunks (prompts the step
       can end first, then the most urgent), as many as the measured step costs fit within the
       first-token target (and the decode-step target while a lane decodes), the prefill budget
       and the free cells; while an interactive lane runs, other classes' prefill waits
    6. sample and commit each lane's token, checkpoint lanes that committed enough tokens since
       they were last parked; the step's log records go out in one write, then its pieces to
       their readers (a generation's first at once, the others every stream_interval: handoff.py)
    7. hand the log's fsync to its syncer thread (the "tick" policy)
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from time import perf_counter  # a step's duration (the tests time their fake engine's steps here)
from typing import Any

from engines.errors import EngineError, Interrupted, NoRoom
from kvpool import Pool
from superfluid.host import sampling as sampler
from superfluid.host.constraints import ConstraintError, Masks, constrained
from superfluid.host.errors import ContextFull, GenerationTimeout, Overloaded
from superfluid.host.handoff import Handoff
from superfluid.host.interruption import Arrival, Arrivals, StepInFlight, goes_first, worth_interrupting
from superfluid.host.kv import KVManager, common_prefix
from superfluid.host.lane import Job, Live
from superfluid.host.log import LogWriteFailed, SessionLog
from superfluid.host.planner import MIN_PREFILL_CHUNK, Planner, depth_of
from superfluid.host.policy import Policy
from superfluid.host.session import Generation, Piece
from superfluid.host.sessions import Sessions
from superfluid.host.stats import Counters, HostStats, Publisher, host_stats
from superfluid.host.tenants import TenantLoad, tenant_stats

# Short-first with aging: a waiting prompt's place improves by one token for every ten the engine
# is fed meanwhile, so a long prompt waits behind at most ~10x its length of other work.
AGING = 0.1
LOG = logging.getLogger(__name__)


class Scheduler:
    """Everything the engine's thread does with one engine: the queue of generations, the plan
    and the step. Nothing here may be called from another thread, except `hurry`."""

    def __init__(self, open_engine: Callable[[], Any], open_pool: Callable[[Any], Pool], log: SessionLog,
                 counters: Counters, policy: Policy, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._open_engine, self._open_pool = open_engine, open_pool
        self.log, self.counters, self.policy, self.clock = log, counters, policy, clock
        self._next_expiry_sweep = 0.0  # when expire_idle_sessions next walks the sessions
        self.sessions: Sessions | None = None  # the owner of sessions' state, made with the engine
        # the sessions and request lanes with a generation, in order of arrival: a tick looks at
        # these and the lanes, never at every session (most are idle)
        self.active: dict[Live, None] = {}
        self.tenants = TenantLoad()  # the tenants of the active generations, for each one's share
        self.fed = 0  # tokens fed to the engine so far, every lane together (a waiting generation's age)
        self._outbox: list[tuple[Generation, Piece]] | None = None  # a step's pieces, until its records are written
        self.planner: Planner | None = None  # made with the engine, whose descriptor it reads
        self.arrivals = Arrivals()  # the most urgent arrival since the last look, the step in flight, recent stops
        self._order = itertools.count(1)
        self.ticks = 0  # rounds of the loop so far (the test modes choose ticks by number)
        self.publisher = Publisher(self.stats)  # what /health and /metrics read; generations' ends after it
        self.masks = Masks()  # constrained generations' next masks, computed beside each step
        self.handoff = Handoff(policy.stream_interval)  # when the steps' pieces reach their readers

    def next_order(self) -> int:
        """A number larger than every one handed out before (arrival and recency order)."""
        return next(self._order)

    # ----------------------------------------------------------------------------- engine

    def open(self) -> None:
        """Open the engine, the pool, and the owners of sessions, KV and the plan (on the thread
        that will run every later call)."""
        self.engine = self._open_engine()
        try:
            self.descriptor = self.engine.describe()
            self.pool = self._open_pool(self.descriptor)
        except BaseException:
            self.engine.close()
            self.engine.release_thread()
            raise
        policy = self.policy
        idle_park_seconds = 0.0 if policy.churn is not None else policy.idle_park_seconds
        self.sessions = Sessions(self.log, self.engine, self.next_order, self.clock, self.context_limit)
        self.kv = KVManager(self.engine, self.pool, self.sessions, self.counters, decode_reserve=policy.decode_reserve,
                            idle_park_seconds=idle_park_seconds, watermarks=policy.watermarks,
                            max_pinned_fraction=policy.max_pinned_fraction, order=self.next_order,
                            tenants=self.tenants)
        self.sessions.kv = self.kv
        self.kv.urgency = self.urgency
        self.planner = Planner(policy, self.descriptor, self.kv.memory.kind == "kv", self.urgency)

    def release_engine(self) -> None:
        """Close the engine (idempotent: after a clean close this does nothing) and let go of what
        the runtime keeps for this thread, which ends."""
        self.masks.close()
        self.engine.close()
        self.engine.release_thread()

    def idle(self) -> None:
        """A round with no generation active: park idle lanes, and sync what idle commands wrote
        (the "tick" policy's idle tick)."""
        self.kv.park_idle(self.clock(), generating=False)
        self.expire_idle_sessions()
        self._sync_soon()

    def _sync_soon(self) -> None:
        """Have the log synced; an fsync the disk refused is retried at the next one (what it
        covers is written, in the page cache: only a power cut before a sync succeeds loses it)."""
        try:
            self.log.sync_soon()
        except OSError as exc:
            self.counters.log_sync_failures += 1
            LOG.warning("the session log could not be synced (%s); retrying at the next tick", exc)

    def expire_idle_sessions(self) -> None:
        """Delete the sessions idle for `session_expiry_seconds` (never a pinned one, nor one
        generating). Looked for at most every tenth of the expiry (a walk of every session), so a
        tick's cost does not grow with the sessions kept; off by default: sessions are promised
        to survive."""
        expiry, now = self.policy.session_expiry_seconds, self.clock()
        if expiry is None or now < self._next_expiry_sweep:
            return
        self._next_expiry_sweep = now + max(expiry / 10, 0.1)
        self.counters.expired_sessions += self.sessions.expire_idle(now, expiry)

    def end_round(self, closing: bool) -> None:
        """After each round of the thread's loop: publish the statistics where due and tell the
        generations that ended (after close the pool and the engine are gone: nothing to
        publish); the churn test mode moves KV on purpose."""
        self.handoff.round_ended()
        self.announce(publish=not closing)
        self.ticks += 1
        if self.policy.churn is not None and not closing:
            self.policy.churn.after_tick(self.ticks, self.kv, self.sessions)

    def fail_all(self, exc: BaseException) -> None:
        """The engine or the pool failed: every active generation ends with `exc`."""
        for live in list(self.active):
            live.job.generation._finish("error", exc)
            live.job = None
        self.active.clear()
        self.tenants.clear()

    # ----------------------------------------------------------------------------- statistics

    def stats(self) -> HostStats:
        """The statistics now: the counters, the pool, the engine's cells (on this thread)."""
        tenants = tenant_stats(self.active, self.kv.lanes, self.sessions.owned, self.counters.rejected_by_tenant)
        return host_stats(self.counters, self.kv, self.sessions, self.engine.stats(), len(self.active), self.waiting(),
                          tenants)

    def announce(self, *, force: bool = False, publish: bool = True) -> None:
        """Publish the statistics where due (`force`: now), then tell the generations that ended."""
        self.publisher.announce(force=force, publish=publish)

    # ----------------------------------------------------------------------------- generations

    def waiting(self) -> int:
        """Generations that have not started yet (waiting for their first admission)."""
        return sum(1 for live in self.active if not live.job.started)

    def check_capacity(self, live: Live) -> None:
        """Overloaded when a new generation for `live` would wait beyond the bounded queue, unless
        its tenant has less than its equal share of the queue (tenants.py): one tenant filling the
        queue does not shut the others out."""
        limit = self.policy.max_waiting
        if limit is None or live.seq is not None:
            return
        waiting = [other for other in self.active if not other.job.started]
        if len(waiting) < limit:
            return
        tenant = live.state.tenant
        if self.tenants.may_wait(tenant, sum(1 for other in waiting if other.state.tenant == tenant), limit):
            return
        self.counters.rejected += 1
        self.counters.rejected_by_tenant[tenant] += 1
        raise Overloaded(f"{len(waiting)} generations are waiting for the engine already (max_waiting={limit});"
                         " retry shortly, or raise max_waiting", retry_after=1)

    def enqueue(self, live: Live, job: Job) -> None:
        """Give `live` the generation `job`: it starts at once on a warm lane whose new tokens and
        reserve fit in the free cells, else it waits (a warm lane that does not fit is parked and
        admitted like any other, by import)."""
        live.job = job
        self.active[live] = None
        self.tenants.started(live.state.tenant)
        if live.seq is None:
            return
        if self.kv.cells_free() >= live.pending + self.kv.reserve_for(live):
            job.admitted = live.last_used = self.next_order()
            job.reserved_to = len(live.state.tokens) + self.kv.reserve_for(live)
            self._started(live)
        else:
            self.kv.park(live, keep_lane=False)

    def _started(self, live: Live) -> None:
        job = live.job
        if not job.started:
            job.started = True
            self.counters.cached_tokens += live.kv
            job.generation.prompt_tokens = len(live.state.tokens)
            job.generation.cached_tokens = live.kv

    def urgency(self, live: Live, uncached: int) -> tuple:
        """Admission and prefill order: priority class, then uncached prompt less its age."""
        job = live.job
        return job.priority, uncached - AGING * (self.fed - job.fed_at_arrival), job.arrival

    # ----------------------------------------------------------------------------- one tick

    def tick(self) -> None:
        """End, park, admit, step, sample, commit, stream, checkpoint, sync."""
        now = self.clock()
        self._end_cancelled_and_late(now)
        if all(live.seq is not None for live in self.active):  # (moving a lane must not hand its seat to another)
            self.kv.reseat_stranded()
        self._admit()  # first: a waiting generation may fork an idle lane
        self.kv.park_idle(now, generating=any(live.job is not None for live in self.kv.lanes))
        self.expire_idle_sessions()
        decode, prefill = self._plan()
        if not decode and not prefill:
            return
        if self.descriptor.packing.mixes_prefill_and_decode:
            self._step(decode + prefill)
        else:
            self._step(decode)
            # the decode step may have preempted or ended a lane planned for prefill
            self._step([(live, request) for live, request in prefill
                        if live.job is not None and live.seq == request.seq])
        self.kv.relieve_pressure()
        self._sync_soon()
        if self.log.should_compact():
            self.log.compact_beside()  # on a thread of its own: no step waits for it

    def _end_cancelled_and_late(self, now: float) -> None:
        limit = self.policy.max_wait_seconds
        for live in list(self.active):
            job = live.job
            if job.generation.cancelled.is_set():
                self.finish(live, "cancelled")
            elif job.deadline is not None and now > job.deadline:
                self.finish(live, "timeout", GenerationTimeout(
                    f"session {live.state.id}: the generation ran past its timeout after {job.produced} tokens; "
                    "what it produced is kept in the session"))
            elif not job.started and limit is not None and now - job.queued_at > limit:
                self.counters.rejected += 1
                self.counters.rejected_by_tenant[live.state.tenant] += 1
                self.finish(live, "error", Overloaded(
                    f"session {live.state.id}: the generation waited {now - job.queued_at:.1f} s for the engine "
                    f"without starting (max_wait_seconds={limit}); retry shortly, or raise max_wait_seconds"))

    def _admit(self) -> None:
        waiting = [live for live in self.active if live.seq is None]
        if not waiting:  # (most ticks under load: every generation has its lane)
            return
        sources = {live: self.kv.source(live) for live in waiting}
        uncached = {live: len(live.state.tokens) - max(s.lane_tokens, s.pool_tokens) for live, s in sources.items()}
        ordered = self.tenants.fair_order(waiting, lambda live: self.urgency(live, uncached[live]), self.kv.lanes,
                                          self.kv.max_sequences)
        for live in ordered:
            source = sources[live]
            if self._prefilling_same_prefix(live, len(live.state.tokens) - uncached[live]):
                continue  # another lane is prefilling this prefix: fork from it when it has
            try:
                if not self.kv.admit(live, source):
                    break  # what is more urgent waits: nothing behind it overtakes it into the cells
            except EngineError as exc:  # this lane cannot start (a refused state): it alone fails
                self.finish(live, "error", exc)
                continue
            self._started(live)

    def _prefilling_same_prefix(self, live: Live, available: int) -> bool:
        """True when a lane being prefilled will soon hold more of `live`'s prefix than is
        available now: better to wait a tick or two and fork from it than prefill it twice."""
        tokens, namespace = live.state.tokens, live.state.namespace
        for other in self.kv.lanes:
            if other is live or other.job is None or other.pending <= 1 or other.state.namespace != namespace:
                continue
            if other.job.priority > live.job.priority:  # its prefill may wait behind ours: do not wait on it
                continue
            target = common_prefix(other.state.tokens, tokens, len(tokens) - 1)
            # Waiting costs nothing: the lanes would share the tick's prefill budget anyway.
            if target > available + MIN_PREFILL_CHUNK and other.kv < target:
                return True
        return False

    def _plan(self) -> tuple[list, list]:
        """This tick's step requests: (decode, prefill) lists of (lane, StepRequest)."""
        lanes = [live for live in self.kv.lanes if live.job is not None]
        room = self._room_for_step(lanes)  # may park or preempt: the running lanes are those after it
        running = [live for live in lanes if live.seq is not None and live.job is not None]
        return self.planner.plan(running, room)

    def _room_for_step(self, lanes: list[Live]) -> int:
        """Free cells for this step: at least one per decoding lane (and one for prefill when none
        decodes), made by parking idle lanes, then preempting the lane that matters least."""
        while True:
            running = [live for live in lanes if live.seq is not None and live.job is not None]
            decoding = sum(1 for live in running if live.pending == 1)
            need = decoding or (1 if running else 0)
            room = self.kv.cells_total - self.kv.cells_used()
            if room >= need:
                return room
            if self.kv.park_least_recent_idle():
                continue
            if len(running) == 1:  # one session alone fills every cell
                self._context_full(running[0])
                continue
            self.kv.preempt(self.kv.victim_for_growth(set()))

    def _context_full(self, live: Live) -> None:
        """End `live`'s generation: it alone reached the cells the engine has."""
        limit = self.context_limit()
        error = None if self.policy.on_context_full == "stop" else ContextFull(
            f"session {live.state.id} reached the context length ({limit} tokens); trim it (Session.trim), fork a "
            "shorter one, or start a new session")
        self.finish(live, "length", error)

    def context_limit(self) -> int:
        """The most tokens one session can hold: the model's context, within the engine's cells."""
        context, cells = self.descriptor.context_length, self.kv.cells_total
        return min(context, cells) if context and cells else context or cells

    def hurry(self, arrival: Arrival) -> None:
        """A request was just queued (from any thread). If it would go before what the step in
        flight feeds, the next steps run in pieces, and a step or piece that has barely begun
        is stopped (interruption.py); else a step in pieces ends after the piece in flight, and
        between steps the next one looks at the request before it starts. With the policy's
        arrival_wait, any step or piece with more than that left is stopped."""
        self.arrivals.heard(arrival)
        flight, now = self.arrivals.in_flight, perf_counter()
        if flight is not None and goes_first(arrival, flight.first, flight.tokens):
            self.planner.arrival_went_first(now)  # the next steps are cut into pieces (planner.py)
            # (else a piece ends soon, and the step ends after it)
            self.arrivals.interrupt_for(arrival, now, self.policy.arrival_wait, self.engine)

    def _step(self, requests: list) -> None:
        """Run the planned step as the planner's pieces (planner.py), one after another; before
        each piece after the first, stop for a request that arrived meanwhile and goes first
        (interruption.py): what ran is kept, and the rest is planned again after it."""
        pieces = self.planner.pieces(requests, perf_counter()) if requests else []
        for index, piece in enumerate(pieces):
            if index:
                # (a lane may have ended in the pieces before: a failed log write ends its generation)
                piece = [(live, request) for live, request in piece if live.job is not None and live.seq == request.seq]
                rest = [pair for later in pieces[index:] for pair in later]
                prompts = [(live.job.priority, live.pending) for live, _ in rest if live.job is not None]
                arrived = self.arrivals.take()
                if arrived is not None and prompts and goes_first(arrived, min(prompts),
                                                                  sum(len(request.tokens) for _, request in rest)):
                    self.counters.yielded_steps += 1
                    self.planner.step_dropped()
                    return
            if not self._step_piece(piece):
                return

    def _step_piece(self, requests: list) -> bool:
        """One piece of a step; False where it did not run to its end (stopped, or no room)."""
        if not requests:
            return True
        began = perf_counter()
        flight = self._in_flight(requests, began)
        self.arrivals.begin(flight)  # (ended below whatever happens: else a later arrival could stop the next step)
        try:
            arrived = self.arrivals.take()
            if arrived is not None and worth_interrupting(flight, arrived, began,
                                                          self.arrivals.wait(self.policy.arrival_wait, began)):
                # a request that goes first came between this tick's commands and its step: plan
                # again with it (if it was among the commands already, one plan is all this costs)
                self.planner.arrival_went_first(began)
                self.planner.step_dropped()
                return False
            if self.handoff.holding() and any(len(request.tokens) > 1 for _, request in requests):
                self.handoff.before_long_step()  # a step with a prompt may last long: what is held goes first
            self.masks.start((live, live.job.matching) for live, request in requests
                             if live.job.matching is not None and request.logits != "none")
            results = self.engine.step([request for _, request in requests])
        except NoRoom:
            self.masks.discard()
            self._no_room([live for live, _ in requests])
            return False
        except Interrupted:  # for a request that goes first; the lanes keep what was finished
            self.masks.discard()
            now = perf_counter()
            self.counters.interrupted_steps += 1
            self.counters.interrupted_seconds += now - began
            self.arrivals.stopped(now, now - began)
            self.planner.step_dropped()
            grown = []
            for live, _ in requests:
                held = live.kv
                self.kv.resync(live)
                # llama.cpp keeps the ubatches it finished: prompt tokens only (resync cuts a
                # decode token kept without its logits back, to be fed again)
                self._count_fed(live, live.kv - held, decode=False)
                if live.seq is not None and live.kv > held:
                    grown.append(live)
            self.kv.placed(grown)
            return False
        finally:
            self.arrivals.end(self.engine)
        self._measure(requests, perf_counter() - began)
        # The step's records go to the log in one write, and only then do readers hear of its
        # tokens: a write that fails hands out nothing (the failure reaches every reader instead).
        self._outbox = []
        try:
            try:
                with self.log.batch():
                    self._commit_step(requests, results)
                outbox = self._outbox
            except LogWriteFailed as failed:
                outbox = self._write_failed(failed, requests)
        finally:
            self._outbox = None
        self.kv.placed([live for live, _ in requests if live.seq is not None])  # (the step's cells counted)
        self.handoff.step(outbox)  # each reader's loop woken once for the whole step, if at all
        return True

    def _write_failed(self, failed: LogWriteFailed, requests: list) -> list:
        """The step's records could not be written (the log put the sessions back as the file has
        them): every generation whose session was in the write ends with the error, its lane cut
        back to its session; the others (request lanes, which write no records) go on. The
        pieces still owed to those others."""
        self.sessions.recount_parked()
        self.counters.log_write_failures += 1
        touched = failed.sessions
        self.publisher.fail_ended(touched, failed)  # a reply that ended in this step: its end was not written
        for live, _ in requests:
            if live.durable and live.state.id in touched:
                self.kv.cut(live, len(live.state.tokens))
                if live.job is not None:
                    self.finish(live, "error", failed)
        return [(generation, piece) for generation, piece in self._outbox if generation.session_id not in touched]

    def _count_fed(self, live: Live, fed: int, *, decode: bool) -> None:
        """Count `fed` tokens a step put in `live`'s cells: a decode token, or prompt."""
        if fed <= 0 or live.job is None:
            return
        self.fed += fed
        if decode:
            self.counters.decode_tokens += 1
        else:
            self.counters.prefill_tokens += fed
            live.job.prefilled += fed

    def _commit_step(self, requests: list, results: list) -> None:
        """Count what a step fed, sample and commit each lane's next token, checkpoint."""
        for (live, request), logits in zip(requests, results):
            fed = len(request.tokens)
            live.kv += fed
            self._count_fed(live, fed, decode=fed == 1 and bool(live.job.produced))
            if request.logits == "none":
                if self._needs_checkpoint(live):
                    self.kv.park(live, keep_lane=True)  # a checkpoint inside a long prompt
                continue
            if fed > 1 and (live.job.prefilled >= self.policy.publish_tokens or self.kv.memory.kind != "kv"):
                # the end of a prompt: published for others when long; and where the memory
                # cannot be cut back, the checkpoint a trim or a regenerated reply restores
                self.kv.park(live, keep_lane=True)
            self._emit(live, logits[-1])

    def _needs_checkpoint(self, live: Live) -> bool:
        """True where the memory cannot be cut back and `checkpoint_tokens` were prefilled since
        the session's last parked state: a session diverging inside this prompt restores the
        latest checkpoint before the divergence instead of prefilling it all."""
        if self.kv.memory.kind == "kv":
            return False
        parked = live.state.parked[1] if live.state.parked is not None else 0
        return live.kv - parked >= self.policy.checkpoint_tokens

    def _in_flight(self, requests: list, began: float) -> StepInFlight | None:
        """What the thread queueing a request needs to know of this step (None: it feeds no
        prompt, or its time cannot be predicted yet)."""
        prompts = [(live.job.priority, live.pending) for live, _ in requests if live.pending > 1]
        if not prompts:
            return None
        tokens = sum(len(request.tokens) for _, request in requests)
        predicted = self.planner.costs.seconds_for(tokens, depth_of(requests))
        if predicted is None:
            return None
        return StepInFlight(began, predicted, min(prompts), tokens)

    def _measure(self, requests: list, seconds: float) -> None:
        """Fold a step's time into the measured step costs, by the tokens it carried and the cells
        they attended (measured before the step's commit moves the lanes on)."""
        self.planner.costs.observe(sum(len(request.tokens) for _, request in requests), seconds, depth_of(requests))

    def _no_room(self, stepped: list[Live]) -> None:
        """The engine found no room for a step its cells seemed to allow (a fragmented cache):
        park an idle lane or preempt the lane that matters least; one lane alone is full."""
        for live in stepped:  # a step split into several forwards may have fed part of it
            self.kv.resync(live)
        if self.kv.park_least_recent_idle():
            return  # the next tick tries again
        running = [live for live in self.kv.lanes if live.job is not None]
        if len(running) > 1:
            self.kv.preempt(self.kv.victim_for_growth(set()))
        else:
            self._context_full(stepped[0])

    def _emit(self, live: Live, logits) -> None:
        """Sample the next token from `logits`, commit it, and hand the piece to the generation."""
        job, state = live.job, live.state
        request = job.request
        if request.keep_logits:
            job.generation.logits.append(logits.copy())
        position = len(state.tokens)
        try:
            drawn_from = (logits if job.matching is None
                          else constrained(logits, job.matching, self.masks.take(live, job.matching)))
            token = sampler.sample(drawn_from, job.sampling, position, state.tokens[-job.sampling.repetition_window:])
            if job.matching is not None:
                job.matching.advance(token)
        except (sampler.SamplingError, ConstraintError) as exc:  # this generation ends, the others go on
            self.finish(live, "error", exc)
            return
        except Exception as exc:  # noqa: BLE001 - the grammar engine failed on this generation alone
            if job.matching is None:
                raise
            self.finish(live, "error", ConstraintError(f"the constraint failed: {exc}"))
            return
        self.sessions.commit(live, [token])
        job.produced += 1
        # (a constrained generation ends at an end token: the grammar allowed it as its end)
        end_of_turn = token in self.descriptor.eos_tokens and (not request.ignore_eos or job.matching is not None)
        text = "" if end_of_turn else job.stream.feed(self.engine.detokenize([token]))
        scored = None if request.logprobs is None else sampler.logprobs(
            logits, token, request.logprobs, lambda t: self.engine.detokenize([t]))
        self._deliver(job.generation, Piece(text, token, scored))
        if end_of_turn or job.stream.stopped is not None or (job.matching is not None and job.matching.finished):
            self.finish(live, "stop")
        elif job.produced >= request.max_tokens:
            self.finish(live, "length")
        elif len(state.tokens) >= self.context_limit():
            self._context_full(live)
        elif live.since_park >= self.policy.checkpoint_tokens:
            self.kv.park(live, keep_lane=True)

    def _deliver(self, generation: Generation, piece: Piece) -> None:
        """Hand `piece` to its reader: at once, or inside a step once the step's records are written."""
        if self._outbox is None:
            generation._put(piece)
        else:
            self._outbox.append((generation, piece))

    # ----------------------------------------------------------------------------- ending

    def finish(self, live: Live, reason: str, error: BaseException | None = None) -> None:
        """End the session's generation; its lane stays warm until room is needed or it idles."""
        job = live.job
        live.job = None
        del self.active[live]
        self.tenants.ended(live.state.tenant)
        live.idle_since = self.clock()
        if live.seq is None:
            self.kv.release_held(live)  # ended while swapped out
        # text held back as a possible start of a stop string is the reply's after all, also when
        # an end-of-turn token ended it (after a stop string matched, finish() holds nothing)
        rest = job.stream.finish()
        if rest:
            self._deliver(job.generation, Piece(rest, -1))
        self.counters.generations += 1
        if not job.started:  # it never ran: the session is as it was before it asked
            if len(live.state.tokens) > job.opened_at:
                self.sessions.cut_back(live, job.opened_at)
        else:  # also after an error: the transcript stays whole
            try:
                self.sessions.close_turn(live, job)
            except Exception as exc:  # a template that cannot close the turn: the tokens are kept
                error = error or exc
        job.generation.finish_reason = reason
        self.publisher.ended(job.generation, reason, error)  # told once the statistics show it
        if not live.durable:  # a request lane ends with its generation: its KV parked for its prefix
            self.kv.park(live, keep_lane=False)
            self.kv.drop(live)
            self.sessions.remove(live)
