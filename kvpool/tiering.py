"""The pool and its disk tier: entries spilled in the background, found and loaded back.

Once a pool has a disk tier (`attach_disk`), every entry it commits is queued for a writer thread
that copies the entry's live bytes into a file of the tier (one copy, off the caller's path: the
step never waits for a disk). While it writes, the writer holds a view of the entry, so the
entry is neither evicted nor moved by compaction under it. An entry the tier holds a copy of is
the first the memory tier evicts (it loses only a read back); an entry evicted before its turn
came is gone, as without a tier.

`lookup` covers both tiers: a disk entry is returned (marked `on_disk`) only where it holds more
of the tokens than any entry in memory. `load` reads it into a new memory entry, verified on the
way, which the engine then imports: disk to engine is two copies (into the pool, then the import),
both counted. A mixin of Pool: it works on the pool's records under the pool's lock, and takes the
tier's lock only inside the pool's, never the other way round.
"""

from __future__ import annotations

import collections
import threading

from kvpool import disk_format, layout as layouts
from kvpool.disk import DiskStats, DiskTier, PendingWrite
from kvpool.entry import EntryInfo, EntryRecord
from kvpool.errors import EntryNotFound, PoolError
from kvpool.layout import ArrayLayout
from kvpool.prefix import PrefixMatch


class Tiered:
    """Pool methods that keep entries on a disk tier behind the memory."""

    _disk: DiskTier | None = None
    _sealing: EntryRecord | None = None  # evicted, its file being flushed by the writer

    def attach_disk(self, tier: DiskTier) -> None:
        """Keep this pool's entries on `tier` too, from now on; every ready entry is queued for it
        (the pool closes the tier when it closes)."""
        with self._lock:
            self._check_open()
            if self._disk is not None:
                raise PoolError(f"pool {self.name!r} already has a disk tier ({self._disk.folder})")
            self._disk = tier
            self._spill_queue: collections.deque[int] = collections.deque(sorted(self._entries))
            self._seal_queue: collections.deque[tuple[PendingWrite, EntryRecord]] = collections.deque()
            self._spill_wake = threading.Condition(self._lock)
            self._spill_stop = False
            self._spill_busy = False
            self._spiller = threading.Thread(target=self._spill_loop, name=f"kvpool-spill-{self.name}", daemon=True)
            self._spiller.start()

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier behind this pool, if it has one."""
        return self._disk

    def disk_stats(self) -> DiskStats | None:
        """A snapshot of the disk tier (None without one)."""
        return None if self._disk is None else self._disk.stats()

    def wait_spilled(self, timeout: float | None = None) -> bool:
        """Wait until every entry queued for the disk tier has been written (or refused); False
        on timeout. (Tests, benchmarks and an orderly close use it; nothing on a request's path.)"""
        with self._lock:
            if self._disk is None:
                return True
            return self._spill_wake.wait_for(self._spilled, timeout)

    def load(self, disk_id: int, identity: str) -> EntryInfo | None:
        """Read disk entry `disk_id` into a new memory entry held once by the caller (release it),
        verified as it lands: DataCorrupt when it fails (the file is removed), EntryNotFound when
        the tier no longer has it, PoolError when it is another identity's. None when memory has
        no room for it even after eviction."""
        if self._disk is None:
            raise EntryNotFound(f"pool {self.name!r} has no disk tier")
        with self._disk.reading(disk_id) as (header, tokens, read_into):
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
        return info

    def erase(self, *, tag: str, namespace: str | None = None) -> int:
        """Erase from the disk tier every entry carrying `tag` (of `namespace`, when given), and
        keep such entries in memory from being written to it again: what deleting their owner
        erases. Memory entries stay, evictable, as before. The disk entries removed."""
        with self._lock:
            sealing = [record for _, record in self._seal_queue] if self._disk is not None else []
            for record in [*self._entries.values(), *sealing, *([self._sealing] if self._sealing else [])]:
                if record.header.tag == tag and (namespace is None or record.header.namespace == namespace):
                    record.erased = True  # (one evicted while its file is flushed is removed after)
        return 0 if self._disk is None else self._disk.erase(tag=tag, namespace=namespace)

    # ----------------------------------------------------------------------------- pool hooks

    def _lookup_below(self, identity: str, tokens, serves, namespace: str,
                      found: PrefixMatch | None) -> PrefixMatch | None:
        """The disk tier's match where it holds more tokens than `found`, the memory's."""
        if self._disk is None or (found is not None and found.tokens >= len(tokens)):
            return found
        below = self._disk.lookup(identity, tokens, serves, namespace=namespace)
        return below if below is not None and (found is None or below.tokens > found.tokens) else found

    def _kept_below(self, record: EntryRecord) -> bool:
        """True when the disk tier holds a copy of `record`'s cells (under the pool's lock)."""
        return record.disk_id is not None and self._disk is not None and self._disk.has(record.disk_id)

    def _queue_spill(self, record: EntryRecord) -> None:
        """Queue a committed entry for the disk tier (under the pool's lock)."""
        if self._disk is not None and record.disk_id is None and not record.erased and not self._spill_stop:
            self._spill_queue.append(record.id)
            self._spill_wake.notify_all()

    def _spilled(self) -> bool:
        """Nothing queued for the writer, and nothing being written (under the lock)."""
        return not self._spill_queue and not self._seal_queue and not self._spill_busy

    def _keep_on_disk(self, record: EntryRecord) -> None:
        """Before memory evicts `record` to make room (under the pool's lock): if the disk tier
        has no copy yet (the writer had not reached it), write one now into the page cache (one
        copy; the writer flushes and names it), so an entry evicted under pressure stays on disk
        instead of being dropped."""
        if (self._disk is None or record.erased or self._spill_stop or record.extending
                or self._kept_below(record)):
            return
        header = record.header
        data, tokens = self._store.data(header), self._store.tokens(header)
        pending = self._disk.begin(_disk_header(record, header, tokens), tokens,
                                   layouts.all_live_runs(data, record.layout, header.live))
        if pending is not None:
            self._seal_queue.append((pending, record))
            self._spill_wake.notify_all()

    def _forget_disk_copy(self, record: EntryRecord) -> None:
        """An entry's cells changed (an extension): its disk copy is not them any more."""
        if record.disk_id is not None and self._disk is not None:
            self._disk.remove(record.disk_id)
        record.disk_id = None

    def _stop_spilling(self) -> None:
        """Let the writer write what is queued, then end it and close the tier (before the pool
        closes: what a host parks as it closes reaches the disk too)."""
        if self._disk is None:
            return
        with self._lock:
            self._spill_wake.wait_for(self._spilled)
            self._spill_stop = True
            self._spill_wake.notify_all()
        self._spiller.join()
        self._disk.close()

    def _spill_loop(self) -> None:
        self._disk.wait_scanned()  # (so that an entry already on disk is found, not written twice)
        while True:
            with self._lock:
                self._spill_busy = False
                self._spill_wake.notify_all()
                self._spill_wake.wait_for(lambda: self._spill_queue or self._seal_queue or self._spill_stop)
                if self._spill_stop:
                    return
                if self._seal_queue:
                    pending, self._sealing = self._seal_queue.popleft()
                    self._spill_busy = True
                else:
                    pending = None
            if pending is not None:  # written as its entry was evicted: flush and name it
                disk_id = self._disk.finish(pending)
                with self._lock:
                    if disk_id is not None and self._sealing.erased:
                        self._disk.remove(disk_id)
                    self._sealing = None
                continue
            with self._lock:
                record = self._entries.get(self._spill_queue.popleft())
                if record is None or record.disk_id is not None or record.erased or record.extending:
                    continue
                self._spill_busy = True
                record.views += 1  # neither evicted nor moved while its bytes are read
                header = record.header
                data, tokens = self._store.data(header), self._store.tokens(header)
            try:
                disk_id = self._disk.find_copy(header.identity, header.namespace, header.tag, tokens,
                                               header.data_checksum)
                if disk_id is None:
                    disk_id = self._disk.write(_disk_header(record, header, tokens), tokens,
                                               layouts.all_live_runs(data, record.layout, header.live))
            except Exception:  # a bug of ours must not end the writer: the entry just is not on disk
                disk_id = None
            finally:
                del data, tokens
                with self._lock:
                    record.views -= 1
            with self._lock:
                if disk_id is None:
                    continue
                if record.erased or record.header.live != header.live or self._entries.get(record.id) is not record:
                    self._disk.remove(disk_id)  # deleted or extended meanwhile: not these cells any more
                else:
                    record.disk_id = disk_id


def _disk_header(record: EntryRecord, header, tokens) -> disk_format.DiskHeader:
    """The disk header of `record`'s cells as `header` describes them, laid out without slack."""
    layout = record.layout
    if isinstance(layout, ArrayLayout):
        layout, _ = layouts.plan(layouts.templates_of(layout), header.live, dict(layout.engine_values))
    return disk_format.header_for(header.identity, header.namespace, header.tag, header.live, layout,
                                  layouts.live_nbytes(layout, header.live), header.data_checksum, tokens,
                                  header.recompute_cost, header.created_at)
