"""The statistics of the pool and of its disk tier: counters that only grow, and snapshots of where
the bytes are."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from kvpool.entry import EntryRecord
    from kvpool.recovery import RecoveryReport
    from kvpool.store import Store


@dataclass
class Counters:
    """Monotonic event counters, updated under the pool's lock."""

    puts: int = 0
    gets: int = 0
    shares: int = 0
    releases: int = 0
    extends: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    refused: int = 0  # inserts that found no room even after compaction and eviction
    slack_reclaims: int = 0
    bytes_reclaimed: int = 0
    relocations: int = 0
    bytes_written: int = 0  # copies into the pool (put, or an engine writing a reserved entry)
    bytes_read: int = 0  # copies out of the pool through read_into (an engine's import)
    bytes_moved: int = 0  # compaction: slack reclaimed, extents relocated
    corrupt_found: int = 0  # entries whose bytes failed their checksum while being moved
    evicted_unspilled: int = 0  # evicted before the disk tier's writer reached them: written as they went
    superseded: int = 0  # entries dropped for a longer one of the same tokens (their owner parked again)

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class PoolStats(msgspec.Struct, frozen=True):
    """A snapshot of the pool. `bytes_copied` is every byte any copy moved; sharing adds none."""

    name: str
    capacity: int  # arena bytes
    budget_bytes: int
    bytes_used: int  # what entries take, headers and side records included (checked against the budget)
    bytes_live: int
    bytes_slack: int
    bytes_free: int  # free arena bytes
    largest_free: int
    entries: int
    writing: int
    referenced: int
    shared: int  # entries held by more than one reference
    pinned: int
    bytes_copied: int
    puts: int
    gets: int
    shares: int
    releases: int
    extends: int
    evictions: int
    evicted_bytes: int
    refused: int
    slack_reclaims: int
    bytes_reclaimed: int
    relocations: int
    bytes_written: int
    bytes_read: int
    bytes_moved: int
    corrupt_found: int
    evicted_unspilled: int
    superseded: int
    recovered_entries: int
    recovered_freed_writing: int
    recovered_dropped: int


def snapshot(store: "Store", records: Sequence["EntryRecord"], writing: int, bytes_used: int, counters: Counters,
             report: "RecoveryReport") -> PoolStats:
    """PoolStats from the pool's records, counters and store, taken under the pool's lock."""
    c = counters
    return PoolStats(
        name=store.header.name, capacity=store.header.arena_size, budget_bytes=store.header.budget_bytes,
        bytes_used=bytes_used, bytes_live=sum(r.live_bytes for r in records),
        bytes_slack=sum(r.slack_bytes for r in records), bytes_free=store.allocator.free_bytes,
        largest_free=store.allocator.largest_free, entries=len(records), writing=writing,
        referenced=sum(1 for r in records if r.refcount), shared=sum(1 for r in records if r.refcount > 1),
        pinned=sum(1 for r in records if r.pins or r.views), bytes_copied=c.bytes_written + c.bytes_read + c.bytes_moved,
        recovered_entries=report.entries, recovered_freed_writing=report.freed_writing,
        recovered_dropped=report.dropped, **c.as_dict())


@dataclass
class DiskCounters:
    """The disk tier's event counters, updated under its lock (DiskStats says what each counts)."""

    writes: int = 0
    bytes_written: int = 0
    refused: int = 0
    write_failures: int = 0
    loads: int = 0
    bytes_read: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    erased: int = 0
    corrupt_found: int = 0
    torn_removed: int = 0


class DiskStats(msgspec.Struct, frozen=True):
    """A snapshot of the tier: where its bytes are and what moved (every byte counted)."""

    folder: str
    budget_bytes: int
    bytes_used: int  # every file in the folder: entries, files not yet scanned, unreadable ones
    entries: int
    scanning: bool  # the start-up scan is still indexing files
    unreadable: int  # files of another format version, kept until room is needed (or gc)
    writes: int = 0
    bytes_written: int = 0
    refused: int = 0  # entries not written: not worth their room, or the disk too full
    write_failures: int = 0  # writes the file system refused (no space, an I/O error)
    loads: int = 0  # entries read back (hits of this tier)
    bytes_read: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    erased: int = 0  # entries removed because their owner was deleted
    corrupt_found: int = 0  # files found torn or damaged, at the scan or on a read (removed)
    torn_removed: int = 0  # half-written files a crash left, removed at open
