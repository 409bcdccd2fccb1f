"""Decode over HTTP at 1, 2, 4 and 8 streams: `superfluid serve` against llama.cpp's llama-server,
sample by sample.

The four servers run at once, idle but for the one being measured (an idle server sleeps: its
threads wait on a condition, not spinning), on the same GGUF, 2 threads and flash attention on:
ours with serve's defaults, ours writing every token as it comes (`--stream-interval 0`; by
default a stream's tokens between its first and its end are written together every 20 ms),
llama-server with its defaults (4 slots) and with `-np 8 --kv-unified` on as many cells as ours.
Each sample asks N streamed chat completions at once, as the official openai client sends them
(no priority field, greedy, exactly `tokens` tokens each), of each server in turn, so the
machine's drift falls on all alike. The figure is aggregate generated tokens/s; the ratio is ours
over the better peer at each count (goal: 1), and ours over ours writing every token (no goal:
what the interval buys).

    .venv/bin/python benchmarks/decode_streams.py [--quick]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import servers  # noqa: E402
from benchmarks.harness import Run  # noqa: E402
from benchmarks.texts import text_of  # noqa: E402
from benchmarks.traffic import streamed_tokens  # noqa: E402

GROUP = "Decode over HTTP: superfluid serve against llama-server, sample by sample"
EVERY_TOKEN = "superfluid serve --stream-interval 0"  # ours, each token written as it comes


class DecodeSizes(NamedTuple):
    counts: tuple[int, ...]  # streams at once
    tokens: int  # tokens each stream generates
    repeat: int  # samples of each server at each count


FULL = DecodeSizes(counts=(1, 2, 4, 8), tokens=128, repeat=5)
QUICK = DecodeSizes(counts=(1, 2), tokens=16, repeat=2)


def label(count: int) -> str:
    return f"decode tokens/s, {count} stream{'s' if count > 1 else ''} at once"


def aggregate_rate(served: servers.Served, count: int, tokens: int, salt: int) -> float:
    """Generated tokens/s of `count` streams at once, each from its own short prompt."""
    prompts = [f"Write about {text_of(8, salt=salt + i)}." for i in range(count)]
    start = time.perf_counter()
    with ThreadPoolExecutor(count) as workers:
        generated = sum(workers.map(lambda p: streamed_tokens(served, p, tokens), prompts))
    return generated / (time.perf_counter() - start)


def bench(run: Run, model: Path, sizes: DecodeSizes, tick: Callable[[str], None]) -> None:
    """Every count on the three servers, alternating sample by sample, then the ratios."""
    running: list[servers.Served] = []
    with tempfile.TemporaryDirectory() as scratch:
        try:
            running.append(servers.start_ours(model, None, scratch))
            cells = json.loads(running[0].get("/health"))["kv"]["cells"]
            running.append(servers.start_ours(model, None, str(Path(scratch) / "every-token"), label=EVERY_TOKEN,
                                              pool=f"bench-serve-every-{os.getpid()}", extra=("--stream-interval", "0")))
            running.append(servers.start_peer(model, servers.PEER_CONTEXT, extra=("-fa", "on")))
            running.append(servers.start_peer(model, cells, slots=8, extra=("-fa", "on")))
            for served in running:
                aggregate_rate(served, 1, 4, salt=9000)  # one-time costs go here
            for count in sizes.counts:
                rates: dict[str, list[float]] = {served.label: [] for served in running}
                for r in range(sizes.repeat):
                    for served in running:  # the same prompts for each, new ones each sample
                        rates[served.label].append(aggregate_rate(served, count, sizes.tokens, 100 * count + 10 * r))
                for served in running:
                    run.record(f"{served.label}: {label(count)}", rates[served.label], unit="tok/s")
                tick(f"{count} at once")
        finally:
            for served in running:
                served.stop()
    for count in sizes.counts:
        peers = {peer: run.figures[f"{peer}: {label(count)}"].median for peer in servers.PEERS}
        better = max(peers, key=peers.get)
        for peer in peers:
            run.ratio(f"{label(count)}: ours / {peer}", ours=f"{servers.OURS}: {label(count)}",
                      baseline=f"{peer}: {label(count)}", group=GROUP, goal=1 if peer == better else None)
        run.ratio(f"{label(count)}: ours / ours writing every token", ours=f"{servers.OURS}: {label(count)}",
                  baseline=f"{EVERY_TOKEN}: {label(count)}", group=GROUP)


def main(argv: list[str] | None = None) -> int:
    return servers.standalone(argv, __doc__.splitlines()[0], "bench-decode-streams", bench, FULL, QUICK)


if __name__ == "__main__":
    sys.exit(main())
