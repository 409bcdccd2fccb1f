"""The step planner: what each step carries, as a token budget sized from measured step costs.

Every step carries one decode token for each decoding lane first (decode is never held back by
prefill), then prefill chunks, most urgent first, from as many prompts as fit. How many prompt
tokens fit is a matter of time: a step is what every decoding lane waits for before its next
token, and what a request arriving meanwhile waits for before its prompt goes first. So a step
lasts at most

    first_token_target      always (a request arriving during the step waits for its end), and
    decode_step_target      while a lane decodes (its next token waits for the step's end),

and carries the most tokens that the measured step costs say fit in that time (never more than
`prefill_budget` prompt tokens, and at least MIN_PREFILL_CHUNK so that prompts always advance).

The costs are measured, not assumed: the seconds of each step are kept by the tokens it carried,
in buckets of powers of two, and a step of n tokens is predicted from the measured steps nearest
in size. A step reads every weight whatever it carries, so a token costs less in a larger step
(on SmolLM2 on 2 cores with flash attention, 1,800 prompt tokens prefill at 251 tok/s in chunks
of 512, 166 in chunks of 32 and 150 in chunks of 8): the longer the targets allow a step to be,
the closer prefill comes to the engine's full speed. Predictions past the largest step measured
take its cost per token (an overestimate), so budgets grow step by step as larger steps are
measured, and never jump past what was seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The fewest prompt tokens a step carries for prefill, whatever the targets: prompts always
# advance, and a chunk that would leave fewer than this behind takes them too (a step for a few
# tokens costs nearly a whole one).
MIN_PREFILL_CHUNK = 8
# Weight of the newest step in its bucket's moving average: recent steps count most, since the
# cost of a step grows with the context its lanes attend to.
NEWEST = 0.3


@dataclass
class _Bucket:
    tokens: float  # moving average of the tokens its steps carried
    seconds: float  # and of their seconds


class StepCosts:
    """Measured seconds of steps by the tokens they carried."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}  # by log2 of the tokens carried

    def observe(self, tokens: int, seconds: float) -> None:
        """Fold one step's duration in."""
        if tokens <= 0 or seconds < 0:
            return
        key = int(math.log2(tokens))
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = _Bucket(float(tokens), seconds)
        else:
            bucket.tokens += NEWEST * (tokens - bucket.tokens)
            bucket.seconds += NEWEST * (seconds - bucket.seconds)

    def measured(self) -> bool:
        """True once any step was measured."""
        return bool(self._buckets)

    def _points(self) -> list[tuple[float, float]]:
        """(tokens, seconds) of each bucket by size, seconds made non-decreasing (a larger step
        never predicts less than a smaller one)."""
        points, longest = [], 0.0
        for key in sorted(self._buckets):
            bucket = self._buckets[key]
            longest = max(longest, bucket.seconds)
            points.append((bucket.tokens, longest))
        return points

    def seconds_for(self, tokens: int) -> float | None:
        """The predicted seconds of a step of `tokens` (None: nothing measured yet)."""
        points = self._points()
        if not points:
            return None
        first, last = points[0], points[-1]
        if tokens <= first[0]:
            return first[1] * tokens / first[0]
        if tokens >= last[0]:
            return last[1] * tokens / last[0]  # the largest step's cost per token: an overestimate
        for (n0, s0), (n1, s1) in zip(points, points[1:]):
            if n0 <= tokens <= n1:
                return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0) if n1 > n0 else s1
        return last[1]  # not reached

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may carry to last at most `seconds` (None: nothing measured)."""
        points = self._points()
        if not points:
            return None
        first, last = points[0], points[-1]
        if seconds <= first[1]:
            return int(first[0] * seconds / first[1]) if first[1] > 0 else int(first[0])
        for (n0, s0), (n1, s1) in zip(points, points[1:]):
            if s0 <= seconds <= s1:
                return int(n0 + (n1 - n0) * (seconds - s0) / (s1 - s0)) if s1 > s0 else int(n1)
        return int(last[0] * seconds / last[1]) if last[1] > 0 else 1 << 30


def step_seconds(first_token_target: float | None, decode_step_target: float | None, decoding: bool) -> float | None:
    """How long this step may last: the first-token target, and the decode-step target while a
    lane decodes (None: no bound)."""
    bounds = [first_token_target] + ([decode_step_target] if decoding else [])
    bounds = [bound for bound in bounds if bound is not None]
    return min(bounds) if bounds else None


def prefill_budget(costs: StepCosts, limit: int, seconds: float | None, decode_tokens: int) -> int:
    """Prompt tokens this step carries beside `decode_tokens` decode tokens: the most that the
    measured costs fit in `seconds`, at most `limit` (the configured budget), at least
    MIN_PREFILL_CHUNK. Unmeasured or unbounded: the whole `limit` (the first step measures)."""
    if seconds is None:
        return limit
    fits = costs.tokens_within(seconds)
    if fits is None:
        return limit
    return max(MIN_PREFILL_CHUNK, min(limit, fits - decode_tokens))
