"""When a step's pieces reach their readers: a generation's first text and its end at once, the
pieces between together, each generation's at most every `interval` seconds.

Handing a piece over wakes its reader: a thread blocked on the generation's queue, or an event
loop (a write to its self-pipe) that resumes the reader's coroutine, encodes the piece and writes
it to a socket, whose client wakes in turn. On 2 cores every wake takes a core from the forward
in flight, and its code runs with the caches cold after the forward. Measured over HTTP on
SmolLM2 (one stream, ~7 ms a token, servers alternating): the event loop's CPU per token fell
from 0.20 to 0.10 ms with pieces handed every 20 ms (every second or third token), and the whole
token from 7.57 to 7.18 ms, 0.95 of llama-server's rate to 1.00 (0.98 in later paired runs).
What a reader loses is nothing it can see: the first text comes as soon as it is sampled (the
time to first token unchanged), the end as soon as it is written, and a display refreshed 50
times a second shows text as smoothly as one refreshed every token. A generation whose tokens
come slower than the interval has each handed at once.

When one generation's pieces are due, every generation's held pieces go with them: readers on
one event loop then share one wake, and every generation handed is due again an interval later.
A step that feeds a prompt may last far longer than the interval (up to the first-token target):
what is held goes before it, not after.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter

from superfluid.host.session import Generation, Piece, Wakes, wake_readers


class Handoff:
    """The pieces a scheduler's steps produced, held for their readers until due (on the
    scheduler's thread only). `interval` 0: each step's pieces go at its end, as they come."""

    def __init__(self, interval: float, clock: Callable[[], float] = perf_counter) -> None:
        self.interval = interval
        self._clock = clock  # real time: the interval paces wakes, whatever clock the host's policies use
        self._holding: dict[Generation, None] = {}  # generations with pieces held, in order

    def step(self, outbox: list[tuple[Generation, Piece]]) -> None:
        """A step's pieces, in order: held, and handed over with all that is held if any
        generation's are due (a generation's first text is due at once)."""
        for generation, piece in outbox:
            generation._hold(piece)
            self._holding[generation] = None
        self._hand(due_only=True)

    def before_long_step(self) -> None:
        """Before a step that feeds a prompt (it may last up to the first-token target): hand over
        everything held, rather than after it."""
        self._hand(due_only=False)

    def round_ended(self) -> None:
        """After each round of the scheduler's loop: hand over what is due, also when no step ran
        (a generation waiting for room has its pieces handed on time), and forget generations
        that ended (they handed their own)."""
        if self._holding:
            for generation in [g for g in self._holding if not g._held]:
                del self._holding[generation]
            self._hand(due_only=True)

    def holding(self) -> int:
        """Generations with pieces held now."""
        return len(self._holding)

    def _hand(self, due_only: bool) -> None:
        """Every generation's held pieces to its reader (with `due_only`, only if one is due),
        each reader's loop woken once."""
        if not self._holding:
            return
        now = self._clock()
        if due_only and not any(now >= generation._due for generation in self._holding):
            return
        wakes: Wakes = {}
        for generation in self._holding:
            if generation._hand(wakes):  # (a piece with no text yet, say half a character: not due later)
                generation._due = now + self.interval
        self._holding.clear()
        wake_readers(wakes)
