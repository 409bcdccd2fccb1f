"""The KV manager: where every session's KV is, and what moves it.

A session's KV is in a lane (an engine sequence holding its first `kv` tokens), in a pool entry
(parked), or nowhere (its log has the tokens; it is prefilled again). The engine's cells are a
managed resource and the pool is their swap space:

- **Admission by cells.** A waiting generation gets a lane when its uncached prompt plus a
  decode reserve fits in the cells that are neither used nor reserved by admitted generations.
  A fork of a live lane in a unified cache costs no cells for the shared prefix.
- **Swap.** To make room: idle lanes are parked first (least recently used first); then an
  interactive arrival preempts the least urgent lane of another class, and any arrival preempts
  a lane of its class or a less urgent one whose prompt is still being fed and has at least
  SHORT_FACTOR times more left than the arrival's (a short request never waits for a long one
  to finish its prompt because the long ones hold every sequence). A step whose lanes grew
  past what is free preempts the running lane that matters least (lowest priority, then the
  most recently started, then the most uncached work). A preempted lane's KV is parked and held
  by reference until it resumes, by import: it is never prefilled again while its entry lives.
- **Idle KV leaves the engine.** A lane idle for `idle_park_seconds` is parked and its cells
  freed; in a unified cache (where every forward reads every used cell) an idle lane is parked
  as soon as another lane is generating.
- **Stranded lanes move down.** In llama.cpp's unified cache a decoding lane whose cells were
  placed high (past a burst's, since ended) is parked and imported straight back, into the lowest
  free cells (seats.py says when that pays).

Everything here runs on the scheduler thread (a request's read from the disk tier on its caller's
thread is warming.py's, which touches only the pool).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from engines.errors import EngineError
from kvpool import DataCorrupt, Pool, PoolError, PrefixMatch
from superfluid.host import seats, transfer
from superfluid.host.errors import PinLimit, SuperfluidError
from superfluid.host.lane import Live, Span
from superfluid.host.request import SHORT_FACTOR, Priority
from superfluid.host.stats import Counters
from superfluid.host.tenants import TenantLoad
from superfluid.host.warming import DiskWarming

if TYPE_CHECKING:
    from superfluid.host.sessions import Sessions

INTERACTIVE = Priority.INTERACTIVE
# An entry a lane was imported from goes once the lane parks its own, if all it held beyond what
# the lane kept is this many tokens or fewer: the last turn's reply tokens as the next turn's
# prompt renders them again (a retry of that turn recomputes at most these).
SUPERSEDED_TAIL = 64
# A park of plain KV by a lane that goes on generating (the end of a prompt, a checkpoint) is
# superseded by the lane's next park, usually within seconds: the disk tier writes it only if it
# is still the latest this long after (or memory evicts it first). A power cut meanwhile loses
# that KV, not the session's tokens (the log has them); a process crash loses nothing (the segment
# keeps it). (Other memory kinds keep each checkpoint: a restore point, never superseded.)
PROVISIONAL_SPILL_SECONDS = 30.0


class Source(NamedTuple):
    """Where a lane can start from: a live lane holding a prefix of its tokens (and how many), and
    the pool's longest cached prefix."""

    lane: Live | None
    lane_tokens: int
    match: PrefixMatch | None

    @property
    def pool_tokens(self) -> int:
        """Tokens the pool's match covers (0: none)."""
        return self.match.tokens if self.match is not None else 0

    @property
    def forks(self) -> bool:
        """True when the live lane holds at least as much as the pool: fork it rather than import."""
        return self.lane is not None and self.lane_tokens > 0 and self.lane_tokens >= self.pool_tokens


class KVManager:
    """Placement, admission, swap, idle parking and pins of one engine's sessions."""

    def __init__(self, engine: Any, pool: Pool, sessions: Sessions, counters: Counters, *, decode_reserve: int,
                 idle_park_seconds: float | None, watermarks: tuple[float, float], max_pinned_fraction: float,
                 order: Callable[[], int], tenants: TenantLoad) -> None:
        self.engine, self.pool, self.sessions, self.counters = engine, pool, sessions, counters
        self.descriptor = engine.describe()
        self.cells_total = self.descriptor.kv_cells or self.descriptor.context_length
        self.unified = self.descriptor.unified_cells
        # where lanes' cells lie matters: llama.cpp's one cache of plain KV (seats.py)
        self.seats_tracked = self.unified and self.descriptor.memory.kind == "kv"
        self.memory = self.descriptor.memory  # what can be cut back, and so where checkpoints are needed
        self.max_sequences = self.descriptor.packing.max_sequences
        self.decode_reserve, self.idle_park_seconds = decode_reserve, idle_park_seconds
        self.high_watermark, self.low_watermark = watermarks
        self.max_pinned_fraction = max_pinned_fraction
        self.order = order
        self.tenants = tenants  # who is active, for each tenant's share of the sequences (the scheduler keeps it)
        # admission order (set by the scheduler, which owns it): who may swap whom out
        self.urgency: Callable[[Live, int], tuple] = lambda live, uncached: (live.job.priority, uncached)
        self.lanes: list[Live] = []  # sessions holding an engine sequence
        self._groups = itertools.count(1)
        self.warming = DiskWarming(pool, self.descriptor.identity, self.memory)  # (callers' threads)

    # ----------------------------------------------------------------------------- cells

    def cells_used(self) -> int:
        """Cells the engine's lanes hold now (a span shared by forks counted once)."""
        reach: dict[int, tuple[int, int]] = {}
        for live in self.lanes:
            for span in live.spans():
                start, end = reach.get(span.group, (span.start, span.end))
                reach[span.group] = (start, max(end, span.end))
        return sum(end - start for start, end in reach.values())

    def cells_reserved(self) -> int:
        """Cells admitted generations may still write: prompt not yet fed, and their decode reserve."""
        return sum(max(live.job.reserved_to, len(live.state.tokens)) - live.kv
                   for live in self.lanes if live.job is not None)

    def cells_free(self) -> int:
        """Cells neither used nor reserved."""
        return self.cells_total - self.cells_used() - self.cells_reserved()

    def reserve_for(self, live: Live) -> int:
        """The decode reserve of `live`'s generation: cells for its first output tokens."""
        return min(self.decode_reserve, max(0, live.job.request.max_tokens - 1))

    # ----------------------------------------------------------------------------- admission

    def source(self, live: Live) -> Source:
        """The longest cached prefix of `live`'s tokens (all but the last, whose logits the next
        step needs): a live lane holding it, and the pool's best match."""
        tokens = live.state.tokens
        want = len(tokens) - 1
        lane, held = None, 0
        namespace = live.state.namespace  # (only KV of its own namespace: tenants.py)
        for other in self.lanes:
            if other is not live and other.state.namespace == namespace:
                common = common_prefix(other.state.tokens[:other.kv], tokens, want)
                # a memory that cannot be cut back is forked only where it ends at the prefix
                if common > held and self.memory.can_cut_restored(other.kv, common):
                    lane, held = other, common
        return Source(lane, held, self._pool_match(live))

    def _pool_match(self, live: Live) -> PrefixMatch | None:
        """The pool's longest match (memory or disk) for `live`'s tokens but the last, of its namespace."""
        want = len(live.state.tokens) - 1
        serves = None if self.memory.kind == "kv" else self.memory.can_cut_restored
        return (self.pool.lookup(self.descriptor.identity, live.state.tokens[:want], serves,
                                 namespace=live.state.namespace) if want > 0 else None)

    def cells_needed(self, live: Live, source: Source) -> int:
        """New cells `live` takes if it starts from `source`: what it does not share, and its reserve
        (never more than the engine has, so a session that fits alone always starts)."""
        shared = source.lane_tokens if source.forks and self.unified else 0
        return min(len(live.state.tokens) - shared + self.reserve_for(live), self.cells_total)

    def admit(self, live: Live, source: Source) -> bool:
        """Give waiting `live` a lane holding the prefix `source` offers, making room by swap if
        need be. False when it must wait (the cells or sequences are taken by what matters as
        much). EngineError when the engine refuses it (the lane is freed again)."""
        uncached = len(live.state.tokens) - max(source.lane_tokens, source.pool_tokens)
        keep = source.lane if source.forks else None
        if not self._make_room(live, self.cells_needed(live, source), keep, uncached):
            # The lane it would fork may be what stands in the way: it holds the engine's last
            # free sequence, idle, or running and less urgent (an interactive chat whose only
            # shared prefix with a background job is the template's first token). Start without
            # it (from the pool, or the prompt), which lets it be parked or swapped out like any
            # other lane.
            alone = Source(None, 0, source.match)
            if keep is None or not self._make_room(live, self.cells_needed(live, alone), None,
                                                   len(live.state.tokens) - source.pool_tokens):
                return False
        if source.lane is not None and source.lane.seq is None:
            source = self.source(live)  # the lane it would fork was parked to make room
        try:
            self._restore(live, source)
        except EngineError:
            if live.seq is not None:
                self._close(live)
            raise
        live.job.admitted = live.last_used = self.order()
        live.job.reserved_to = len(live.state.tokens) + self.reserve_for(live)
        live.seat_mark = self.cells_used()
        return True

    def _make_room(self, live: Live, cells: int, keep: Live | None, uncached: int) -> bool:
        """Park idle lanes (not `keep`, the lane to fork), then preempt, until `cells` and a
        sequence are free; nothing is moved unless that is enough."""
        idle = [other for other in self.lanes if other.job is None and other is not keep]
        victims = [other for other in self._victims_for(live, uncached) if other is not keep]
        freeable = sum(self._own_cells(other) for other in idle + victims)
        freeable_seqs = len(idle) + len(victims)
        if (self.cells_free() + freeable < cells
                or len(self.lanes) - freeable_seqs >= self.max_sequences):
            return False
        while len(self.lanes) >= self.max_sequences or self.cells_free() < cells:
            if self.park_least_recent_idle(exclude={keep}):
                continue
            if not victims:  # shared cells freed less than counted
                return False
            self.preempt(victims.pop(0))
        return True

    def _own_cells(self, live: Live) -> int:
        """Cells freed by taking `live` out of the engine: those it wrote, and its reservation."""
        reserved = max(live.job.reserved_to, len(live.state.tokens)) - live.kv if live.job is not None else 0
        return live.kv - live.own.start + reserved

    def _victims_for(self, live: Live, uncached: int) -> list[Live]:
        """The lanes waiting `live` (with `uncached` prompt tokens to feed) may swap out, least
        urgent first: for an interactive arrival those of a less urgent class; for any arrival
        those of its class or a less urgent one still being prefilled with at least SHORT_FACTOR
        times its uncached prompt left; and for an arrival of a tenant below its equal share of the
        sequences, those of its class or a less urgent one of a tenant above its own, as many as
        that tenant holds beyond its share. With several tenants active, a tenant at or above its
        share never swaps out one at or below its own, by any rule (tenants.py): else two tenants'
        arrivals could swap each other's lanes out turn by turn."""
        job, tenant = live.job, live.state.tenant
        mine = self.urgency(live, uncached)
        held = self.tenants.lanes_held(self.lanes) if self.tenants.contended else None
        victims, owed = {}, {}
        for other in self.lanes:
            theirs = other.job
            if theirs is None:
                continue
            if held is not None and self.tenants.shields(tenant, other.state.tenant, held, self.max_sequences):
                continue
            if job.priority == INTERACTIVE and theirs.priority > job.priority:
                victims[other] = self.unimportance(other)
            elif (theirs.priority >= job.priority and not theirs.produced and other.pending > 1
                  and other.pending >= SHORT_FACTOR * max(uncached, 1) and self.urgency(other, other.pending) > mine):
                victims[other] = self.unimportance(other)
            elif (held is not None and theirs.priority >= job.priority
                  and self.tenants.owes(tenant, other.state.tenant, held, self.max_sequences)):
                owed.setdefault(other.state.tenant, []).append(other)
        for holder, lanes in owed.items():  # only what the holder runs beyond its share
            beyond = held[holder] - self.tenants.share(self.max_sequences)
            for other in sorted(lanes, key=self.unimportance, reverse=True)[:beyond]:
                victims[other] = self.unimportance(other)
        return sorted(victims, key=victims.__getitem__, reverse=True)

    @staticmethod
    def unimportance(live: Live) -> tuple:
        """Preemption order: lowest priority, then most recently started, then most uncached work."""
        return live.job.priority, live.job.admitted, live.pending

    def victim_for_growth(self, exclude: set) -> Live | None:
        """The running lane that matters least, of those not in `exclude`."""
        running = [other for other in self.lanes if other.job is not None and other not in exclude]
        return max(running, key=self.unimportance, default=None)

    # ----------------------------------------------------------------------------- restoring

    def _restore(self, live: Live, source: Source) -> None:
        """Give `live` a sequence holding the prefix `source` offers: a fork of a live lane when
        it holds at least as much as the pool, else the pool entry imported (one copy)."""
        if source.forks:
            self._open(live, self.engine.fork(source.lane.seq), source.lane.kv, source.lane)
            if live.kv > source.lane_tokens:
                try:
                    self.truncate(live, source.lane_tokens)
                except EngineError:  # a cache that cannot be cut back: start from the pool or nothing
                    self._close(live)
        if live.seq is None:
            self._open(live, self.engine.new_sequence(), 0)
            match = source.match if source.pool_tokens > 0 else None
            if match is not None and not match.on_disk and not self._import(live, match.entry_id, match.tokens):
                # gone since it was found (evicted by a park that made room for this lane, or by
                # a read from disk on another thread): once more, from wherever it is now
                again = self._pool_match(live)
                if again is not None and (again.on_disk or again.entry_id != match.entry_id):
                    match = again
                    if not again.on_disk:
                        self._import(live, again.entry_id, again.tokens)
            self._count_tiers(live, match)
            if match is not None and match.on_disk:
                self._import_from_disk(live, match.entry_id, match.tokens)
            if match is not None:
                # The pool holds what came in, so only what follows it is unexported: counted
                # from the session's start, a request resumed from a long cached prefix would be
                # checkpointed (its whole KV copied out again) at its first token.
                live.since_park = len(live.state.tokens) - live.kv
        live.warmed = None
        self.release_held(live)

    def _count_tiers(self, live: Live, match: PrefixMatch | None) -> None:
        """Count where a lane that does not fork found its prefix (`match`): memory, disk (read in
        by the scheduler, or for it on its caller's thread: warming.py), or neither."""
        on_disk = match is not None and match.on_disk
        if match is not None and not on_disk and live.warmed is not None and match.entry_id == live.warmed:
            self.counters.memory_misses += 1  # (a disk match's id is the tier's, never compared with memory's)
            self.counters.disk_hits += 1
            return
        if match is not None and not on_disk:
            self.counters.memory_hits += 1
            return
        self.counters.memory_misses += 1
        if not on_disk and self.pool.disk is not None:
            self.counters.disk_misses += 1  # (a disk hit is counted once its entry is read: _import_from_disk)

    def _import_from_disk(self, live: Live, disk_id: int, keep: int) -> None:
        """Read disk entry `disk_id` into the pool (one copy, verified), then import it as any
        entry: two copies from disk to engine. A file found damaged or gone, or no room in
        memory, leaves the lane empty (its tokens are prefilled)."""
        try:
            loaded = self.pool.load(disk_id, self.descriptor.identity)
        except PoolError:  # DataCorrupt (the file is removed), gone, or another identity's
            loaded = None
        if loaded is None:
            self.counters.import_failures += 1
            self.counters.disk_misses += 1
            return
        self.counters.disk_hits += 1
        try:
            self._import(live, loaded.id, keep)
        finally:
            self.pool.release(loaded.id)  # cached in memory now, evictable as any entry

    def _import(self, live: Live, entry: int, keep: int) -> bool:
        """Import pool entry `entry` into `live`'s new, empty lane and cut it to `keep` tokens. When
        the entry is corrupt, gone or refused, or cannot be cut to `keep`, the lane is left empty
        (its tokens are prefilled). False where the pool could not give it (corrupt, gone, refused)."""
        try:
            with self.pool.get(entry, verify=False) as view:
                restored = transfer.import_(self.engine, live.seq, view)
        except (DataCorrupt, PoolError, EngineError) as exc:
            self.counters.import_failures += 1
            if isinstance(exc, DataCorrupt):
                self.release_held(live)  # its own reference must not keep a corrupt entry alive
                try:
                    self.pool.evict(entry)  # nobody should start from it again
                except PoolError:
                    pass  # held elsewhere: the pool counts it corrupt, its holders will find out
            return False
        self.counters.imports += 1
        live.kv = restored
        live.started_from = entry
        if restored > keep:
            try:
                self.engine.truncate(live.seq, keep)
                live.kv = keep
            except EngineError:  # a cache that cannot be cut back (a wrapped ring, recurrent state)
                self._close(live)
                self._open(live, self.engine.new_sequence(), 0)
        return True

    # ----------------------------------------------------------------------------- lanes

    def _open(self, live: Live, seq: int, kv: int, parent: Live | None = None) -> None:
        """`live` holds sequence `seq` with `kv` positions: borrowed from `parent` where forks
        share cells, else cells of its own."""
        if live not in self.lanes:
            self.lanes.append(live)
        live.seq, live.kv = seq, kv
        if parent is not None and self.unified:
            live.borrowed = [Span(s.group, s.start, min(s.end, kv)) for s in parent.spans() if s.start < kv]
            live.own = Span(next(self._groups), kv, kv)
        else:
            live.borrowed, live.own = [], Span(next(self._groups), 0, 0)

    def _close(self, live: Live) -> None:
        self.engine.free_sequence(live.seq)
        self.lanes.remove(live)
        live.seq, live.kv, live.borrowed = None, 0, []

    def fork(self, parent: Live, child: Live) -> None:
        """Start `child` where `parent` is: an engine fork of its lane where a sequence (and, if
        forks copy, the cells) are free, else the parent's parked KV by reference."""
        cells = 0 if self.unified else parent.kv
        if parent.seq is not None and len(self.lanes) < self.max_sequences and self.cells_free() >= cells:
            self._open(child, self.engine.fork(parent.seq), parent.kv, parent)
            child.seat_mark = parent.seat_mark
        elif parent.state.parked is not None:  # the same parked KV: nothing copied, nothing referenced
            self.sessions.parked(child, *parent.state.parked)

    def truncate(self, live: Live, tokens: int) -> None:
        """Cut `live`'s lane to its first `tokens` positions (EngineError from a cache that
        cannot be cut back)."""
        self.engine.truncate(live.seq, tokens)
        # What is kept becomes borrowed, and later writes go to new cells: a fork may still hold
        # the cells past the cut, so they are not this lane's to write again.
        kept = [Span(s.group, s.start, min(s.end, tokens)) for s in live.spans() if s.start < tokens]
        live.kv, live.borrowed, live.own = tokens, kept, Span(next(self._groups), tokens, tokens)

    def cut(self, live: Live, tokens: int) -> None:
        """Keep at most `tokens` positions in `live`'s lane; a cache that cannot be cut back loses
        its lane (the log has the tokens)."""
        if live.seq is None or live.kv <= tokens:
            return
        try:
            self.truncate(live, tokens)
        except EngineError:
            self._close(live)

    def drop(self, live: Live) -> None:
        """Free `live`'s lane and everything it holds in the pool (a deleted session)."""
        if live.seq is not None:
            self._close(live)
        self.release_held(live)
        self.unpin(live)

    def erase(self, gone: list[Live], sessions: Iterable[Live]) -> None:
        """Erase the KV of durable sessions `gone` (deleted or expired), from disk and from memory,
        except an entry another of `sessions` (every session kept) still starts from: a fork's
        parked KV is its parent's entry until the fork parks its own."""
        gone = [live for live in gone if live.durable]
        if not gone:
            return
        keep = {other.entry for other in sessions if other.entry is not None}
        for live in gone:
            self.pool.erase(tag=session_tag(live.state.id), namespace=live.state.namespace, keep=keep)

    def resync(self, live: Live) -> None:
        """After a step the engine refused part-way: `live.kv` from what the engine holds."""
        held = self.engine.length(live.seq)
        if held < live.kv or held >= len(live.state.tokens):
            # cells gone, or the last token fed without its logits: feed it again next step
            try:
                self.truncate(live, min(held, len(live.state.tokens) - 1))
            except EngineError:
                self._close(live)
        else:
            live.kv = held

    # ----------------------------------------------------------------------------- parking

    def park(self, live: Live, *, keep_lane: bool, hold: bool = False) -> None:
        """Export the lane's KV into the pool (logged as Parked); free its sequence unless
        `keep_lane`; keep a reference to the entry while swapped out if `hold`."""
        if live.seq is not None and live.kv > 0 and not self._parked_as_is(live):
            live.since_park = 0  # also after a failure: retried at the next checkpoint, not every token
            try:
                # a request lane's id means nothing after it ends: its entry is tagged as a request's
                tag = session_tag(live.state.id) if live.durable else "request"
                info = transfer.export(self.engine, self.pool, live.seq, live.state.tokens[:live.kv], tag=tag,
                                       namespace=live.state.namespace)
            except (PoolError, EngineError):
                self.counters.export_failures += 1  # the pool is full or refused it: the lane keeps its KV
                info = None
            if info is not None:
                previous = live.entry
                self.counters.exports += 1
                # Sessions hold no reference to their parked KV: under pressure it is evicted by
                # cost like any cached entry (the session then prefills from its log); only a
                # pinned session's stays. A swapped-out generation holds one until it resumes.
                self.pool.release(info.id)
                self.sessions.parked(live, info.id, live.kv)
                self.follow_pin(live)
                if self.memory.kind == "kv":
                    if keep_lane and live.job is not None:  # the lane's next park supersedes this one
                        self.pool.defer_spill(info.id, PROVISIONAL_SPILL_SECONDS)
                    # The lane's earlier state, and the entry it was imported from (the last turn
                    # of a returning conversation), are prefixes of this one where their tokens
                    # are, and plain KV is cut back on import: they serve nothing this one does
                    # not (a fork or a request starting from them finds this one by prefix), so
                    # they leave memory and disk unless someone holds them.
                    if previous is not None and previous != info.id:
                        self.pool.supersede(previous, info.id)
                    if live.started_from not in (None, previous, info.id):
                        self.pool.supersede(live.started_from, info.id, tail=SUPERSEDED_TAIL)
                live.started_from = None
        elif not keep_lane and live.entry is not None:
            # the lane leaves with what it parked last (a request that ended at its first token
            # parked only the end of its prompt): nothing will supersede that soon
            self.pool.defer_spill(live.entry, 0)
        if hold and live.held is None and self._parked_as_is(live):
            self.pool.share(live.entry)
            live.held = live.entry
        if not keep_lane and live.seq is not None:
            self._close(live)

    def preempt(self, live: Live) -> None:
        """Swap a running lane out: its KV parked and held, its generation waiting to resume."""
        self.park(live, keep_lane=False, hold=True)
        self.counters.preemptions += 1

    def placed(self, lanes: list[Live]) -> None:
        """After a step fed `lanes` (all or part of it): where their new cells may lie (seats.py)."""
        if self.seats_tracked:
            seats.mark_placed(lanes, self.cells_used())

    def reseat_stranded(self) -> int:
        """Move the decoding lanes stranded high in llama.cpp's unified cache (seats.py) down to
        its lowest free cells; how many moved. Nothing to do elsewhere."""
        if not self.seats_tracked or all(
                live.seat_mark < seats.STRANDED_CELLS for live in self.lanes):  # (most ticks: no cells counted)
            return 0
        return sum(self.reseat(live) for live in seats.stranded(self.lanes, self.cells_used()))

    def reseat(self, live: Live) -> bool:
        """Park running `live` (one copy out) and import it straight back into a new sequence (one
        copy in), which llama.cpp places in the lowest free run of cells. False where the pool
        refused the copy (the lane stays as it was) or the engine the import (the lane is then
        swapped out, its entry held, and resumes by admission as a preempted lane does)."""
        self.park(live, keep_lane=True, hold=True)
        entry, kv = live.held, live.kv
        if entry is None:
            live.seat_mark = self.cells_used()  # not tried again at every tick: once it takes cells high again
            return False
        self._close(live)
        self._open(live, self.engine.new_sequence(), 0)
        if not self._import(live, entry, kv) or live.kv != kv:
            self._close(live)
            return False
        self.release_held(live)
        live.seat_mark = self.cells_used()
        self.counters.reseats += 1
        return True

    def park_least_recent_idle(self, exclude: set | frozenset = frozenset()) -> bool:
        """Park the least recently used idle lane; False when there is none."""
        idle = [live for live in self.lanes if live.job is None and live not in exclude]
        if not idle:
            return False
        self.park(min(idle, key=lambda live: live.last_used), keep_lane=False)
        self.counters.idle_parks += 1
        return True

    def park_idle(self, now: float, generating: bool) -> None:
        """Park the lanes idle past `idle_park_seconds`, and in a unified cache every idle lane
        while others are generating (each forward would read their cells)."""
        for live in [live for live in self.lanes if live.job is None]:
            expired = self.idle_park_seconds is not None and now - live.idle_since >= self.idle_park_seconds
            if expired or (generating and self.unified):
                self.park(live, keep_lane=False)
                self.counters.idle_parks += 1

    def _parked_as_is(self, live: Live) -> bool:
        """True when the pool still holds the session's KV as its lane holds it now."""
        if live.state.parked is None or live.state.parked[1] != live.kv:
            return False
        return self.in_pool(live.entry)  # not evicted since

    def release_held(self, live: Live) -> None:
        """Drop the reference a swapped-out lane held on its parked entry."""
        if live.held is not None:
            try:
                self.pool.release(live.held)
            except PoolError:
                pass  # gone already
            live.held = None

    def follow_pin(self, live: Live) -> None:
        """Move a pinned session's pin to the entry its state now records as parked (after a
        park, or a trim that made the parked KV not the session's); with none, it is unpinned."""
        if not live.pinned or live.pin == live.entry:
            return
        if live.entry is None:
            self.unpin(live)
            return
        self.pool.pin(live.entry)
        self._unpin_entry(live.pin)
        live.pin = live.entry

    def pin(self, live: Live) -> int:
        """Park `live`'s KV as it is now and pin it (PinLimit past the cap); the bytes pinned."""
        if live.pinned:
            return self.pool.info(live.entry).stored_bytes
        self.park(live, keep_lane=True)
        if live.entry is None or not self.in_pool(live.entry):
            raise SuperfluidError(f"session {live.state.id!r} has no KV to pin yet (nothing was prefilled, or the "
                                  "pool had no room); generate first")
        budget, size = self.pool.stats().budget_bytes, self.pool.info(live.entry).stored_bytes
        cap, pinned = int(self.max_pinned_fraction * budget), self.pool.pinned_bytes()
        if pinned + size > cap:
            raise PinLimit(f"pinning session {live.state.id!r} ({size} bytes) would pin {pinned + size} bytes, over "
                           f"the cap of {cap} ({self.max_pinned_fraction:.0%} of the pool's budget); unpin other "
                           "sessions or raise max_pinned_fraction")
        self.pool.pin(live.entry)
        live.pin = live.entry
        return size

    def unpin(self, live: Live) -> None:
        """Let `live`'s parked KV be evicted again under pressure."""
        if live.pinned:
            self._unpin_entry(live.pin)
            live.pin = None

    def _unpin_entry(self, entry: int) -> None:
        try:
            self.pool.unpin(entry)
        except PoolError:
            pass  # already gone

    def in_pool(self, entry: int) -> bool:
        """True while the pool holds `entry` (not evicted, nor erased)."""
        try:
            self.pool.info(entry)
        except PoolError:
            return False
        return True

    def relieve_pressure(self) -> int:
        """Past the high watermark, evict cached entries nobody holds down to the low one."""
        used, budget = self.pool.usage()
        if used <= self.high_watermark * budget:
            return 0
        return self.pool.shed(int(self.low_watermark * budget))


def session_tag(session_id: str) -> str:
    """The tag of a durable session's pool entries (how they are found to be erased with it)."""
    return f"session:{session_id}"


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many tokens `a` and `b` share at their start, up to `limit`."""
    common = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        common += 1
    return common
