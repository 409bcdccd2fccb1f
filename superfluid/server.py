"""`superfluid serve`: the Host behind a minimal OpenAI-compatible HTTP server on loopback.

One thread per connection (the standard library's ThreadingHTTPServer); each request is a Host
session, so requests that share a prompt prefix share its KV through the pool, and requests
decode together in the scheduler's packed steps. A streamed response is server-sent events; a
client that goes away mid-stream cancels its generation, which frees its lane at once.

    GET  /health                     no auth
    GET  /metrics                    Prometheus text
    GET  /v1/models
    POST /v1/chat/completions        stream or not; usage with prompt_tokens_details.cached_tokens
    POST /v1/completions
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from superfluid import api, logprobs, responses
from superfluid.errors import GenerationTimeout, HostClosed, SessionNotFound
from superfluid.commands import OneShot
from superfluid.host import Host
from superfluid.metrics import CONTENT_TYPE, Metrics

MAX_BODY = 1 << 20  # bytes of request body
DRAIN_LIMIT = 16 << 20  # an oversized body up to this is read away before the 413; a larger one is cut off
DEFAULT_MAX_TOKENS = 256
# Routes by method: path pattern (a session id is *) -> the Handler method that answers it. The
# metrics' route label is one of these patterns, or "other".
ROUTES = {
    "GET": {"/health": "_health", "/metrics": "_metrics", "/v1/models": "_models", "/v1/sessions": "_session_list",
            "/v1/sessions/*": "_session_info"},
    "POST": {"/v1/chat/completions": "_chat", "/v1/completions": "_completions", "/v1/sessions": "_session_create",
             "/v1/sessions/*/messages": "_session_messages", "/v1/sessions/*/generate": "_session_generate",
             "/v1/sessions/*/fork": "_session_fork"},
    "DELETE": {"/v1/sessions/*": "_session_delete"},
}
REQUESTS = logging.getLogger("superfluid.requests")
FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "timeout": "length", "closed": "stop"}


class Server(ThreadingHTTPServer):
    """The HTTP server around one Host. `stop()` ends it gracefully: no new requests, idle
    keep-alive connections closed, running generations ended by the host's close (their streams
    finish with [DONE]), and every request thread joined."""

    daemon_threads = False  # server_close() joins them: a stream in flight is finished, not cut
    # Connections waiting to be accepted: the standard library's 5 overflows when a burst of
    # clients connects at once, and the kernel then drops or resets some of their connections.
    request_queue_size = 128
    block_on_close = True

    def __init__(self, host: Host, address: tuple[str, int], *, api_key: str | None = None,
                 model_name: str | None = None) -> None:
        """Serve `host` on `address` ("127.0.0.1", port); port 0 picks a free one."""
        self.host = host
        self.api_key = api_key or None
        self.model_name = model_name or "superfluid"
        self.metrics = Metrics(frozenset(route for table in ROUTES.values() for route in table))
        self.metrics.watch(lambda: self.host.stats())  # read at each scrape (the host may come after the bind)
        self.started = time.time()
        self.stopping = False
        self._connections: dict = {}  # socket -> idle (waiting for a request on a kept-alive connection)
        self._connections_lock = threading.Lock()
        super().__init__(address, Handler)

    def mark(self, connection, idle: bool | None) -> None:
        """Track a connection as idle or busy (None: gone)."""
        with self._connections_lock:
            if idle is None:
                self._connections.pop(connection, None)
            else:
                self._connections[connection] = idle

    def stop(self) -> None:
        """Stop accepting, then close the connections that wait idle for their next request."""
        self.stopping = True
        self.shutdown()
        with self._connections_lock:
            idle = [connection for connection, waiting in self._connections.items() if waiting]
        for connection in idle:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed meanwhile

    @property
    def url(self) -> str:
        """The base URL of the OpenAI API here (…/v1)."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


class Handler(BaseHTTPRequestHandler):
    """One request: auth, route, decode, answer (errors as OpenAI-style bodies)."""

    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the standard library's name
        """Log nothing: a quiet server (/metrics counts the requests)."""

    def setup(self) -> None:
        """A new connection: idle until its first request line arrives."""
        super().setup()
        self.server.mark(self.connection, idle=True)

    def finish(self) -> None:
        """The connection is done: stop tracking it."""
        self.server.mark(self.connection, idle=None)
        super().finish()

    def parse_request(self) -> bool:
        """A request line arrived: the connection is busy until it is answered."""
        self.server.mark(self.connection, idle=False)  # a request line arrived: busy until answered
        return super().parse_request()

    def handle_one_request(self) -> None:
        """Answer one request; once the server is stopping, no next one on this connection."""
        super().handle_one_request()
        if self.server.stopping:
            self.close_connection = True  # no next request on this connection
        self.server.mark(self.connection, idle=True)

    # ----------------------------------------------------------------------------- dispatch

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        """GET routes."""
        self._dispatch(ROUTES["GET"])

    def do_POST(self) -> None:  # noqa: N802
        """POST routes."""
        self._dispatch(ROUTES["POST"])

    def do_DELETE(self) -> None:  # noqa: N802
        """DELETE routes."""
        self._dispatch(ROUTES["DELETE"])

    def _dispatch(self, routes: dict[str, str]) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        parts = path.split("/")
        self.session_id = parts[3] if len(parts) > 3 and parts[:3] == ["", "v1", "sessions"] else None
        route = "/".join(parts[:3] + ["*"] + parts[4:]) if self.session_id is not None else path
        status = 500
        started = self.arrived = time.perf_counter()  # first-token and latency clocks start here
        self.responded = False  # once a status line went out, an error may not write another
        try:
            handler = routes.get(route)
            if handler is None:
                raise api.ApiError(404, f"no route {self.command} {route}", kind="not_found_error")
            handler = getattr(self, handler)
            if route != "/health":
                self._authorize()
            status = handler() or 200
        except (BrokenPipeError, ConnectionResetError):
            status = 499  # the client went away
        except Exception as exc:  # noqa: BLE001 - every error is answered, and the server goes on
            status, body, headers = responses.error_response(exc)
            if self.responded:  # too late for a status: the connection ends instead
                self.close_connection = True
            else:
                self._json(status, body, headers)
        finally:
            self.server.metrics.count(route, status)
            # one line per request (the path as repr: a hostile one cannot forge log lines)
            REQUESTS.info("%s %s %r %d %.0f ms", self.client_address[0], self.command, self.path[:200], status,
                          (time.perf_counter() - started) * 1000)

    def send_response(self, code: int, message: str | None = None) -> None:
        """The status line (and the note that one went out)."""
        self.responded = True
        super().send_response(code, message)

    def _authorize(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        token = given[7:] if given.startswith("Bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise api.ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                               kind="authentication_error", code="invalid_api_key")

    def _body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise api.ApiError(400, "Content-Length is not a number") from None
        if length > MAX_BODY:
            if length <= DRAIN_LIMIT:  # read it away, so the client sees the answer rather than a reset
                for _ in range(0, length, 1 << 16):
                    self.rfile.read(min(1 << 16, length))
                    length -= 1 << 16
            self.close_connection = True  # whatever is unread must not be taken for the next request
            raise api.ApiError(413, f"request body of {self.headers.get('Content-Length')} bytes is over the limit of "
                               f"{MAX_BODY}")
        return self.rfile.read(length)

    # ----------------------------------------------------------------------------- writing

    def _json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _events(self, chunks: Iterator[dict]) -> None:
        """Server-sent events, one JSON chunk each, then [DONE] (chunked transfer). An error after
        the stream began goes out as an error event (OpenAI's clients raise it as an API error),
        then [DONE]: never as a second response inside the first."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for chunk in chunks:
                self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:  # noqa: BLE001 - whatever it is, the client must hear of it in the stream
            self._chunk(f"data: {json.dumps(responses.error_event(exc))}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    # ----------------------------------------------------------------------------- routes

    def _health(self) -> None:
        stats = self.server.host.stats()
        self._json(200, {"status": "ok", "model": self.server.model_name, "runtime": self.server.host.runtime,
                         "kv": responses.kv_summary(stats), "generating": stats.generating, "waiting": stats.waiting})

    def _models(self) -> None:
        self._json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                     "created": int(self.server.started), "owned_by": "superfluid"}]})

    def _metrics(self) -> None:
        data = self.server.metrics.exposition()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _check_model(self, model: str) -> None:
        if model != self.server.model_name:
            raise api.ApiError(404, f"the model `{model}` does not exist here; this server serves "
                               f"`{self.server.model_name}` (GET /v1/models)", param="model", kind="not_found_error",
                               code="model_not_found")

    def _chat(self) -> None:
        request = api.decode(self._body(), api.ChatRequest)
        self._check_model(request.model)
        api.refuse_unsupported(request)
        if not request.messages:
            raise api.ApiError(400, "`messages` must hold at least one message", param="messages")
        messages = tuple(("system" if m.role == "developer" else m.role, api.text_of(m)) for m in request.messages)
        self._one_shot(request, request.max_completion_tokens or request.max_tokens, chat=True, messages=messages)

    def _completions(self) -> None:
        request = api.decode(self._body(), api.CompletionRequest)
        self._check_model(request.model)
        api.refuse_unsupported(request)
        if not isinstance(request.prompt, str):
            if len(request.prompt) != 1:
                raise api.ApiError(400, "`prompt` must be one string (a list of several would mean several choices)",
                                   param="prompt")
            request.prompt = request.prompt[0]
        self._one_shot(request, request.max_tokens, chat=False, text=request.prompt)

    def _one_shot(self, request, max_tokens: int | None, *, chat: bool, messages: tuple = (),
                  text: str | None = None) -> None:
        """A request's own session: opened, filled and started in one scheduler command (a busy
        engine answers commands between steps, so one wait instead of one per message), answered,
        then retired into the pool for later requests with the same prefix."""
        host = self.server.host
        one_shot = OneShot(api.sampling_of(request), messages, text, _max_tokens(max_tokens),
                           tuple(api.stops_of(request)), request.ignore_eos, request.priority,
                           api.logprobs_of(request, chat=chat))
        session_id, generation = host.call(host.commands.start_one_shot, one_shot)
        try:
            self._answer(generation, request, chat)
        finally:
            try:
                host.retire(session_id)
            except (HostClosed, SessionNotFound):
                pass  # the host closed under it (its close parked the lane), or a client deleted it

    # ----------------------------------------------------------------------------- session routes

    def _session_json(self, status: int, session_id: str) -> None:
        info = self.server.host.session(id=session_id).info()
        self._json(status, {"id": info.id, "object": "session", "tokens": info.tokens, "messages": info.messages,
                            "priority": info.priority, "created": int(info.created), "parent": info.parent,
                            "generating": info.generating})

    def _append(self, session, messages: list) -> None:
        for message in messages:
            role = "system" if message.role == "developer" else message.role
            session.append_message(role, api.text_of(message))

    def _session_create(self) -> int:
        request = api.decode(self._body(), api.SessionCreate)
        session = self.server.host.session(system=request.system, priority=request.priority,
                                           **api.sampling_of(request))
        self._append(session, request.messages)
        self._session_json(201, session.id)
        return 201

    def _session_list(self) -> None:
        self._json(200, {"object": "list", "data": [{"id": i.id, "object": "session", "tokens": i.tokens,
                                                     "messages": i.messages, "parent": i.parent}
                                                    for i in self.server.host.sessions()]})

    def _session_info(self) -> None:
        self._session_json(200, self.session_id)

    def _session_messages(self) -> None:
        request = api.decode(self._body(), api.SessionMessages)
        self._append(self.server.host.session(id=self.session_id), request.messages)
        self._session_json(200, self.session_id)

    def _session_generate(self) -> None:
        request = api.decode(self._body(), api.SessionGenerate)
        session = self.server.host.session(id=self.session_id)
        generation = session.generate(max_tokens=_max_tokens(request.max_tokens), stop=api.stops_of(request),
                                      ignore_eos=request.ignore_eos, priority=request.priority,
                                      logprobs=api.logprobs_of(request, chat=True), **api.sampling_of(request))
        self._answer(generation, request, chat=True)

    def _session_fork(self) -> int:
        child = self.server.host.session(id=self.session_id).fork()
        self._session_json(201, child.id)
        return 201

    def _session_delete(self) -> None:
        self.server.host.delete(self.session_id)
        self._json(200, {"id": self.session_id, "object": "session", "deleted": True})

    # ----------------------------------------------------------------------------- generating

    def _answer(self, generation, request, chat: bool) -> None:
        """Answer with `generation`: one JSON body, or server-sent events."""
        started = self.arrived
        pieces = self._timed(iter(generation), started)
        try:
            # The status goes out with the first piece: a generation refused while it waited
            # (Overloaded, ContextFull) is answered with its own status, not inside a 200.
            first = next(pieces, None)
        except GenerationTimeout:
            first = None  # nothing produced in time: answered with finish_reason "length"
        except BaseException:
            generation.cancel()
            raise
        try:
            self._respond(generation, first, pieces, request, chat)
        finally:
            if first is not None:
                self.server.metrics.latency(time.perf_counter() - started)

    def _timed(self, pieces: Iterator, started: float) -> Iterator:
        """`pieces`, observing the time to the first token and between output tokens."""
        last = None
        for piece in pieces:
            if piece.token >= 0:  # a new token (-1: held-back text at the end)
                now = time.perf_counter()
                if last is None:
                    self.server.metrics.first_token(now - started)
                else:
                    self.server.metrics.output_token(now - last)
                last = now
            yield piece

    def _respond(self, generation, first, pieces: Iterator, request, chat: bool) -> None:
        """The answer after its first piece: one JSON body, or server-sent events."""
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        base = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.server.model_name}
        if request.stream:
            self._stream(generation, first, pieces, base, chat, request)
            return
        scored = [first.logprobs] if first is not None and first.logprobs is not None else []
        try:
            for piece in pieces:
                if piece.logprobs is not None:
                    scored.append(piece.logprobs)
        except GenerationTimeout:
            pass  # what it produced is answered (its logprobs too), with finish_reason "length"
        text = generation.text
        reason = FINISH.get(generation.finish_reason or "stop", "stop")
        wanted = api.logprobs_of(request, chat=chat) is not None
        shown = (logprobs.chat(scored) if chat else logprobs.completion(scored)) if wanted else None
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                   "logprobs": shown} if chat else
                  {"index": 0, "text": text, "finish_reason": reason, "logprobs": shown})
        self._json(200, {**base, "choices": [choice], "usage": responses.usage(generation)})

    def _stream(self, generation, first, pieces: Iterator, base: dict, chat: bool, request) -> None:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        kind = "chat.completion.chunk" if chat else "text_completion"

        wanted = api.logprobs_of(request, chat=chat) is not None
        sent = 0  # characters streamed so far (completions' text offsets)

        def every_piece() -> Iterator:
            if first is not None:
                yield first
            try:
                yield from pieces
            except GenerationTimeout:
                pass  # what it produced was streamed; it ends with finish_reason "length"

        def shown(scored: list) -> dict:
            # a token's logprobs go out with the first chunk that carries its text (or the last)
            if not wanted:
                return {}
            return {"logprobs": logprobs.chat(scored) if chat else logprobs.completion(scored, sent)}

        def chunks() -> Iterator[dict]:
            nonlocal sent
            if chat:
                yield {**base, "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                             "finish_reason": None}]}
            pending = []
            for piece in every_piece():
                if piece.logprobs is not None:
                    pending.append(piece.logprobs)
                if piece.text:
                    delta = {"delta": {"content": piece.text}} if chat else {"text": piece.text}
                    yield {**base, "object": kind, "choices": [{"index": 0, **delta, **shown(pending),
                                                                 "finish_reason": None}]}
                    sent, pending = sent + len(piece.text), []
            reason = FINISH.get(generation.finish_reason or "stop", "stop")
            last = {"delta": {}} if chat else {"text": ""}
            yield {**base, "object": kind, "choices": [{"index": 0, **last, **(shown(pending) if pending else {}),
                                                         "finish_reason": reason}]}
            if include_usage:
                yield {**base, "object": kind, "choices": [], "usage": responses.usage(generation)}

        try:
            self._events(chunks())
        except (BrokenPipeError, ConnectionResetError):
            generation.cancel()  # the client went away: free its lane now
            raise


def _max_tokens(value: int | None) -> int:
    """A request's max_tokens (the default when absent); ApiError below 1."""
    value = DEFAULT_MAX_TOKENS if value is None else value
    if value < 1:
        raise api.ApiError(400, "`max_tokens` must be at least 1", param="max_tokens")
    return value


def model_name_of(path: str | Path) -> str:
    """The id /v1/models shows for a model file or directory: its name without the suffix."""
    path = Path(path)
    return path.stem if path.is_file() else path.name

