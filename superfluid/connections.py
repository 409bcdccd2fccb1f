"""How long a client may hold a connection without sending a request: uvicorn's HTTP/1.1
protocol with a deadline for the request head.

uvicorn closes a kept-alive connection that sends nothing for `timeout_keep_alive` seconds after
a response, but a connection that opens and sends half a request head (or one byte a minute) is
held for good: a thousand such clients would hold a thousand sockets forever. Here every
connection that waits for a request head (a new one, or a kept-alive one after its response)
gets `header_timeout` seconds to deliver the whole head, however slowly the bytes trickle in;
then it is closed. The body has its own deadline, kept by the application that reads it.
"""

from __future__ import annotations

import asyncio

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class ServerConfig(uvicorn.Config):
    """uvicorn's configuration with the request head's deadline."""

    def __init__(self, app, *, header_timeout: float, **settings) -> None:
        """`header_timeout`: seconds a connection has to send a whole request head; `settings`
        as uvicorn.Config takes them."""
        super().__init__(app, http=HeadDeadlineProtocol, **settings)
        self.header_timeout = header_timeout


class HeadDeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request head is not complete in time."""

    config: ServerConfig
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """A new connection: its first request head is due within the deadline."""
        super().connection_made(transport)
        self._await_head()

    def handle_events(self) -> None:
        """Parse what arrived; a whole request head lifts the deadline."""
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection is ending)
            self._lift_deadline()

    def on_response_complete(self) -> None:
        """A response went out: a kept-alive connection's next head is due within the deadline."""
        super().on_response_complete()  # may already parse a pipelined request (handle_events)
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection is gone: no deadline to keep."""
        self._lift_deadline()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._lift_deadline()
        self._head_deadline = self.loop.call_later(self.config.header_timeout, self._head_overdue)

    def _lift_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_overdue(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.close()  # nothing was asked of us: no response is owed
