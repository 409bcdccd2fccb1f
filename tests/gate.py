"""A gate in an engine's step, so a test can act at a chosen point of a generation, whatever the
speed of the machine.

A test that sends an arrival "while the others are mid-generation" otherwise races them: on a
fast engine or a stalled test thread they may have finished before the arrival is queued, and
the test then checks nothing (or fails). Wrapped in `Gate.wrap`, an engine stops before the
first step that `pause_when` picks, until the test opens the gate: the test queues its arrival
with `Host.submit` (which does not wait for the scheduler thread) while the step is held, then
opens it, and the arrival is planned at the very next tick.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from engines.base import StepRequest
from superfluid.host.request import GenerateRequest

WAIT_SECONDS = 120  # only a broken test waits this long


class Gate:
    """Holds the first step for which `pause_when(requests)` is true, until `open()`."""

    def __init__(self, pause_when: Callable[[Sequence[StepRequest]], bool]) -> None:
        self.pause_when = pause_when
        self._reached, self._opened = threading.Event(), threading.Event()

    def wrap(self, engine) -> GatedEngine:
        """`engine`, with its step behind this gate."""
        return GatedEngine(engine, self)

    def wait_reached(self) -> None:
        """Wait until the scheduler thread is held at the gate."""
        assert self._reached.wait(WAIT_SECONDS), "the engine never took a step the gate waits for"

    def open(self) -> None:
        """Let the held step (and every later one) run."""
        self._opened.set()

    def generate_while_held(self, host, session, max_tokens: int, priority: str | None = None):
        """Queue `session`'s generation (made before the gate was reached: a call waits for the
        scheduler thread) once the engine is held here, then open the gate; the Generation."""
        self.wait_reached()
        queued = host.submit(host.commands.generate, session.id, GenerateRequest.of(max_tokens=max_tokens,
                                                                                     priority=priority))
        self.open()
        return queued.result()

    def check(self, requests: Sequence[StepRequest]) -> None:
        """On the scheduler thread, before a step: hold it if it is the one picked."""
        if not self._reached.is_set() and self.pause_when(requests):
            self._reached.set()
            assert self._opened.wait(WAIT_SECONDS), "the test never opened the gate"


def decode_steps_of(lanes: int, count: int) -> Callable[[Sequence[StepRequest]], bool]:
    """A `pause_when` that picks the `count`-th step decoding one token in each of `lanes` lanes:
    those lanes are then mid-generation, with count - 1 tokens fed back each."""
    seen = [0]

    def picks(requests: Sequence[StepRequest]) -> bool:
        if len(requests) == lanes and all(len(request.tokens) == 1 for request in requests):
            seen[0] += 1
        return seen[0] == count

    return picks


class GatedEngine:
    """An engine whose step waits at a gate; everything else goes straight to the engine."""

    def __init__(self, engine, gate: Gate) -> None:
        self._engine, self._gate = engine, gate

    def step(self, requests: Sequence[StepRequest]):
        """The engine's step, once the gate lets it through."""
        self._gate.check(requests)
        return self._engine.step(requests)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def start_together(host, sessions, request: GenerateRequest) -> list:
    """Start each session's generation in one scheduler command (their Generations): they are
    admitted in the same tick and decode side by side from the first step, however fast or slow
    the machine is. Started one call at a time, the first could be done before the second
    arrives, and the step a gate waits for never come."""
    return host.call(lambda: [host.commands.generate(session.id, request) for session in sessions])
