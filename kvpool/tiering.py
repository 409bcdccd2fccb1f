"""The pool and its disk tier: entries spilled in the background, found and loaded back.

Once a pool has a disk tier (`attach_disk`), every entry it commits is queued for a writer thread
that copies the entry's live bytes into a file of the tier (one copy, off the caller's path: the
step never waits for a disk), SPILL_DELAY_SECONDS after the commit (or later, where its owner
expects to replace it: `defer_spill`), so an entry superseded or dropped before is never
written. While it writes, the writer holds a view of the entry, so the entry is neither evicted
nor moved by compaction under it. An entry the tier holds a copy of is
the first the memory tier evicts (it loses only a read back); one evicted before the writer took
it (within its delay, or queued) is copied into the page cache by the evicting thread as it
goes, and the writer flushes and names that file.

`lookup` covers both tiers: a disk entry is returned (marked `on_disk`) only where it holds more
of the tokens than any entry in memory. `load` reads it into a new memory entry, verified on the
way, which the engine then imports: disk to engine is two copies (into the pool, then the import),
both counted. A mixin of Pool: it works on the pool's records under the pool's lock, and takes the
tier's lock only inside the pool's, never the other way round.
"""

from __future__ import annotations

import collections
import heapq
import logging
import threading
import time
from collections.abc import Collection

from kvpool import disk_format, layout as layouts
from kvpool.disk import DiskTier, PendingWrite
from kvpool.entry import EntryInfo, EntryRecord
from kvpool.errors import EntryNotFound, PoolError
from kvpool.layout import ArrayLayout
from kvpool.prefix import PrefixMatch, common_prefix
from kvpool.stats import DiskStats

# How many entries evicted to the disk tier the pool remembers by their memory id, so that their
# owner's next park can still supersede them there (older ones are left to the tier's eviction).
MOVED_BELOW_REMEMBERED = 16384
# How long a committed entry waits before the writer copies it to disk. Most parks are superseded
# within seconds (a conversation parks each turn, a lane parks again at its end), and an entry
# dropped before its turn is never written. A process crash loses nothing by it (the segment keeps
# the entry); a power cut loses the latest parks still waiting (this long, or as long as their
# owner deferred them: defer_spill), not their tokens (the session log has them). Memory evicting
# an entry first writes it then.
SPILL_DELAY_SECONDS = 2.0
MAX_SPILL_DELAY_SECONDS = 3600.0
CLOSE_DRAIN_SECONDS = 60.0  # at close, what the writer has not written by then stays in the segment only
SCAN_POLL_SECONDS = 0.1
LOG = logging.getLogger("kvpool.tiering")


class Tiered:
    """Pool methods that keep entries on a disk tier behind the memory."""

    _disk: DiskTier | None = None
    _spill_stop = False
    _sealing: EntryRecord | None = None  # evicted, its file being flushed by the writer
    _sealing_tokens = None  # (and that file's token ids)

    def attach_disk(self, tier: DiskTier, *, delay: float | None = None) -> None:
        """Keep this pool's entries on `tier` too, from now on: every ready entry is queued for it
        now, each committed later `delay` seconds (default SPILL_DELAY_SECONDS, at most an hour)
        after its commit, unless it is dropped first (the pool closes the tier when it closes)."""
        delay = SPILL_DELAY_SECONDS if delay is None else delay
        if not 0 <= delay <= MAX_SPILL_DELAY_SECONDS:  # (NaN too)
            raise ValueError(f"delay={delay!r}: seconds from 0 to {MAX_SPILL_DELAY_SECONDS:g}")
        with self._lock:
            self._check_open()
            if self._disk is not None:
                raise PoolError(f"pool {self.name!r} already has a disk tier ({self._disk.folder})")
            self._disk = tier
            self._spill_delay = delay
            now = time.monotonic()
            # (when it is due, entry id): a heap, as an entry deferred (defer_spill) goes back in later
            self._spill_queue: list[tuple[float, int]] = [(now, entry_id) for entry_id in sorted(self._entries)]
            heapq.heapify(self._spill_queue)
            self._hurried = 0  # callers waiting for everything queued (wait_spilled, close): no delay
            self._seal_queue: collections.deque[tuple[PendingWrite, EntryRecord]] = collections.deque()
            self._spill_wake = threading.Condition(self._lock)
            self._spill_busy = False
            # memory id -> disk id of entries evicted for room while the tier kept them
            self._moved_below: collections.OrderedDict[int, int] = collections.OrderedDict()
            self._spiller = threading.Thread(target=self._spill_loop, name=f"kvpool-spill-{self.name}", daemon=True)
            self._spiller.start()

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier behind this pool, if it has one (closed with the pool)."""
        return self._disk

    def disk_stats(self) -> DiskStats | None:
        """A snapshot of the disk tier (None without one)."""
        return None if self._disk is None else self._disk.stats()

    def defer_spill(self, entry_id: int, seconds: float) -> None:
        """Entry `entry_id`'s owner expects to replace it within `seconds` (a lane that goes on
        after a checkpoint parks again at its end): the writer copies it no sooner than `seconds`
        from now, instead of after the pool's delay, so that the copy is usually never made.
        Called again it moves that time, earlier too: `seconds=0` ends a deferral (the owner will
        not replace it after all). Memory evicting it first writes it then, like any entry, and
        `wait_spilled` and close write it at once. Nothing without a disk tier, for an entry no
        longer in memory, or to end the deferral of one never deferred."""
        if not 0 <= seconds <= MAX_SPILL_DELAY_SECONDS:  # (NaN too)
            raise ValueError(f"seconds={seconds!r}: from 0 to {MAX_SPILL_DELAY_SECONDS:g}")
        with self._lock:
            record = self._entries.get(entry_id)
            if self._tier() is None or record is None or (seconds == 0 and not record.spill_not_before):
                return
            now = time.monotonic()
            earlier = now + seconds < record.spill_not_before
            record.spill_not_before = now + seconds
            if earlier and record.disk_id is None and not record.erased:
                # its place in the queue is at the old time: one more at the new (a pop finds the
                # entry written, or deferred, and skips it)
                self._queue_spill(record, now + seconds)

    def wait_spilled(self, timeout: float | None = None) -> bool:
        """Write every entry queued for the disk tier now, without its delay, and wait until all
        are written (or refused); False on timeout. (Tests, benchmarks and an orderly close use
        it; nothing on a request's path.)"""
        with self._lock:
            if self._tier() is None:
                return True
            return self._hurry_spills(timeout)

    def _hurry_spills(self, timeout: float | None) -> bool:
        """wait_spilled() under the pool's lock."""
        self._hurried += 1
        self._spill_wake.notify_all()
        try:
            return self._spill_wake.wait_for(lambda: self._spilled() or not self._spiller.is_alive(), timeout)
        finally:
            self._hurried -= 1

    def load(self, disk_id: int, identity: str) -> EntryInfo | None:
        """Read disk entry `disk_id` into a new memory entry held once by the caller (release it),
        verified as it lands: DataCorrupt when it fails (the file is removed), EntryNotFound when
        the tier no longer has it (or cannot read it now), PoolError when it is another identity's.
        None when memory has no room for it even after eviction."""
        tier = self._tier()
        if tier is None:
            raise EntryNotFound(f"pool {self.name!r} has no open disk tier")
        with tier.reading(disk_id) as (header, tokens, read_into):
            if header.identity != identity:
                raise PoolError(f"disk entry {disk_id} was written by {header.identity}, not {identity}: "
                                "another model's state is never loaded")
            layout = header.decoded_layout()
            options = dict(tag=header.tag, recompute_cost=header.recompute_cost, namespace=header.namespace)
            if isinstance(layout, ArrayLayout):
                writer = self.reserve(identity, tokens, layouts.templates_of(layout),
                                      engine_values=dict(layout.engine_values), **options)
            else:
                writer = self.reserve_blob(identity, tokens, layout.length, **options)
            if writer is None:
                return None
            with writer:
                writer._record.disk_id = disk_id  # already on disk: never spilled again
                read_into(writer.live_runs())
                info = writer.commit(header.data_checksum)
        with self._lock:
            record = self._entries.get(info.id)
            if record is not None and record.erased:  # its owner was deleted while it was read
                record.refcount -= 1
                if not record.refcount and self._movable(record):
                    self._evict(record)
                raise EntryNotFound(f"disk entry {disk_id} was erased while it was read")
            if record is not None and record.disk_id == disk_id and not tier.has(disk_id):
                record.disk_id = None  # its file was removed while read (superseded, evicted): written anew
                self._queue_spill(record)
        return info

    def erase(self, *, tag: str, namespace: str | None = None, keep: Collection[int] = ()) -> int:
        """Erase every entry carrying `tag` (of `namespace`, when given): what deleting their
        owner erases. From disk, files included; from memory, the entries nobody holds (so a
        restart does not write them back), except those in `keep` (entries others still start
        from: a fork's parked KV) and their disk copies; entries held stay in memory, never to
        be written to disk again. The disk entries removed now."""
        with self._lock:
            kept_copies = {self._entries[i].disk_id for i in keep if i in self._entries}
            sealing = [record for _, record in self._seal_queue] if self._disk is not None else []
            # (an entry being loaded back from disk on another thread is erased as it commits)
            loading = list(self._writing.values())
            for record in [*self._entries.values(), *sealing, *([self._sealing] if self._sealing else []), *loading]:
                if record.id in keep or record.header.tag != tag or namespace not in (None, record.header.namespace):
                    continue
                record.erased = True  # (one evicted while its file is flushed is removed after)
                if self._entries.get(record.id) is record and not record.refcount and self._movable(record):
                    self._evict(record)
        tier = self._tier()
        return 0 if tier is None else tier.erase(tag=tag, namespace=namespace, keep=kept_copies - {None})

    # ----------------------------------------------------------------------------- pool hooks

    def _tier(self) -> DiskTier | None:
        """The disk tier while it is open (not once the pool began to close)."""
        return None if self._spill_stop else self._disk

    def _lookup_below(self, identity: str, tokens, serves, namespace: str,
                      found: PrefixMatch | None) -> PrefixMatch | None:
        """The disk tier's match where it holds more tokens than `found`, the memory's."""
        tier = self._tier()
        if tier is None or (found is not None and found.tokens >= len(tokens)):
            return found
        below = tier.lookup(identity, tokens, serves, namespace=namespace)
        return below if below is not None and (found is None or below.tokens > found.tokens) else found

    def _kept_below(self, record: EntryRecord) -> bool:
        """True when the disk tier holds a copy of `record`'s cells (under the pool's lock)."""
        return record.disk_id is not None and self._disk is not None and self._disk.has(record.disk_id)

    def _queue_spill(self, record: EntryRecord, when: float | None = None) -> None:
        """Queue a committed entry for the disk tier, due after the pool's delay or at `when`
        (monotonic), under the pool's lock."""
        if self._tier() is not None and record.disk_id is None and not record.erased:
            due = (time.monotonic() + self._spill_delay if when is None else when, record.id)
            heapq.heappush(self._spill_queue, due)
            if self._spill_queue[0] is due:  # else the writer already wakes before it is due: a wake-up
                self._spill_wake.notify_all()  # per park would take the interpreter's lock from the step

    def _spilled(self) -> bool:
        """Nothing queued for the writer, and nothing being written (under the lock)."""
        return not self._spill_queue and not self._seal_queue and not self._spill_busy

    def _keep_on_disk(self, record: EntryRecord) -> None:
        """Before memory evicts `record` to make room (under the pool's lock): if the disk tier
        has no copy yet (the writer had not reached it), write one now into the page cache (one
        copy, on the evicting thread; the writer flushes and names it), so an entry evicted under
        pressure stays on disk instead of being dropped."""
        tier = self._tier()
        if tier is None or record.erased or record.extending or self._kept_below(record):
            return
        header = record.header
        data, tokens = self._store.data(header), self._store.tokens(header)
        record.disk_id = tier.find_copy(header.identity, header.namespace, header.tag, tokens, header.data_checksum)
        if record.disk_id is not None:
            return
        self._counters.evicted_unspilled += 1
        pending = tier.begin(_disk_header(record, header, tokens), tokens,
                             layouts.all_live_runs(data, record.layout, header.live))
        if pending is not None:
            self._seal_queue.append((pending, record))
            self._spill_wake.notify_all()

    def _hand_down_disk_copy(self, old: EntryRecord, new: EntryRecord) -> None:
        """`old` is dropped for `new`, which holds its tokens and more (under the pool's lock): its
        disk copies go now if `new` has one, else once `new` is written (until then a crash still
        finds the shorter state on disk)."""
        # (never `new`'s own copy: an entry parked again with nothing new adopts the same file)
        copies = [c for c in [*old.supersedes, old.disk_id] if c is not None and c != new.disk_id]
        if self._kept_below(new):
            for disk_id in copies:
                self._disk.remove(disk_id)
        else:
            new.supersedes.extend(copies)

    def _written(self, record: EntryRecord, disk_id: int) -> None:
        """`record`'s cells are on disk as `disk_id` (under the pool's lock): the copies of what it
        superseded go."""
        record.disk_id = disk_id
        for old in record.supersedes:
            if old != disk_id:  # (its own file, adopted: a park with nothing new)
                self._disk.remove(old)
        record.supersedes.clear()
        if self._entries.get(record.id) is not record:  # evicted for room while its file was flushed
            if record.superseded_by is not None:  # and its owner parked again meanwhile
                self._hand_down_disk_copy(record, record.superseded_by)
            else:
                self._moved_below_now(record)

    def _moved_below_now(self, record: EntryRecord) -> None:
        """`record` left memory for room and the tier keeps it (under the pool's lock): remember
        where, so that `supersede` finds it by its memory id."""
        if record.disk_id is None or self._disk is None:
            return
        self._moved_below[record.id] = record.disk_id
        while len(self._moved_below) > MOVED_BELOW_REMEMBERED:
            self._moved_below.popitem(last=False)

    def _supersede_below(self, old_id: int, new: EntryRecord, tail: int) -> bool:
        """`supersede` for an entry memory evicted for room, kept on disk (under the pool's lock):
        its file goes, once `new` has one, where `new` (of the same identity, namespace and tag)
        holds its tokens (short of `tail`) and no entry in memory still names that file as its
        own (one loaded from it, or loading). Without this, a conversation returning from disk
        left each turn's file behind, and those crowded out conversations not yet back. The
        pool remembers the last MOVED_BELOW_REMEMBERED entries it evicted so, for as long as it
        is open; older files are left to the tier's own eviction."""
        tier = self._tier()
        if tier is None:
            return False
        header, new_tokens = new.header, self._store.tokens(new.header)

        def holds(tokens) -> bool:
            return len(tokens) - common_prefix(tokens, new_tokens) <= tail

        flushing = self._flushing(old_id)
        if flushing is not None:  # evicted before the writer flushed its file: that goes once both are
            record, tokens = flushing
            before = record.header
            if ((before.identity, before.namespace, before.tag) != (header.identity, header.namespace, header.tag)
                    or record.superseded_by is not None or not holds(tokens)):
                return False
            record.superseded_by = new  # (_written hands its file down)
            self._counters.superseded += 1
            return True
        disk_id = self._moved_below.get(old_id)
        if disk_id is None:
            return False
        tokens = tier.tokens_of(disk_id, identity=header.identity, namespace=header.namespace, tag=header.tag)
        if tokens is None:  # gone from disk (forgotten), or another owner's (remembered for its own)
            if not tier.has(disk_id):
                del self._moved_below[old_id]
            return False
        if not holds(tokens):
            return False
        if any(record.disk_id == disk_id for record in [*self._entries.values(), *self._writing.values()]):
            return False  # memory holds it again (or is loading it): superseded as that entry, or kept
        del self._moved_below[old_id]
        if disk_id == new.disk_id or disk_id in new.supersedes:
            return True  # already handed down (the same file reached by two of the lane's entries)
        if self._kept_below(new):
            tier.remove(disk_id)
        else:
            new.supersedes.append(disk_id)
        self._counters.superseded += 1
        return True

    def _flushing(self, entry_id: int):
        """(record, token ids) of entry `entry_id` if memory evicted it before the writer flushed
        its file, and the writer has yet to (under the pool's lock); else None."""
        if self._sealing is not None and self._sealing.id == entry_id:
            return self._sealing, self._sealing_tokens
        for pending, record in self._seal_queue:
            if record.id == entry_id:
                return record, pending.tokens
        return None

    def _forget_disk_copy(self, record: EntryRecord) -> None:
        """An entry's cells changed (an extension): its disk copy is not them any more."""
        if record.disk_id is not None and self._disk is not None:
            self._disk.remove(record.disk_id)
        record.disk_id = None

    def _stop_spilling(self, drain_seconds: float = CLOSE_DRAIN_SECONDS) -> None:
        """Let the writer write what is queued (for at most `drain_seconds`: what is left stays in
        the segment), then end it and close the tier (before the pool closes: what a host parks
        as it closes reaches the disk too). From here on the pool uses the tier no more."""
        if self._disk is None:
            return
        with self._lock:
            if not self._spill_stop:
                self._hurry_spills(drain_seconds)
                self._spill_stop = True
                self._spill_wake.notify_all()
        self._spiller.join()
        self._disk.close()

    def _spill_loop(self) -> None:
        while not self._disk.wait_scanned(SCAN_POLL_SECONDS):  # (so an entry already on disk is found, not
            with self._lock:                                  # written twice)
                if self._spill_stop:
                    return
        while True:
            with self._lock:
                self._spill_busy = False
                self._sealing = self._sealing_tokens = None
                self._spill_wake.notify_all()
                while not (self._seal_queue or self._spill_stop or self._spill_due()):
                    self._spill_wake.wait(self._spill_queue[0][0] - time.monotonic() if self._spill_queue else None)
                if self._spill_stop:
                    return
                self._spill_busy = True
            try:
                self._spill_one()
            except Exception:  # a bug of ours must not end the writer, nor leave an entry held
                LOG.exception("pool %s: the disk tier's writer failed on an entry; it stays in memory only", self.name)

    def _spill_due(self) -> bool:
        """Whether the next queued entry is due (or someone waits for all of them), under the lock."""
        return bool(self._spill_queue) and (self._hurried > 0 or self._spill_queue[0][0] <= time.monotonic())

    def _spill_one(self) -> None:
        """Write the next queued file: one evicted (flushed and named), else one committed."""
        with self._lock:
            if self._seal_queue:
                pending, self._sealing = self._seal_queue.popleft()
                self._sealing_tokens = pending.tokens
            else:
                _, entry_id = heapq.heappop(self._spill_queue)
                pending, record = None, self._entries.get(entry_id)
                if record is None or record.disk_id is not None or record.erased or record.extending:
                    return
                if record.spill_not_before > time.monotonic() and not self._hurried:
                    heapq.heappush(self._spill_queue, (record.spill_not_before, entry_id))  # deferred
                    return
                record.views += 1  # neither evicted nor moved while its bytes are read
        if pending is not None:  # written as its entry was evicted: flush and name it
            disk_id = self._disk.finish(pending)
            with self._lock:
                if disk_id is not None and self._sealing.erased:
                    self._disk.remove(disk_id)
                elif disk_id is not None:
                    self._written(self._sealing, disk_id)
            return
        try:
            with self._lock:
                header = record.header
                data, tokens = self._store.data(header), self._store.tokens(header)
            disk_id = self._disk.find_copy(header.identity, header.namespace, header.tag, tokens,
                                           header.data_checksum)
            if disk_id is None:
                disk_id = self._disk.write(_disk_header(record, header, tokens), tokens,
                                           layouts.all_live_runs(data, record.layout, header.live))
        finally:
            with self._lock:
                record.views -= 1
                self._drop_if_superseded(record)
        with self._lock:
            if disk_id is None:
                return
            if record.erased or record.header.live != header.live or self._entries.get(record.id) is not record:
                self._disk.remove(disk_id)  # deleted or extended meanwhile: not these cells any more
            else:
                self._written(record, disk_id)


def _disk_header(record: EntryRecord, header, tokens) -> disk_format.DiskHeader:
    """The disk header of `record`'s cells as `header` describes them, laid out without slack."""
    layout = record.layout
    if isinstance(layout, ArrayLayout):
        layout, _ = layouts.plan(layouts.templates_of(layout), header.live, dict(layout.engine_values))
    return disk_format.header_for(header.identity, header.namespace, header.tag, header.live, layout,
                                  layouts.live_nbytes(layout, header.live), header.data_checksum, tokens,
                                  header.recompute_cost, header.created_at)
