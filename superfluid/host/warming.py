"""Reading a request's cached KV back from the disk tier on its caller's thread.

The scheduler thread is every lane's: while it reads a file (about 20 ms for 1,500 tokens of the
default model), no lane steps. A request's prompt is known before the scheduler sees it (it is
rendered and tokenized on the caller's thread, Host.prepare), so where the pool's longest match
for it is only on disk, the caller's thread reads that entry into memory there and then, and the
scheduler only imports it, as any entry in memory. The entry is released at once: cached and
evictable like any other (memory evicts one with a disk copy first); should it be gone by the
time the request starts, the scheduler reads the file itself, as it does for a session.

Only the pool is touched here (it is safe from any thread), and the pool's close waits for
reads in flight (`stop`), since a pool does not close while an entry is being written into it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from engines.base import Memory
from kvpool import Pool, PoolError

STOP_WAIT_SECONDS = 30.0  # at close, how long reads in flight may still take (one file each)


class DiskWarming:
    """Loads from the disk tier made on callers' threads, for one pool and engine identity."""

    def __init__(self, pool: Pool, identity: str, memory: Memory) -> None:
        """`memory`: the engine's memory kind, which says which cached states can serve a prefix."""
        self.pool, self.identity = pool, identity
        self.serves = None if memory.kind == "kv" else memory.can_cut_restored
        self._gate = threading.Condition()
        self._reading = 0
        self._stopped = False

    def warm(self, tokens: Sequence[int], namespace: str) -> int | None:
        """Any thread: where the pool's longest match for a lane of `tokens` in `namespace` (all
        but the last token, whose logits the lane computes) is on disk only, read it into memory
        now. The memory entry read in (released), or None: nothing on disk to read, no room in
        memory, the file gone or damaged meanwhile, or the pool closing."""
        if self.pool.disk is None or len(tokens) < 2:
            return None
        with self._gate:
            if self._stopped:
                return None
            self._reading += 1
        try:
            match = self.pool.lookup(self.identity, list(tokens[:-1]), self.serves, namespace=namespace)
            if match is None or not match.on_disk:
                return None
            loaded = self.pool.load(match.entry_id, self.identity)
            if loaded is None:
                return None
            self.pool.release(loaded.id)
            return loaded.id
        except PoolError:  # gone meanwhile, damaged (removed), erased, closing: the scheduler looks again
            return None
        finally:
            with self._gate:
                self._reading -= 1
                self._gate.notify_all()

    def stop(self, timeout: float = STOP_WAIT_SECONDS) -> bool:
        """Start no more reads and wait for those in flight (before the pool closes); False if
        some still run after `timeout` seconds."""
        with self._gate:
            self._stopped = True
            return self._gate.wait_for(lambda: not self._reading, timeout)
