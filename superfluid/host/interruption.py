"""Stopping the step in flight for a request that would go before it.

A step lasts up to the first-token target (1 s by default) while prompts prefill, and a
request arriving meanwhile used to wait for its end before its own prompt went first: behind
eight long prompts prefilling, a one-line chat arriving at a random moment waited 0.27 s by
the median and 0.86 s at the 95th percentile, against 0.05 s on an idle engine. A request
goes first when its class and prompt come before every prompt the step feeds (a shorter prompt
of the same class, or a more urgent class) and its prompt is short (no longer than what the
step carries; a more urgent class need not be short). For such a request the step stops in
one of two ways:

- **Between two pieces.** While such requests keep arriving (one in the last ten seconds), the
  planner runs a step's prompt chunks as pieces of about a quarter of the first-token target
  (`Planner.pieces`), one after another; before each piece the scheduler looks at the most
  urgent request that arrived meanwhile (a later, longer arrival does not hide it) and, if it
  goes first, ends the step there. What ran is kept, nothing is thrown away, and the request
  waits for the piece in flight at most. Any engine, any memory. (The first such request after
  a quiet spell finds a step not in pieces, which it waits for unless stopped as below.)
- **Part-way, when a step or piece has barely begun.** Where the engine can stop a forward
  part-way (llama.cpp on plain KV: it keeps the ubatches it finished), the thread that queues
  the request asks it to when at most INTERRUPT_WITHIN of the step's (or piece's) predicted time
  has passed and at least MIN_SAVED_SECONDS of it remain: the work thrown away is what it did so
  far, a quarter of it at most. An arrival later in it waits for its end instead.

That default spends little to answer sooner, and a request that goes first waits for up to
three quarters of a piece: beside prompts that keep prefilling, a chat arriving at a random
moment waits about a quarter of a piece by the median and nearly three quarters at the 95th
percentile (a piece lasts 0.3-0.5 s on 2 cores).
**`arrival_wait`** (a Host option, `--arrival-wait` for serve) trades prefill for that wait:
where the engine can stop a forward, a step or piece with more than `arrival_wait` seconds of
its predicted time left is stopped for such a request, what it did so far is thrown away
(llama.cpp keeps the ubatches it finished; a piece of up to 512 tokens is one), and the request
waits at most about that long (a step or piece barely begun is still stopped, as without it).
Each stop throws away up to a piece, so what it costs grows with how often such requests
arrive; while the steps stopped in the last 4 s had run for half of them or more (all of it
counted as thrown away, kept ubatches too: the pause comes sooner, never later), only what has
barely begun is stopped, so requests arriving more often than a piece lasts cannot stop every
piece of a long prompt, and the work thrown away stays near half the engine's time at most. With a chat every second beside three long documents on 2
cores, `arrival_wait` 0.08 s brought the chats' 95th percentile from about 0.5 s to 0.08-0.16 s
(an idle engine's first token took 77-98 ms) and made the documents 29-43% slower (11-12 s of
44-52 thrown away).

The scheduler counts both: the steps ended between pieces (`yielded_steps`), and those stopped
part-way with the seconds they had run (`interrupted_steps`, `interrupted_seconds`).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from superfluid.host.request import Priority

# A step is stopped only while no more than this share of its predicted time has passed.
INTERRUPT_WITHIN = 0.25
# ...and only when at least this much of it is left to save.
MIN_SAVED_SECONDS = 0.05
# arrival_wait pauses while the steps stopped in the last THROWN_WINDOW seconds had run for this
# share of them: the work thrown away stays near half the engine's time at most however often
# requests arrive (one stop may pass it; the budget is looked at before each). (A quarter was
# tried: behind 8 agents with a chat every 0.6-2 s, the chats that missed were those arriving
# while it held.)
THROWN_SHARE = 0.5
THROWN_WINDOW = 4.0


class Arrival(NamedTuple):
    """A request just queued: its class and the tokens of its prompt."""

    priority: Priority
    prompt_tokens: int


class StepInFlight(NamedTuple):
    """The step the engine runs now, as the thread queueing a request sees it."""

    began: float  # perf_counter() when it began
    predicted: float  # its predicted seconds
    first: tuple[Priority, int]  # the most urgent prompt it feeds: (class, tokens left to feed)
    tokens: int  # the tokens it carries


def goes_first(arrival: Arrival, first: tuple[Priority, int], tokens: int) -> bool:
    """True when `arrival` would go before work that feeds prompts, the most urgent `first`
    (class, tokens left to feed), in `tokens` tokens: its class and prompt come first, and its
    prompt is short (no longer than that work; a more urgent class need not be short)."""
    if (arrival.priority, arrival.prompt_tokens) >= first:
        return False  # it would not go before what the step feeds
    # not a short prompt: a step of its own would take as long as this one
    return arrival.priority != first[0] or arrival.prompt_tokens <= tokens


def worth_interrupting(flight: StepInFlight | None, arrival: Arrival, now: float, wait: float | None = None) -> bool:
    """True when `arrival` should stop `flight` (a step or piece; None: no prompt is being fed)
    at `now`: when it has barely begun, or (with `wait`, the policy's arrival_wait) when more
    than `wait` of it is left."""
    if flight is None or not goes_first(arrival, flight.first, flight.tokens):
        return False
    elapsed = now - flight.began
    left = flight.predicted - elapsed
    if wait is not None and left > max(wait, MIN_SAVED_SECONDS):
        return True
    return elapsed <= INTERRUPT_WITHIN * flight.predicted and left >= MIN_SAVED_SECONDS


class Arrivals:
    """What the scheduler knows of arrivals between two looks, and of its recent stops: the
    most urgent request queued since it last looked (hurry() runs on other threads: a lock, so
    none is lost, and a later, longer arrival does not hide a chat), the step or piece in flight
    (under the same lock, so an interrupt asked for it never lands after it ended, where it
    would stop the next one), and the seconds that the steps stopped in the last THROWN_WINDOW
    seconds had run (past THROWN_SHARE of that window, arrival_wait pauses: requests arriving
    more often than a piece lasts cannot stop every piece of a long prompt)."""

    def __init__(self) -> None:
        """Nothing heard, nothing in flight, nothing stopped."""
        self._lock = threading.Lock()
        self._arrived: Arrival | None = None
        self._flight: StepInFlight | None = None
        self._thrown: tuple[tuple[float, float], ...] = ()  # (when, seconds run) of each recent stop

    def heard(self, arrival: Arrival) -> None:
        """`arrival` was queued (any thread): kept if it is the most urgent since the last look."""
        with self._lock:
            if self._arrived is None or (arrival.priority, arrival.prompt_tokens) < (
                    self._arrived.priority, self._arrived.prompt_tokens):
                self._arrived = arrival

    def take(self) -> Arrival | None:
        """The most urgent arrival since the last look (None: none), forgotten here."""
        with self._lock:
            arrived, self._arrived = self._arrived, None
        return arrived

    @property
    def in_flight(self) -> StepInFlight | None:
        """The step or piece the engine runs now (None: none, or it feeds no prompt)."""
        return self._flight

    def begin(self, flight: StepInFlight | None) -> None:
        """A step or piece is about to run (the scheduler thread)."""
        with self._lock:
            self._flight = flight

    def end(self, engine) -> None:
        """The step or piece in flight ended, or did not run: an interrupt asked for it that the
        engine did not take (one asked after its last node) is taken back."""
        with self._lock:
            if self._flight is not None:
                self._flight = None
                engine.clear_interrupt()

    def interrupt_for(self, arrival: Arrival, now: float, arrival_wait: float | None, engine) -> bool:
        """Stop the step or piece in flight for `arrival` where it is worth it (any thread).
        True where the engine was asked to."""
        with self._lock:
            if worth_interrupting(self._flight, arrival, now, self.wait(arrival_wait, now)):
                return engine.interrupt()
        return False

    def wait(self, arrival_wait: float | None, now: float) -> float | None:
        """The arrival wait at `now`: `arrival_wait`, unless the steps stopped in the last
        THROWN_WINDOW seconds had run for THROWN_SHARE of it or more."""
        if arrival_wait is None:
            return None
        thrown = sum(seconds for when, seconds in self._thrown if when > now - THROWN_WINDOW)
        return None if thrown >= THROWN_SHARE * THROWN_WINDOW else arrival_wait

    def stopped(self, now: float, seconds: float) -> None:
        """A step or piece was stopped part-way at `now`, having run `seconds` (the scheduler
        thread; other threads read the record, replaced whole)."""
        self._thrown = (*((when, ran) for when, ran in self._thrown if when > now - THROWN_WINDOW), (now, seconds))
