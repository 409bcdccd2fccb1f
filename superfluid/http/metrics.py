"""The server's /metrics, through prometheus-client: request histograms the server observes, and
the host's own counters and gauges read at each scrape.

Names follow vLLM's where they mean the same (`time_to_first_token_seconds`,
`time_per_output_token_seconds`, `e2e_request_latency_seconds`), under the `superfluid_` prefix.
Every label value comes from a closed set: the route label is a route of the server's table, or
`other` for any path it does not serve; the tenant label a tenant of the server's keys (`default`
the unnamed one), so a client cannot add series or break the exposition. Each tenant's series
(`superfluid_tenant_*`) count what its requests asked and what the host holds for it; a tenant
sees its own only, and the unnamed tenant (the operator's key, or a server without keys or with
one) sees every tenant's: how much another tenant sends is that tenant's business.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from superfluid.host.tenants import UNNAMED
from superfluid.http.keys import label

CONTENT_TYPE = CONTENT_TYPE_LATEST
OTHER_ROUTE = "other"

# vLLM's buckets: first tokens from milliseconds (a cached prompt) to minutes (behind a queue);
# output tokens from a fast decode step to a stalled one; whole requests up to an hour.
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                        20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 3840.0)

# The host's statistics: (name, kind, help, HostStats field).
HOST_SERIES = (
    ("prefill_tokens", "counter", "Prompt tokens fed through the model.", "prefill_tokens"),
    ("cached_tokens", "counter", "Prompt tokens taken from cache instead of prefilled.", "cached_tokens"),
    ("decode_tokens", "counter", "Generated tokens fed back through decode steps (a reply's last is not).",
     "decode_tokens"),
    ("evictions", "counter", "Pool entries evicted.", "evictions"),
    ("preemptions", "counter", "Running generations swapped out to the pool to make room.", "preemptions"),
    ("kv_bytes_copied", "counter", "KV bytes copied (pool and engine).", "bytes_copied"),
    ("idle_parks", "counter", "Idle lanes parked into the pool to free engine cells.", "idle_parks"),
    ("reseats", "counter", "Running lanes moved down the engine's cache once the cells below them were freed.",
     "reseats"),
    ("exports", "counter", "KV exports into the pool (parks, swaps out, checkpoints).", "exports"),
    ("imports", "counter", "KV imports from the pool (resumes, swaps in, shared prefixes).", "imports"),
    ("interrupted_steps", "counter", "Steps stopped part-way for a request that went first.", "interrupted_steps"),
    ("interrupted_seconds", "counter", "Seconds the interrupted steps had run.", "interrupted_seconds"),
    ("yielded_steps", "counter", "Steps stopped between two pieces for a request that went first.",
     "yielded_steps"),
    ("rejected", "counter", "Generations answered 503: the wait queue was full or waited too long.", "rejected"),
    ("log_write_failures", "counter", "Session log writes the disk refused (the generations in them ended).",
     "log_write_failures"),
    ("log_sync_failures", "counter", "Session log fsyncs the disk refused (retried at the next tick).",
     "log_sync_failures"),
    ("expired_sessions", "counter", "Sessions deleted after --session-expiry-seconds idle.", "expired_sessions"),
    ("pool_bytes_used", "gauge", "Bytes the KV pool holds.", "pool_bytes_used"),
    ("pool_entries", "gauge", "Entries in the KV pool.", "pool_entries"),
    ("pool_budget_bytes", "gauge", "Bytes of KV the pool may hold (its export budget).", "pool_budget_bytes"),
    ("generating", "gauge", "Generations running now.", "generating"),
    ("waiting", "gauge", "Generations waiting for the engine's cells (not started yet).", "waiting"),
    ("lanes", "gauge", "Sessions whose KV is in the engine.", "lanes"),
    ("parked_sessions", "gauge", "Sessions whose KV is parked in the pool.", "parked_sessions"),
    ("sessions", "gauge", "Sessions the host keeps.", "sessions"),
    ("kv_cells", "gauge", "KV cells the engine holds, all sessions together.", "cells_total"),
    ("kv_cells_used", "gauge", "KV cells in use in the engine.", "cells_used"),
    ("kv_cell_bytes", "gauge", "Bytes of KV per cell (the cell price).", "cell_price"),
)

# Each tier of KV beyond the engine: (name, kind, help, TierStats field), labelled by tier
# ("memory": the shared-memory pool; "disk": its disk tier, where it has one).
TIER_SERIES = (
    ("kv_tier_hits", "counter", "Lanes that found their prompt's prefix in a tier (disk: after missing memory).",
     "hits"),
    ("kv_tier_misses", "counter", "Lanes that did not find their prompt's prefix in a tier.", "misses"),
    ("kv_tier_evictions", "counter", "Entries a tier evicted.", "evictions"),
    ("kv_tier_bytes_read", "counter", "KV bytes copied out of a tier (memory: into the engine; disk: into memory).",
     "bytes_read"),
    ("kv_tier_bytes_written", "counter", "KV bytes copied into a tier (memory: exports and disk reads; disk: "
     "spills).", "bytes_written"),
    ("kv_tier_bytes_used", "gauge", "Bytes a tier holds.", "bytes_used"),
    ("kv_tier_budget_bytes", "gauge", "Bytes a tier may hold.", "budget_bytes"),
    ("kv_tier_entries", "gauge", "Entries a tier holds.", "entries"),
)

# Each tenant's part of the host: (name, kind, help, TenantStats field), labelled by tenant.
TENANT_SERIES = (
    ("tenant_sessions", "gauge", "Sessions a tenant holds.", "sessions"),
    ("tenant_generating", "gauge", "A tenant's generations running or waiting.", "generating"),
    ("tenant_waiting", "gauge", "A tenant's generations not started yet.", "waiting"),
    ("tenant_lanes", "gauge", "Engine sequences running a tenant's generations.", "lanes"),
    ("tenant_rejected", "counter", "A tenant's generations answered 503 (its share of the wait queue was full, "
     "or it waited too long).", "rejected"),
)


class _HostCollector:
    """The host's statistics as series: those of the scrape being answered."""

    def __init__(self) -> None:
        self.stats = None  # set by Metrics.exposition for the scrape it answers
        self.grammars = None  # the host's compiled constraints (their cache's hits and misses), likewise

    def describe(self):
        """The host's series without values (the registry asks at registration, before a host
        may exist: the server binds its port before the model loads)."""
        for name, kind, help_text, _ in HOST_SERIES:
            yield (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(f"superfluid_{name}", help_text)
        for name, kind, help_text, _ in TIER_SERIES:
            yield (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(f"superfluid_{name}", help_text,
                                                                                     labels=("tier",))
        yield from self._grammar_series(0, 0)

    @staticmethod
    def _grammar_series(hits: int, misses: int):
        yield CounterMetricFamily("superfluid_grammar_cache_hits", "Constraints found compiled in the cache.",
                                  value=hits)
        yield CounterMetricFamily("superfluid_grammar_cache_misses", "Constraints compiled (not in the cache).",
                                  value=misses)

    def collect(self):
        """The host's series, from the statistics of this scrape (none before a host exists)."""
        if self.stats is None:
            return
        for name, kind, help_text, field in HOST_SERIES:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"superfluid_{name}", help_text, value=getattr(self.stats, field))
        for name, kind, help_text, field in TIER_SERIES:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(f"superfluid_{name}", help_text,
                                                                                      labels=("tier",))
            for tier, stats in sorted(self.stats.tiers.items()):
                family.add_metric([tier], getattr(stats, field))
            yield family
        if self.grammars is not None:
            yield from self._grammar_series(self.grammars.hits, self.grammars.misses)


class _TenantCollector:
    """Each tenant's series: its requests and tokens (counted here as requests end) and its part of
    the host (from the scrape's statistics); of the scrape's `viewer` only, unless it is the
    unnamed tenant (None: every tenant's, before a key was checked: never answered)."""

    def __init__(self) -> None:
        self.requests: Tally[tuple[str, str]] = Tally()  # (tenant, status) -> requests
        self.tokens: Tally[tuple[str, str]] = Tally()  # (tenant, kind) -> tokens
        self.lock = threading.Lock()  # requests end on the event loop, counted while a scrape may read
        self.stats = None  # set by Metrics.exposition for the scrape it answers, with the viewer
        self.viewer: str | None = None

    def describe(self):
        """The series without values."""
        yield CounterMetricFamily("superfluid_tenant_requests", "HTTP requests by tenant and status (those whose "
                                  "key was accepted).", labels=("tenant", "status"))
        yield CounterMetricFamily("superfluid_tenant_tokens", "Tokens of a tenant's generations: prompt (of which "
                                  "cached: taken from cache) and completion.", labels=("tenant", "kind"))
        for name, kind, help_text, _ in TENANT_SERIES:
            yield (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(f"superfluid_{name}", help_text,
                                                                                     labels=("tenant",))

    def _shown(self, tenant: str) -> bool:
        return self.viewer == UNNAMED or tenant == self.viewer

    def collect(self):
        """The series the viewer may see."""
        families = list(self.describe())
        with self.lock:
            for (tenant, status), count in sorted(self.requests.items()):
                if self._shown(tenant):
                    families[0].add_metric((label(tenant), status), count)
            for (tenant, kind), count in sorted(self.tokens.items()):
                if self._shown(tenant):
                    families[1].add_metric((label(tenant), kind), count)
        yield from families[:2]
        if self.stats is None:
            return
        for family, (_, _, _, field) in zip(families[2:], TENANT_SERIES):
            for tenant, part in self.stats.tenants.items():
                if self._shown(tenant):
                    family.add_metric((label(tenant),), getattr(part, field))
            yield family


class Metrics:
    """Request metrics for /metrics (thread-safe: prometheus-client locks its own values)."""

    def __init__(self, routes: frozenset[str]) -> None:
        """`routes`: every route label there is; anything else is counted as `other`."""
        self.routes = routes
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("superfluid_requests", "HTTP requests by route and status.", ("route", "status"),
                                registry=self.registry)
        self.first_token_seconds = Histogram("superfluid_time_to_first_token_seconds",
                                             "Seconds from a request's arrival to its first token.",
                                             buckets=FIRST_TOKEN_BUCKETS, registry=self.registry)
        self.output_token_seconds = Histogram("superfluid_time_per_output_token_seconds",
                                              "Seconds between consecutive output tokens of a request.",
                                              buckets=OUTPUT_TOKEN_BUCKETS, registry=self.registry)
        self.latency_seconds = Histogram("superfluid_e2e_request_latency_seconds",
                                         "Seconds from a generating request's arrival to its last byte.",
                                         buckets=LATENCY_BUCKETS, registry=self.registry)
        self.stalled_clients = Counter("superfluid_stalled_clients", "Responses cut because their client read "
                                       "nothing for the send deadline (serve's --send-timeout).",
                                       registry=self.registry)
        self._host = _HostCollector()
        self.registry.register(self._host)
        self._tenants = _TenantCollector()
        self.registry.register(self._tenants)

    def route_label(self, route: str) -> str:
        """The route label for a request's route: itself if the server serves it, else `other`."""
        return route if route in self.routes else OTHER_ROUTE

    def count(self, route: str, status: int, tenant: str | None = None) -> None:
        """Count one answered request (and its tenant's, once its key was accepted)."""
        self.requests.labels(self.route_label(route), str(status)).inc()
        if tenant is not None:
            with self._tenants.lock:
                self._tenants.requests[tenant, str(status)] += 1

    def tokens(self, tenant: str | None, prompt: int, cached: int, completion: int) -> None:
        """Count the tokens of one of `tenant`'s generations."""
        if tenant is None:
            return
        with self._tenants.lock:
            for kind, count in (("prompt", prompt), ("cached", cached), ("completion", completion)):
                if count:
                    self._tenants.tokens[tenant, kind] += count

    def first_token(self, seconds: float) -> None:
        """Record a request's time to first token."""
        self.first_token_seconds.observe(seconds)

    def output_token(self, seconds: float) -> None:
        """Record the time between two output tokens of one request."""
        self.output_token_seconds.observe(seconds)

    def stalled(self) -> None:
        """Count one response cut for a client that stopped reading."""
        self.stalled_clients.inc()

    def latency(self, seconds: float) -> None:
        """Record a generating request's whole time."""
        self.latency_seconds.observe(seconds)

    def exposition(self, stats=None, viewer: str = UNNAMED, grammars=None) -> bytes:
        """The Prometheus text of everything, the host's series from `stats` (its HostStats, read
        for this scrape), the tenants' those `viewer` may see; CONTENT_TYPE says the format's
        version; `grammars`: the host's compiled constraints. Called on one thread at a time (the
        server's event loop): the statistics are held for the length of the call."""
        self._host.stats = self._tenants.stats = stats
        self._host.grammars = grammars
        self._tenants.viewer = viewer
        try:
            return generate_latest(self.registry)
        finally:
            self._host.stats = self._tenants.stats = self._host.grammars = None
