"""How long a client may hold a connection without sending a request: uvicorn's HTTP/1.1
protocol with a deadline for the request head.

uvicorn closes a kept-alive connection that sends nothing for `timeout_keep_alive` seconds after
a response, but a connection that opens and sends half a request head (or one byte a minute) is
held for good: a thousand such clients would hold a thousand sockets forever. Here every
connection that waits for a request head (a new one, or a kept-alive one after its response)
gets `header_timeout` seconds to deliver the whole head, however slowly the bytes trickle in;
then it is closed. The body has its own deadline, kept by the application that reads it.

Beyond the connection cap, new connections are told so (503) or, far beyond it, closed at once.
Each request's scope carries a way to cut its connection, for a response whose client stopped
reading (the application's send deadline).
"""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class ServerConfig(uvicorn.Config):
    """uvicorn's configuration with the request head's deadline and the connection cap."""

    def __init__(self, app, *, header_timeout: float, max_connections: int, **settings) -> None:
        """`header_timeout`: seconds a connection has to send a whole request head;
        `max_connections`: open connections served (see HeadDeadlineProtocol); `settings` as
        uvicorn.Config takes them."""
        super().__init__(app, http=HeadDeadlineProtocol, **settings)
        self.header_timeout = header_timeout
        self.max_connections = max_connections


class HeadDeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request head is not complete in time, and
    that marks connections beyond the cap.

    A connection accepted while `max_connections` others are open is over capacity: its request
    is answered 503 and the connection closed (the application reads `scope["state"]
    ["over_capacity"]`), so the connections already served go on being served. Beyond the cap
    and REFUSING_ROOM more, a new connection is closed at once without a word: each open
    connection is a file, and the process must keep files for its log and its pool."""

    config: ServerConfig
    _head_deadline: asyncio.TimerHandle | None = None
    _answered: object = None  # the request cycle whose response went out last (None: no request yet)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """A new connection: its first request head is due within the deadline."""
        others = len(self.connections)
        super().connection_made(transport)
        if others >= self.config.max_connections + REFUSING_ROOM:
            transport.abort()
            return
        # copied into each request's scope: how the application cuts this connection (a response
        # whose client stopped reading: a close would wait for it to read what is buffered)
        self.app_state = {**self.app_state, ABORT: transport.abort}
        if others >= self.config.max_connections:
            self.app_state = {**self.app_state, OVER_CAPACITY: True}
        self._await_head()

    def handle_events(self) -> None:
        """Parse what arrived; a new request head lifts the deadline."""
        super().handle_events()
        if self._head_deadline is not None and self.cycle is not self._answered:
            self._lift_deadline()

    def on_response_complete(self) -> None:
        """A response went out: a kept-alive connection's next head is due within the deadline
        (also while the rest of a body the application did not read still arrives)."""
        super().on_response_complete()  # may already start a pipelined request (handle_events)
        if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection is gone: no deadline to keep."""
        self._lift_deadline()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._lift_deadline()
        self._answered = self.cycle
        self._head_deadline = self.loop.call_later(self.config.header_timeout, self._head_overdue)

    def _lift_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_overdue(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing() and self.cycle is self._answered:
            self.transport.close()  # no new request arrived: no response is owed


OVER_CAPACITY = "over_capacity"
ABORT = "abort"
# Connections beyond the cap that are still accepted, to be answered 503 (past them a new one is
# closed unanswered).
REFUSING_ROOM = 64
