"""Two `superfluid serve` workers behind sglang-router (a cache-aware router, PyPI's sglang-router):
the prompt tokens prefilled and the time to first token of a concurrent mixed load, routed by
its cache-aware policy against round-robin.

The load: `prefixes` long shared prefixes (a system text each), `per_prefix` requests on each with
a question of their own, and `distinct` requests whose whole prompt is their own, shuffled
(always the same order) and sent `concurrency` at a time as streamed chats. Each policy gets
fresh workers (empty pools) and the same load. The prompt tokens prefilled are the workers'
/metrics counts; the first token is timed at the client, through the router.

The workers share this machine's cores, so the figures are the prefill a policy avoids and the
latency that follows from it, not the throughput two machines would have.

    .venv/bin/python benchmarks/routing.py [--quick]   # prints the figures and ratios

Router and Front start the router and an HAProxy front (docs/haproxy.cfg) as child processes; the
scaling test uses them too.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import servers  # noqa: E402
from benchmarks.harness import Run  # noqa: E402
from benchmarks.texts import text_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GROUP = "two workers behind sglang-router: cache-aware against round-robin"
POLICIES = ("cache_aware", "round_robin")
REPLY_TOKENS = 8
HAPROXY_CONFIG = ROOT / "docs" / "haproxy.cfg"


@dataclass(frozen=True)
class RoutingSizes:
    """How big the routed load is."""

    prefixes: int  # distinct shared prefixes
    per_prefix: int  # requests on each
    distinct: int  # requests with a whole prompt of their own
    prefix_tokens: int  # tokens of each shared prefix, and of each distinct prompt
    concurrency: int  # requests in flight at once


FULL = RoutingSizes(prefixes=4, per_prefix=10, distinct=8, prefix_tokens=950, concurrency=4)
QUICK = RoutingSizes(prefixes=2, per_prefix=3, distinct=2, prefix_tokens=200, concurrency=2)


def _wait(check: Callable[[], bool], what: str, process: subprocess.Popen, log, seconds: float = 120) -> None:
    """Poll `check` until it holds; RuntimeError naming `what` if the process exits or time runs out."""
    deadline = time.monotonic() + seconds
    while not check():
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{what}: exited with {process.returncode}: {log.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready within {seconds:g} s")
        time.sleep(0.2)


def _get_json(url: str):
    """The JSON at `url`, or None if nothing answers there (yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except OSError:
        return None


# The routers workers are tested behind: the module that launches each, and its name for a quiet log.
# vllm-router began as a fork of sglang-router and takes the same flags.
ROUTERS = {"sglang-router": ("sglang_router.launch_router", "warn"),
           "vllm-router": ("vllm_router.launch_router", "warning")}


class Router:
    """A router (`kind`: sglang-router by default, or vllm-router) over `worker_urls` with
    `policy`, in a child process on a loopback port. Its health checks run every second, so a dead
    worker is passed over within about two."""

    def __init__(self, worker_urls: list[str], policy: str, model: str, kind: str = "sglang-router") -> None:
        """Start it, and wait until every worker is registered and healthy for `model`."""
        module, quiet = ROUTERS[kind]
        self.port, metrics_port = servers.free_port(), servers.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.worker_urls = list(worker_urls)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *self.worker_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(metrics_port), "--health-check-interval-secs", "1",
             "--health-failure-threshold", "2", "--health-success-threshold", "1", "--log-level", quiet],
            stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=900)
        try:
            _wait(lambda: self.healthy() == set(self.worker_urls) and self._lists(model), kind,
                  self.process, self.log)
        except BaseException:
            self.stop()
            raise

    def _lists(self, model: str) -> bool:
        listed = _get_json(f"{self.base}/v1/models")
        return bool(listed) and [m["id"] for m in listed["data"]] == [model]

    def healthy(self) -> set[str]:
        """The worker URLs the router holds healthy now."""
        listed = _get_json(f"{self.base}/workers") or {"workers": []}
        return {w["url"] for w in listed["workers"] if w.get("is_healthy")}

    def wait_healthy(self, urls: set[str]) -> None:
        """Wait until exactly `urls` are held healthy (after a worker died or came back)."""
        _wait(lambda: self.healthy() == urls, f"the router holding {sorted(urls)} healthy", self.process, self.log)

    def stop(self) -> None:
        """End it (by its pid)."""
        servers.end(self.process, grace=30)
        self.log.close()


class Front:
    """HAProxy with docs/haproxy.cfg: session routes to the worker their id names, everything else
    to the router. `workers` maps each worker's name (w1, w2, as the file names them) to its address."""

    def __init__(self, router: Router, workers: dict[str, str]) -> None:
        """Start it and wait until it answers."""
        self.port = servers.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "FRONT": f"127.0.0.1:{self.port}", "ROUTER": f"127.0.0.1:{router.port}",
               **{name.upper(): address for name, address in workers.items()}}
        if shutil.which("haproxy") is None:
            raise RuntimeError("haproxy is not installed: scripts/setup installs it as root (apt-get install haproxy)")
        self.log = tempfile.TemporaryFile(mode="w+")
        # -db: stay in the foreground (a child this process ends by its pid)
        self.process = subprocess.Popen(["haproxy", "-db", "-f", str(HAPROXY_CONFIG)], env=env, stdout=self.log,
                                        stderr=subprocess.STDOUT, text=True)
        try:
            _wait(lambda: _get_json(f"{self.base}/v1/models") is not None, "haproxy", self.process, self.log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """End it (by its pid)."""
        servers.end(self.process, grace=30)
        self.log.close()


def start_worker(model: Path, name: str, scratch: str) -> servers.Served:
    """`superfluid serve` named `name` among the workers, on a pool and log of its own (512 MiB:
    several share this machine's memory), on one thread (two workers share its two cores)."""
    return servers.start_ours(model, 4096, os.path.join(scratch, name), pool=f"bench-{name}-{os.getpid()}",
                              threads=1, extra=("--worker-name", name, "--pool-bytes", "512M"))


def load_of(sizes: RoutingSizes) -> list[list[dict]]:
    """The requests' messages, in the order they are sent."""
    requests = [[{"role": "system", "content": text_of(sizes.prefix_tokens, salt=5000 + p)},
                 {"role": "user", "content": f"Question {q}: what does it say about the pool?"}]
                for p in range(sizes.prefixes) for q in range(sizes.per_prefix)]
    requests += [[{"role": "user", "content": text_of(sizes.prefix_tokens, salt=6000 + d)}]
                 for d in range(sizes.distinct)]
    random.Random(16).shuffle(requests)
    return requests


def routed(run: Run, model: Path, policy: str, sizes: RoutingSizes, tick: Callable[[str], None]) -> None:
    """The load through the router with `policy`, on two fresh workers."""
    with tempfile.TemporaryDirectory() as scratch:
        workers = []
        try:
            for name in ("w1", "w2"):
                workers.append(start_worker(model, name, scratch))
            router = Router([w.base for w in workers], policy, workers[0].model)
            try:
                before = sum(w.counts()["prompt"] for w in workers)
                with ThreadPoolExecutor(sizes.concurrency) as pool:
                    seconds = list(pool.map(
                        lambda m: servers.first_text_seconds(router.client, workers[0].model, m, REPLY_TOKENS, temperature=0.0),
                        load_of(sizes)))
                prefilled = sum(w.counts()["prompt"] for w in workers) - before
                per_worker = {name: served_chats(w) for name, w in zip(("w1", "w2"), workers)}
            finally:
                router.stop()
        finally:
            for worker in workers:
                worker.stop()
    tick(f"routing: {policy}")
    run.record(f"{policy}: first token", seconds)
    run.record(f"{policy}: prompt tokens prefilled", [prefilled], unit="tokens")
    run.note(f"routing, {policy}: requests each worker served", per_worker)


def served_chats(worker: servers.Served) -> int:
    """Chat requests the worker answered (200), from its /metrics."""
    return int(sum(value for key, value in worker.metrics("superfluid_requests_total").items()
                   if 'route="/v1/chat/completions"' in key and 'status="200"' in key))


def bench(run: Run, model: Path, sizes: RoutingSizes, tick: Callable[[str], None]) -> None:
    """The load under each policy, then the ratios (above 1: cache-aware is ahead)."""
    for policy in POLICIES:
        routed(run, model, policy, sizes, tick)
    requests = sizes.prefixes * sizes.per_prefix + sizes.distinct
    run.note("routing: the load", f"{requests} streamed chats, {sizes.concurrency} at a time: {sizes.prefixes} "
             f"{sizes.prefix_tokens}-token prefixes x {sizes.per_prefix} questions, and {sizes.distinct} "
             f"{sizes.prefix_tokens}-token prompts of their own")
    run.ratio("prompt tokens prefilled: round-robin / cache-aware", ours="cache_aware: prompt tokens prefilled",
              baseline="round_robin: prompt tokens prefilled", group=GROUP, goal=1)
    run.ratio("first token (median): round-robin / cache-aware", ours="cache_aware: first token",
              baseline="round_robin: first token", group=GROUP, goal=1)


def main(argv: list[str] | None = None) -> int:
    """Print the routed load's figures and ratios."""
    return servers.standalone(argv, __doc__.splitlines()[0], "routing", bench, FULL, QUICK)


if __name__ == "__main__":
    sys.exit(main())
