"""When a step's pieces reach their readers (superfluid/host/handoff.py): a generation's first
piece and its end at once, the pieces between together at most every stream_interval."""

import asyncio
import threading

import pytest

from superfluid.host import session as session_module
from superfluid.host.handoff import Handoff
from superfluid.host.host import _policy
from superfluid.host.scheduler import Policy
from superfluid.host.session import Generation, Piece
from tests.gate import WAIT_SECONDS, Gate, decode_steps_of


class Clock:
    """Seconds that move only when the test moves them."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pieces(*numbers: int) -> list[Piece]:
    return [Piece(str(n), n) for n in numbers]


def test_the_first_piece_goes_at_once_and_the_next_ones_together_when_due():
    clock = Clock()
    handoff = Handoff(0.02, clock)
    generation = Generation("s")
    handoff.step([(generation, Piece("0", 0))])
    assert generation.pieces_ready() == pieces(0)  # the time to first token is never held
    handoff.step([(generation, Piece("1", 1))])  # (the first hand-over of held pieces is due at once)
    assert generation.pieces_ready() == pieces(1)
    clock.now += 0.005
    handoff.step([(generation, Piece("2", 2))])
    clock.now += 0.005
    handoff.step([(generation, Piece("3", 3))])
    assert generation.pieces_ready() == [] and handoff.holding() == 1  # held: the interval has not passed
    arrival = Generation("t")  # a generation starting now: its first piece is not held for the others'
    handoff.step([(generation, Piece("4", 4)), (arrival, Piece("a", 0))])
    assert arrival.pieces_ready() == [Piece("a", 0)] and generation.pieces_ready() == []
    clock.now += 0.011
    handoff.round_ended()  # due, and no step needed for it
    assert generation.pieces_ready() == pieces(2, 3, 4) and handoff.holding() == 0


def test_the_end_goes_at_once_after_every_piece_held():
    clock = Clock()
    handoff = Handoff(3600.0, clock)  # an hour: only the end can release what is held
    generation = Generation("s")
    for number in range(5):
        handoff.step([(generation, Piece(str(number), number))])
    assert handoff.holding() == 1
    generation._finish("stop")
    assert list(generation) == pieces(0, 1, 2, 3, 4) and generation.finish_reason == "stop"
    handoff.round_ended()  # nothing left to hand: the reader is not told anything twice
    assert generation.pieces_ready() == []


def test_a_piece_handed_at_once_goes_after_those_held():
    # finish() hands a reply's held-back text outside any step: it must not overtake the tokens held
    clock = Clock()
    handoff = Handoff(3600.0, clock)
    generation = Generation("s")
    for number in range(3):
        handoff.step([(generation, Piece(str(number), number))])
    generation._put(Piece("rest", -1))
    assert generation.pieces_ready() == [*pieces(0, 1, 2), Piece("rest", -1)]


def test_every_generation_held_goes_together_so_a_loop_is_woken_once(monkeypatch):
    clock = Clock()
    handoff = Handoff(0.02, clock)
    generations = [Generation(f"s{i}") for i in range(8)]
    woken = []
    wake_readers = session_module.wake_readers
    monkeypatch.setattr("superfluid.host.handoff.wake_readers",
                        lambda wakes: (woken.append(sum(len(events) for events in wakes.values())), wake_readers(wakes)))

    async def read() -> None:
        for generation in generations:
            generation.__aiter__()
            generation._waiting = True  # as a reader waiting for its next piece
        handoff.step([(generation, Piece("a", 1)) for generation in generations])  # the first pieces: at once
        handoff.step([(generation, Piece("b", 2)) for generation in generations])  # due at once too
        for generation in generations:
            generation._waiting = True
        for step in range(3):  # within the interval: held, nobody woken
            clock.now += 0.005
            handoff.step([(generation, Piece("c", 3 + step)) for generation in generations])
        clock.now += 0.006
        handoff.round_ended()
        await asyncio.sleep(0)

    asyncio.run(read())
    assert woken == [8, 0, 0, 0, 0, 8]  # one call into the loop for all eight readers, each time
    assert all(len(generation.pieces_ready()) == 5 for generation in generations)


def test_an_interval_of_zero_hands_every_step_at_its_end():
    handoff = Handoff(0.0, Clock())  # the clock never moves: 0 must not wait on it
    generation = Generation("s")
    for number in range(4):
        handoff.step([(generation, Piece(str(number), number))])
        assert generation.pieces_ready() == pieces(number)
    assert handoff.holding() == 0


@pytest.mark.parametrize("interval", [-0.01, float("nan"), float("inf"), "0.02", True, None])
def test_a_bad_stream_interval_is_refused_by_name(interval):
    settings = {name: getattr(Policy(), name) for name in Policy.__dataclass_fields__}
    settings["stream_interval"] = interval
    with pytest.raises(ValueError, match="stream_interval"):
        _policy(**settings)


@pytest.mark.parametrize("interval, ready", [(3600.0, 2), (0.0, 6)])
def test_a_reader_has_its_first_pieces_at_once_the_rest_when_due_and_the_end_at_once(open_host, interval, ready):
    # Held before the sixth decode step, six tokens are sampled: an hour's interval has handed the
    # first (at once) and the second (the first hand-over of held pieces is due at once), none
    # since; an interval of 0 has handed all six. Then the end comes at once, whatever the interval.
    gate = Gate(decode_steps_of(1, 6))
    host = open_host(gate=gate, stream_interval=interval)
    session = host.session(temperature=0.0)
    session.append_text("hello there, how are you")
    generation = session.generate(max_tokens=12, ignore_eos=True)
    gate.wait_reached()
    generation.pieces_ready()
    assert len(generation.tokens) == ready
    gate.open()
    reader = threading.Thread(target=generation.collect)
    reader.start()
    reader.join(WAIT_SECONDS)  # (an end held for the interval would keep it here an hour)
    assert not reader.is_alive() and generation.finish_reason == "length" and len(generation.tokens) == 12
