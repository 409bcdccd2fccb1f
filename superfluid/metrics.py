"""The server's /metrics: request counters and first-token times, and the Prometheus text of
them with the host's statistics."""

from __future__ import annotations

import threading


class Metrics:
    """Request counters and first-token times for /metrics (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.first_token_seconds: list[float] = []

    def count(self, route: str, status: int) -> None:
        """Count one answered request."""
        with self.lock:
            self.requests[(route, status)] = self.requests.get((route, status), 0) + 1

    def first_token(self, seconds: float) -> None:
        """Record a request's time to first token (the last 1,000 are kept)."""
        with self.lock:
            self.first_token_seconds.append(seconds)
            del self.first_token_seconds[:-1000]

    def exposition(self, stats) -> str:
        """The Prometheus text of the host's statistics `stats` and these request counters."""
        lines = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP superfluid_{name} {help_text}", f"# TYPE superfluid_{name} {kind}"])
            lines.extend(f"superfluid_{name}{labels} {value}" for labels, value in samples)

        metric("prefill_tokens_total", "counter", "Prompt tokens fed through the model.", [("", stats.prefill_tokens)])
        metric("cached_tokens_total", "counter", "Prompt tokens taken from cache instead of prefilled.",
               [("", stats.cached_tokens)])
        metric("decode_tokens_total", "counter", "Generated tokens.", [("", stats.decode_tokens)])
        metric("pool_bytes_used", "gauge", "Bytes the KV pool holds.", [("", stats.pool_bytes_used)])
        metric("pool_entries", "gauge", "Entries in the KV pool.", [("", stats.pool_entries)])
        metric("evictions_total", "counter", "Pool entries evicted.", [("", stats.evictions)])
        metric("preemptions_total", "counter", "Running generations swapped out to the pool to make room.",
               [("", stats.preemptions)])
        metric("kv_bytes_copied_total", "counter", "KV bytes copied (pool and engine).", [("", stats.bytes_copied)])
        metric("idle_parks_total", "counter", "Idle lanes parked into the pool to free engine cells.",
               [("", stats.idle_parks)])
        metric("exports_total", "counter", "KV exports into the pool (parks, swaps out, checkpoints).",
               [("", stats.exports)])
        metric("imports_total", "counter", "KV imports from the pool (resumes, swaps in, shared prefixes).",
               [("", stats.imports)])
        metric("rejected_total", "counter", "Generations answered 503: the wait queue was full or waited too long.",
               [("", stats.rejected)])
        metric("generating", "gauge", "Generations running now.", [("", stats.generating)])
        metric("waiting", "gauge", "Generations waiting for the engine's cells (not started yet).",
               [("", stats.waiting)])
        metric("lanes", "gauge", "Sessions whose KV is in the engine.", [("", stats.lanes)])
        metric("parked_sessions", "gauge", "Sessions whose KV is parked in the pool.", [("", stats.parked_sessions)])
        metric("kv_cells", "gauge", "KV cells the engine holds, all sessions together.", [("", stats.cells_total)])
        metric("kv_cells_used", "gauge", "KV cells in use in the engine.", [("", stats.cells_used)])
        metric("kv_cell_bytes", "gauge", "Bytes of KV per cell (the cell price).", [("", stats.cell_price)])
        metric("pool_budget_bytes", "gauge", "Bytes of KV the pool may hold (its export budget).",
               [("", stats.pool_budget_bytes)])
        metric("sessions", "gauge", "Sessions the host keeps.", [("", stats.sessions)])
        with self.lock:
            requests = sorted(self.requests.items())
            firsts = sorted(self.first_token_seconds)
        metric("requests_total", "counter", "HTTP requests by route and status.",
               [(f'{{route="{route}",status="{status}"}}', count) for (route, status), count in requests])
        quantiles = [(q, firsts[min(len(firsts) - 1, int(q * len(firsts)))]) for q in (0.5, 0.9, 0.99)] if firsts else []
        metric("time_to_first_token_seconds", "summary", "Seconds from request to first token (last 1,000).",
               [(f'{{quantile="{q}"}}', round(v, 6)) for q, v in quantiles] + [("_count", len(firsts))])
        return "\n".join(lines) + "\n"
