"""One huge request beside everyone else: a chat of 20,000 empty messages (a ~700 KB body) sent
while another client streams a reply and a monitor polls /health, on `superfluid serve` and on
llama.cpp's llama-server, side by side.

What counts is what the others see while the huge request is decoded, rendered, tokenized and
refused (20,000 turns are longer than the model's context on both servers): the longest wait for
/health, and the longest gap between two tokens of the stream, against its median gap. Before
the request path moved rendering off the scheduler thread, the template was rendered once per
message there, and nothing decoded for minutes.

    .venv/bin/python benchmarks/long_chat.py
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import servers  # noqa: E402
from engines import models  # noqa: E402

MESSAGES = 20_000
STREAM_TOKENS = 600


def measure(served: servers.Served) -> dict:
    """The huge request's status and seconds; /health's longest and median wait; the stream's
    longest and median gap between tokens while the huge request was in flight."""
    gaps, health, done = [], [], threading.Event()
    window = {}

    def stream() -> None:
        last = None
        response = served.client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=STREAM_TOKENS, stream=True, extra_body=served.exact(STREAM_TOKENS))
        for chunk in response:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content and last is not None:
                gaps.append((now, now - last))
            last = now

    def monitor() -> None:
        while not done.is_set():
            began = time.perf_counter()
            served.get("/health")
            health.append((began, time.perf_counter() - began))
            time.sleep(0.02)

    streamer, watcher = threading.Thread(target=stream), threading.Thread(target=monitor)
    streamer.start()
    watcher.start()
    time.sleep(1.0)  # the stream is decoding
    body = json.dumps({"model": served.model, "max_tokens": 8,
                       "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": ""}
                                    for i in range(MESSAGES - 1)] + [{"role": "user", "content": "Hi"}]}).encode()
    request = urllib.request.Request(f"{served.base}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer bench"})
    window["start"] = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=900) as response:
            status, answer = response.status, response.read()[:200]
    except urllib.error.HTTPError as error:
        status, answer = error.code, error.read()[:200]
    window["end"] = time.perf_counter()
    streamer.join()
    done.set()
    watcher.join()
    inside = lambda samples: [v for t, v in samples if window["start"] <= t <= window["end"]] or [0.0]  # noqa: E731
    return {"status": status, "answer": answer.decode(errors="replace"), "seconds": window["end"] - window["start"],
            "body_bytes": len(body), "health_max_ms": 1000 * max(inside(health)),
            "health_median_ms": 1000 * statistics.median(inside(health)),
            "gap_max_ms": 1000 * max(inside(gaps)), "gap_median_ms": 1000 * statistics.median(v for _, v in gaps)}


def main() -> int:
    model = models.default_model(print)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for start in (lambda: servers.start_ours(model, None, scratch),
                      lambda: servers.start_peer(model, 8192, extra=("-fa", "on"))):
            served = start()
            try:
                results[served.label] = figures = measure(served)
            finally:
                served.stop()
            print(f"{served.label}: the {MESSAGES}-message chat ({figures['body_bytes']} bytes) answered "
                  f"{figures['status']} in {figures['seconds']:.2f} s ({figures['answer'][:90]!r}); meanwhile "
                  f"/health waited at most {figures['health_max_ms']:.0f} ms (median "
                  f"{figures['health_median_ms']:.0f}), the stream's longest gap {figures['gap_max_ms']:.0f} ms "
                  f"(median gap {figures['gap_median_ms']:.0f})", flush=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
