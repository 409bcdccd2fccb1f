"""A Generation read from an event loop: woken only while it waits, catching up in batches."""

import asyncio
import threading

import pytest

from superfluid.host import session as session_module
from superfluid.host.session import Generation, Piece


def test_an_async_reader_is_woken_only_while_it_waits_and_catches_up_in_batches(monkeypatch):
    generation = Generation("s")
    wakes = []
    wake_readers = session_module.wake_readers
    monkeypatch.setattr(session_module, "wake_readers", lambda readers: (wakes.append(1), wake_readers(readers)))

    async def read() -> list[int]:
        pieces = generation.__aiter__()
        for number in range(50):  # put before the reader looks: nothing to wake
            generation._put(Piece(str(number), number))
        first = await anext(pieces)
        assert [first, *generation.pieces_ready()] == [Piece(str(n), n) for n in range(50)]
        assert wakes == []

        def scheduler_side() -> None:  # puts once the reader waits on an empty queue
            while not generation._waiting:
                threading.Event().wait(0.001)
            generation._put(Piece("x", 99))

        putter = threading.Thread(target=scheduler_side)
        putter.start()
        assert await anext(pieces) == Piece("x", 99)
        putter.join()
        generation._finish("stop")  # it is busy with "x": no wake
        assert generation.pieces_ready() == []  # the end stays for the next read
        with pytest.raises(StopAsyncIteration):
            await anext(pieces)
        return wakes

    assert asyncio.run(read()) == [1]  # one wake: the put it waited for
    assert generation.text == "".join(str(n) for n in range(50)) + "x" and generation.finish_reason == "stop"
    assert generation.tokens == [*range(50), 99]


def test_a_steps_pieces_wake_each_readers_loop_once():
    # Four streams read in one event loop: the scheduler thread puts a step's four pieces, then
    # wakes the loop once for all of them (each wake takes a core from the forward in flight).
    generations = [Generation(f"s{i}") for i in range(4)]

    async def read() -> tuple[list[Piece], int]:
        loop = asyncio.get_running_loop()
        calls = []
        call_soon_threadsafe = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: (calls.append(args), call_soon_threadsafe(*args))
        readers = [g.__aiter__() for g in generations]
        waiting = [asyncio.ensure_future(anext(reader)) for reader in readers]

        def scheduler_side() -> None:  # a step's pieces, once every reader waits on an empty queue
            while not all(g._waiting for g in generations):
                threading.Event().wait(0.001)
            wakes: session_module.Wakes = {}
            for i, g in enumerate(generations):
                g._put(Piece(str(i), i), wakes)
            session_module.wake_readers(wakes)

        putter = threading.Thread(target=scheduler_side)
        putter.start()
        pieces = await asyncio.gather(*waiting)
        putter.join()
        return pieces, len(calls)

    pieces, calls = asyncio.run(read())
    assert pieces == [Piece(str(i), i) for i in range(4)] and calls == 1
