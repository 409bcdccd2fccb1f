"""The Host on SmolLM2 through llama.cpp: warm against cold, shared prefixes, batching, priorities.

    python benchmarks/host_ratios.py          # the issue's sizes (a few minutes on 2 cores)
    python benchmarks/host_ratios.py --quick  # small sizes (what the tests run)

Figures, each measured side by side with its comparison in this run:
- a second turn after a long first turn: time to first token warm (the session's live lane; and
  its KV parked in the pool, as after a restart) against cold (the same tokens prefilled);
- sessions sharing one long prefix, arriving together: how many tokens were prefilled and the
  total time, against llama-cpp-python's `Llama` with its `LlamaRAMCache`, one request at a time;
- aggregate decode tokens/s at 1, 2, 4 and 8 concurrent sessions;
- an interactive session's time to first token while 8 background sessions generate, against
  the same on an idle host.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import Run  # noqa: E402
from benchmarks.texts import text_of  # noqa: E402
from benchmarks.ttft import first_token_seconds  # noqa: E402
from engines import models  # noqa: E402
from kvpool import segment  # noqa: E402
from superfluid import Host  # noqa: E402

THREADS = {"llamacpp_threads": 2, "llamacpp_threads_batch": 2}


class Hosts:
    """Hosts on fresh pools and logs, all closed and removed at the end."""

    def __init__(self, model: Path) -> None:
        self.model, self.opened = model, []
        self.scratch = tempfile.TemporaryDirectory()

    def open(self, pool_name: str | None = None, log_dir: Path | None = None, **options) -> Host:
        """A host on a new pool and log, or on `pool_name` and `log_dir` again (a restart)."""
        name = pool_name or f"bench-host-{os.getpid()}-{len(self.opened)}"
        host = Host(self.model, pool_name=name, pool_bytes=512 << 20, log_dir=log_dir or Path(self.scratch.name) / name,
                    **{**THREADS, "llamacpp_n_ctx": 32768, **options})
        self.opened.append(host)
        return host

    def close(self) -> None:
        for host in self.opened:
            host.close(remove_pool=True)
        self.scratch.cleanup()


def bench_second_turn(run: Run, hosts: Hosts, first_turn: int, repeat: int) -> None:
    """Per repeat, two conversations on different texts, each alone on its host: one continues
    on its live lane; the other's host restarts in between, so its second turn starts from its
    KV parked in the pool. Both are timed against a host with nothing cached prefilling the same
    tokens. (Alone: llama.cpp's unified cache attends over every sequence's cells, so a second
    long conversation resident in the same engine slows every forward.)"""
    warm, parked, cold = [], [], []
    for i in range(repeat):
        conversations = []
        for salt in (2 * i, 2 * i + 1):
            host = hosts.open()
            s = host.session()
            s.append_user(text_of(first_turn, salt=salt))
            s.complete(max_tokens=8)
            s.append_user(text_of(16, salt=100 + salt))  # the second turn adds a 16-token user message
            conversations.append((host, s))
        (host, live), (other, restarted) = conversations
        tokens = live.tokens
        warm.append(first_token_seconds(live, max_tokens=4)[0])
        host.close(remove_pool=True)
        other.close()
        again = hosts.open(pool_name=other.pool.name, log_dir=other._log.directory)
        parked.append(first_token_seconds(again.session(id=restarted.id), max_tokens=4)[0])
        again.close(remove_pool=True)
        stranger = hosts.open()
        lone = stranger.session()
        lone.append_tokens(tokens)
        cold.append(first_token_seconds(lone, max_tokens=4)[0])
        stranger.close(remove_pool=True)
    label = f"second turn after {first_turn}: first token"
    run.record(f"{label}, warm lane", warm)
    run.record(f"{label}, parked in the pool (after a restart)", parked)
    run.record(f"{label}, cold", cold)
    run.ratio(f"cold / warm lane at {first_turn}", ours=f"{label}, warm lane", baseline=f"{label}, cold", goal=50)
    run.ratio(f"cold / parked at {first_turn}", ours=f"{label}, parked in the pool (after a restart)",
              baseline=f"{label}, cold")


def bench_shared_prefix(run: Run, hosts: Hosts, model: Path, sessions: int, prefix: int) -> None:
    from llama_cpp import Llama, LlamaRAMCache

    shared = text_of(prefix)
    questions = [f" question {i}: what comes next?" for i in range(sessions)]
    host = hosts.open()
    start = time.perf_counter()
    handles = []
    for question in questions:
        s = host.session()
        s.append_text(shared + question)
        handles.append(s)
    generations = [s.generate(max_tokens=16) for s in handles]
    for generation in generations:
        generation.collect()
    ours = time.perf_counter() - start
    stats = host.stats()
    prompt_tokens = len(handles[0].tokens) - 16
    run.record(f"{sessions} sessions on a {prefix}-token prefix, ours", [ours])
    run.note(f"{sessions} on a shared prefix: tokens prefilled, ours", stats.prefill_tokens)
    run.note(f"{sessions} on a shared prefix: prompt tokens of one session", prompt_tokens)

    llm = Llama(str(model), n_ctx=4096, n_threads=2, n_threads_batch=2, verbose=False)
    llm.set_cache(LlamaRAMCache(capacity_bytes=2 << 30))
    evaluated = [0]
    plain_eval = llm.eval

    def counting_eval(tokens):  # llama-cpp-python feeds every prompt token it cannot reuse through eval
        evaluated[0] += len(tokens)
        return plain_eval(tokens)

    llm.eval = counting_eval
    start = time.perf_counter()
    for question in questions:
        llm(shared + question, max_tokens=16, temperature=0.0)
    theirs = time.perf_counter() - start
    llm.close()
    run.record(f"{sessions} sessions on a {prefix}-token prefix, llama-cpp-python + LlamaRAMCache", [theirs])
    run.note(f"{sessions} on a shared prefix: tokens evaluated, llama-cpp-python (prompt and decode)", evaluated[0])
    run.ratio(f"{sessions} on a shared prefix: llama-cpp-python / ours (total time)",
              ours=f"{sessions} sessions on a {prefix}-token prefix, ours",
              baseline=f"{sessions} sessions on a {prefix}-token prefix, llama-cpp-python + LlamaRAMCache")


def bench_decode(run: Run, hosts: Hosts, counts: list[int], tokens: int) -> None:
    host = hosts.open()
    for count in counts:
        handles = []
        for i in range(count):
            s = host.session()
            s.append_text(text_of(32, salt=count * 10 + i))
            handles.append(s)
        for s in handles:  # prefilled apart, so what follows is decode only
            s.complete(max_tokens=1)
        start = time.perf_counter()
        generations = [s.generate(max_tokens=tokens) for s in handles]
        produced = sum(len(g.tokens) for g in generations if g.collect() is not None)
        seconds = time.perf_counter() - start
        run.record(f"decode tokens/s, {count} sessions", [produced / seconds], unit="tok/s")
        for s in handles:
            host.delete(s.id)
    first, last = counts[0], counts[-1]
    speedup = run.figures[f"decode tokens/s, {last} sessions"].median / run.figures[f"decode tokens/s, {first} sessions"].median
    run.note(f"decode tokens/s, {last} sessions / {first} (goal >= 3)", round(speedup, 2))


def bench_interactive(run: Run, hosts: Hosts, background: int, repeat: int, group: str | None = None) -> None:
    host = hosts.open()
    idle, busy = [], []
    for i in range(repeat):
        s = host.session(priority="interactive")
        s.append_text(text_of(64, salt=i))
        idle.append(first_token_seconds(s, max_tokens=4)[0])
    generations = []
    for i in range(background):
        s = host.session(priority="background")
        s.append_text(text_of(64, salt=50 + i))
        generations.append(s.generate(max_tokens=100_000))
    for generation in generations:
        next(generation)  # all generating now
    for i in range(repeat):
        s = host.session(priority="interactive")
        s.append_text(text_of(64, salt=200 + i))
        busy.append(first_token_seconds(s, max_tokens=4)[0])
    for generation in generations:
        generation.cancel()
        generation.collect()
    run.record("interactive first token, idle host", idle)
    run.record(f"interactive first token, {background} background sessions generating", busy)
    run.ratio("interactive first token: idle / busy (goal: busy <= 2x idle)",
              ours=f"interactive first token, {background} background sessions generating",
              baseline="interactive first token, idle host", goal=0.5, group=group)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (for tests)")
    parser.add_argument("--out", type=Path, help="where to write the JSON (default: benchmarks/results/host.json)")
    args = parser.parse_args(argv)
    model = models.default_model(progress=print)
    run = Run("host-quick" if args.quick else "host")
    run.note("model", Path(model).name)
    hosts = Hosts(model)
    try:
        if args.quick:
            bench_second_turn(run, hosts, 128, repeat=1)
            bench_shared_prefix(run, hosts, model, sessions=4, prefix=128)
            bench_decode(run, hosts, [1, 2], tokens=8)
            bench_interactive(run, hosts, background=2, repeat=2)
        else:
            bench_second_turn(run, hosts, 2000, repeat=3)
            bench_shared_prefix(run, hosts, model, sessions=16, prefix=1000)
            bench_decode(run, hosts, [1, 2, 4, 8], tokens=64)
            bench_interactive(run, hosts, background=8, repeat=5)
    finally:
        hosts.close()
        for name in segment.list_pool_names():
            if name.startswith(f"bench-host-{os.getpid()}-"):
                segment.unlink(name)
    return run.finish(args.out)


if __name__ == "__main__":
    main()
