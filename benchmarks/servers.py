"""`superfluid serve` against llama-cpp-python's own server and llama.cpp's llama-server, all driven
with the openai client.

All serve the same GGUF through llama.cpp on 2 threads, one server at a time (the machine's two
cores go to whichever runs), each in a child process this module starts and stops:

- a shared-prefix burst: many completion requests at once, each a long shared prefix plus its
  own question; the prompt tokens each server evaluated (ours from /metrics, llama-cpp-python's
  counted by benchmarks/llama_server.py, llama-server's from its /metrics) and the time until the
  last answer;
- aggregate decode tokens/s with 1, 2, 4 and 8 requests at once.

llama-cpp-python's server serves one request at a time, as shipped. The burst runs against it
twice: with its prompt cache on (`--cache true`: a LlamaRAMCache, which saves the whole state after
every request) and as it starts by default (no cache; it still reuses the prompt prefix left in its
context). Decode runs against the default, its faster configuration.

llama-server (C++, built once from the same llama.cpp: benchmarks/cpp_server.py) is the peer
users pick: continuous batching over parallel slots and a unified KV cache, with its host-memory
prompt cache. It runs with its defaults (4 slots) and with 8 slots (`-np 8`), on 8,192 cells.

Every request asks for the same number of tokens on every server (ours and llama-server:
`ignore_eos`; llama-cpp-python's: `min_tokens`), and the tokens actually generated are what the
rates count.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from benchmarks.harness import Run
from benchmarks.texts import text_of

ROOT = Path(__file__).resolve().parent.parent
OURS, THEIRS, THEIRS_CACHED = "superfluid serve", "llama-cpp-python server", "llama-cpp-python server + cache"
OURS_NO_DISK = "superfluid serve --disk-tier no"  # ours as it was before the disk tier: the pool's memory only
PEER, PEER_NP8 = "llama-server", "llama-server -np 8"  # llama.cpp's own C++ server: its defaults, and 8 slots
PEERS = (PEER, PEER_NP8)
PEER_GROUP = "ours against llama.cpp's llama-server"
PEER_CONTEXT = 8192  # its cells (-c), shared by its slots (a unified KV cache, its default)
BURST = "shared-prefix burst: ours against llama-cpp-python's server"
DECODE = "decode: aggregate tokens/s, ours against llama-cpp-python's server"
BURST_TOKENS = 16  # tokens each burst request generates


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Served:
    """A server child process on a loopback port; stop() ends it (by its pid) and cleans up."""

    def __init__(self, label: str, argv: list[str], port: int, counts: Callable[["Served"], dict],
                 cleanup: Callable[[], None] = lambda: None, exact_length: dict | None = None) -> None:
        """`exact_length`: the request fields that make it generate exactly max_tokens (past an
        end-of-text token): ours and llama-server take ignore_eos, llama-cpp-python min_tokens."""
        self.label, self.port, self._counts, self._cleanup = label, port, counts, cleanup
        self.argv = argv
        self.exact_length = exact_length or {"ignore_eos": True}
        self.log = tempfile.TemporaryFile(mode="w+")
        self.base = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="bench", max_retries=0, timeout=900)
        self._launch()

    def _launch(self) -> None:
        self.process = subprocess.Popen(self.argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        try:
            self.model = self._wait_until_serving()
        except BaseException:  # not serving (or interrupted): nothing it started may stay behind
            self.stop()
            raise

    def restart(self, between: Callable[[], None] = lambda: None) -> None:
        """Stop it (SIGTERM) and start the same command again, keeping what it keeps beyond its
        process (ours: the session log, the KV pool in shared memory and its disk tier), less
        what `between` removes while it is down (a reboot: the pool's segment, the page cache)."""
        end(self.process)
        between()
        self._launch()

    def exact(self, max_tokens: int) -> dict:
        """The request fields that make it generate exactly `max_tokens` tokens."""
        return {name: (max_tokens if value == "max_tokens" else value) for name, value in self.exact_length.items()}

    def _wait_until_serving(self) -> str:
        """The model id the server lists, once it answers; RuntimeError if it exits or stays
        silent for 600 s."""
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.label} exited with {self.process.returncode} before serving: "
                                   f"{self.log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.base}/v1/models", timeout=5) as response:
                    return json.loads(response.read())["data"][0]["id"]
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.label} did not answer on port {self.port} within 600 s") from None
                time.sleep(0.5)

    def counts(self) -> dict:
        """{"prompt": prompt tokens evaluated, "decode": generated tokens} so far."""
        return self._counts(self)

    def metrics(self, prefix: str) -> dict[str, float]:
        """Its Prometheus series whose names start with `prefix`, by name (labels included)."""
        values = {}
        for line in self.get("/metrics").decode().splitlines():
            if line.startswith(prefix) and " " in line:
                key, value = line.split(" ", 1)
                values[key] = float(value)
        return values

    def get(self, path: str) -> bytes:
        """The body of GET `path`."""
        with urllib.request.urlopen(f"{self.base}{path}", timeout=60) as response:
            return response.read()

    def complete(self, prompt: str, max_tokens: int) -> int:
        """One completion request for exactly `max_tokens` tokens (end-of-text ignored); the tokens
        it generated."""
        reply = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens,
                                               temperature=0.0, extra_body=self.exact(max_tokens))
        return reply.usage.completion_tokens

    def stop(self) -> None:
        """SIGTERM to its pid, then SIGKILL after 60 s; then remove what it left (pool, log)."""
        end(self.process)
        self.log.close()
        self._cleanup()


def end(process: subprocess.Popen, grace: float = 60) -> None:
    """End a child this benchmark started, by its pid: SIGTERM, then SIGKILL after `grace` seconds."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def first_text_seconds(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int,
                       **options) -> float:
    """Seconds until a streamed chat's first text (the whole stream is read); `options` go to the
    request as they are (temperature, extra_body)."""
    start = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True,
                                            **options)
    seconds = None
    for chunk in stream:
        if seconds is None and chunk.choices and chunk.choices[0].delta.content:
            seconds = time.perf_counter() - start
    return seconds if seconds is not None else time.perf_counter() - start


def start_ours(model: Path, n_ctx: int | None, scratch: str, *, pool: str | None = None, threads: int = 2,
               extra: tuple[str, ...] = (), label: str = OURS, command: tuple[str, ...] = ()) -> Served:
    """`superfluid serve` on `model` through llama.cpp on `threads` threads with `n_ctx` cells
    (None: serve's default, sized from memory), on a pool (`pool`, default one named for this
    process; sized as serve sizes it unless `extra` says --pool-bytes) and log of its own, with
    `extra` flags; named `label` in the figures. `command`: what runs in place of `python -m
    superfluid` (a script taking the same arguments, such as a wrapper that times serve)."""
    from kvpool import places, segment
    from kvpool.tier_folder import remove_tier

    port, pool = free_port(), pool or f"bench-serve-{os.getpid()}"
    argv = [*(command or (sys.executable, "-m", "superfluid")), "serve", str(model), "--port", str(port),
            "--pool-name", pool, "--log-dir", os.path.join(scratch, "log"), "--llamacpp-threads",
            str(threads), "--llamacpp-threads-batch", str(threads),
            *(["--llamacpp-n-ctx", str(n_ctx)] if n_ctx is not None else []),
            # no refusal for waiting long (serve's default 300 s): the peers have no such limit, and
            # how long a request waits here is the shared machine's as much as ours
            "--max-wait-seconds", "86400", *extra]

    def counts(served: Served) -> dict:
        metrics = served.metrics("superfluid_")
        return {"prompt": metrics["superfluid_prefill_tokens_total"],
                "decode": metrics["superfluid_decode_tokens_total"]}

    def cleanup() -> None:
        if pool in segment.list_pool_names():
            segment.unlink(pool)
        if "--disk-dir" not in extra:  # (a benchmark that names the folder removes it)
            remove_tier(places.disk_folder(pool))

    return Served(label, argv, port, counts, cleanup)


def start_theirs(model: Path, n_ctx: int, cache: bool) -> Served:
    """llama-cpp-python's server on `model`, with its RAM prompt cache or without (its default),
    counting what it evaluates (see llama_server.py)."""
    port = free_port()
    argv = [sys.executable, str(ROOT / "benchmarks" / "llama_server.py"), "--model", str(model), "--host",
            "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", "2", "--n_threads_batch", "2",
            "--cache", "true" if cache else "false", "--verbose", "false"]

    def counts(served: Served) -> dict:
        return json.loads(served.get("/bench/counts"))

    return Served(THEIRS_CACHED if cache else THEIRS, argv, port, counts, exact_length={"min_tokens": "max_tokens"})


def start_peer(model: Path, n_ctx: int, slots: int | None = None, extra: tuple[str, ...] = ()) -> Served:
    """llama.cpp's llama-server on `model` (built once, benchmarks/cpp_server.py) with its
    defaults (4 slots, a unified KV cache, its host-memory prompt cache) or `slots` slots, on 2
    threads, with `extra` flags, counting what it evaluates from its own /metrics."""
    from benchmarks import cpp_server

    port = free_port()
    argv = [str(cpp_server.find_or_build()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
            "-tb", "2", "-c", str(n_ctx), "--metrics",
            # its unified KV cache comes with automatic slots only: a slot count alone would split
            # the cells (8 slots of 1,024, refusing longer prompts)
            *(["-np", str(slots), "--kv-unified"] if slots else []), *extra]

    def counts(served: Served) -> dict:
        metrics = served.metrics("llamacpp:")
        # prompt tokens it processed (what its prompt cache and slots did not hold), tokens generated
        return {"prompt": metrics["llamacpp:prompt_tokens_total"], "decode": metrics["llamacpp:tokens_predicted_total"]}

    return Served(PEER if slots is None else f"{PEER} -np {slots}", argv, port, counts)


def burst(run: Run, served: Served, requests: int, prefix: int, repeat: int, tick: Callable[[str], None]) -> None:
    """`requests` completions at once on one `prefix`-token prefix, `repeat` times (a new prefix
    each time); the wall time until the last answer and the prompt tokens evaluated."""
    seconds, evaluated, generated = [], [], []
    for r in range(repeat):
        shared = text_of(prefix, salt=1000 + r)
        prompts = [f"{shared} question {i}: what comes next?" for i in range(requests)]
        before = served.counts()
        start = time.perf_counter()
        with ThreadPoolExecutor(requests) as workers:
            produced = list(workers.map(lambda p: served.complete(p, BURST_TOKENS), prompts))
        seconds.append(time.perf_counter() - start)
        evaluated.append(int(served.counts()["prompt"] - before["prompt"]))
        generated.append(sum(produced))
        tick(f"{served.label}: burst {r + 1}/{repeat}")
    run.record(f"{served.label}: {requests} requests on a {prefix}-token prefix", seconds)
    run.note(f"{served.label}: prompt tokens evaluated per burst of {requests} on a {prefix}-token prefix",
             evaluated)
    run.note(f"{served.label}: tokens generated per burst (asked: {requests} x {BURST_TOKENS})", generated)


def decode(run: Run, served: Served, counts: list[int], tokens: int, repeat: int,
           tick: Callable[[str], None]) -> None:
    """Aggregate generated tokens/s with each of `counts` requests at once (32-token distinct prompts,
    `tokens` tokens each)."""
    generated = 0
    for count in counts:
        rates = []
        for r in range(repeat):
            prompts = [text_of(32, salt=count * 10 + i + 100 * r) for i in range(count)]
            start = time.perf_counter()
            with ThreadPoolExecutor(count) as workers:
                produced = sum(workers.map(lambda p: served.complete(p, tokens), prompts))
            rates.append(produced / (time.perf_counter() - start))
            generated += produced
        run.record(f"{served.label}: decode tokens/s, {count} at once", rates, unit="tok/s")
        tick(f"{served.label}: decode with {count} at once")
    run.note(f"{served.label}: tokens generated in the decode runs (asked: {tokens} per request)", generated)


def bench(run: Run, model: Path, *, requests: int, prefix: int, counts: list[int], tokens: int, repeat: int,
          burst_repeat: int, tick: Callable[[str], None]) -> None:
    """The server runs, one after the other, then the ratios: ours, llama-cpp-python's (with its
    cache and without) and llama.cpp's llama-server (its defaults and 8 slots)."""
    n_ctx = max(4096, prefix + 512)
    with tempfile.TemporaryDirectory() as scratch:
        for start, measures_decode in ((lambda: start_ours(model, 2 * n_ctx, scratch), True),
                                       (lambda: start_theirs(model, n_ctx, cache=True), False),
                                       (lambda: start_theirs(model, n_ctx, cache=False), True),
                                       (lambda: start_peer(model, PEER_CONTEXT), True),
                                       (lambda: start_peer(model, PEER_CONTEXT, slots=8), True)):
            served = start()
            try:
                served.complete(text_of(32, salt=999), 4)  # one-time costs go here
                burst(run, served, requests, prefix, burst_repeat, tick)
                if measures_decode:
                    decode(run, served, counts, tokens, repeat, tick)
            finally:
                served.stop()
    label = f"{requests} requests on a {prefix}-token prefix"
    for theirs in (THEIRS_CACHED, THEIRS):
        run.ratio(f"shared-prefix burst: {theirs} / ours (time for {requests} on a {prefix}-token prefix)",
                  ours=f"{OURS}: {label}", baseline=f"{theirs}: {label}", group=BURST)
    for peer in PEERS:
        run.ratio(f"shared-prefix burst: {peer} / ours (time for {requests} on a {prefix}-token prefix)",
                  ours=f"{OURS}: {label}", baseline=f"{peer}: {label}", group=PEER_GROUP, goal=1)
    for count in counts:
        run.ratio(f"decode tokens/s, {count} at once: ours / theirs", ours=f"{OURS}: decode tokens/s, {count} at once",
                  baseline=f"{THEIRS}: decode tokens/s, {count} at once", group=DECODE)
        for peer in PEERS:
            run.ratio(f"decode tokens/s, {count} at once: ours / {peer}",
                      ours=f"{OURS}: decode tokens/s, {count} at once", baseline=f"{peer}: decode tokens/s, {count} at once",
                      group=PEER_GROUP, goal=0.9 if count == counts[-1] and count >= 8 else None)
    first, last = counts[0], counts[-1]
    run.ratio(f"decode tokens/s: ours at {last} at once / ours at {first}", ours=f"{OURS}: decode tokens/s, {last} at once",
              baseline=f"{OURS}: decode tokens/s, {first} at once", group=DECODE, goal=3 if last >= 8 else None)


def standalone(argv: list[str] | None, description: str, name: str, bench: Callable, full, quick) -> int:
    """A server benchmark module's command line: `--quick` (small sizes) and `--model`; runs
    `bench(run, model, sizes, tick)` and prints its figures, ratios and notes."""
    import argparse

    from engines import models

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: SmolLM2-135M-Instruct from PyPI)")
    args = parser.parse_args(argv)
    model = args.model or models.default_model(progress=print)
    run = Run(name)
    bench(run, Path(model), quick if args.quick else full, tick=lambda step: print(step, flush=True))
    print(run.table())
    for key, value in run.notes.items():
        print(f"{key}: {value}")
    return 0
