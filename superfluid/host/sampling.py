"""Choosing the next token from logits, with a counter-based random stream.

Every draw is a pure function of (seed, position): the uniform number for the token at stream
position p comes from Philox keyed by the seed with its counter set to p. So a fork, a cut and a
resume after a crash or a preemption draw exactly what the uninterrupted stream would have, and
batching several sessions together changes nothing about any one of them.

The filters run in llama.cpp's usual order: repetition penalty, top-k, top-p, min-p, then
temperature; temperature 0 is greedy (the first highest logit). The draw walks the candidates
most likely first where top-k or top-p ordered them, else in token-id order: either way each
candidate is drawn with its probability.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec
import numpy as np


MAX_TOP_LOGPROBS = 20  # alternatives a token's logprobs may list (OpenAI's limit)


class SamplingError(ValueError):
    """A sampling parameter out of its range."""


class Alternative(NamedTuple):
    """One candidate token and its log-probability under the model."""

    token: int
    bytes: bytes
    logprob: float


class TokenLogprobs(NamedTuple):
    """The log-probability of a sampled token under the model's own distribution (the raw logits'
    softmax, before any penalty, filter or temperature: what the model thought, as vLLM reports by
    default) and the `top` most likely tokens at that position, most likely first."""

    token: int
    bytes: bytes
    logprob: float
    top: tuple[Alternative, ...]


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a session picks tokens. Defaults: greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    repetition_window: int = 64  # how many recent tokens the penalty looks at
    seed: int = 0

    def __post_init__(self) -> None:
        checks = (
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "a finite number >= 0"),
            ("top_k", self.top_k >= 0, "an integer >= 0 (0 turns it off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             "a finite number > 0 (1 turns it off)"),
            ("repetition_window", self.repetition_window >= 0, "an integer >= 0"),
            ("seed", 0 <= self.seed < 1 << 64, "an integer in [0, 2**64)"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise SamplingError(f"sampling {name}={getattr(self, name)!r}: must be {expected}")

    @property
    def greedy(self) -> bool:
        """True when no randomness is involved."""
        return self.temperature == 0


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) for stream position `position` under `seed`."""
    generator = np.random.Generator(np.random.Philox(key=seed, counter=position))
    return float(generator.random())


def sample(logits: np.ndarray, sampling: Sampling, position: int, recent: Sequence[int] = ()) -> int:
    """The token for stream position `position` given its `logits` (1-D) and the `recent` tokens
    before it (for the repetition penalty)."""
    scores = np.array(logits, dtype=np.float64)  # a copy: the penalty writes into it
    if sampling.repetition_penalty != 1.0 and recent and sampling.repetition_window:
        seen = np.unique(np.asarray(recent[-sampling.repetition_window:], dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < scores.size)]
        values = scores[seen]
        scores[seen] = np.where(values > 0, values / sampling.repetition_penalty, values * sampling.repetition_penalty)
    if sampling.greedy:
        token = int(np.argmax(scores))
        if np.isfinite(scores[token]):
            return token
        scores, token = _without_nan(scores)
        return token if token is not None else int(np.argmax(scores))
    # The candidates, as token ids. Nothing sorts the whole vocabulary: a full sort cost 6 ms a
    # token at SmolLM2's 49,152 ids and 46 ms at Gemma 3's 262,144 on 2 cores, against decode
    # steps of 15 and 28 ms.
    peak = scores.max()
    if not np.isfinite(peak):
        scores, token = _without_nan(scores)
        if token is not None:
            return token
        peak = scores.max()
    candidates = None  # None: every id, in id order
    if sampling.top_k and sampling.top_k < scores.size:
        candidates = _best(scores, sampling.top_k)
    if sampling.top_p < 1.0:
        candidates = _nucleus(scores, peak, sampling.top_p, candidates)
    kept = scores if candidates is None else scores[candidates]
    if sampling.min_p > 0.0:
        keep = np.exp(kept - peak) >= sampling.min_p
        candidates = (np.flatnonzero(keep) if candidates is None else candidates[keep])
        kept = kept[keep]
    weights = np.exp((kept - peak) / sampling.temperature)
    cumulative = np.cumsum(weights)
    draw = uniform(sampling.seed, position) * cumulative[-1]
    chosen = min(int(np.searchsorted(cumulative, draw, side="right")), len(kept) - 1)
    return chosen if candidates is None else int(candidates[chosen])


def _without_nan(scores: np.ndarray) -> tuple[np.ndarray, int | None]:
    """Scores with a NaN (a broken step: an overflow, a bad quantisation) never drawn; and the
    token that takes all the probability where a score is +inf (the first such). SamplingError
    when no score is left to draw from, which ends this generation, not the host."""
    scores[np.isnan(scores)] = -np.inf
    peak = scores.max()
    if peak == np.inf:
        return scores, int(np.argmax(scores))
    if peak == -np.inf:
        raise SamplingError("the model's logits at this position are all NaN or -inf: the engine's step produced "
                            "nothing to sample from (check the model file and its quantisation)")
    return scores, None


def _best(scores: np.ndarray, n: int) -> np.ndarray:
    """The ids of the `n` highest scores, highest first, ties to the lower id (as a stable sort
    of the whole would order them), found by partition."""
    if n >= scores.size:
        return np.argsort(-scores, kind="stable")
    chosen = np.argpartition(scores, scores.size - n)[scores.size - n:]
    threshold = scores[chosen].min()
    if np.count_nonzero(scores == threshold) != np.count_nonzero(scores[chosen] == threshold):
        # the partition split a tie at the edge: of the tied, the lower ids are the best
        above = np.flatnonzero(scores > threshold)
        chosen = np.concatenate((above, np.flatnonzero(scores == threshold)[:n - above.size]))
    return chosen[np.lexsort((chosen, -scores[chosen]))]


# Top-p without top-k groups the vocabulary by score in buckets of 1/16 of a logit: the buckets'
# probability mass says which tokens are surely in the nucleus and which bucket it ends in, and
# only that bucket is sorted. Sorting more (the best 64, 512, 4,096, ... until they reached top_p)
# took 4.1 ms a token on SmolLM2's logits, whose nucleus at 0.95 holds thousands of tokens.
BUCKETS_PER_LOGIT = 16
BUCKETS = 4096  # the last one also takes everything 256 logits or more below the best


def _nucleus(scores: np.ndarray, peak: float, top_p: float, candidates: np.ndarray | None) -> np.ndarray:
    """The fewest most likely candidates (ordered, or every id when None) whose probabilities,
    normalised over the candidates, reach `top_p`; ties at the edge go to the lower ids. Ordered
    candidates stay ordered; of every id, the nucleus comes in id order."""
    if candidates is not None:  # already the few best, in order
        probabilities = np.exp(scores[candidates] - peak)
        cumulative = np.cumsum(probabilities) / probabilities.sum()
        return candidates[:int(np.searchsorted(cumulative, top_p)) + 1]
    weights = np.exp(scores - peak)
    target = top_p * weights.sum()
    bucket = np.minimum((peak - scores) * BUCKETS_PER_LOGIT, BUCKETS - 1).astype(np.int64)
    below = np.cumsum(np.bincount(bucket, weights=weights, minlength=BUCKETS))  # mass of buckets 0..j
    edge = min(int(np.searchsorted(below, target)), BUCKETS - 1)  # the bucket where it reaches top_p
    needed = target - (below[edge - 1] if edge else 0.0)
    inside = bucket < edge
    last = np.flatnonzero(bucket == edge)  # ascending ids: a stable sort sends ties to the lower id
    last = last[np.argsort(-scores[last], kind="stable")]
    inside[last[:int(np.searchsorted(np.cumsum(weights[last]), needed)) + 1]] = True
    return np.flatnonzero(inside)


def logprobs(logits: np.ndarray, token: int, top: int, spell: Callable[[int], bytes]) -> TokenLogprobs:
    """`token`'s log-probability under `logits` (1-D) and the `top` most likely tokens (ties: lower
    id first), each spelled by `spell` (its bytes)."""
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise SamplingError(f"top logprobs={top!r}: must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    scores = np.asarray(logits, dtype=np.float64)
    peak = scores.max()
    log_total = peak + math.log(np.exp(scores - peak).sum())
    alternatives = ()
    if top:
        best = np.argpartition(-scores, top - 1)[:top] if top < scores.size else np.arange(scores.size)
        best = sorted(best.tolist(), key=lambda t: (-scores[t], t))
        alternatives = tuple(Alternative(t, spell(t), float(scores[t] - log_total)) for t in best)
    return TokenLogprobs(token, spell(token), float(scores[token] - log_total), alternatives)
