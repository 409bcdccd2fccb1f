"""When a step's pieces reach their readers (superfluid/host/handoff.py): a generation's first text
and its end at once, the pieces between together, each generation's at most every stream_interval."""

import asyncio
import threading

import pytest

from superfluid.host import session as session_module
from superfluid.host.handoff import Handoff
from superfluid.host.host import _policy
from superfluid.host.policy import Policy
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


def test_the_first_text_goes_at_once_and_the_next_pieces_together_when_due():
    clock = Clock()
    handoff = Handoff(0.02, clock)
    generation = Generation("s")
    handoff.step([(generation, Piece("0", 0))])
    assert generation.pieces_ready() == pieces(0)  # the time to first token is never held
    for number in (1, 2):
        clock.now += 0.005
        handoff.step([(generation, Piece(str(number), number))])
    assert generation.pieces_ready() == [] and handoff.holding() == 1  # held: the interval has not passed
    clock.now += 0.011
    handoff.round_ended()  # due, and no step needed for it
    assert generation.pieces_ready() == pieces(1, 2) and handoff.holding() == 0
    clock.now += 0.005
    handoff.step([(generation, Piece("3", 3))])  # due again an interval after that hand-over
    assert generation.pieces_ready() == []


def test_pieces_without_text_do_not_start_the_interval():
    # half a character, or text held back as the possible start of a stop string: the reader has
    # nothing to show yet, so the first piece with text still goes at once
    clock = Clock()
    handoff = Handoff(0.02, clock)
    generation = Generation("s")
    handoff.step([(generation, Piece("", 5))])
    clock.now += 0.001
    handoff.step([(generation, Piece("", 6))])
    clock.now += 0.001
    handoff.step([(generation, Piece("é", 7))])
    assert generation.pieces_ready() == [Piece("", 5), Piece("", 6), Piece("é", 7)]
    clock.now += 0.001
    handoff.step([(generation, Piece("x", 8))])
    assert generation.pieces_ready() == []


def test_a_generation_due_takes_everyone_held_with_it():
    clock = Clock()
    handoff = Handoff(0.02, clock)
    fast, slow = Generation("fast"), Generation("slow")
    handoff.step([(fast, Piece("a", 0)), (slow, Piece("a", 0))])
    clock.now += 0.015
    handoff.step([(fast, Piece("b", 1))])  # not due
    clock.now += 0.01
    arrival = Generation("new")  # a new generation's first text is due at once, and so is the slow one's
    handoff.step([(arrival, Piece("c", 0)), (slow, Piece("b", 1))])
    assert [len(g.pieces_ready()) for g in (fast, slow, arrival)] == [2, 2, 1]


def test_the_end_goes_at_once_after_every_piece_held():
    clock = Clock()
    handoff = Handoff(3600.0, clock)  # an hour: only the end can release what is held
    generation = Generation("s")
    for number in range(5):
        handoff.step([(generation, Piece(str(number), number))])
    assert handoff.holding() == 1
    generation._finish("stop")
    assert list(generation) == pieces(0, 1, 2, 3, 4) and generation.finish_reason == "stop"
    handoff.round_ended()  # it handed its own: forgotten, not told anything twice
    assert handoff.holding() == 0 and generation.pieces_ready() == []


def test_a_piece_handed_at_once_goes_after_those_held():
    # finish() hands a reply's held-back text outside any step: it must not overtake the tokens held
    clock = Clock()
    handoff = Handoff(3600.0, clock)
    generation = Generation("s")
    for number in range(3):
        handoff.step([(generation, Piece(str(number), number))])
    generation._put(Piece("rest", -1))
    assert generation.pieces_ready() == [*pieces(0, 1, 2), Piece("rest", -1)]


def test_what_is_held_goes_before_a_step_that_feeds_a_prompt():
    clock = Clock()
    handoff = Handoff(3600.0, clock)
    generation = Generation("s")
    for number in range(3):
        handoff.step([(generation, Piece(str(number), number))])
    assert generation.pieces_ready() == pieces(0)
    handoff.before_long_step()
    assert generation.pieces_ready() == pieces(1, 2) and handoff.holding() == 0


def test_generations_handed_together_wake_their_loop_once(monkeypatch):
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
        handoff.step([(generation, Piece("a", 1)) for generation in generations])  # the first texts: at once
        for generation in generations:
            generation._waiting = True
        for step in range(3):  # within the interval: held, nobody woken
            clock.now += 0.005
            handoff.step([(generation, Piece("c", 3 + step)) for generation in generations])
        clock.now += 0.006
        handoff.round_ended()
        await asyncio.sleep(0)

    asyncio.run(read())
    assert woken == [8, 8]  # one call into the loop for all eight readers each time, none while held
    assert all(len(generation.pieces_ready()) == 4 for generation in generations)


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


def test_a_reader_has_its_first_text_at_once_the_rest_when_due_and_the_end_at_once(open_host, tmp_path):
    # Held before the sixth decode step, six tokens are sampled. An hour's interval has handed the
    # pieces up to the first with text (at once), none since; an interval of 0 has handed all six.
    # Then the end comes at once, whatever the interval, and the tokens are the same.
    read = {}
    for interval in (3600.0, 0.0):
        gate = Gate(decode_steps_of(1, 6))
        host = open_host(gate=gate, stream_interval=interval, pool_name=f"{tmp_path.name}-{interval:.0f}",
                         log_dir=tmp_path / f"log-{interval:.0f}")
        session = host.session(temperature=0.0)
        session.append_text("hello there, how are you")
        generation = session.generate(max_tokens=12, ignore_eos=True)
        gate.wait_reached()
        early = generation.pieces_ready()
        gate.open()
        reader = threading.Thread(target=generation.collect)
        reader.start()
        reader.join(WAIT_SECONDS)  # (an end held for the interval would keep it here an hour)
        assert not reader.is_alive() and generation.finish_reason == "length" and len(generation.tokens) == 12
        read[interval] = (early, generation.tokens)
    first_text = next((i for i, piece in enumerate(read[0.0][0]) if piece.text), 5)
    assert len(read[3600.0][0]) == first_text + 1 and len(read[0.0][0]) == 6
    assert read[3600.0][1] == read[0.0][1]


def test_an_async_reader_gets_every_token_committed_also_when_cancelled_mid_hold(open_host):
    host = open_host(stream_interval=3600.0)
    session = host.session(temperature=0.0)
    session.append_text("hello there, how are you")

    async def read() -> Generation:
        generation = session.generate(max_tokens=100_000, ignore_eos=True)
        async for _ in generation:  # the first text comes at once; then an hour's interval holds the rest
            generation.cancel()
        return generation

    generation = asyncio.run(read())
    assert generation.finish_reason == "cancelled" and len(generation.tokens) >= 1
    assert session.tokens[-len(generation.tokens):] == generation.tokens  # nothing committed was kept from it


def test_tokens_handed_together_share_the_time_between_tokens_in_the_metrics():
    from superfluid.http.completions import _timed

    class Recorded:
        def __init__(self) -> None:
            self.first, self.between = [], []

        def first_token(self, seconds: float) -> None:
            self.first.append(seconds)

        def output_token(self, seconds: float) -> None:
            self.between.append(seconds)

    class App:
        metrics = Recorded()

    generation = Generation("s")

    async def read() -> None:
        batches = _timed(App, generation, started=0.0)
        generation._put(Piece("a", 1))
        assert len(await anext(batches)) == 1
        await asyncio.sleep(0.01)
        for number in (2, 3, 4):  # handed over together
            generation._hold(Piece("b", number))
        generation._hand(None)
        assert len(await anext(batches)) == 3

    asyncio.run(read())
    between = App.metrics.between
    assert len(App.metrics.first) == 1 and len(between) == 3
    assert between[0] == between[1] == between[2] > 0  # each its part of the wait, none 0
