"""A session's place in the scheduler: its logged state, the generation it runs, and the engine
sequence and cells that hold its KV.

A lane's engine sequence holds the KV of its session's first `kv` tokens; the tokens after that
(at least the last one: the next forward needs its logits) are fed by the next steps:

    state.tokens   [t0 t1 t2 ............ t(kv-1) | t(kv) ... t(n-1)]
                    <-------- in the lane -------->  <-- to be fed -->

Cells are counted by *span*: a run of positions written once into the engine's cache. A fork in
a unified cache shares its parent's spans (the same cells, tagged with one more sequence), so
cells used = for each span, the furthest any lane reaches into it:

    parent   [==== span A ====][== span B ==]
    child    [==== span A ====][= C =]          A is counted once: A + B + C cells in use
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from superfluid.host import sampling as sampler
from superfluid.host.constraints import Matching
from superfluid.host.log_records import SessionState
from superfluid.host.request import GenerateRequest, Priority
from superfluid.host.session import Generation
from superfluid.host.stream import TextStream


class Span(NamedTuple):
    """Positions [start, end) of a lane that live in cells written under `group`."""

    group: int
    start: int
    end: int


@dataclass(eq=False)
class Job:
    """One generation: what it asked for (its request, unchanged from where it entered) and where
    it is."""

    generation: Generation
    request: GenerateRequest
    sampling: sampler.Sampling  # the request's overrides over the session's defaults
    priority: Priority  # the request's, else the session's
    stream: TextStream
    deadline: float | None  # on the scheduler's clock: the request's timeout from its arrival
    arrival: int  # order of arrival (the clock of the scheduler's commands)
    queued_at: float  # when it began waiting (for max_wait_seconds)
    fed_at_arrival: int  # tokens the engine had been fed when it arrived: its age, for short-first with aging
    first: int = 0  # position of the first token this generation produces
    opened_at: int = 0  # the session's length before the generation committed its assistant opening
    produced: int = 0
    prefilled: int = 0  # tokens this generation fed before its output
    started: bool = False  # admitted at least once (prompt counters set, the client told)
    admitted: int = 0  # the clock when it last got a lane: the most recently started is preempted first
    reserved_to: int = 0  # the position up to which its cells were reserved at admission
    matching: Matching | None = None  # its place in its constraint's grammar (constraints.py), if constrained


@dataclass(eq=False)
class Live:
    """The scheduler's side of a session or a request: its state, its lane in the engine if any,
    and its generation if one runs. Its state is written only by `Sessions` (superfluid.host.sessions)."""

    state: SessionState
    durable: bool = True  # a session, logged; False: a one-shot request's lane, in memory only
    seq: int | None = None
    kv: int = 0  # state.tokens[:kv] are in the engine sequence
    held: int | None = None  # a pool entry this lane holds a reference to while it is swapped out
    job: Job | None = None
    version: int = 0  # changes with its tokens or messages (appends rendered elsewhere check it)
    last_used: int = 0  # the clock of the last thing it did (least recently used is parked first)
    idle_since: float = 0.0  # when its last generation ended (for idle parking)
    active_at: float = 0.0  # when anything of it was last logged, or it was recovered (for expiry)
    owed_cut: int | None = None  # a cut back the log refused to record, made before its next command
    since_park: int = 0  # tokens committed since the last export
    pin: int | None = None  # the pool entry pinned for it, if pinned (the pin moves to each newly parked entry)
    started_from: int | None = None  # the pool entry its lane was imported from, until it parks its own
    warmed: int | None = None  # a pool entry read in from disk for it off the scheduler thread (a disk hit if used)
    borrowed: list[Span] = field(default_factory=list)  # spans shared with other lanes (a fork's prefix)
    own: Span = Span(0, 0, 0)  # the span this lane writes: [own.start, kv) in cells of group own.group
    # The most cells in use when this lane last took new ones (a step that fed it, its import): in
    # llama.cpp's unified cache its cells lie about that far up at most, and a forward reads every
    # cell up to the highest in use (kv.py, `KVManager.reseat_stranded`).
    seat_mark: int = 0

    @property
    def entry(self) -> int | None:
        """The pool entry of its parked KV, as its state records it (the pool may have evicted it
        since: the KV manager asks the pool before reading it)."""
        parked = self.state.parked
        return None if parked is None else parked[0]

    @property
    def pinned(self) -> bool:
        """True while its parked KV is pinned in the pool."""
        return self.pin is not None

    @property
    def pending(self) -> int:
        """Tokens committed but not yet fed to the engine."""
        return len(self.state.tokens) - self.kv

    def spans(self) -> list[Span]:
        """Every span of cells this lane's sequence holds, in position order."""
        own = Span(self.own.group, self.own.start, self.kv)
        return [*self.borrowed, own] if own.end > own.start else list(self.borrowed)
