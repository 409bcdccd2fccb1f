"""A test mode that moves KV between the engine and the pool on purpose, as often as the host
ever could, instead of when a clock or memory pressure happens to say so.

What the host does to a session's KV depends on timing: an idle lane is parked after
`idle_park_seconds`, prefill chunks are sized by the measured step time, and room is made by
parking and preempting. On a fast idle machine most of that never happens in a test; on a slow
or busy one it happens at other points of the same story. Under churn it happens everywhere:

    Churn()                 every lane without a generation is parked at every tick (and
                            between commands): each fork, trim or next turn starts from the pool
    Churn(preempt_every=n)  also every running lane is preempted after the step of every n-th
                            tick (parked, held, and resumed by import at the next admission), so
                            a generation is swapped out inside its prompt and between its tokens

and after every tick the KV manager's bookkeeping is checked against the engine (a lane naming
a sequence the engine freed, a leaked sequence, a miscounted length), so a broken invariant
stops the host at the tick that broke it rather than at some later call. Outputs must not
change: a test runs a story with and without churn and compares the tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from superfluid.host.kv import KVManager
    from superfluid.host.lane import Live


class ChurnViolation(AssertionError):
    """The KV manager's bookkeeping disagrees with the engine (a defect of the host, found by churn)."""


@dataclass(frozen=True)
class Churn:
    """Park every idle lane at every tick; preempt every running lane every `preempt_every`
    ticks (0: never); check the KV manager after every tick."""

    preempt_every: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.preempt_every, int) or self.preempt_every < 0:
            raise ValueError(f"Churn(preempt_every={self.preempt_every!r}): a whole number of ticks >= 0 "
                             "(0: never preempt)")

    def after_tick(self, tick: int, kv: KVManager, sessions: Iterable[Live]) -> None:
        """At the end of tick number `tick`: preempt the running lanes if it is a chosen tick,
        then check every session's bookkeeping (ChurnViolation naming what is wrong)."""
        if self.preempt_every and tick % self.preempt_every == 0:
            for live in [live for live in kv.lanes if live.job is not None]:
                kv.preempt(live)
        problems = bookkeeping_problems(kv, sessions)
        if problems:
            raise ChurnViolation("; ".join(problems))


def bookkeeping_problems(kv: KVManager, sessions: Iterable[Live]) -> list[str]:
    """What is wrong with the KV manager's bookkeeping of `sessions` (every session the host has), if
    anything: each lane names a sequence of its own that the engine holds, with exactly the
    positions the lane says; the engine holds no sequence without a lane; a session without a
    lane names no sequence, and the entry it holds while swapped out is still in the pool.
    Empty when all is well (checked after every tick under churn)."""
    found = []
    seqs = sorted(live.seq for live in kv.lanes if live.seq is not None)
    if len(seqs) != len(kv.lanes) or len(set(seqs)) != len(seqs):
        found.append(f"the lanes name sequences {[live.seq for live in kv.lanes]}: each needs one of its own")
    if seqs != kv.engine.sequences():
        found.append(f"the lanes hold sequences {seqs}, the engine {kv.engine.sequences()}")
    for live in sessions:
        name = f"session {live.state.id}"
        if live in kv.lanes:
            if live.seq in kv.engine.sequences() and kv.engine.length(live.seq) != live.kv:
                found.append(f"{name}: its lane says {live.kv} positions, sequence {live.seq} holds "
                             f"{kv.engine.length(live.seq)}")
            if live.kv > len(live.state.tokens):
                found.append(f"{name}: {live.kv} positions in its lane, {len(live.state.tokens)} tokens committed")
            if live.held is not None:
                found.append(f"{name} has a lane and still holds its swapped-out entry {live.held}")
        elif live.seq is not None or live.kv:
            found.append(f"{name} has no lane but names sequence {live.seq} with {live.kv} positions")
        elif live.held is not None and not kv.in_pool(live.held):
            found.append(f"{name} holds entry {live.held}, which the pool no longer has")
    if kv.cells_used() > kv.cells_total:
        found.append(f"{kv.cells_used()} cells used of {kv.cells_total}")
    return found
