"""The host's statistics: what it prefilled, what it took from cache, what it copied."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


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
    preemptions: int = 0  # running generations swapped out to the pool to make room
    idle_parks: int = 0  # idle lanes parked to free the engine's cells
    rejected: int = 0  # generations refused as Overloaded (the wait queue full, or waited too long)


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
    rejected: int = 0
    cells_total: int = 0  # KV cells the engine holds, all sequences together
    cells_used: int = 0
    cells_reserved: int = 0  # cells admitted generations may still write
    cell_price: int = 0  # bytes of KV per cell
    pool_budget_bytes: int = 0  # the pool's export budget
