"""The host's statistics: what it prefilled, what it took from cache, what it copied; and their
publication, for readers that must not wait for the scheduler thread."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import msgspec

# How old the published statistics may grow while the engine is busy (/health, /metrics and a
# router's /get_load read them without waiting for a step). They are published again at once
# after every batch of commands and every ended generation, before anyone is told of either.
STATS_SECONDS = 0.1


@dataclass
class Counters:
    """Counts the scheduler keeps (read by `Host.stats()`)."""

    prefill_tokens: int = 0  # tokens fed as prompt (a resumed lane's catch-up included), not decode steps
    decode_tokens: int = 0  # generated tokens fed back
    cached_tokens: int = 0  # tokens a lane started with instead of prefilling (fork, pool, own lane)
    generations: int = 0
    exports: int = 0
    imports: int = 0
    import_failures: int = 0
    export_failures: int = 0
    # where admitted lanes found their prompt's prefix (a fork of a live lane counts in neither)
    memory_hits: int = 0
    memory_misses: int = 0
    disk_hits: int = 0  # found on disk (missed in memory) and read back
    disk_misses: int = 0  # found in neither tier, with a disk tier
    preemptions: int = 0  # running generations swapped out to the pool to make room
    idle_parks: int = 0  # idle lanes parked to free the engine's cells
    reseats: int = 0  # running lanes moved down llama.cpp's cache once the cells below them were freed
    rejected: int = 0  # generations refused as Overloaded (the wait queue full, or waited too long)
    interrupted_steps: int = 0  # steps stopped part-way for a request that went first
    interrupted_seconds: float = 0.0  # and how long they had run (the work thrown away, at most)
    yielded_steps: int = 0  # steps stopped between two pieces for a request that went first (nothing lost)
    expired_sessions: int = 0  # sessions deleted after session_expiry_seconds idle
    log_write_failures: int = 0  # writes of the session log the disk refused (their generations ended)
    log_sync_failures: int = 0  # fsyncs of the session log the disk refused (retried)
    rejected_by_tenant: Counter[str] = field(default_factory=Counter)  # `rejected`, by the tenant refused


class TenantStats(msgspec.Struct, frozen=True):
    """One tenant's part of the host (tenants.py): its sessions, its generations now, its refusals."""

    sessions: int = 0
    generating: int = 0  # generations running or waiting
    waiting: int = 0  # of which not started yet
    lanes: int = 0  # engine sequences running its generations
    rejected: int = 0  # generations refused as Overloaded


class TierStats(msgspec.Struct, frozen=True):
    """One tier of KV beyond the engine (the memory pool, the disk): lookups it answered or
    missed, what it evicted, every byte copied into and out of it, and what it holds."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0  # copied out of the tier (memory: into the engine; disk: into memory)
    bytes_written: int = 0  # copied into the tier (memory: exports and disk reads; disk: spills)
    bytes_used: int = 0
    budget_bytes: int = 0
    entries: int = 0


class HostStats(msgspec.Struct, frozen=True):
    """A snapshot of the host for tests, benchmarks and the server's /metrics."""

    prefill_tokens: int
    decode_tokens: int
    cached_tokens: int
    generations: int
    exports: int
    imports: int
    import_failures: int
    export_failures: int
    preemptions: int
    bytes_copied: int  # KV bytes copied: pool writes and reads, plus the engine's own copies
    pool_bytes_copied: int
    engine_bytes_copied: int
    evictions: int
    pool_bytes_used: int
    pool_entries: int
    sessions: int
    lanes: int  # sessions holding an engine sequence
    generating: int
    waiting: int = 0  # generations not started yet
    parked_sessions: int = 0  # sessions whose KV is in the pool, not in the engine
    idle_parks: int = 0
    reseats: int = 0  # running lanes moved down the engine's cache (parked and imported straight back)
    rejected: int = 0
    cells_total: int = 0  # KV cells the engine holds, all sequences together
    cells_used: int = 0
    cells_reserved: int = 0  # cells admitted generations may still write
    cell_price: int = 0  # bytes of KV per cell
    pool_budget_bytes: int = 0  # the pool's export budget
    interrupted_steps: int = 0  # steps stopped part-way for a request that went first
    interrupted_seconds: float = 0.0  # how long those steps had run
    yielded_steps: int = 0  # steps stopped between two pieces for a request that went first
    expired_sessions: int = 0  # sessions deleted after session_expiry_seconds idle
    log_write_failures: int = 0  # writes of the session log the disk refused (their generations ended)
    log_sync_failures: int = 0  # fsyncs of the session log the disk refused (retried)
    tenants: dict[str, TenantStats] = {}  # by tenant ("" the unnamed one): those with sessions, work or refusals
    tiers: dict[str, TierStats] = {}  # "memory" (the pool), and "disk" where the pool has a disk tier


def host_stats(c: Counters, kv: Any, sessions: Any, engine: Any, generating: int, waiting: int,
               tenants: dict[str, TenantStats]) -> HostStats:
    """The host's statistics from the scheduler's counters `c`, its KV manager (the lanes, the
    cells and the pool), its sessions, the engine's statistics (EngineStats), the generations
    running or waiting and those not started yet, and each tenant's part."""
    pool = kv.pool.stats()
    # parked: sessions whose state records parked KV, less those whose lane holds it too
    parked = sessions.parked_count - sum(1 for live in kv.lanes if live.durable and live.state.parked is not None)
    return HostStats(c.prefill_tokens, c.decode_tokens, c.cached_tokens, c.generations, c.exports, c.imports,
                     c.import_failures, c.export_failures, c.preemptions, pool.bytes_copied + engine.bytes_copied,
                     pool.bytes_copied, engine.bytes_copied, pool.evictions, pool.bytes_used, pool.entries,
                     len(sessions.durable), len(kv.lanes), generating, waiting=waiting,
                     parked_sessions=parked, idle_parks=c.idle_parks, reseats=c.reseats, rejected=c.rejected,
                     cells_total=kv.cells_total, cells_used=kv.cells_used(), cells_reserved=kv.cells_reserved(),
                     cell_price=kv.descriptor.cell_price, pool_budget_bytes=pool.budget_bytes,
                     interrupted_steps=c.interrupted_steps, interrupted_seconds=c.interrupted_seconds,
                     yielded_steps=c.yielded_steps,
                     expired_sessions=c.expired_sessions, log_write_failures=c.log_write_failures,
                     log_sync_failures=c.log_sync_failures, tenants=tenants,
                     tiers=tier_stats(pool, kv.pool.disk_stats(), c))


def tier_stats(pool: Any, disk: Any, counters: Counters) -> dict[str, TierStats]:
    """Each tier's statistics from the pool's (kvpool.PoolStats), the disk tier's
    (kvpool.stats.DiskStats, or None without one) and the scheduler's counters."""
    tiers = {"memory": TierStats(counters.memory_hits, counters.memory_misses, pool.evictions, pool.bytes_read,
                                 pool.bytes_written, pool.bytes_used, pool.budget_bytes, pool.entries)}
    if disk is not None:
        tiers["disk"] = TierStats(counters.disk_hits, counters.disk_misses, disk.evictions, disk.bytes_read,
                                  disk.bytes_written, disk.bytes_used, disk.budget_bytes, disk.entries)
    return tiers


class Publisher:
    """The statistics a scheduler publishes, and the ends of its generations, told only once the
    published statistics show them: a client that reads /metrics after its reply ended, or a
    caller that reads them after its command returned, sees what it did."""

    def __init__(self, measure: Callable[[], HostStats]) -> None:
        self._measure = measure  # the statistics now (on the scheduler thread)
        self.latest: HostStats | None = None  # as of the last publication (any thread reads it)
        self._at = 0.0
        self._ended: list[tuple[Any, str, BaseException | None]] = []

    def ended(self, generation: Any, reason: str, error: BaseException | None) -> None:
        """A generation ended: its reader is told at the next announcement."""
        self._ended.append((generation, reason, error))

    def fail_ended(self, session_ids: set[str], error: BaseException) -> None:
        """Generations of `session_ids` that ended but were not told yet end with `error` instead
        (what ended them was not written)."""
        self._ended = [(generation, "error", error) if generation.session_id in session_ids else (generation, reason, e)
                       for generation, reason, e in self._ended]

    def announce(self, *, force: bool = False, publish: bool = True) -> None:
        """Publish the statistics (if `publish`: when `force`, when a generation ended, or
        STATS_SECONDS after the last time), then tell the generations that ended."""
        now = perf_counter()
        if publish and (force or self._ended or now - self._at >= STATS_SECONDS):
            self.latest, self._at = self._measure(), now
        self.tell_ended()

    def tell_ended(self) -> None:
        """Tell the generations that ended, without publishing (the host is closing or failed)."""
        ended, self._ended = self._ended, []
        for generation, reason, error in ended:
            generation._finish(reason, error)
