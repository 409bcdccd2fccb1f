"""The OpenAI-compatible HTTP API as an ASGI application around one Host.

Nothing here blocks the event loop: a host call is queued on the scheduler thread and its future
awaited, and a generation is read with `async for`, woken by the scheduler as each token is
committed. So a thousand open connections cost a thousand small objects on one loop, not a
thousand threads.

    GET  /health                     no auth
    GET  /metrics                    Prometheus text
    GET  /v1/models
    POST /v1/chat/completions        stream or not; usage with prompt_tokens_details.cached_tokens
    POST /v1/completions
    POST /v1/sessions …              sessions that outlive a request (docs/server.md)
    GET  /server_info, /model_info, /get_load    what a router asks a worker (superfluid/http/worker.py)
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from superfluid import __version__
from superfluid.host import sampling as sampler
from superfluid.host.errors import HostClosed, SessionNotFound
from superfluid.host.interruption import Arrival
from superfluid.host.messages import ChatMessage
from superfluid.host.request import GenerateRequest, Priority, Prompt
from superfluid.host.session import LIVENESS_SECONDS
from superfluid.host.tenants import UNNAMED
from superfluid.host.tools import FREE_CHOICES, ToolUse
from superfluid.http import api, builders, completions, responses, worker
from superfluid.http.connections import ABORT, OVER_CAPACITY
from superfluid.http.keys import ApiKeys
from superfluid.http.metrics import CONTENT_TYPE, Metrics

MAX_BODY = 1 << 20  # bytes of request body
DRAIN_LIMIT = 16 << 20  # an unread body up to this is read away before the answer; a larger one is cut off
# Routes by method: path pattern (a session id is *) -> the App method that answers it. The
# metrics' route label is one of these patterns, or "other".
ROUTES = {
    "GET": {"/health": "_health", "/metrics": "_metrics", "/v1/models": "_models", "/v1/sessions": "_session_list",
            "/v1/sessions/*": "_session_info", "/server_info": "_server_info", "/model_info": "_model_info",
            "/get_load": "_load"},
    "POST": {"/v1/chat/completions": "_chat", "/v1/completions": "_completions", "/v1/sessions": "_session_create",
             "/v1/sessions/*/messages": "_session_messages", "/v1/sessions/*/generate": "_session_generate",
             "/v1/sessions/*/fork": "_session_fork"},
    "DELETE": {"/v1/sessions/*": "_session_delete"},
}
REQUESTS = logging.getLogger("superfluid.requests")
BODY_DISCARD_SECONDS = 5.0  # a body answered without being read (an error, a route that takes none) is read away this long


class ClientStalled(ConnectionError):
    """A response could not be sent within the send deadline: its client stopped reading."""


class Exchange:
    """One request and its response: the ASGI receive and send, with what was sent so far."""

    def __init__(self, scope: dict, receive: Callable, send: Callable, worker_name: str | None = None,
                 send_timeout: float | None = None, on_stall: Callable[[], None] = lambda: None) -> None:
        """The request `scope` uvicorn parsed, and its receive and send callables; `worker_name`
        goes out on every response (worker.HEADER) when given; a write that cannot go out within
        `send_timeout` seconds cuts the connection and calls `on_stall` (None: no deadline)."""
        self.method: str = scope["method"]
        self.target = scope["raw_path"].decode("latin-1") + (f"?{scope['query_string'].decode('latin-1')}"
                                                             if scope["query_string"] else "")
        self.headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        self.client = (scope.get("client") or ("-", 0))[0]
        self.over_capacity = bool(scope.get("state", {}).get(OVER_CAPACITY))
        self._abort = scope.get("state", {}).get(ABORT)  # cuts the connection (connections.py)
        self.send_timeout, self._on_stall = send_timeout, on_stall
        self._sending_since: float | None = None  # when the write in progress began (loop time)
        self._send_watch: asyncio.TimerHandle | None = None  # the send deadline's timer, while armed
        self._writer: asyncio.Task | None = None  # the task writing the response
        self._stalled = False  # the send deadline passed: the response is given up
        self._cancelled_writer = False  # ...and the writer was cancelled (no way to cut the connection)
        self.arrived = time.perf_counter()  # first-token and latency clocks start here
        self.receive, self._send = receive, send
        self.worker_headers = {worker.HEADER: worker_name} if worker_name else {}
        # h11 has checked the framing: a body is declared by a length or by chunked encoding
        self.consumed = int(self.headers.get("content-length", "0")) == 0 and "transfer-encoding" not in self.headers
        self.responded = False  # a status went out: an error may not send another
        self.close = False  # answer with Connection: close (the connection cannot carry another request)
        self.gone = False  # the client went away
        self.finished = False  # the response is complete
        self.tenant: str | None = None  # whose request it is, once its key was checked (tenants.py)

    async def body(self, limit: int, timeout: float) -> bytes:
        """The request body (ApiError 413 over `limit` bytes, 408 when it is not all in within
        `timeout` seconds)."""
        try:
            return await asyncio.wait_for(self._read(limit), timeout)
        except TimeoutError:
            self.close = True  # the rest may still come: it must not be taken for the next request
            raise api.ApiError(408, f"the request body did not arrive within {timeout:g} s",
                               code="request_timeout") from None

    async def _read(self, limit: int) -> bytes:
        declared = self.headers.get("content-length")
        if declared is not None and int(declared) > limit:  # read away (or cut off) when the 413 starts
            raise api.ApiError(413, f"request body of {declared} bytes is over the limit of {limit}")
        chunks, size = [], 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                raise ConnectionResetError("the client went away while sending its request")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise api.ApiError(413, f"request body of over {limit} bytes is over the limit of {limit}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                self.consumed = True
                return b"".join(chunks)

    async def _discard(self, timeout: float) -> None:
        """Read away a body nobody needs before answering (a client still sending it would see
        a reset instead of the answer), up to DRAIN_LIMIT bytes; else the connection closes."""
        declared = int(self.headers.get("content-length", "-1"))
        if "100-continue" in self.headers.get("expect", "").lower() or declared > DRAIN_LIMIT:
            self.close = True  # not sent yet (it waits for our go-ahead), or too much to read
            return
        try:
            async with asyncio.timeout(timeout):
                size = 0
                while size <= DRAIN_LIMIT:
                    message = await self.receive()
                    if message["type"] == "http.disconnect":
                        self.gone = True
                        return
                    size += len(message.get("body", b""))
                    if not message.get("more_body", False):
                        self.consumed = True
                        return
        except TimeoutError:
            pass
        self.close = True

    async def start(self, status: int, headers: dict[str, str]) -> None:
        """The status line and headers (after reading away a request body nobody read)."""
        if not self.consumed and not self.close:
            await self._discard(BODY_DISCARD_SECONDS)
        self.responded = True
        headers = {**self.worker_headers, **headers}
        if self.close or not self.consumed:
            headers = {**headers, "Connection": "close"}
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [(name.lower().encode(), value.encode()) for name, value in headers.items()]})

    async def write(self, data: bytes, *, more: bool) -> None:
        """Body bytes; `more=False` ends the response. ClientStalled when they cannot go out within
        the send deadline (the client reads nothing): the connection is cut (serve's protocol puts
        the way to cut it in the scope; elsewhere the write is cancelled instead), and the
        disconnect watcher cancels the generation; nothing is written after that."""
        if self.gone:
            return
        message = {"type": "http.response.body", "body": data, "more_body": more}
        if self.send_timeout is None:
            await self._send(message)
        else:
            loop = asyncio.get_running_loop()
            self._sending_since = loop.time()
            if self._send_watch is None:
                self._writer = asyncio.current_task()
                self._send_watch = loop.call_at(self._sending_since + self.send_timeout, self._check_send)
            try:
                await self._send(message)
            except asyncio.CancelledError:
                if not self._cancelled_writer:
                    raise
                self._cancelled_writer = False
                if self._writer.uncancel() > 0:
                    raise  # cancelled from outside too: that cancellation goes on
            finally:
                self._sending_since = None
            if self._stalled:
                await asyncio.sleep(0)  # the connection's loss is handled before the response is given up
                raise ClientStalled(f"the client read nothing for {self.send_timeout:g} s (serve's --send-timeout)")
        self.finished = self.finished or not more

    def done(self) -> None:
        """The request is answered (or given up): the send deadline's timer goes with it."""
        if self._send_watch is not None:
            self._send_watch.cancel()
            self._send_watch = None

    def _check_send(self) -> None:
        # The send deadline's timer: one armed at a time by a write, not one a write (a streamed
        # token's write is on the path of every token; almost all go out at once). A write still
        # waiting `send_timeout` after it began cuts the connection, which ends the wait (uvicorn
        # resumes a send waiting to drain when its connection is lost).
        self._send_watch = None
        began = self._sending_since
        if began is None:
            return  # no write waits: the next one arms the timer again
        loop = asyncio.get_running_loop()
        if loop.time() < began + self.send_timeout:
            self._send_watch = loop.call_at(began + self.send_timeout, self._check_send)
            return
        self._stalled = self.gone = True
        try:
            if self._abort is not None:
                self._abort()  # a close would wait for the client to read what is buffered: forever
            else:
                self._cancelled_writer = True
                self._writer.cancel()
        finally:
            self._on_stall()

    async def json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        """A whole JSON response."""
        data = json.dumps(payload).encode()
        await self.start(status, {**(headers or {}), "Content-Type": "application/json",
                                  "Content-Length": str(len(data))})
        await self.write(data, more=False)

    async def watch_disconnect(self, on_gone: Callable[[], None]) -> None:
        """Wait (as a task) until the client goes away, then call `on_gone` (after the response
        is complete the wait ends without calling it)."""
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                break
        if not self.finished:
            self.gone = True
            on_gone()


class App:
    """The ASGI application: auth, routing, request decoding and OpenAI-style answers."""

    def __init__(self, host, *, keys: ApiKeys | None, model_name: str, metrics: Metrics, allow_priority: bool = False,
                 max_connections: int, body_timeout: float, send_timeout: float = 60.0,
                 worker_name: str | None = None) -> None:
        """`keys`: the API keys and the tenant each names (None: no key needed, every request the
        unnamed tenant's); `max_connections`: the cap the 503 for a connection beyond it names; `body_timeout`:
        seconds a request body may take to arrive; `send_timeout`: seconds a response may wait for
        its client to read; `worker_name`: this server's name among workers behind a router (it
        heads the ids of the sessions it creates; worker.py)."""
        self.host = host
        self.keys = keys
        self.allow_priority = allow_priority  # honour priority "interactive" (it preempts other clients)
        self.model_name = model_name
        self.metrics = metrics
        self.max_connections = max_connections
        self.body_timeout = body_timeout
        self.send_timeout = send_timeout
        self.worker_name = worker_name  # checked where it is given (serve's flag, Server)
        self.started = time.time()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """ASGI: answer one HTTP request."""
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        exchange = Exchange(scope, receive, send, self.worker_name, self.send_timeout, self.metrics.stalled)
        path = scope["path"].rstrip("/") or "/"
        parts = path.split("/")
        session_id = parts[3] if len(parts) > 3 and parts[:3] == ["", "v1", "sessions"] else None
        route = "/".join(parts[:3] + ["*"] + parts[4:]) if session_id is not None else path
        status = 500
        try:
            if exchange.over_capacity:
                exchange.close = True
                raise api.ApiError(503, f"the server holds {self.max_connections} connections, its limit; retry "
                                   "shortly (serve's --max-connections)", kind="server_error", code="overloaded")
            handler = ROUTES.get(exchange.method, {}).get(route)
            if handler is None:
                allowed = [method for method, table in ROUTES.items() if route in table]
                if allowed:
                    raise api.ApiError(405, f"{route} takes {' or '.join(allowed)}, not {exchange.method}",
                                       kind="invalid_request_error")
                raise api.ApiError(404, f"no route {exchange.method} {route}", kind="not_found_error")
            if route != "/health":
                exchange.tenant = self._authorize(exchange)
            status = await getattr(self, handler)(exchange, session_id) or 200
        except Exception as exc:  # noqa: BLE001 - every error is answered, and the server goes on
            if isinstance(exc, SessionNotFound) and session_id is not None:
                exc = worker.misdirected(session_id, self.worker_name) or exc
            status, body, headers = responses.error_response(exc)
            if exchange.gone or isinstance(exc, ConnectionResetError):
                status = 499  # the client went away: nobody to answer
            elif exchange.responded:
                pass  # too late for a status: returning unfinished makes uvicorn cut the connection
            else:
                if status == 503:
                    headers = {"Retry-After": "1", **(headers or {})}
                await exchange.json(status, body, headers)
        finally:
            exchange.done()
            if exchange.gone:
                status = 499
            self.metrics.count(route, status, exchange.tenant)
            # one line per request (the path as repr: a hostile one cannot forge log lines)
            REQUESTS.info("%s %s %r %d %.0f ms", exchange.client, exchange.method, exchange.target[:200], status,
                          (time.perf_counter() - exchange.arrived) * 1000)

    def _authorize(self, exchange: Exchange) -> str:
        """The tenant whose key the request carries; ApiError 401 without a key this server knows."""
        if self.keys is None:
            return UNNAMED
        given = exchange.headers.get("authorization", "")
        tenant = self.keys.tenant_of(given[7:]) if given.startswith("Bearer ") else None
        if tenant is None:
            raise api.ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                               kind="authentication_error", code="invalid_api_key")
        return tenant

    async def call(self, command: Callable, *args: Any, arrival: Arrival | None = None, **keywords: Any) -> Any:
        """Run `command(*args, **keywords)` on the scheduler thread and await its result, never
        blocking the loop (HostClosed if the scheduler stops before answering). `arrival`: the
        command starts a request that may stop the step in flight (Host.call)."""
        future = asyncio.wrap_future(self.host.submit(command, *args, arrival=arrival, **keywords))
        while True:
            done, _ = await asyncio.wait({future}, timeout=LIVENESS_SECONDS)
            if done:
                return future.result()
            if not self.host.alive():
                future.cancel()
                raise HostClosed("the host's scheduler stopped before answering")

    async def _decoded(self, exchange: Exchange, kind: type) -> Any:
        return api.decode(await exchange.body(MAX_BODY, self.body_timeout), kind)

    # ----------------------------------------------------------------------------- routes

    async def _health(self, exchange: Exchange, _: None) -> None:
        stats = self.host.published_stats()
        await exchange.json(200, {"status": "ok", "model": self.model_name, "runtime": self.host.runtime,
                                  "kv": responses.kv_summary(stats), "generating": stats.generating,
                                  "waiting": stats.waiting})

    async def _models(self, exchange: Exchange, _: None) -> None:
        await exchange.json(200, {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "created": int(self.started),
                                                              "owned_by": "superfluid"}]})

    async def _metrics(self, exchange: Exchange, _: None) -> None:
        data = self.metrics.exposition(self.host.published_stats(), exchange.tenant, self.host.grammars)
        await exchange.start(200, {"Content-Type": CONTENT_TYPE, "Content-Length": str(len(data))})
        await exchange.write(data, more=False)

    async def _server_info(self, exchange: Exchange, _: None) -> None:
        stats = self.host.published_stats()
        await exchange.json(200, worker.server_info(self.model_name, __version__, stats))

    async def _model_info(self, exchange: Exchange, _: None) -> None:
        await exchange.json(200, worker.model_info(self.host.runtime))

    async def _load(self, exchange: Exchange, _: None) -> None:
        await exchange.json(200, worker.load(self.host.published_stats()))

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise api.ApiError(404, f"the model `{model}` does not exist here; this server serves "
                               f"`{self.model_name}` (GET /v1/models)", param="model", kind="not_found_error",
                               code="model_not_found")

    async def _chat(self, exchange: Exchange, _: None) -> None:
        body = await exchange.body(MAX_BODY, self.body_timeout)
        # decoding, checking, rendering and tokenizing cost as much as the request is long: on a
        # worker thread, so neither the event loop nor the scheduler thread waits for them
        await completions.one_shot(self, exchange, *await builders.build(self._chat_request, body, exchange.tenant),
                                   chat=True)

    def _chat_request(self, body: bytes, tenant: str) -> tuple:
        """On a worker thread: `tenant`'s chat request, its prompt built, and what it asks of the host."""
        request = api.decode(body, api.ChatRequest)
        self._check_model(request.model)
        api.refuse_unsupported(request)
        if not request.messages:
            raise api.ApiError(400, "`messages` must hold at least one message", param="messages")
        tools = api.tool_use_of(request, request.tools, self.host.tool_use)
        wanted = self._wanted(request, chat=True, tools=tools)
        messages = tuple(api.message_of(m) for m in request.messages)
        prompt = Prompt(messages, tools=None if tools is None else tools.tools)
        return request, self.host.prepare(prompt, tenant=tenant, cache_salt=request.cache_salt), wanted

    async def _completions(self, exchange: Exchange, _: None) -> None:
        body = await exchange.body(MAX_BODY, self.body_timeout)
        await completions.one_shot(self, exchange, *await builders.build(self._completion_request, body,
                                                                         exchange.tenant), chat=False)

    def _completion_request(self, body: bytes, tenant: str) -> tuple:
        """On a worker thread: `tenant`'s completion request, its prompt built, and what it asks of the host."""
        request = api.decode(body, api.CompletionRequest)
        self._check_model(request.model)
        api.refuse_unsupported(request)
        if not isinstance(request.prompt, str):
            if len(request.prompt) != 1:
                raise api.ApiError(400, "`prompt` must be one string (a list of several would mean several choices)",
                                   param="prompt")
            request.prompt = request.prompt[0]
        wanted = self._wanted(request, chat=False)
        return request, self.host.prepare(Prompt(text=request.prompt), tenant=tenant,
                                          cache_salt=request.cache_salt), wanted

    def _wanted(self, request, *, chat: bool, tools: ToolUse | None = None) -> GenerateRequest:
        """The host's request for an HTTP request (api.generate_request), its priority allowed and
        its constraint compiled (on a worker thread: a long schema, or the first one, which reads
        the model's whole vocabulary, must not hold up the event loop)."""
        self._check_priority(request.priority)
        return api.generate_request(request, chat=chat, compile=self.host.grammars.compile, tools=tools)

    def _check_priority(self, priority: str | None) -> None:
        """ApiError 400 for a class above default where the server does not honour it: any client
        could send it and preempt every other client's work."""
        if priority is not None and Priority.named(priority) < Priority.DEFAULT and not self.allow_priority:
            raise api.ApiError(400, f"`priority: {priority}` preempts other clients' work; this server does not "
                               "honour it (serve's --allow-priority); send default or background",
                               param="priority", code="priority_not_allowed")

    # ----------------------------------------------------------------------------- session routes

    async def _session_json(self, exchange: Exchange, status: int, info) -> None:
        await exchange.json(status, {"id": info.id, "object": "session", "tokens": info.tokens,
                                     "messages": info.messages, "priority": info.priority,
                                     "created": int(info.created), "parent": info.parent,
                                     "generating": info.generating})

    async def _session_create(self, exchange: Exchange, _: None) -> int:
        request = await self._decoded(exchange, api.SessionCreate)
        self._check_priority(request.priority)
        settings = sampler.Sampling(**api.sampling_of(request))
        # the system message appended with the others, rendered together where the template
        # cannot render it alone (Llama 3's, offered tools, wants the user message too)
        messages = ([ChatMessage("system", request.system)] if request.system is not None else []) + \
            [api.message_of(m) for m in request.messages]
        tenant = exchange.tenant
        session_id = await self.call(self.host.commands.create, worker.new_session_id(self.worker_name),
                                     None, settings, request.priority, tenant=tenant,
                                     cache_salt=request.cache_salt, tools=api.tools_of(request.tools))
        try:
            await self._append(session_id, messages, tenant)
        except BaseException:  # none of it if a message is refused
            await self.call(self.host.commands.delete, session_id, tenant=tenant)
            raise
        await self._session_json(exchange, 201, await self.call(self.host.commands.info, session_id, tenant=tenant))
        return 201

    async def _session_list(self, exchange: Exchange, _: None) -> None:
        listed = await self.call(self.host.commands.list, tenant=exchange.tenant)
        await exchange.json(200, {"object": "list", "data": [{"id": i.id, "object": "session", "tokens": i.tokens,
                                                              "messages": i.messages, "parent": i.parent}
                                                             for i in listed]})

    async def _session_info(self, exchange: Exchange, session_id: str) -> None:
        await self._session_json(exchange, 200, await self.call(self.host.commands.info, session_id,
                                                                tenant=exchange.tenant))

    async def _session_messages(self, exchange: Exchange, session_id: str) -> None:
        request = await self._decoded(exchange, api.SessionMessages)
        messages = [api.message_of(m) for m in request.messages]
        await self._append(session_id, messages, exchange.tenant)
        await self._session_json(exchange, 200, await self.call(self.host.commands.info, session_id,
                                                                tenant=exchange.tenant))

    async def _append(self, session_id: str, messages: list[ChatMessage], tenant: str) -> None:
        """Append `messages` to `tenant`'s session, rendered on a worker thread (Host.append_messages)."""
        if messages:
            await builders.build(functools.partial(self.host.append_messages, tenant=tenant), session_id, messages)

    async def _session_generate(self, exchange: Exchange, session_id: str) -> None:
        request = await self._decoded(exchange, api.SessionGenerate)
        if request.tools is not None:
            raise api.ApiError(400, "a session's tools are given when it is made (POST /v1/sessions with `tools`); "
                               "here, `tool_choice` and `parallel_tool_calls` say how this turn may call them",
                               param="tools")
        tools = None
        if request.tool_choice is not None or request.parallel_tool_calls is not None:
            offered = await self.call(self.host.commands.tools, session_id, tenant=exchange.tenant)
            if offered is None and request.tool_choice not in FREE_CHOICES:
                raise api.ApiError(400, f"session {session_id!r} offers no tools; give `tools` when making it",
                                   param="tool_choice")
            tools = api.tool_use_of(request, offered, self.host.tool_use)
        wanted = await builders.build(functools.partial(self._wanted, chat=True, tools=tools), request)
        generation = await self.call(self.host.commands.generate, session_id, wanted, tenant=exchange.tenant)
        await completions.answer(self, exchange, generation, request, chat=True)

    async def _session_fork(self, exchange: Exchange, session_id: str) -> int:
        commands, tenant = self.host.commands, exchange.tenant
        child_id = worker.new_session_id(self.worker_name)
        info = await self.call(lambda: commands.info(commands.fork(session_id, child_id, tenant=tenant), tenant=tenant))
        await self._session_json(exchange, 201, info)
        return 201

    async def _session_delete(self, exchange: Exchange, session_id: str) -> None:
        await self.call(self.host.commands.delete, session_id, tenant=exchange.tenant)
        await exchange.json(200, {"id": session_id, "object": "session", "deleted": True})

