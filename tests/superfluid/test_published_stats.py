"""The statistics the scheduler publishes: read without waiting for the scheduler thread (what
/health, /metrics, /get_load and /server_info answer from), and current after every command and
every ended generation, before anyone hears of either."""

import concurrent.futures
import http.client
import json
import threading

import pytest

from superfluid import HostClosed
from superfluid.http.server import Server
from superfluid.host.request import GenerateRequest, Prompt
from tests.gate import WAIT_SECONDS, Gate

PROMPT = "The capital of France is Paris. The quick brown fox"


def test_published_statistics_are_read_while_the_engine_is_held_mid_step(open_host):
    gate = Gate(lambda requests: True)
    host = open_host(gate=gate)
    session = host.session()
    session.append_text(PROMPT)
    running = host.submit(host.commands.generate, session.id, GenerateRequest(max_tokens=3, ignore_eos=True))
    gate.wait_reached()
    try:
        stats = host.published_stats()  # the scheduler thread is inside the step: this does not wait for it
        assert stats.generating == 1 and stats.sessions == 1 and stats.generations == 0
    finally:
        gate.open()
    running.result().collect()
    # published before the reader heard of the end
    after = host.published_stats()
    assert after.generating == 0 and after.generations == 1 and after.decode_tokens + after.prefill_tokens > 0


def test_a_request_lane_is_gone_from_the_published_statistics_when_its_reader_hears_the_end(open_host):
    host = open_host()
    _, generation = host.call(host.commands.start_request, host.prepare(Prompt(text=PROMPT * 8)),
                              GenerateRequest(max_tokens=2, ignore_eos=True))
    generation.collect()
    stats = host.published_stats()
    assert stats.generations == 1 and stats.lanes == 0 and stats.sessions == 0
    assert stats.exports == 1 and stats.pool_entries == 1  # its KV parked under its prefix


def test_published_statistics_refuse_once_the_host_is_closed(open_host):
    host = open_host()
    host.close()
    with pytest.raises(HostClosed):
        host.published_stats()


def test_health_and_metrics_answer_while_the_scheduler_thread_is_inside_a_step(open_host):
    gate = Gate(lambda requests: True)
    host = open_host(gate=gate)
    server = Server(host, ("127.0.0.1", 0))
    serving = threading.Event()
    thread = threading.Thread(target=server.run, kwargs={"on_serving": serving.set}, daemon=True)
    thread.start()
    try:
        assert serving.wait(WAIT_SECONDS)
        session = host.session()
        session.append_text(PROMPT)
        running = host.submit(host.commands.generate, session.id, GenerateRequest(max_tokens=3, ignore_eos=True))
        gate.wait_reached()
        try:
            # Each asked on a thread of its own; all must be answered while the step is still held
            # (a route that waited for the scheduler thread would wait for the gate, which opens
            # only after these answers, or after WAIT_SECONDS).
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                answers = dict(zip(("/health", "/metrics", "/get_load", "/server_info"), pool.map(
                    lambda path: get(server.address, path), ("/health", "/metrics", "/get_load", "/server_info"))))
        finally:
            gate.open()
        running.result().collect()
        assert all(status == 200 for status, _ in answers.values()), answers
        health = json.loads(answers["/health"][1])
        assert health["status"] == "ok" and health["generating"] == 1
        assert b"superfluid_generating 1" in answers["/metrics"][1]
    finally:
        server.stop()
        thread.join(WAIT_SECONDS)
        assert not thread.is_alive()


def get(address, path: str) -> tuple[int, bytes]:
    """GET `path` of the server at `address`: (status, body)."""
    connection = http.client.HTTPConnection(*address, timeout=WAIT_SECONDS)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_parked_sessions_are_counted_as_a_walk_over_every_session_would_count_them(open_host, tmp_path):
    host = open_host(log_dir=tmp_path / "log")

    def walked() -> int:  # on the scheduler thread: what the count stands for
        return sum(1 for live in host.commands.sessions.durable.values()
                   if live.seq is None and live.state.parked is not None)

    def agree() -> int:
        counted, walk = host.stats().parked_sessions, host.call(walked)
        assert counted == walk
        return counted

    first, second = host.session(), host.session()
    for s in (first, second):
        s.append_text(PROMPT)
        s.complete(max_tokens=3)
    agree()  # (in a unified cache the first was parked while the second generated)
    host.call(host.commands.retire, first.fork().id)  # a fork parked then deleted: counted in, then out
    first.pin()
    agree()
    host.call(lambda: host.commands.kv.park(host.commands.sessions.get(second.id), keep_lane=False))
    before = agree()
    child = second.fork()  # second has no lane: the child takes its parked KV by reference
    assert agree() == before + 1
    child.trim(2)  # the parked KV reached past the cut: not the child's any more
    assert agree() == before
    host.delete(second.id)
    assert agree() == before - 1
    host.close()  # every lane parked
    again = open_host(log_dir=tmp_path / "log")
    counted = again.stats().parked_sessions
    assert counted == again.call(lambda: sum(1 for live in again.commands.sessions.durable.values()
                                             if live.state.parked is not None)) == 1  # first: the child kept no KV
