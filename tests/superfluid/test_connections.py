"""What careless and hostile connections cannot do to `superfluid serve`: hold threads, memory or
sockets for good, or keep others from being answered. Raw sockets, since no client library sends
half a request."""

import http.client
import json
import resource
import socket
import time
from pathlib import Path

import pytest

from tests.superfluid.served import Served

HALF_OPEN = 1000
HEADER_TIMEOUT = 3  # seconds; long enough to open 1,000 connections and ask /health meanwhile
KEEP_ALIVE = 1
BODY_TIMEOUT = 3  # seconds; a body that never arrives is answered 408 after this (serve's default: 30)


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    server = Served(tiny_models["f32"].gguf, tmp_path_factory.mktemp("connections"),
                    "--header-timeout", str(HEADER_TIMEOUT), "--timeout-keep-alive", str(KEEP_ALIVE),
                    "--body-timeout", str(BODY_TIMEOUT))
    yield server
    assert server.stop() == 0


def threads_of(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def half_open(address, count: int) -> list[socket.socket]:
    """`count` connections that each send half a request head and stop."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 256:  # each socket is a file in this process too
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(count + 256, hard), hard))
    sockets = []
    for _ in range(count):
        connection = socket.create_connection(address, timeout=30)
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        sockets.append(connection)
    return sockets


def closed_by_server(connection: socket.socket) -> bool:
    """True when the server closed the connection (EOF or reset); waits up to the socket's timeout."""
    try:
        return connection.recv(1024) == b""
    except ConnectionResetError:
        return True


def health(served) -> dict:
    connection = http.client.HTTPConnection(*served.address, timeout=30)
    connection.request("GET", "/health")
    response = connection.getresponse()
    body = json.loads(response.read())
    connection.close()
    assert response.status == 200
    return body


def test_a_thousand_half_open_connections_hold_no_threads_and_leave_health_answering(served):
    pid = served.process.pid
    health(served)  # the server has answered once: whatever threads that starts, it has started
    threads, memory = threads_of(pid), resident_bytes(pid)
    opened = time.monotonic()
    sockets = half_open(served.address, HALF_OPEN)
    try:
        assert health(served)["status"] == "ok"  # answered beside them
        held = time.monotonic() - opened < HEADER_TIMEOUT  # (on a slow machine some may be gone already)
        assert threads_of(pid) <= threads + 1, "a connection must not hold a thread"
        if held:
            # the standard library's server held 812 MiB for 1,000 such connections
            assert resident_bytes(pid) - memory < 64 << 20
        # none of them ever completes its head: the server closes every one after the deadline
        assert all(closed_by_server(connection) for connection in sockets)
        assert time.monotonic() - opened >= HEADER_TIMEOUT
    finally:
        for connection in sockets:
            connection.close()
    assert health(served)["status"] == "ok"


def test_a_head_sent_a_byte_at_a_time_is_cut_off_at_the_deadline(served):
    started = time.monotonic()  # before connecting: the server's deadline starts when it accepts
    connection = socket.create_connection(served.address, timeout=30)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    try:
        for byte in head:  # a byte every 0.1 s: the keep-alive timer never fires, the head's deadline does
            connection.sendall(bytes([byte]))
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass  # cut off while sending: what the deadline is for
    assert closed_by_server(connection)
    assert time.monotonic() - started >= HEADER_TIMEOUT
    connection.close()


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(served):
    connection = http.client.HTTPConnection(*served.address, timeout=30)
    connection.connect()
    # The server's idle timer starts when it has sent the answer, which is before the client has
    # read it: timed from the client's read, the close came 0.9985 s later in CI. Timed from
    # before the request, the whole idle wait lies inside the measured span on any machine.
    asked = time.monotonic()
    connection.request("GET", "/health")
    response = connection.getresponse()
    response.read()
    assert response.status == 200 and response.getheader("Connection") != "close"  # kept alive
    assert closed_by_server(connection.sock)
    assert time.monotonic() - asked >= KEEP_ALIVE
    connection.close()


def test_a_kept_alive_connection_carries_several_requests(served):
    connection = http.client.HTTPConnection(*served.address, timeout=30)
    for _ in range(3):
        connection.request("GET", "/v1/models")
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["data"][0]["id"] == served.model
    connection.close()


def test_a_body_that_does_not_arrive_is_answered_408(served):
    connection = socket.create_connection(served.address, timeout=60)
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"model\": ")
    reply = b""
    while chunk := connection.recv(4096):  # the server answers, then closes
        reply += chunk
    connection.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert "did not arrive" in json.loads(body)["error"]["message"]


def test_connections_beyond_the_limit_are_answered_503_and_those_within_it_go_on(tiny_models, tmp_path):
    server = Served(tiny_models["f32"].gguf, tmp_path, "--max-connections", "4")
    try:
        kept = http.client.HTTPConnection(*server.address, timeout=30)  # within the limit, kept alive
        kept.request("GET", "/v1/models")
        assert kept.getresponse().read() and kept.sock is not None
        held = half_open(server.address, 3)  # four open now: the limit
        try:
            connection = http.client.HTTPConnection(*server.address, timeout=30)
            connection.request("GET", "/v1/models")
            response = connection.getresponse()
            body = json.loads(response.read())
            assert response.status == 503 and response.getheader("Retry-After")
            assert response.getheader("Connection") == "close"
            assert "--max-connections" in body["error"]["message"] and body["error"]["code"] == "overloaded"
            connection.close()
            kept.request("GET", "/v1/models")  # a connection within the limit is still served
            assert kept.getresponse().status == 200
        finally:
            for connection in held:
                connection.close()
            kept.close()
        deadline = time.monotonic() + 30  # the server hears of the closes asynchronously
        while (status := server.raw("GET", "/v1/models")[0]) == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200
    finally:
        assert server.stop() == 0


def test_an_answer_given_before_the_body_arrived_reads_it_away_or_closes(served):
    # a whole body the route never reads: read away, and the connection carries the next request
    connection = http.client.HTTPConnection(*served.address, timeout=30)
    connection.request("POST", "/v1/nowhere", body=b"x" * 5000)
    response = connection.getresponse()
    assert response.status == 404 and response.getheader("Connection") != "close"
    response.read()
    connection.request("GET", "/v1/models")
    assert connection.getresponse().status == 200
    connection.close()
    # a body that never comes: answered, then the connection closed (what still arrives is not a request)
    raw = socket.create_connection(served.address, timeout=60)
    raw.sendall(b"POST /v1/nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly some")
    reply = b""
    while chunk := raw.recv(4096):
        reply += chunk
    raw.close()
    assert reply.startswith(b"HTTP/1.1 404") and b"connection: close" in reply.lower()


def test_a_route_asked_with_the_wrong_method_is_a_405_naming_the_right_one(served):
    status, data = served.raw("DELETE", "/v1/chat/completions")
    assert status == 405 and "takes POST" in json.loads(data)["error"]["message"]


def test_sigterm_right_after_the_serving_line_is_a_clean_stop(tiny_models, tmp_path):
    server = Served(tiny_models["f32"].gguf, tmp_path)
    assert server.stop() == 0
    assert "superfluid: stopped" in server.process.stdout.read()


def test_a_client_that_leaves_before_a_whole_reply_frees_its_lane(served):
    connection = socket.create_connection(served.address, timeout=30)
    body = json.dumps({"model": served.model, "prompt": "Go on", "max_tokens": 100_000, "ignore_eos": True}).encode()
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while not served.metric("generating") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.metric("generating") == 1
    connection.close()  # a non-streamed request: no write would fail, the server must notice the close
    deadline = time.monotonic() + 30
    while served.metric("generating") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.metric("generating") == 0
    deadline = time.monotonic() + 30  # its log line is written once the handler has finished
    while " 499 " not in served.stderr() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "'/v1/completions' 499" in served.stderr()
