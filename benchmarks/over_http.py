"""What the HTTP layer costs: `superfluid serve` against the same Host called in this process.

    .venv/bin/python benchmarks/over_http.py           # 1, 2, 4 and 8 requests at once (a few minutes)
    .venv/bin/python benchmarks/over_http.py --quick   # small sizes

Both run SmolLM2 through llama.cpp with serve's engine settings (2 threads, flash attention on,
the same cells), one at a time: each sample asks N requests at once of the Host in-process (a
thread per request, as an embedding application would) and then of the server (the openai
client, a thread per request), N distinct 32-token prompts each generating the same number of
tokens. The ratio is aggregate decode tokens/s over HTTP against in-process (goal: 0.9).

The in-process Host runs in a fresh child interpreter of its own (spawned, driven through a
pipe), as the server does: inside a long benchmark run the parent holds what earlier parts left
(MLX's runtime, closed engines), and a Host there ran at a third of its speed alone.

Then /health with 1,000 connections held half-open (each sent half a request head and stopped),
against /health on a quiet server: the threads and memory those connections hold, and the
answer's latency (goal: under 100 ms).
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import servers  # noqa: E402
from benchmarks.harness import Run  # noqa: E402
from benchmarks.texts import text_of  # noqa: E402
from engines import models  # noqa: E402
from superfluid import Host  # noqa: E402

GROUP = "HTTP: superfluid serve against the same Host in-process"
IN_PROCESS, OVER_HTTP = "Host in-process", "superfluid serve over HTTP"
HALF_OPEN = 1000


def in_process(host: Host, prompts: list[str], tokens: int) -> float:
    """Aggregate tokens/s of one completion per prompt at once, each a session of its own
    (retired into the pool after, as the server does). Runs in the child (InProcess)."""

    def complete(prompt: str) -> int:
        session = host.session(temperature=0.0)
        session.append_text(prompt)
        generation = session.generate(max_tokens=tokens, ignore_eos=True)
        generation.collect()
        host.retire(session.id)
        return len(generation.tokens)

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as workers:
        produced = sum(workers.map(complete, prompts))
    return produced / (time.perf_counter() - start)


def _host_child(connection, model: str, pool: str, log_dir: str, n_ctx: int) -> None:
    """The child's loop: a Host with serve's engine settings; each (prompts, tokens) received is
    answered with its tokens/s, until None."""
    host = Host(model, runtime="llamacpp", pool_name=pool, pool_bytes=512 << 20, log_dir=log_dir,
                llamacpp_threads=2, llamacpp_threads_batch=2, llamacpp_n_ctx=n_ctx, llamacpp_flash_attn=True)
    try:
        connection.send("ready")
        while (work := connection.recv()) is not None:
            connection.send(in_process(host, *work))
    finally:
        host.close(remove_pool=True)


class InProcess:
    """A Host in a spawned child process (a fresh interpreter), measured through a pipe."""

    def __init__(self, model: Path, pool: str, log_dir: Path, n_ctx: int) -> None:
        """Start the child and wait until its Host has loaded."""
        context = multiprocessing.get_context("spawn")
        self.connection, child_end = context.Pipe()
        self.process = context.Process(target=_host_child, args=(child_end, str(model), pool, str(log_dir), n_ctx))
        self.process.start()
        child_end.close()  # the child holds its end now: if it dies, recv() ends instead of waiting forever
        try:
            started = self.connection.recv()
        except EOFError:
            started = None
        if started != "ready":
            self.process.join(timeout=60)
            raise RuntimeError(f"the in-process Host's child exited ({self.process.exitcode}) before it started")

    def decode(self, prompts: list[str], tokens: int) -> float:
        """Aggregate tokens/s of the child's Host on `prompts`."""
        self.connection.send((prompts, tokens))
        return self.connection.recv()

    def close(self) -> None:
        """Close the Host (its pool removed) and end the child."""
        try:
            self.connection.send(None)
        except OSError:
            pass
        self.process.join(timeout=120)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def over_http(served: servers.Served, prompts: list[str], tokens: int) -> float:
    """Aggregate tokens/s of one completion request per prompt at once."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as workers:
        produced = sum(workers.map(lambda p: served.complete(p, tokens), prompts))
    return produced / (time.perf_counter() - start)


def health_seconds(port: int, repeat: int) -> list[float]:
    """Seconds for GET /health on a new connection, `repeat` times."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        connection.close()
        samples.append(time.perf_counter() - start)
        assert response.status == 200, response.status
    return samples


def process_figures(pid: int) -> tuple[int, int]:
    """(threads, resident bytes) of process `pid`."""
    threads = len(os.listdir(f"/proc/{pid}/task"))
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return threads, int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def bench_half_open(run: Run, served: servers.Served, repeat: int) -> None:
    """/health on a quiet server, then beside 1,000 half-open connections."""
    quiet = health_seconds(served.port, repeat)
    threads, memory = process_figures(served.process.pid)
    held = []
    try:
        for _ in range(HALF_OPEN):
            connection = socket.create_connection(("127.0.0.1", served.port), timeout=60)
            connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
            held.append(connection)
        loaded = health_seconds(served.port, repeat)
        threads_held, memory_held = process_figures(served.process.pid)
    finally:
        for connection in held:
            connection.close()
    run.record("GET /health, quiet", quiet)
    run.record(f"GET /health beside {HALF_OPEN:,} half-open connections", loaded)
    run.ratio(f"/health: quiet / beside {HALF_OPEN:,} half-open connections (time)",
              ours=f"GET /health beside {HALF_OPEN:,} half-open connections", baseline="GET /health, quiet",
              group=GROUP)
    median = sorted(loaded)[len(loaded) // 2]
    run.note(f"GET /health beside {HALF_OPEN:,} half-open connections: median ms (goal: under 100)",
             round(median * 1000, 1))
    run.note(f"server threads, quiet / beside {HALF_OPEN:,} half-open connections", [threads, threads_held])
    run.note(f"server resident MiB, quiet / beside {HALF_OPEN:,} half-open connections",
             [round(memory / 2**20), round(memory_held / 2**20)])


def bench(run: Run, model: Path, counts: list[int], tokens: int, repeat: int, tick=lambda step: None) -> None:
    """Decode over HTTP against in-process at each of `counts`, alternating sample by sample
    (so drift on a shared machine falls on both), then /health beside half-open connections."""
    n_ctx = 8192
    with tempfile.TemporaryDirectory() as scratch:
        host = InProcess(model, f"bench-inproc-{os.getpid()}", Path(scratch) / "inproc", n_ctx)
        try:
            served = servers.start_ours(model, n_ctx, scratch)
            try:
                host.decode([text_of(32, salt=999)], 4)  # one-time costs go here
                served.complete(text_of(32, salt=998), 4)
                for count in counts:
                    ours, theirs = [], []
                    for r in range(repeat):
                        prompts = [text_of(32, salt=5000 + 100 * count + 10 * r + i) for i in range(count)]
                        theirs.append(host.decode([f"A. {p}" for p in prompts], tokens))
                        ours.append(over_http(served, [f"B. {p}" for p in prompts], tokens))
                    run.record(f"{IN_PROCESS}: decode tokens/s, {count} at once", theirs, unit="tok/s")
                    run.record(f"{OVER_HTTP}: decode tokens/s, {count} at once", ours, unit="tok/s")
                    run.ratio(f"decode tokens/s, {count} at once: over HTTP / in-process",
                              ours=f"{OVER_HTTP}: decode tokens/s, {count} at once",
                              baseline=f"{IN_PROCESS}: decode tokens/s, {count} at once", group=GROUP, goal=0.9)
                    tick(f"HTTP against in-process, {count} at once")
                bench_half_open(run, served, repeat=max(5, repeat))
                tick("/health beside half-open connections")
            finally:
                served.stop()
        finally:
            host.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    args = parser.parse_args(argv)
    run = Run("over_http")
    model = models.default_model(progress=print)
    counts, tokens, repeat = ([1, 2], 16, 2) if args.quick else ([1, 2, 4, 8], 128, 3)
    bench(run, model, counts, tokens, repeat, tick=print)
    print(run.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
