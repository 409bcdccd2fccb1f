"""Two `superfluid serve` workers behind a cache-aware router (sglang-router, and vllm-router, its
fork) and an HAProxy front (docs/haproxy.cfg), all real processes on loopback: shared prefixes
are prefilled once each, a session's turns reach the worker that holds it, the others carry on
when a worker dies, and a restarted worker resumes its sessions from its pool."""

import http.client
import json
import time

import pytest

from benchmarks.routing import ROUTERS, Front, Router
from tests.superfluid.served import Served

pytestmark = pytest.mark.slow
NAMES = ("w1", "w2")


class Cluster:
    """Two named workers on the tiny model, a router (`kind`, cache-aware) over them, and the front."""

    def __init__(self, model, tmp_path, kind: str) -> None:
        self.model, self.tmp_path = model, tmp_path
        self.workers: dict[str, Served] = {}
        self.router = self.front = None
        try:
            for name in NAMES:
                self.workers[name] = self._start(name)
            self.router = Router([self.url(name) for name in NAMES], "cache_aware", self.workers["w1"].model, kind)
            self.front = Front(self.router, {name: self.url(name).removeprefix("http://") for name in NAMES})
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, *, pool: str | None = None, port: int = 0) -> Served:
        # idle sessions park into the pool at once, so a crash leaves their KV there
        return Served(self.model, self.tmp_path, "--worker-name", name, "--idle-park-seconds", "0.1",
                      "--port", str(port), pool=pool)

    def url(self, name: str) -> str:
        host, port = self.workers[name].address
        return f"http://{host}:{port}"

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash: the pool and the log stay."""
        served = self.workers[name]
        served.process.kill()
        served.process.wait()

    def restart(self, name: str) -> None:
        """The same worker again: its name, pool, log and port (the router and the front know it by
        its address; the port was ephemeral, and nothing on loopback binds it in between but a
        rare outgoing connection, which would fail the restart with a clear "cannot listen")."""
        old = self.workers[name]
        self.workers[name] = self._start(name, pool=old.pool, port=old.address[1])

    def stop(self) -> None:
        """Everything ended and removed; then the workers' exit codes checked (0, or -9 killed)."""
        for part in (self.front, self.router):
            if part is not None:
                part.stop()
        codes = {name: served.stop() for name, served in self.workers.items()}
        assert set(codes.values()) <= {0, -9}, codes


@pytest.fixture(params=sorted(ROUTERS))
def cluster(request, tiny_models, tmp_path):
    running = Cluster(tiny_models["f32"].gguf, tmp_path, request.param)
    yield running
    running.stop()


def request(base: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict, str | None]:
    """(status, JSON body, the X-Superfluid-Worker header) of one request."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    connection.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, (json.loads(data) if data.startswith(b"{") else {}), response.getheader("X-Superfluid-Worker")


def prefix(i: int) -> str:
    return " ".join(f"fact {i}-{j}: the pool keeps what the engine parks." for j in range(24))


def ask(cluster: Cluster, p: int, q: int) -> tuple[str, int, int]:
    """A chat on prefix `p` with question `q` through the router: (worker, prompt tokens, cached tokens)."""
    raw = cluster.router.client.chat.completions.with_raw_response.create(
        model=cluster.workers["w1"].model, max_tokens=2, temperature=0.0,
        messages=[{"role": "system", "content": prefix(p)}, {"role": "user", "content": f"question {q}?"}])
    reply = raw.parse()
    return raw.headers["x-superfluid-worker"], reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens


def prefilled(cluster: Cluster) -> float:
    return sum(served.metric("prefill_tokens_total") for served in cluster.workers.values())


def wait_for(check, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.1)


def test_shared_prefixes_are_prefilled_once_each_under_the_cache_aware_policy(cluster):
    before = prefilled(cluster)
    answers = {p: [ask(cluster, p, q) for q in range(3)] for p in range(3)}  # prefix by prefix
    answers = {p: answers[p] + [ask(cluster, p, 3 + q) for q in range(2)] for p in range(3)}  # and interleaved
    uncached = 0
    for p, replies in answers.items():
        assert len({worker for worker, _, _ in replies}) == 1, f"prefix {p} was served by {replies}"
        for worker, prompt, cached in replies[1:]:
            assert prompt - cached <= prompt // 4, f"prefix {p} was prefilled again on {worker}: {replies}"
        uncached += sum(prompt - cached for _, prompt, cached in replies)
    # the workers' own count agrees: each prefix once, then only the questions
    assert prefilled(cluster) - before == uncached
    assert uncached < sum(replies[0][1] for replies in answers.values()) * 1.5


def test_sessions_reach_their_worker_survive_the_others_death_and_resume_from_the_pool(cluster):
    front = cluster.front.base
    sessions = {}
    for i in range(4):
        status, body, worker = request(front, "POST", "/v1/sessions",
                                       {"system": "You are terse.", "messages": [{"role": "user", "content": f"Hi {i}"}]})
        assert status == 201 and body["id"].startswith(f"{worker}.")
        sessions[body["id"]] = worker
    assert set(sessions.values()) == set(NAMES), "the front spreads new sessions over the workers"
    for turn in range(2):
        for session_id, owner in sessions.items():
            if turn:
                status, _, worker = request(front, "POST", f"/v1/sessions/{session_id}/messages",
                                            {"messages": [{"role": "user", "content": "More?"}]})
                assert (status, worker) == (200, owner)
            status, body, worker = request(front, "POST", f"/v1/sessions/{session_id}/generate", {"max_tokens": 3})
            assert (status, worker) == (200, owner), body
    parent = next(iter(sessions))
    status, child, worker = request(front, "POST", f"/v1/sessions/{parent}/fork")
    assert status == 201 and child["id"].startswith(f"{sessions[parent]}.") and worker == sessions[parent]
    sessions[child["id"]] = sessions[parent]
    # a session asked of the wrong worker: a 421 naming the right one
    other = next(s for s, owner in sessions.items() if owner == "w2")
    status, body, worker = request(cluster.url("w1"), "GET", f"/v1/sessions/{other}")
    assert (status, worker) == (421, "w1") and "`w2`" in body["error"]["message"]
    for unknown in ("w3.0123abcd", "0123abcd"):  # the front names what it cannot route
        status, body, _ = request(front, "GET", f"/v1/sessions/{unknown}")
        assert (status, body["error"]["code"]) == (404, "unknown_worker")

    # each prefix lives on the worker that served it first
    holder = {p: ask(cluster, p, 0)[0] for p in range(2)}
    dead = holder[0]
    alive = next(name for name in NAMES if name != dead)
    kept = {}
    for session_id, owner in sessions.items():
        status, body, _ = request(front, "GET", f"/v1/sessions/{session_id}")
        kept[session_id] = body["tokens"]
    mine = {s: t for s, t in kept.items() if sessions[s] == dead}
    wait_for(lambda: cluster.workers[dead].metric("lanes") == 0, "parking the idle sessions into the pool")

    cluster.kill(dead)
    cluster.router.wait_healthy({cluster.url(alive)})
    for p in range(2):  # every prefix is still answered, by the worker left
        worker, prompt, cached = ask(cluster, p, 1)
        assert worker == alive
        if holder[p] == alive:
            assert prompt - cached <= prompt // 4
    for session_id, owner in sessions.items():
        status, body, worker = request(front, "POST", f"/v1/sessions/{session_id}/generate", {"max_tokens": 2})
        if owner == alive:
            assert (status, worker) == (200, alive), body
            kept[session_id] = None  # it moved on
        else:
            assert status == 503, "a dead worker's sessions wait for it (their log and KV are there)"

    cluster.restart(dead)
    cluster.router.wait_healthy({cluster.url(name) for name in NAMES})
    some = next(iter(mine))
    wait_for(lambda: request(front, "GET", f"/v1/sessions/{some}")[0] == 200, "the front finding the worker again")
    before, uncached = cluster.workers[dead].metric("prefill_tokens_total"), 0
    for session_id, tokens in mine.items():
        status, body, worker = request(front, "GET", f"/v1/sessions/{session_id}")
        assert (status, worker, body["tokens"]) == (200, dead, tokens)
        status, body, worker = request(front, "POST", f"/v1/sessions/{session_id}/generate", {"max_tokens": 2})
        assert (status, worker) == (200, dead), body
        # its KV came from the pool: only the turn's few new tokens are prefilled, not the session
        prompt, cached = body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert prompt >= tokens and prompt - cached <= prompt // 4, body["usage"]
        uncached += prompt - cached
    assert cluster.workers[dead].metric("prefill_tokens_total") - before == uncached
