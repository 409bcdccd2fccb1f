"""Cutting the step in flight short for a request that would go before it.

A step lasts up to the first-token target (1 s by default) while prompts prefill, and a
request arriving meanwhile used to wait for its end before its own prompt went first: behind
eight long prompts prefilling, a one-line chat waited about half a step more than on an idle
engine. Where the engine can stop a forward part-way (llama.cpp on plain KV: it keeps the
ubatches it finished), the thread that queues a request asks it to, when

- the request would go first: its class and prompt come before every prompt the step feeds
  (a shorter prompt of the same class, or a more urgent class), and its prompt is short (no
  longer than the step in flight carries; a more urgent class need not be short), and
- the step has barely begun: at most INTERRUPT_WITHIN of its predicted time has passed, and
  at least MIN_SAVED_SECONDS of it remain. The work a stopped forward throws away is what it
  did so far; an arrival late in a step waits for its end instead. Requests that come one
  after another (a client that sends the next once the last is answered) find a step that has
  just begun, and cost almost nothing; arrivals spread over time stop about one step in eight,
  each after an eighth of it on average.

The scheduler counts the steps stopped and the seconds they had run (`interrupted_steps`,
`interrupted_seconds` in the host's statistics).
"""

from __future__ import annotations

from typing import NamedTuple

from superfluid.host.request import Priority

# A step is stopped only while no more than this share of its predicted time has passed.
INTERRUPT_WITHIN = 0.25
# ...and only when at least this much of it is left to save.
MIN_SAVED_SECONDS = 0.05


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


def worth_interrupting(flight: StepInFlight | None, arrival: Arrival, now: float) -> bool:
    """True when `arrival` should stop `flight` (None: no prompt is being fed) at `now`."""
    if flight is None:
        return False
    if (arrival.priority, arrival.prompt_tokens) >= flight.first:
        return False  # it would not go before what the step feeds
    if arrival.priority == flight.first[0] and arrival.prompt_tokens > flight.tokens:
        return False  # not a short prompt: a step of its own would take as long as this one
    elapsed = now - flight.began
    return elapsed <= INTERRUPT_WITHIN * flight.predicted and flight.predicted - elapsed >= MIN_SAVED_SECONDS
