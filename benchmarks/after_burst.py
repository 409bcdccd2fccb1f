"""A long reply through a burst of long prompts: how fast it decodes once the burst is over,
`superfluid serve` against llama.cpp's llama-server.

A background job streams a long reply; while it decodes, `burst` requests of ~`prompt`-token
prompts arrive at once and are answered (`answer` tokens each). In llama.cpp's unified KV cache
the reply's tokens take cells past the burst's; when the burst ends its cells are freed, but the
reply's stay where they were placed, and every later forward reads the cache up to its highest
cell in use. Serve moves such a lane to the cache's start (parked and imported straight back);
llama-server leaves it. The figure: the reply's tokens/s over the `measured` tokens after the
burst's last answer, against the same server's rate over the same positions of the same reply
sent alone, on the server started afresh (so the context each token attends is the same in both,
and nothing else is in its cache).

The servers, one at a time on the same GGUF, 2 threads and flash attention on, each started
afresh in each of `passes` passes (the order reversed every other pass): ours with serve's
defaults, llama-server with its defaults (4 slots on 8,192 cells) and with `-np 8 --kv-unified`
on as many cells as ours. Driven with the official openai client as OpenAI clients send it:
chat completions, no priority field, greedy, `ignore_eos`.

Ratios: ours over each peer after the burst (the goal, 1, against the better peer), and each
server's after the burst over alone (1: the burst left nothing behind).

    .venv/bin/python benchmarks/after_burst.py [--quick]
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import servers  # noqa: E402
from benchmarks.harness import Run  # noqa: E402
from benchmarks.texts import text_of  # noqa: E402
from benchmarks.traffic import merge_passes  # noqa: E402

GROUP = "a long reply after a burst: ours against llama.cpp's llama-server"
AFTER = "the reply after the burst, tok/s"
ALONE = "the same tokens of the reply alone, tok/s"


@dataclass(frozen=True)
class BurstSizes:
    """How much one run sends."""

    burst: int = 6  # long requests at once
    prompt: int = 1500  # tokens of each one's prompt (three at once fit llama-server's 8,192 cells beside the reply)
    answer: int = 8  # tokens each one generates
    measured: int = 500  # the reply's tokens timed after the burst
    reply: int = 7000  # the most the reply may generate (its stream is closed once timed)
    passes: int = 2


FULL = BurstSizes()
QUICK = BurstSizes(burst=2, prompt=300, answer=4, measured=32, reply=1500, passes=1)


class Reply:
    """A streamed reply read on a thread of its own: when each piece of text came."""

    def __init__(self, served: servers.Served, salt: int, max_tokens: int) -> None:
        self.stamps: list[float] = []
        self.stop_after: int | None = None  # close the stream once this many pieces came
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(served, salt, max_tokens))
        self._thread.start()

    def _read(self, served: servers.Served, salt: int, max_tokens: int) -> None:
        messages = [{"role": "user", "content": f"Write at length about {text_of(8, salt=salt)}."}]
        try:
            stream = served.client.chat.completions.create(model=served.model, messages=messages,
                                                           max_tokens=max_tokens, stream=True, temperature=0.0,
                                                           extra_body=served.exact(max_tokens))
            with stream:
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        self.stamps.append(time.perf_counter())
                        if self.stop_after is not None and len(self.stamps) >= self.stop_after:
                            break  # (closing the stream cancels the rest of the reply)
        except Exception as exc:  # noqa: BLE001 - raised in the caller's thread by join()
            self.failure = exc

    def join(self) -> None:
        """Wait for the stream's end; raise what failed it."""
        self._thread.join()
        if self.failure is not None:
            raise self.failure

    def rate(self, first: int, last: int) -> float:
        """Pieces per second from piece `first` to piece `last` (a piece is a token of text here:
        serve and llama-server write each token as it comes unless tokens are held for UTF-8)."""
        return (last - first) / (self.stamps[last] - self.stamps[first])


def through_a_burst(run: Run, served: servers.Served, sizes: BurstSizes, salt: int) -> None:
    """The reply with a burst arriving as it starts, timed after the burst; then the same reply
    alone, timed over the same positions."""
    reply = Reply(served, salt, sizes.reply)
    while not reply.stamps and reply.failure is None:  # decoding before the burst arrives
        time.sleep(0.01)
    answered: list[float] = []

    def one(i: int) -> None:
        served.client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": text_of(sizes.prompt, salt=salt + 1 + i)}],
            max_tokens=sizes.answer, temperature=0.0, extra_body=served.exact(sizes.answer))
        answered.append(time.perf_counter())

    burst = [threading.Thread(target=one, args=(i,)) for i in range(sizes.burst)]
    for thread in burst:
        thread.start()
    for thread in burst:
        thread.join()
    if len(answered) != sizes.burst:
        reply.stop_after = 0
        reply._thread.join()
        raise RuntimeError(f"{sizes.burst - len(answered)} of the burst's {sizes.burst} requests failed")
    first = len(reply.stamps)  # the reply's position when the burst was over
    reply.stop_after = first + sizes.measured + 1
    reply.join()
    if len(reply.stamps) < reply.stop_after:
        raise RuntimeError(f"the reply ended {len(reply.stamps) - first} tokens after the burst; raise `reply` "
                           f"above {sizes.reply} (the burst took longer than the reply lasts on this machine)")
    run.record(f"{served.label}: {AFTER}", [reply.rate(first, first + sizes.measured)], unit="tok/s")
    run.note(f"{served.label}: the reply's tokens before the burst was over", first)
    if served.label == servers.OURS:
        run.note(f"{servers.OURS}: lanes moved down the cache",
                 int(served.metrics("superfluid_reseats")["superfluid_reseats_total"]))
    # Alone on a fresh process: llama-server's idle slots keep the burst's cells (its prompt cache),
    # which its every forward would read; serve's request lanes leave the engine as they end.
    served.restart()
    alone = Reply(served, salt, sizes.reply)
    alone.stop_after = first + sizes.measured + 1
    alone.join()
    run.record(f"{served.label}: {ALONE}", [alone.rate(first, first + sizes.measured)], unit="tok/s")


def bench(run: Run, model: Path, sizes: BurstSizes, tick: Callable[[str], None]) -> None:
    """The shape on each server in turn, in `sizes.passes` passes; then the ratios."""
    cells: dict[str, int] = {}
    passes: list[Run] = []
    with tempfile.TemporaryDirectory() as scratch:
        starts = [lambda: servers.start_ours(model, None, scratch),
                  lambda: servers.start_peer(model, servers.PEER_CONTEXT, extra=("-fa", "on")),
                  lambda: servers.start_peer(model, cells["ours"], slots=8, extra=("-fa", "on"))]
        for number in range(sizes.passes):
            this = Run(run.name)
            for start in starts if number % 2 == 0 else starts[::-1]:  # ours first in the first pass: its cells
                served = start()
                try:
                    if served.label == servers.OURS:
                        cells.setdefault("ours", json.loads(served.get("/health"))["kv"]["cells"])
                    servers.first_text_seconds(served.client, served.model, [{"role": "user", "content": "Hi."}], 4,
                                               temperature=0.0)  # one-time costs go here
                    try:
                        through_a_burst(this, served, sizes, salt=7000 + 100 * number)
                    except Exception as exc:  # noqa: BLE001 - a server failing the shape is a finding
                        this.note(f"{served.label}: FAILED", f"{type(exc).__name__}: {exc}"[:300])
                    tick(f"pass {number + 1}/{sizes.passes}: {served.label}")
                finally:
                    served.stop()
            passes.append(this)
    merge_passes(run, passes)
    run.note("cells: ours (sized from memory) and llama-server -np 8 --kv-unified (the same)", cells.get("ours"))
    after = {peer: run.figures[f"{peer}: {AFTER}"].median for peer in servers.PEERS if f"{peer}: {AFTER}" in run.figures}
    if f"{servers.OURS}: {AFTER}" in run.figures:
        better = max(after, key=after.get) if after else None
        for peer in after:
            run.ratio(f"{AFTER}: ours / {peer}", ours=f"{servers.OURS}: {AFTER}", baseline=f"{peer}: {AFTER}",
                      group=GROUP, goal=1 if peer == better else None)
    for server in (servers.OURS, *servers.PEERS):
        if f"{server}: {AFTER}" in run.figures:
            run.ratio(f"{server}: after the burst / alone", ours=f"{server}: {AFTER}", baseline=f"{server}: {ALONE}",
                      group=GROUP)


def main(argv: list[str] | None = None) -> int:
    return servers.standalone(argv, __doc__.splitlines()[0], "bench-after-burst", bench, FULL, QUICK)


if __name__ == "__main__":
    sys.exit(main())
