"""Where a generated token's time goes in the Host, between the engine's step and the reader.

One Host on SmolLM2 through llama.cpp (2 threads, flash attention on, as serve runs it) decodes
`tokens` tokens for each of 1 and 8 requests at once, as sessions (logged, synced every tick: the
default policy) and as request lanes (what the server's chat completions run on: never logged).
Each part of the scheduler thread's work is timed where it runs (the functions are wrapped; a
wrapper costs about a microsecond), and the figures are milliseconds per generated token:

    engine step     llama.cpp's forward (what no scheduler can remove)
    sample          choosing the next token from the logits (sampling.py)
    commit          the token appended to the session's state (a log record for a session)
    log write       the tick's records, in one write (sessions only)
    sync            handing the tick's fsync to the log's syncer thread (sessions only)
    detokenize      the token's text
    plan, admit...  the rest of the tick, each by name
    unaccounted     wall time per token less every part above (the loop, the GIL, the queue)

Then over HTTP (`--http`): one streamed completion at a time from `superfluid serve` and from
llama.cpp's llama-server (same model, 2 threads, flash attention on), alternating, read by a
plain HTTP client in this process. Per token: the time between tokens at the client, and the
CPU time of each server's threads from /proc: the two busiest are the forward's (the thread
that steps and llama.cpp's second worker; they spin between graphs, so their CPU follows the
wall time), and "other threads" is what the server spends beside the forward (our event loop,
llama-server's HTTP threads). On 2 cores every millisecond there is taken from the forward.

    .venv/bin/python benchmarks/token_breakdown.py [--tokens N] [--http]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.texts import text_of  # noqa: E402
from engines import models  # noqa: E402
from superfluid import Host  # noqa: E402
from superfluid.host import scheduler as scheduler_module  # noqa: E402
from superfluid.host.request import GenerateRequest, Prompt  # noqa: E402

OPTIONS = {"llamacpp_threads": 2, "llamacpp_threads_batch": 2, "llamacpp_flash_attn": True,
           "llamacpp_n_ctx": 8192}


class Timers:
    """Seconds spent in each wrapped call, by name (only the scheduler thread's calls count)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.thread: threading.Thread | None = None

    def wrap(self, owner, attribute: str, name: str) -> None:
        """Replace `owner.attribute` with a timed call of itself."""
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if threading.current_thread() is self.thread:
                    self.seconds[name] += time.perf_counter() - began

        setattr(owner, attribute, timed)


def measure(host: Host, requests: int, tokens: int, lanes: bool) -> dict[str, float]:
    """Milliseconds per generated token of each part, for `requests` generations at once."""
    scheduler = host._scheduler
    timers = Timers()
    timers.thread = host._thread.thread
    timers.wrap(scheduler.engine, "step", "engine step")
    timers.wrap(scheduler_module.sampler, "sample", "sample")
    timers.wrap(scheduler.sessions, "commit", "commit")
    timers.wrap(scheduler.log, "sync_soon", "sync (handed to the log's syncer thread)")
    timers.wrap(scheduler.log, "_write", "log write (one per tick)")
    timers.wrap(scheduler.engine, "detokenize", "detokenize")
    for name in ("_plan", "_admit", "_end_cancelled_and_late", "announce"):
        timers.wrap(scheduler, name, name.strip("_").replace("_", " "))
    timers.wrap(scheduler.kv, "park_idle", "park idle")
    timers.wrap(scheduler.kv, "relieve_pressure", "relieve pressure")
    wanted = GenerateRequest(max_tokens=tokens, ignore_eos=True, sampling={"temperature": 0.0})
    prompts = [text_of(32, salt=i) for i in range(requests)]
    if lanes:
        prepared = [host.prepare(Prompt(text=text)) for text in prompts]
        start = lambda: [host.commands.start_request(p, wanted)[1] for p in prepared]  # noqa: E731
    else:
        sessions = [host.session(temperature=0.0) for _ in prompts]
        for session, text in zip(sessions, prompts):
            session.append_text(text)
        start = lambda: [host.commands.generate(s.id, wanted) for s in sessions]  # noqa: E731
    generations = host.call(start)
    began = time.perf_counter()

    def read(generation) -> None:
        for _ in generation:
            pass

    threads = [threading.Thread(target=read, args=(g,)) for g in generations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    produced = sum(len(g.tokens) for g in generations)
    per_token = {name: 1000 * seconds / produced for name, seconds in sorted(timers.seconds.items())}
    per_token["wall"] = 1000 * wall / produced
    # what the wrapped parts leave (plan contains nothing else wrapped; the others are disjoint)
    per_token["unaccounted"] = per_token["wall"] - sum(v for k, v in per_token.items() if k != "wall")
    if not lanes:
        for session in sessions:
            host.delete(session.id)
    # unwrap: a fresh measure wraps again
    for owner, attribute in ((scheduler.engine, "step"), (scheduler.sessions, "commit"), (scheduler.log, "sync_soon"),
                             (scheduler.log, "_write"),
                             (scheduler.engine, "detokenize"), (scheduler.kv, "park_idle"),
                             (scheduler.kv, "relieve_pressure"), *((scheduler, n) for n in
                                                                   ("_plan", "_admit", "_end_cancelled_and_late",
                                                                    "_announce"))):
        if attribute in vars(owner):
            delattr(owner, attribute)
    return per_token


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process `pid`, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as handle:
                stat = handle.read()
        except FileNotFoundError:
            continue  # ended between the listing and the read
        fields = stat[stat.rindex(")") + 2:].split()
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def streamed(served, prompt: str, tokens: int) -> float:
    """Seconds between tokens of one streamed completion of exactly `tokens` tokens, at the client
    (from the first event with text to the last)."""
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=600)
    body = {"model": served.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True,
            **served.exact(tokens)}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    first = last = None
    for line in response:
        if line.startswith(b"data: {"):
            last = time.perf_counter()
            first = first or last
    connection.close()
    return (last - first) / (tokens - 1)


def over_http(model: Path, tokens: int, rounds: int) -> dict[str, dict[str, float]]:
    """Milliseconds per token of a streamed completion, ours and llama-server's: at the client,
    and the CPU of the servers' threads (the two busiest: the forward's; the rest: other)."""
    from benchmarks import servers

    figures: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with tempfile.TemporaryDirectory() as scratch:
        running = [servers.start_ours(model, OPTIONS["llamacpp_n_ctx"], scratch)]
        try:
            running.append(servers.start_peer(model, OPTIONS["llamacpp_n_ctx"], extra=("-fa", "on")))
            for served in running:
                streamed(served, text_of(32, salt=1), 8)  # one-time costs
            for r in range(rounds):
                for served in running:
                    before, client = thread_cpu(served.process.pid), time.process_time()
                    per_token = streamed(served, text_of(32, salt=100 + r), tokens)
                    after, client = thread_cpu(served.process.pid), time.process_time() - client
                    spent = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
                    column = figures[served.label]
                    column["between tokens at the client"].append(1000 * per_token)
                    column["CPU: the forward's two threads"].append(1000 * sum(spent[:2]) / tokens)
                    column["CPU: the server's other threads"].append(1000 * sum(spent[2:]) / tokens)
                    column["CPU: the client"].append(1000 * client / tokens)
        finally:
            for served in running:
                served.stop()
    return {label: {name: statistics.median(values) for name, values in column.items()}
            for label, column in figures.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens each request generates")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: SmolLM2-135M-Instruct from PyPI)")
    parser.add_argument("--http", action="store_true", help="also stream over HTTP, ours against llama-server")
    parser.add_argument("--rounds", type=int, default=5, help="streams of each server over HTTP (the median is shown)")
    args = parser.parse_args(argv)
    model = args.model or models.default_model(progress=print)
    sample = scheduler_module.sampler.sample
    with tempfile.TemporaryDirectory() as scratch:
        host = Host(model, pool_name=f"bench-token-{os.getpid()}", pool_bytes=256 << 20, log_dir=Path(scratch),
                    **OPTIONS)
        try:
            host.call(lambda: None)
            measure(host, 1, 16, lanes=True)  # warm-up: the first decode's one-time costs
            scheduler_module.sampler.sample = sample
            columns = {}
            for requests in (1, 8):
                for lanes in (False, True):
                    columns[f"{requests} {'request lane' if lanes else 'session'}{'s' if requests > 1 else ''}"] = \
                        measure(host, requests, args.tokens, lanes)
                    scheduler_module.sampler.sample = sample
        finally:
            host.close(remove_pool=True)
    names = sorted({name for column in columns.values() for name in column},
                   key=lambda n: (n in ("unaccounted", "wall"), n != "engine step", n))
    print("ms per generated token | " + " | ".join(columns))
    print("|".join(["---"] * (len(columns) + 1)))
    for name in names:
        print(f"{name} | " + " | ".join(f"{column.get(name, 0.0):.3f}" for column in columns.values()))
    if args.http:
        served = over_http(model, args.tokens, args.rounds)
        print(f"\nover HTTP, ms per token (median of {args.rounds} streams) | " + " | ".join(served))
        print("|".join(["---"] * (len(served) + 1)))
        for name in next(iter(served.values())):
            print(f"{name} | " + " | ".join(f"{column[name]:.3f}" for column in served.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
