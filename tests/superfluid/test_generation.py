"""A Generation read from an event loop: woken only while it waits, catching up in batches."""

import asyncio
import threading

import pytest

from superfluid.host.session import Generation, Piece


def test_an_async_reader_is_woken_only_while_it_waits_and_catches_up_in_batches():
    generation = Generation("s")

    async def read() -> list[int]:
        pieces = generation.__aiter__()
        wakes = []
        wake = generation._wake
        generation._wake = lambda: (wakes.append(1), wake())
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
