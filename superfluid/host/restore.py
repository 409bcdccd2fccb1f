"""Starting a lane from KV cached elsewhere, for the KV manager (kv.py): a fork of a live lane
that holds at least as much of the session's tokens as the pool, else the pool's longest match
imported into a new sequence (one copy from memory; a match on disk is read into memory first,
two copies in all). An entry found corrupt, gone or refused leaves the lane empty, and its
tokens are prefilled: a failed restore costs time, never correctness. Where each lane found its
prefix (memory, disk, neither) is counted here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines.errors import EngineError
from kvpool import DataCorrupt, PoolError, PrefixMatch
from superfluid.host import transfer

if TYPE_CHECKING:
    from superfluid.host.kv import KVManager, Source
    from superfluid.host.lane import Live


def restore(kv: KVManager, live: Live, source: Source) -> None:
    """Give `live` a sequence holding the prefix `source` offers: a fork of a live lane when
    it holds at least as much as the pool, else the pool entry imported (one copy)."""
    if source.forks:
        kv.open_lane(live, kv.engine.fork(source.lane.seq), source.lane.kv, source.lane)
        if live.kv > source.lane_tokens:
            try:
                kv.truncate(live, source.lane_tokens)
            except EngineError:  # a cache that cannot be cut back: start from the pool or nothing
                kv.close_lane(live)
    if live.seq is None:
        kv.open_lane(live, kv.engine.new_sequence(), 0)
        match = source.match if source.pool_tokens > 0 else None
        if match is not None and not match.on_disk and not import_entry(kv, live, match.entry_id, match.tokens):
            # gone since it was found (evicted by a park that made room for this lane, or by
            # a read from disk on another thread): once more, from wherever it is now
            again = kv.pool_match(live)
            if again is not None and (again.on_disk or again.entry_id != match.entry_id):
                match = again
                if not again.on_disk:
                    import_entry(kv, live, again.entry_id, again.tokens)
        _count_tiers(kv, live, match)
        if match is not None and match.on_disk:
            _import_from_disk(kv, live, match.entry_id, match.tokens)
        if match is not None:
            # The pool holds what came in, so only what follows it is unexported: counted
            # from the session's start, a request resumed from a long cached prefix would be
            # checkpointed (its whole KV copied out again) at its first token.
            live.since_park = len(live.state.tokens) - live.kv
    live.warmed = None
    kv.release_held(live)


def _count_tiers(kv: KVManager, live: Live, match: PrefixMatch | None) -> None:
    """Count where a lane that does not fork found its prefix (`match`): memory, disk (read in
    by the scheduler, or for it on its caller's thread: warming.py), or neither."""
    on_disk = match is not None and match.on_disk
    if match is not None and not on_disk and live.warmed is not None and match.entry_id == live.warmed:
        kv.counters.memory_misses += 1  # (a disk match's id is the tier's, never compared with memory's)
        kv.counters.disk_hits += 1
        return
    if match is not None and not on_disk:
        kv.counters.memory_hits += 1
        return
    kv.counters.memory_misses += 1
    if not on_disk and kv.pool.disk is not None:
        kv.counters.disk_misses += 1  # (a disk hit is counted once its entry is read: _import_from_disk)


def _import_from_disk(kv: KVManager, live: Live, disk_id: int, keep: int) -> None:
    """Read disk entry `disk_id` into the pool (one copy, verified), then import it as any
    entry: two copies from disk to engine. A file found damaged or gone, or no room in
    memory, leaves the lane empty (its tokens are prefilled)."""
    try:
        loaded = kv.pool.load(disk_id, kv.descriptor.identity)
    except PoolError:  # DataCorrupt (the file is removed), gone, or another identity's
        loaded = None
    if loaded is None:
        kv.counters.import_failures += 1
        kv.counters.disk_misses += 1
        return
    kv.counters.disk_hits += 1
    try:
        import_entry(kv, live, loaded.id, keep)
    finally:
        kv.pool.release(loaded.id)  # cached in memory now, evictable as any entry


def import_entry(kv: KVManager, live: Live, entry: int, keep: int) -> bool:
    """Import pool entry `entry` into `live`'s new, empty lane and cut it to `keep` tokens. When
    the entry is corrupt, gone or refused, or cannot be cut to `keep`, the lane is left empty
    (its tokens are prefilled). False where the pool could not give it (corrupt, gone, refused)."""
    try:
        with kv.pool.get(entry, verify=False) as view:
            restored = transfer.import_(kv.engine, live.seq, view)
    except (DataCorrupt, PoolError, EngineError) as exc:
        kv.counters.import_failures += 1
        if isinstance(exc, DataCorrupt):
            kv.release_held(live)  # its own reference must not keep a corrupt entry alive
            try:
                kv.pool.evict(entry)  # nobody should start from it again
            except PoolError:
                pass  # held elsewhere: the pool counts it corrupt, its holders will find out
        return False
    kv.counters.imports += 1
    live.kv = restored
    live.started_from = entry
    if restored > keep:
        try:
            kv.engine.truncate(live.seq, keep)
            live.kv = keep
        except EngineError:  # a cache that cannot be cut back (a wrapped ring, recurrent state)
            kv.close_lane(live)
            kv.open_lane(live, kv.engine.new_sequence(), 0)
    return True
