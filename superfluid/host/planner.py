"""The step planner: what each step carries, as a token budget sized from measured step costs.

Every step carries one decode token for each decoding lane first (decode is never held back by
prefill), then prefill chunks from as many prompts as fit: those it can end while their first
token is owed first, then the most urgent. A step that feeds a short prompt whole carries only
prompts it ends, none four times longer, and never two such steps in a row (the one after goes
by urgency alone, so a stream of short prompts cannot hold a long one back). Where the engine
runs prompt chunks apart from decode tokens, lanes within one step's time of their end (their
requests' max_tokens) decode first, beside no chunk of a prompt the step cannot end (unless a
prompt of a more urgent class waits), until such chunks have waited one step's time
(`Planner.plan` says why: where llama.cpp puts the decode tokens' cells). How many prompt tokens
fit is a matter of time: a step is what every decoding lane waits for before its next token, and
what a request arriving meanwhile waits for before its prompt goes first. So a step lasts at most

    first_token_target      always (a request arriving during the step waits for its end), and
    decode_step_target      while a lane decodes for a reader that takes its tokens as they come
                            (its next token waits for the step's end; a reply read whole waits
                            only for the sum of its steps, and the prompts beside it are fed
                            in larger chunks, which cost less per token),

and carries the most tokens that the measured step costs say fit in that time (never more than
`prefill_budget` prompt tokens, and at least MIN_PREFILL_CHUNK so that prompts always advance).
A step's long chunks then run in pieces (`Planner.pieces`), between which the scheduler can end
the step for a request that goes first: such a request waits for one piece, not the step.

The costs are measured, not assumed: the seconds of each step are kept by the tokens it carried,
in buckets of powers of two, and by the cells those tokens attended (a token late in a long
context costs more than an early one); a step of n tokens at a depth is predicted from the
measured steps nearest in size, at that depth (`StepCosts`). A step reads every weight whatever
it carries, so a token costs less in a larger step (on SmolLM2 on 2 cores with flash attention, 1,800 prompt tokens prefill at 251 tok/s in chunks
of 512, 166 in chunks of 32 and 150 in chunks of 8): the longer the targets allow a step to be,
the closer prefill comes to the engine's full speed. Predictions past the largest step measured
take its cost per token (an overestimate), so budgets grow step by step as larger steps are
measured, and never jump past what was seen.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engines.base import Descriptor, StepRequest
from superfluid.host.request import SHORT_FACTOR, Priority

if TYPE_CHECKING:
    from superfluid.host.lane import Live
    from superfluid.host.policy import Policy

# The fewest prompt tokens a step carries for prefill, whatever the targets: prompts always
# advance, and a chunk that would leave fewer than this behind takes them too (a step for a few
# tokens costs nearly a whole one).
MIN_PREFILL_CHUNK = 8
# A step's prompt chunks run in pieces of about this many tokens or more, and between two pieces
# the step can stop for a request that goes first (`Planner.pieces`). On llama.cpp's CPU flash
# attention a prompt token costs the same from chunks of 128 up (beside two 1,800-token documents,
# 2.51 ms in chunks of 128 against 2.47 in 512 early in a prompt, 3.33 against 3.25 late), and
# 5-11% more in chunks of 64. A chunk is cut into the whole number of pieces nearest its length,
# so a cut piece holds 0.75-1.5 pieces' worth (a chunk of 1.9 runs as two: on a machine where the
# first-token target fits 240 tokens a step, steps cut only at two whole pieces were never cut).
MIN_PIECE = 128
# ...and of at most about this share of the first-token target where the measured costs allow
# more than MIN_PIECE in it: a request that goes first waits for at most one piece.
PIECE_SHARE = 0.25
# Steps are cut only while requests that go first keep arriving: one did in the last this many
# seconds. Each piece is a forward, and a forward reads every weight whatever it carries, so
# pieces cost prompts about 2% of their time (128 tokens a piece against ~300-400 in one) and
# save nothing where no request would go first (prompts that all arrive together, conversations
# whose next turns are no shorter than the prompts being fed).
RECENT_ARRIVALS = 10.0
# Weight of the newest step in its bucket's moving average of cost: recent steps count most (the
# machine may be shared, and its speed drifts).
NEWEST = 0.3
# ...and in the slower moving averages that fit how a token's cost grows with its depth (about the
# last ten steps of a size): the slope is the model's and the kernel's, not the moment's.
SLOPE_NEWEST = 0.1
# One step's cost counts in the slope's averages at most this share away from their mean: a slow
# step (another process on the cores, a stall) must not pass for a slope, while the cost that
# depth adds (a few percent from one step to the next) passes whole.
SLOPE_CLIP = 0.25
# A slope is fitted from the steps of a size and of the sizes next to it (half and twice: the same
# kernels), once this many of them were measured and their depths (the mean cells their tokens
# attended) spread by this much (a standard deviation): fewer or closer, noise passes for a slope.
MIN_SLOPE_STEPS = 8
MIN_DEPTH_SPREAD = 128.0
# However the slope extrapolates, a bucket's cost a token is kept within these multiples of its
# measured average (a noisy slope must not promise a free step, nor forbid every step).
COST_RANGE = (0.25, 8.0)


@dataclass
class _Bucket:
    """Steps of one size class: moving averages of the tokens they carried, of the cells their
    tokens attended and of their seconds a token (the newest weighing NEWEST), and slower ones
    (SLOPE_NEWEST) of the depth, its spread and how the cost moved with it."""

    tokens: float
    depth: float
    cost: float  # seconds a token
    steps: int = 1
    slow_depth: float = 0.0
    slow_cost: float = 0.0
    depth_variance: float = 0.0
    covariance: float = 0.0  # of depth and seconds a token

    def __post_init__(self) -> None:
        self.slow_depth, self.slow_cost = self.depth, self.cost

    def fold(self, tokens: int, depth: float, cost: float) -> None:
        """Fold one step in."""
        self.steps += 1
        self.tokens += NEWEST * (tokens - self.tokens)
        self.depth += NEWEST * (depth - self.depth)
        self.cost += NEWEST * (cost - self.cost)
        to_depth = depth - self.slow_depth
        to_cost = max(-SLOPE_CLIP * self.slow_cost, min(SLOPE_CLIP * self.slow_cost, cost - self.slow_cost))
        self.slow_depth += SLOPE_NEWEST * to_depth
        self.slow_cost += SLOPE_NEWEST * to_cost
        self.depth_variance = (1 - SLOPE_NEWEST) * (self.depth_variance + SLOPE_NEWEST * to_depth * to_depth)
        self.covariance = (1 - SLOPE_NEWEST) * (self.covariance + SLOPE_NEWEST * to_depth * to_cost)

    def cost_at(self, depth: float, slope: float) -> float:
        """Seconds a token at `depth`, by `slope` from this bucket's recent average."""
        low, high = COST_RANGE
        return min(high * self.cost, max(low * self.cost, self.cost + slope * (depth - self.depth)))


class StepCosts:
    """Measured seconds of steps by the tokens they carried and the cells those tokens attended.

    A step reads every weight whatever it carries, so its tokens cost less in a larger step; and
    each token attends every cell before it, so a token late in a long context costs more than an
    early one (on SmolLM2 on 2 cores with flash attention, a prompt token 2.47 ms early in a
    1,800-token prompt and 3.25 ms late, in chunks of 512; a decode token 6.4 ms at a short
    context and 10.8 ms at ~900 cells). Steps are kept in buckets by the log2 of their tokens,
    and in each bucket a token's cost is fitted as a line in the step's depth (the mean cells its
    tokens attended), from its own steps and those of the sizes next to it: a step of n tokens at
    depth d is predicted from the buckets nearest n, each at d. Where too few steps, or steps all
    at about one depth, say nothing of a slope, a bucket predicts its recent average whatever the
    depth (as the cost by token count alone did)."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}  # by log2 of the tokens carried

    def observe(self, tokens: int, seconds: float, depth: float = 0.0) -> None:
        """Fold one step's duration in: `tokens` carried, their mean depth (cells attended)."""
        if tokens <= 0 or seconds < 0:
            return
        key = int(math.log2(tokens))
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = _Bucket(float(tokens), float(depth), seconds / tokens)
        else:
            bucket.fold(tokens, depth, seconds / tokens)

    def measured(self) -> bool:
        """True once any step was measured."""
        return bool(self._buckets)

    def _slopes(self) -> dict[int, float]:
        """Each bucket's slope, seconds a token gains per cell of depth: fitted from its steps and
        its neighbours' (within each bucket, how the cost moved with the depth) where enough of
        them, spread enough in depth, say; else 0 (its average, whatever the depth). Never
        negative: attending more cells never costs less."""
        slopes = {}
        for key in self._buckets:
            near = [self._buckets[other] for other in (key - 1, key, key + 1) if other in self._buckets]
            variance = sum(bucket.depth_variance for bucket in near) / len(near)
            if sum(bucket.steps for bucket in near) < MIN_SLOPE_STEPS or variance < MIN_DEPTH_SPREAD ** 2:
                slopes[key] = 0.0
            else:
                slopes[key] = max(0.0, sum(bucket.covariance for bucket in near) / len(near) / variance)
        return slopes

    def _points(self, depth_of: Callable[[float], float]) -> list[tuple[float, float]]:
        """(tokens, seconds) of each bucket by size, each at the depth `depth_of` gives for its
        tokens, the seconds made non-decreasing (a larger step never predicts less)."""
        slopes, points, longest = self._slopes(), [], 0.0
        for key in sorted(self._buckets):
            bucket = self._buckets[key]
            longest = max(longest, bucket.tokens * bucket.cost_at(depth_of(bucket.tokens), slopes[key]))
            points.append((bucket.tokens, longest))
        return points

    def seconds_for(self, tokens: int, depth: float = 0.0) -> float | None:
        """The predicted seconds of a step of `tokens` whose tokens attend `depth` cells on
        average (None: nothing measured yet)."""
        points = self._points(lambda _: depth)
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

    def tokens_within(self, seconds: float, start: int = 0) -> int | None:
        """The most prompt tokens a step may carry from context position `start` (the cells
        already before them) to last at most `seconds` (None: nothing measured)."""
        points = self._points(lambda tokens: start + (tokens + 1) / 2)
        if not points:
            return None
        first, last = points[0], points[-1]
        if seconds <= first[1]:
            return int(first[0] * seconds / first[1]) if first[1] > 0 else int(first[0])
        for (n0, s0), (n1, s1) in zip(points, points[1:]):
            if s0 <= seconds <= s1:
                return int(n0 + (n1 - n0) * (seconds - s0) / (s1 - s0)) if s1 > s0 else int(n1)
        return int(last[0] * seconds / last[1]) if last[1] > 0 else 1 << 30


def depth_of(requests: list) -> float:
    """The mean cells a token of these (lane, StepRequest) pairs attends: a token at context
    position p (its lane's cells before the request, then the request's own tokens before it)
    attends p + 1 cells, itself included."""
    tokens = attended = 0
    for live, request in requests:
        count = len(request.tokens)
        tokens += count
        attended += count * live.kv + count * (count + 1) // 2
    return attended / tokens if tokens else 0.0


def step_seconds(first_token_target: float | None, decode_step_target: float | None, streaming: bool) -> float | None:
    """How long this step may last: the first-token target, and the decode-step target while a
    lane decodes for a reader of its tokens as they come (None: no bound)."""
    bounds = [first_token_target] + ([decode_step_target] if streaming else [])
    bounds = [bound for bound in bounds if bound is not None]
    return min(bounds) if bounds else None


def prefill_budget(costs: StepCosts, limit: int, seconds: float | None, decode_tokens: int, start: int = 0) -> int:
    """Prompt tokens this step carries beside `decode_tokens` decode tokens, from context
    position `start`: the most that the measured costs fit in `seconds`, at most `limit` (the
    configured budget), at least MIN_PREFILL_CHUNK. Unmeasured or unbounded: the whole `limit`
    (the first step measures)."""
    if seconds is None:
        return limit
    fits = costs.tokens_within(seconds, start)
    if fits is None:
        return limit
    return max(MIN_PREFILL_CHUNK, min(limit, fits - decode_tokens))


class Planner:
    """Plans each step of one engine: its decode tokens and prefill chunks, from the measured
    step costs (`costs`, fed by the scheduler after every step) and the policy's targets."""

    def __init__(self, policy: Policy, descriptor: Descriptor, memory_cuts_back: bool,
                 urgency: Callable[[Live, int], tuple]) -> None:
        self.policy, self.descriptor, self.urgency = policy, descriptor, urgency
        self.memory_cuts_back = memory_cuts_back  # False: checkpoints within prompts (sliding window, recurrent)
        self.costs = StepCosts()
        self._exclusive_before = False  # the last step carried only prompts it ended
        self._held = 0.0  # predicted seconds of the steps prompt chunks were held out of for ending lanes
        self._held_before = 0.0  # its value before the step last planned (restored if it is dropped)
        self.went_first_at: float | None = None  # when a request that goes first last arrived (any thread sets it)

    def plan(self, lanes: list[Live], room: int) -> tuple[list, list]:
        """This step's requests for the running `lanes` within `room` free cells: (decode,
        prefill) lists of (lane, StepRequest), prefill most urgent first. While an interactive
        lane runs, other classes' prefill waits. A step that feeds a prompt whole carries no
        piece of a much longer prompt (unless the step before left one out)."""
        decode = [(live, StepRequest(live.seq, live.state.tokens[live.kv:], "last")) for live in lanes
                  if live.pending == 1]
        prefilling = sorted((live for live in lanes if live.pending > 1),
                            key=lambda live: self.urgency(live, live.pending))
        if not prefilling:  # decode alone (most steps under load): no budget to work out, no hold
            self._exclusive_before = False
            self._held_before, self._held = self._held, 0.0
            return decode, []
        # the decode-step target binds while a lane's reader takes its tokens as they come; a reply
        # read whole waits for the sum of its steps, not for any one of them
        streaming = any(live.job.request.streamed for live, _ in decode)
        seconds = step_seconds(self.policy.first_token_target, self.policy.decode_step_target, streaming)
        prefill = self._chunks(prefilling, decode, room, seconds, ends_first=not self._exclusive_before)
        # prompts this step feeds whole, from their first token to their last
        whole = [len(request.tokens) for live, request in prefill
                 if len(request.tokens) == live.pending and not live.job.produced and not live.job.prefilled]
        exclusive = bool(whole) and not self._exclusive_before
        if exclusive:
            # This step carries a short prompt whole: it carries no piece of a longer prompt, nor
            # the end of a much longer one, so its first token comes as fast as on an idle engine
            # (the longer prompts go on at the next step; their chunks would have run in a
            # forward of their own anyway, so splitting the step costs them next to nothing).
            # The last chunk of a prompt fed over several steps earns no such step: what it
            # would save is small beside what that prompt has waited already, and the step
            # would carry little. Never two such steps in a row: a stream of short prompts
            # cannot hold the long ones back.
            # (A prompt's end counts by the whole prompt: a chat's 19 tokens beside the last 54
            # of an agent's 1,823 took 0.55 s in one llama.cpp forward, the chat's alone 0.08.)
            short = SHORT_FACTOR * min(whole)
            kept = [(live, request) for live, request in prefill
                    if len(request.tokens) == live.pending and live.job.prefilled + live.pending < short]
            prefill = kept
            exclusive = len(kept) < len(prefilling)  # a prompt waits: the next step goes by urgency
        self._exclusive_before = exclusive
        self._held_before = self._held
        partial = [live for live, request in prefill if len(request.tokens) < live.pending]
        if not partial:  # nothing held back (a short prompt's step does not end a hold)
            if not prefilling:
                self._held = 0.0  # no prompt waits: a later one starts afresh
            return decode, prefill
        if self._lanes_ending(decode, partial, seconds):
            # Lanes that end within one step's time decode first, in steps of their own: no chunk
            # of a prompt the step cannot end goes beside them (a prompt it feeds whole still
            # does, so a short request's first token does not wait). Where chunks run apart from
            # decode tokens this order costs no forward more, and each decode token's cell lands
            # beside its own lane's instead of between two chunks of the next prompt: when the
            # lane ends it leaves one hole, not single cells between the chunks for later prompts
            # to be spread over (a prompt whose cells share blocks of 64 with other sequences
            # makes its tiles compute those blocks too). The chunks wait for such steps at most
            # one step's time in all before they go again, however many short requests keep
            # arriving (their own steps between these count as before: never two in a row).
            kept = [(live, request) for live, request in prefill if len(request.tokens) == live.pending]
            together = decode + kept
            predicted = self.costs.seconds_for(sum(len(request.tokens) for _, request in together), depth_of(together))
            if predicted is not None and self._held + predicted <= seconds:
                self._held += predicted
                return decode, kept
        self._held = 0.0
        return decode, prefill

    def arrival_went_first(self, now: float) -> None:
        """A request that goes before the prompts being fed arrived at `now` (perf_counter)."""
        self.went_first_at = now

    def pieces(self, requests: list, now: float) -> list[list]:
        """The step's (lane, StepRequest) pairs as the sub-steps the scheduler runs one after
        another. While requests that go first keep arriving (one in the last RECENT_ARRIVALS
        seconds before `now`), prompt chunks run as pieces: a piece is about MIN_PIECE tokens or
        more (PIECE_SHARE of the first-token target where the costs fit more), a chunk of one
        and a half pieces' worth or more is cut into the whole number of pieces nearest its
        length, and every piece but a chunk's last asks for no logits. Where the engine runs each
        chunk of 64 tokens or more in a forward of its own (`chunks_apart`: llama.cpp's CPU
        flash attention), every chunk of half a piece or more is a piece of its own too, which
        costs no forward more (two agents' chunks of 111 and 100 tokens had run as one sub-step
        of a whole second, which a chat waited for); elsewhere one forward carries them all, and
        they stay in the first sub-step. The first sub-step carries the decode tokens, the chunks
        not cut and the first piece; every later piece is a sub-step of its own, in the plan's
        order (the most urgent prompt's pieces first). Between two sub-steps the step can stop
        for a request that goes first, which then waits for one piece at most instead of the
        whole step, and nothing already run is lost. No target, or no such request lately: one
        sub-step, as planned."""
        recent = self.went_first_at is not None and now - self.went_first_at <= RECENT_ARRIVALS
        if self.policy.first_token_target is None or not recent:
            return [requests]
        share = PIECE_SHARE * self.policy.first_token_target
        alone = 0.5 if self.descriptor.packing.chunks_apart else 1.5  # pieces' worth that runs apart
        first, later, opened = [], [], False
        for live, request in requests:
            # (a chunk asking for rows of every token is not cut; a piece late in a long prompt
            # attends more cells, so fewer of its tokens fit)
            whole = len(request.tokens) < alone * MIN_PIECE or request.logits == "all"
            size = MIN_PIECE if whole else max(MIN_PIECE, self.costs.tokens_within(share, live.kv) or 0)
            if whole or len(request.tokens) < alone * size:
                first.append((live, request))
                continue
            tokens, end = request.tokens, len(request.tokens)
            count = max(1, round(end / size))  # the whole number of pieces nearest its length
            bounds = [end * i // count for i in range(count + 1)]
            cut = [(live, StepRequest(request.seq, tokens[a:b], request.logits if b == end else "none"))
                   for a, b in zip(bounds, bounds[1:])]
            if not opened:
                first.append(cut.pop(0))
                opened = True
            later.extend([piece] for piece in cut)
        return [first, *later]

    def _lanes_ending(self, decode: list, partial: list[Live], seconds: float | None) -> bool:
        """True where the engine runs prompt chunks apart from decode tokens and a decoding lane
        ends within `seconds` of steps of these decode tokens (its request's max_tokens reached,
        one token a step; a reply that ends on its own is not foreseen), of a class at least as
        urgent as every prompt of `partial` (those the step feeds only in part)."""
        if not decode or seconds is None or not self.descriptor.packing.chunks_apart:
            return False
        step = self.costs.seconds_for(len(decode), depth_of(decode))
        if step is None:
            return False
        waiting = min(live.job.priority for live in partial)
        return any(live.job.priority <= waiting and (live.job.request.max_tokens - live.job.produced) * step <= seconds
                   for live, _ in decode)

    def step_dropped(self) -> None:
        """The step last planned did not run (interrupted, or planned again for an arrival)."""
        self._exclusive_before = False
        self._held = self._held_before

    def _chunks(self, prefilling: list[Live], decode: list, room: int, seconds: float | None,
                ends_first: bool) -> list:
        """Prefill chunks for `prefilling` lanes (most urgent first) beside `decode`, in a step
        of at most `seconds`; with `ends_first`, the prompts whose first token is owed and whose
        rest fits go before the others."""
        interactive = any(live.job.priority == Priority.INTERACTIVE for live in prefilling + [l for l, _ in decode])
        # what one step can carry (the engine's batch, the free cells), and what its time allows
        limit = min(self.descriptor.packing.max_tokens - len(decode), room - len(decode))
        # (sized at the depth of the most urgent prompt, which the step feeds first)
        budget = prefill_budget(self.costs, self.policy.prefill_budget, seconds, len(decode), prefilling[0].kv)
        budget, prefill = min(budget, limit), []
        if ends_first:
            # A prompt this step can end goes before one it cannot, however long the other has
            # waited: age orders prompts that all need more steps, and must not let a long prompt
            # near its end take the whole budget from a short one that arrived behind it (a chat
            # would wait seconds behind an agent's last chunks). The long prompt loses nothing it
            # is owed: the step after one that fed a short prompt alone goes by urgency order.
            # Among those it can end, the shortest of each class first.
            prefilling = sorted(prefilling, key=lambda live: (1,) if live.job.produced or live.pending > budget
                                else (0, live.job.priority, live.pending))
        for live in prefilling:
            if budget <= 0:
                break
            if interactive and live.job.priority != Priority.INTERACTIVE:
                continue  # an interactive lane's steps carry no other class's prefill
            take = min(budget, live.pending)
            if live.pending - take < MIN_PREFILL_CHUNK:  # no runt tail: a step for a few tokens costs a whole one
                take = min(live.pending, limit)
            take = min(take, self._to_checkpoint(live))
            chunk = live.state.tokens[live.kv:live.kv + take]
            budget -= len(chunk)
            limit -= len(chunk)
            prefill.append((live, StepRequest(live.seq, chunk, "last" if len(chunk) == live.pending else "none")))
        return prefill

    def _to_checkpoint(self, live: Live) -> int:
        """Where the memory cannot be cut back, the tokens up to `live`'s next checkpoint (a
        chunk ends there, so checkpoints fall every `checkpoint_tokens` whatever size the plan
        gives chunks, and a trim restores one at most that far back); else no limit."""
        if self.memory_cuts_back:
            return live.pending
        parked = live.state.parked[1] if live.state.parked is not None else 0
        due = parked + self.policy.checkpoint_tokens - live.kv
        return due if due >= MIN_PREFILL_CHUNK else live.pending
