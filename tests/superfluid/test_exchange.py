"""An HTTP exchange's send deadline: a write that cannot go out in time ends the response; the
writes that go out at once (a streamed token's, nearly always) arm no timer each."""

import asyncio

import pytest

from superfluid.http.app import ClientStalled, Exchange
from superfluid.http.connections import ABORT

SCOPE = {"method": "POST", "raw_path": b"/v1/completions", "query_string": b"", "headers": [], "client": ("c", 1)}


def exchange_on(send, *, state: dict | None = None, stalled: list | None = None) -> Exchange:
    async def receive() -> dict:
        await asyncio.Event().wait()  # the client sends nothing more

    scope = {**SCOPE, "state": state or {}}
    return Exchange(scope, receive, send, send_timeout=0.2,
                    on_stall=(lambda: stalled.append(1)) if stalled is not None else lambda: None)


def test_writes_that_go_out_at_once_arm_one_timer_not_one_each():
    sent = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def stream() -> int:
        loop = asyncio.get_running_loop()
        timers = []
        call_at = loop.call_at
        loop.call_at = lambda *args, **kw: (timers.append(args), call_at(*args, **kw))[1]
        exchange = exchange_on(send)
        await exchange.start(200, {"Content-Type": "text/event-stream"})
        for number in range(500):
            await exchange.write(b"data: %d\n\n" % number, more=True)
        await exchange.write(b"data: [DONE]\n\n", more=False)
        exchange.done()
        return len(timers)

    assert asyncio.run(stream()) == 1
    assert len(sent) == 502 and sent[-1]["more_body"] is False


@pytest.mark.parametrize("cut", [True, False], ids=["connection cut", "no way to cut it"])
def test_a_write_the_client_does_not_take_in_time_ends_the_response(cut):
    # With a way to cut the connection (serve's protocol puts one in the scope) the stalled send
    # ends when the connection goes; an ASGI server without one gets the send cancelled.
    stalled, aborted = [], []

    async def respond() -> None:
        readable = asyncio.Event()  # the client never reads: set only when the connection is cut

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and message["body"] == b"stuck":
                await readable.wait()

        state = {ABORT: lambda: (aborted.append(1), readable.set())} if cut else {}
        exchange = exchange_on(send, state=state, stalled=stalled)
        await exchange.start(200, {"Content-Type": "text/event-stream"})
        await exchange.write(b"fine", more=True)
        with pytest.raises(ClientStalled, match="read nothing for 0.2 s"):
            await exchange.write(b"stuck", more=True)
        assert exchange.gone
        await exchange.write(b"after", more=False)  # nothing is written after a stall
        assert asyncio.current_task().cancelling() == 0  # the deadline's cancel taken back
        exchange.done()

    asyncio.run(respond())
    assert stalled == [1] and aborted == ([1] if cut else [])
