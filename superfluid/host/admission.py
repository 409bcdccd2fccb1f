"""Admission: which waiting generations get a lane, in what order, and who may wait at all.

A mixin of the Scheduler (superfluid/host/scheduler.py), as kvpool's Pool takes its compaction
from kvpool/maintenance.py: these methods read and change the scheduler's queue (`active`), its
KV manager and its tenants' load, and run on its thread.

- **The wait queue is bounded** (`max_waiting`): a generation beyond it is refused (Overloaded),
  unless its tenant has less than its equal share of the queue (superfluid/host/tenants.py).
- **Order**: by priority class, then the least uncached prompt less its age (AGING), so a long
  prompt cannot starve; within a class, each tenant's generations within its share of the
  engine's sequences first.
- **A lane from the longest cached prefix**: a waiting generation starts from a live lane or the
  pool's best match (the KV manager), and waits a tick or two for a lane prefilling its prefix
  rather than prefill it twice.
"""

from __future__ import annotations

from engines.errors import EngineError
from superfluid.host.errors import Overloaded
from superfluid.host.kv import common_prefix
from superfluid.host.lane import Job, Live
from superfluid.host.planner import MIN_PREFILL_CHUNK

# Short-first with aging: a waiting prompt's place improves by one token for every ten the engine
# is fed meanwhile, so a long prompt waits behind at most ~10x its length of other work.
AGING = 0.1


class Admitting:
    """The scheduler's admission (a mixin: `self` is the Scheduler)."""

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

    def _admit(self) -> None:
        waiting = [live for live in self.active if live.seq is None]
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
