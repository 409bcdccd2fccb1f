"""A Generation read from an event loop: woken only while it waits, catching up in batches."""

import asyncio
import threading

import pytest

from superfluid.host import session as session_module
from superfluid.host.errors import HostClosed
from superfluid.host.handoff import Handoff
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
    # Four streams read in one event loop: the scheduler thread hands over a step's four pieces
    # (each a generation's first: due at once), waking the loop once for all of them (each wake
    # takes a core from the forward in flight).
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
            Handoff(0.02).step([(g, Piece(str(i), i)) for i, g in enumerate(generations)])

        putter = threading.Thread(target=scheduler_side)
        putter.start()
        pieces = await asyncio.gather(*waiting)
        putter.join()
        return pieces, len(calls)

    pieces, calls = asyncio.run(read())
    assert pieces == [Piece(str(i), i) for i in range(4)] and calls == 1


def test_an_async_reader_hears_of_a_scheduler_that_stopped_without_ending_it():
    # One liveness timer a generation (not one a wait, which every streamed token would pay): a
    # reader waiting on a scheduler that stopped is woken by it and raises; pieces put before
    # the stop are read first.
    generation = Generation("s")
    alive = threading.Event()
    alive.set()
    generation._alive = alive.is_set

    async def read() -> tuple[list[Piece], float, int, float]:
        loop = asyncio.get_running_loop()
        began_reading = loop.time()
        timers = []
        call_at = loop.call_at  # (call_later and asyncio.timeout arm their timers through it)
        loop.call_at = lambda *args, **kw: (timers.append(args), call_at(*args, **kw))[1]
        pieces = generation.__aiter__()
        got = []
        for number in range(200):  # 200 waits, each woken by a put from the scheduler's side
            putter = threading.Thread(target=lambda n=number: (_wait_until(lambda: generation._waiting),
                                                               generation._put(Piece(str(n), n))))
            putter.start()
            got.append(await anext(pieces))
            putter.join()
        generation._put(Piece("last", 7))
        alive.clear()  # the scheduler stops without ending the generation
        began = loop.time()
        got.append(await anext(pieces))  # put before the stop: read, not lost
        with pytest.raises(HostClosed, match="scheduler stopped"):
            await anext(pieces)
        return got, loop.time() - began, len(timers), loop.time() - began_reading

    got, waited, timers, elapsed = asyncio.run(read())
    assert got == [*(Piece(str(n), n) for n in range(200)), Piece("last", 7)]
    assert waited < 30 * session_module.LIVENESS_SECONDS  # heard of, not waited on forever
    assert timers <= elapsed / session_module.LIVENESS_SECONDS + 2  # one a liveness period, not one a wait


def test_the_liveness_watch_ends_with_the_generation(monkeypatch):
    monkeypatch.setattr(session_module, "LIVENESS_SECONDS", 0.01)
    generation = Generation("s")

    async def read() -> int:
        loop = asyncio.get_running_loop()
        timers = []
        call_at = loop.call_at
        loop.call_at = lambda *args, **kw: (timers.append(args), call_at(*args, **kw))[1]
        pieces = generation.__aiter__()
        generation._put(Piece("a", 1))
        generation._finish("stop")
        assert await anext(pieces) == Piece("a", 1)
        with pytest.raises(StopAsyncIteration):
            await anext(pieces)
        await asyncio.sleep(0.2)  # twenty liveness periods
        return len(timers)

    assert asyncio.run(read()) <= 2  # the first, and at most one that found the end


@pytest.mark.parametrize("waited", [True, False], ids=["the first loop waited", "it never waited"])
def test_a_generation_read_again_on_another_loop_is_woken_there(waited):
    # The first reader's loop is gone; the scheduler's wakes (and the liveness watch) follow the
    # loop that reads now.
    generation = Generation("s")

    async def first() -> None:
        pieces = generation.__aiter__()
        if waited:
            putter = threading.Thread(target=lambda: (_wait_until(lambda: generation._waiting),
                                                      generation._put(Piece("a", 1))))
            putter.start()
        else:
            generation._put(Piece("a", 1))
        assert await anext(pieces) == Piece("a", 1)
        if waited:
            putter.join()

    async def second() -> list[Piece]:
        putter = threading.Thread(target=lambda: (_wait_until(lambda: generation._waiting),
                                                  generation._put(Piece("b", 2)), generation._finish("stop")))
        putter.start()
        got = [piece async for piece in generation]
        putter.join()
        return got

    asyncio.run(first())
    assert asyncio.run(asyncio.wait_for(second(), 30)) == [Piece("b", 2)]


def _wait_until(condition) -> None:
    while not condition():
        threading.Event().wait(0.001)
