"""Compaction as the pool carries it out: slack given back, extents moved to join free space.

The plans come from `compaction` (pure functions); the bytes move through the Store, which keeps
every move crash-safe; what is counted goes to the pool's counters. A mixin of Pool: it works on
the pool's records under the pool's lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool import compaction, eviction
from kvpool.allocator import align_up
from kvpool.entry import EntryRecord
from kvpool.errors import DataCorrupt
from kvpool.layout import ArrayLayout

SLACK_RATIO = 0.25  # reclaim an entry's slack once it is a quarter of what the entry reserves
SLACK_MIN_BYTES = 64 << 10


class Compacting:
    """Pool methods that give back slack and defragment the arena."""

    def compact(self, *, ratio: float = SLACK_RATIO, min_bytes: int = SLACK_MIN_BYTES) -> int:
        """Give back the slack of unpinned entries whose slack passes the threshold; the bytes
        returned to the free list."""
        with self._lock:
            self._check_open()
            reclaimed = 0
            candidates = [compaction.Reserved(r.id, r.live_bytes + r.slack_bytes, r.live_bytes)
                          for r in self._entries.values() if self._movable(r) and isinstance(r.layout, ArrayLayout)]
            for entry_id in compaction.slack_to_reclaim(candidates, ratio, min_bytes):
                record = self._entries[entry_id]
                try:
                    reclaimed += self._reclaim_slack(record)
                except DataCorrupt:  # found while moving it
                    self._counters.corrupt_found += 1
                    if not record.refcount:  # nobody can use it: its room is better spent
                        self._evict(record)
            return reclaimed

    def defragment(self, need: int) -> bool:
        """Move unpinned extents so that one free run of `need` bytes exists; False if it cannot."""
        with self._lock:
            self._check_open()
            return self._defragment(align_up(need))

    def _reclaim_slack(self, record: EntryRecord) -> int:
        before = record.stored_bytes
        moved = self._store.relocate(record, record.header.live)
        if moved is None:
            return 0
        self._bytes_used += record.stored_bytes - before
        self._counters.bytes_moved += moved
        self._counters.slack_reclaims += 1
        self._counters.bytes_reclaimed += before - record.stored_bytes
        return before - record.stored_bytes

    def _defragment(self, need: int, taken: Sequence[tuple[int, int]] = ()) -> bool:
        """Move unpinned entries until a free run of `need` bytes exists. `taken` lists extents
        allocated but not yet owned by an entry (they stay put)."""
        while True:
            movable = [r for r in self._entries.values() if self._movable(r)]
            fixed = [r for r in self._entries.values() if not self._movable(r)] + list(self._writing.values())
            try:
                done, entries, moved = self._store.defragment(need, movable, fixed, taken)
            except DataCorrupt as exc:  # found while moving it: drop it if nobody holds it, then go on
                self._counters.corrupt_found += 1
                record = self._entries[exc.entry_id]
                if record.refcount:
                    return False
                self._evict(record)
                continue
            self._counters.relocations += entries
            self._counters.bytes_moved += moved
            return done

    def shed(self, target_bytes: int) -> int:
        """Evict unreferenced, unpinned entries, cheapest per byte first, until the pool uses at
        most `target_bytes` (or nothing evictable is left): what a host does when it passes its
        high watermark, before a put would have to. Returns the bytes freed."""
        with self._lock:
            self._check_open()
            freed = 0
            order = eviction.eviction_order(self._candidate(r) for r in self._entries.values()
                                            if not r.refcount and self._movable(r))
            for entry_id in order:
                if self._bytes_used <= target_bytes:
                    break
                record = self._entries[entry_id]
                freed += record.stored_bytes
                self._evict_for_room(record)
            return freed

    def usage(self) -> tuple[int, int]:
        """(bytes the entries take, the export budget): what a host checks every tick, without
        the full statistics snapshot."""
        with self._lock:
            return self._bytes_used, self._store.header.budget_bytes

    def pinned_bytes(self) -> int:
        """Bytes held by entries pinned with pin() (open views do not count)."""
        with self._lock:
            return sum(r.stored_bytes for r in self._entries.values() if r.pins)
