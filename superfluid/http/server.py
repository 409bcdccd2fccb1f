"""`superfluid serve`'s HTTP server: the ASGI application (superfluid.http.app) on uvicorn, on a socket
bound before the model loads (a taken port costs no load).

What a careless or hostile client cannot do here:
- hold a connection without asking anything: a request head is due within `header_timeout`
  seconds of the connection opening or of its previous response (superfluid.http.connections), its
  body within `body_timeout`, and a kept-alive connection that sends nothing is closed after
  `keep_alive_timeout`;
- hold a lane by not reading: a response that cannot send for `send_timeout` seconds ends, its
  generation is cancelled (its lane freed) and its connection is cut;
- hold a thread: every connection is a few objects on one event loop; the threads are the
  loop's, the scheduler's and a few for the host's close;
- exhaust the process: beyond `max_connections` open connections a request is answered 503
  (Retry-After) and its connection closed.

Stopping (SIGTERM, SIGINT, or `stop()`) is graceful: no new connections, idle ones closed, then
the host closes, which ends running generations (their streams finish with [DONE]) and parks
their lanes, and the server waits for every response to finish. A second SIGINT cuts it short.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

from superfluid.http import worker
from superfluid.http.app import ROUTES, App
from superfluid.http.connections import ServerConfig
from superfluid.http.keys import ApiKeys, KeysError
from superfluid.http.metrics import Metrics

HEADER_TIMEOUT = 10.0  # seconds to send a whole request head
KEEP_ALIVE_TIMEOUT = 5.0  # seconds a kept-alive connection may sit idle (llama-server's and uvicorn's default)
BODY_TIMEOUT = 30.0  # seconds to send a whole request body (1 MiB at most)
# Seconds a response may wait for its client to read (the socket's buffers full): a stream whose
# client stopped reading would otherwise hold its lane, generating into the void, to max_tokens.
SEND_TIMEOUT = 60.0
MAX_CONNECTIONS = 2048  # open connections; beyond them a request is answered 503
# Connections waiting to be accepted: a burst of clients connecting at once overflows a short
# queue, and the kernel then drops or resets some of their connections.
BACKLOG = 1024
# Seconds a stop waits for responses after the host closed (their generations have ended by then;
# what is left is a client that does not read what it was sent): then their connections are cut.
STOP_TIMEOUT = 30.0
LOG = logging.getLogger(__name__)


class Server:
    """The HTTP server around one Host: bound at construction, serving in `run()`."""

    def __init__(self, host, address: tuple[str, int], *, api_key: str | None = None, keys: ApiKeys | None = None,
                 reload_keys: Callable[[], ApiKeys] | None = None, allow_priority: bool = False,
                 model_name: str | None = None,
                 max_connections: int = MAX_CONNECTIONS, header_timeout: float = HEADER_TIMEOUT,
                 keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT, body_timeout: float = BODY_TIMEOUT,
                 send_timeout: float = SEND_TIMEOUT, worker_name: str | None = None) -> None:
        """Bind `address` ("127.0.0.1", port; port 0 picks a free one) now; `host` may be set
        later (`server.host = Host(...)`), before `run()`. OSError if the address is taken.
        `worker_name`: this server's name among workers behind a router (superfluid/http/worker.py);
        `allow_priority`: honour `priority: "interactive"` (else it is refused: any client could
        send it and preempt the others). `api_key`: the one key every request must carry, or
        `keys`: the tenants' keys (superfluid/http/keys.py); neither: no key needed. `reload_keys`:
        reads them again, on SIGHUP (KeysError keeps those in use)."""
        if api_key is not None and keys is not None:
            raise ValueError("give api_key (one key) or keys (tenants' keys), not both")
        self.host = host
        self.keys = ApiKeys.single(api_key) if api_key else keys
        self.reload_keys = reload_keys
        self.allow_priority = allow_priority
        self.model_name = model_name or "superfluid"
        self.worker_name = worker.check_name(worker_name) if worker_name is not None else None
        self.max_connections = max_connections
        self.header_timeout, self.keep_alive_timeout, self.body_timeout = header_timeout, keep_alive_timeout, body_timeout
        self.send_timeout = send_timeout
        self.metrics = Metrics(frozenset(route for table in ROUTES.values() for route in table))
        family = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM)[0][0]
        self.socket = socket.create_server(address, family=family, backlog=BACKLOG)
        self._uvicorn: _Uvicorn | None = None
        self._stop_asked = False

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port)."""
        return self.socket.getsockname()[:2]

    @property
    def url(self) -> str:
        """The base URL of the OpenAI API here (…/v1)."""
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"

    def run(self, on_serving: Callable[[], None] = lambda: None) -> None:
        """Serve until `stop()`, SIGTERM or SIGINT (signals when called on the main thread), then
        stop gracefully (the host is closed on the way). `on_serving` is called once requests are
        answered and the signals are handled. Blocks."""
        app = App(self.host, keys=self.keys, allow_priority=self.allow_priority, model_name=self.model_name,
                  metrics=self.metrics,
                  max_connections=self.max_connections, body_timeout=self.body_timeout,
                  send_timeout=self.send_timeout, worker_name=self.worker_name)
        # proxy_headers off: uvicorn would otherwise take X-Forwarded-For from any loopback client
        # as the client's address (the request log's first field)
        config = ServerConfig(app, header_timeout=self.header_timeout, max_connections=self.max_connections,
                              timeout_keep_alive=self.keep_alive_timeout, timeout_graceful_shutdown=STOP_TIMEOUT,
                              lifespan="off", log_config=None, access_log=False, server_header=False,
                              proxy_headers=False, backlog=BACKLOG, ws="none")
        self._uvicorn = _Uvicorn(config, before_drain=self.host.close, on_serving=on_serving,
                                 on_hangup=None if self.reload_keys is None else lambda: self._reload(app))
        self._uvicorn.should_exit = self._stop_asked
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self.close()

    def _reload(self, app: App) -> None:
        """SIGHUP: the keys read again and in use from the next request; a file that cannot be
        used now keeps those in use (and says why)."""
        try:
            app.keys = self.keys = self.reload_keys()
        except KeysError as exc:
            LOG.warning("SIGHUP: the keys in use are kept: %s", exc)
            return
        LOG.info("SIGHUP: keys read again from %s: %d tenants", self.keys.source, len(self.keys.tenants))

    def stop(self) -> None:
        """Begin a graceful stop (safe from any thread or a signal handler; before `run()` too)."""
        self._stop_asked = True
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    def close(self) -> None:
        """Release the listening socket (a server that never ran, or after run)."""
        self.socket.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn's server that closes the host between refusing new work and waiting for the
    responses in flight, and that leaves the process's exit to its caller after a signal."""

    def __init__(self, config: uvicorn.Config, *, before_drain: Callable[[], None],
                 on_serving: Callable[[], None], on_hangup: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.before_drain, self.on_serving, self.on_hangup = before_drain, on_serving, on_hangup

    def handle_exit(self, sig: int, frame) -> None:
        """SIGTERM or SIGINT: stop gracefully; a second SIGINT: stop now. (uvicorn's own also
        raises the signal again once stopped, which would kill the process before serve says
        it stopped and returns 0.)"""
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def startup(self, sockets=None) -> None:
        """Start answering (signals are handled from here on), then say so."""
        await super().startup(sockets)
        if self.on_hangup is not None and threading.current_thread() is threading.main_thread():
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.on_hangup)
        if self.started:
            self.on_serving()

    async def shutdown(self, sockets=None) -> None:
        """Refuse new connections and close idle ones, close the host so that running
        generations end (their streams finish), then wait for their responses (uvicorn's
        shutdown, whose first steps are the same and find them done)."""
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle: closed now; busy: closed after its response
        try:
            await asyncio.to_thread(self.before_drain)
        except Exception:  # noqa: BLE001 - the responses in flight are still owed their ends
            LOG.exception("closing the host failed")
        await super().shutdown(sockets)


def model_name_of(path: str | Path) -> str:
    """The id /v1/models shows for a model file or directory: its name without the suffix."""
    path = Path(path)
    return path.stem if path.is_file() else path.name
