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


def test_a_write_that_waits_less_than_the_deadline_is_not_cut():
    # The deadline's timer, armed by an earlier write, fires while a later write waits: it is
    # armed again for that write's own deadline, and the write goes out.
    async def respond() -> None:
        release = asyncio.Event()
        blocking = {"on": False}

        async def send(message: dict) -> None:
            if blocking["on"]:
                await release.wait()

        exchange = exchange_on(send)
        await exchange.start(200, {"Content-Type": "text/event-stream"})
        await exchange.write(b"first", more=True)  # arms the timer
        first_timer = exchange._send_watch
        await asyncio.sleep(0.1)
        blocking["on"] = True
        writing = asyncio.ensure_future(exchange.write(b"slow", more=True))
        while exchange._send_watch is first_timer:  # the first timer fires while "slow" waits
            await asyncio.sleep(0.01)
        release.set()
        await writing  # no ClientStalled
        blocking["on"] = False
        await exchange.write(b"last", more=False)
        assert exchange.finished and not exchange.gone
        exchange.done()

    asyncio.run(respond())


def test_a_cancellation_from_outside_is_not_taken_for_a_stall():
    # The deadline cut the connection (which, here, does not end the send), then the task is
    # cancelled from outside (a server shutting down): the cancellation goes on.
    async def respond() -> None:
        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and message["body"] == b"stuck":
                await asyncio.Event().wait()

        exchange = exchange_on(send, state={ABORT: lambda: None})
        await exchange.start(200, {"Content-Type": "text/event-stream"})
        writing = asyncio.ensure_future(exchange.write(b"stuck", more=True))
        while not exchange.gone:
            await asyncio.sleep(0.01)
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        exchange.done()

    asyncio.run(respond())
