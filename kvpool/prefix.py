"""The prefix index: which ready entry shares the longest token prefix with a request.

Token sequences are cut into blocks of BLOCK tokens; each full block gets a chained hash (the
hash of the previous block's hash and this block's tokens), seeded by the entry's *space*: its
engine identity and its namespace (`prefix_space`), so that an entry is only ever found by a
request of the same model, settings and namespace (a tenant, and a salt the request may add). An
entry is listed under every block hash of its tokens, so the deepest hash a request shares with
it bounds the match. A hash is only a hint: every candidate's stored tokens are compared with the
request, and the match length is the exact common prefix. A hash collision can therefore cost a
comparison, never return a wrong entry.

Matches shorter than one block are found through the request's first token: every entry is also
listed under (space, its first token).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import msgspec
import numpy as np
import xxhash

BLOCK = 16
SHORT_CANDIDATES = 64  # entries compared for a match shorter than one block


class PrefixMatch(msgspec.Struct, frozen=True):
    """The entry sharing the longest prefix with a request, and how many tokens match. An entry
    `on_disk` is one of the disk tier's (its id is the tier's): `Pool.load` brings it into memory."""

    entry_id: int
    tokens: int
    on_disk: bool = False


def prefix_space(identity: str, namespace: str) -> str:
    """The space an entry of `identity` in `namespace` is listed in: the identity's length heads
    it, so two different pairs never make the same space, whatever characters they hold."""
    return f"{len(identity)}:{identity}{namespace}"


def block_hashes(space: str, tokens: np.ndarray, block: int = BLOCK) -> list[int]:
    """Chained xxh3-64 of each full block of `tokens` (int32), seeded by the space."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    previous = xxhash.xxh3_64_intdigest(space.encode())
    hashes = []
    for start in range(0, len(tokens) - block + 1, block):
        hasher = xxhash.xxh3_64(previous.to_bytes(8, "little"))
        hasher.update(tokens[start:start + block])
        previous = hasher.intdigest()
        hashes.append(previous)
    return hashes


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixIndex:
    """Maps (space, block-hash chain) to entries; answers longest-prefix queries exactly.

    `tokens_of(entry_id)` returns an entry's stored live tokens; the index keeps only hashes.
    `hasher` computes the block hashes (tests force collisions through it).
    """

    def __init__(self, tokens_of: Callable[[int], np.ndarray],
                 hasher: Callable[[str, np.ndarray], list[int]] = block_hashes) -> None:
        self._tokens_of = tokens_of
        self._hasher = hasher
        self._by_hash: dict[tuple[str, int], set[int]] = defaultdict(set)
        self._by_first: dict[tuple[str, int], set[int]] = defaultdict(set)
        self._keys: dict[int, tuple[str, int | None, list[int]]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, entry_id: int, space: str, tokens: np.ndarray) -> None:
        """List `entry_id` (holding `tokens` in `space`)."""
        self.remove(entry_id)
        hashes = self._hasher(space, tokens)
        first = int(tokens[0]) if len(tokens) else None
        self._keys[entry_id] = (space, first, hashes)
        if first is not None:
            self._by_first[(space, first)].add(entry_id)
        for value in hashes:
            self._by_hash[(space, value)].add(entry_id)

    def remove(self, entry_id: int) -> None:
        """Forget `entry_id` (no-op if it is not listed)."""
        key = self._keys.pop(entry_id, None)
        if key is None:
            return
        space, first, hashes = key
        if first is not None:
            holders = self._by_first[(space, first)]
            holders.discard(entry_id)
            if not holders:
                del self._by_first[(space, first)]
        for value in hashes:
            holders = self._by_hash.get((space, value))
            if holders is not None:
                holders.discard(entry_id)
                if not holders:
                    del self._by_hash[(space, value)]

    def longest(self, space: str, tokens: np.ndarray, usable: Callable[[int], bool] = lambda entry_id: True,
                serves: Callable[[int, int], bool] | None = None) -> PrefixMatch | None:
        """The usable entry of `space` sharing the longest exact token prefix with `tokens`, or None.
        `serves(entry_tokens, matched)` says whether an entry of that many tokens can serve a
        match that long (a state that cannot be cut back serves only its whole length)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        hashes = self._hasher(space, tokens)
        best: PrefixMatch | None = None
        seen: set[int] = set()
        for depth in range(len(hashes), -1, -1):
            # Nothing listed only at a shallower depth can share more than depth blocks + a tail.
            if best is not None and best.tokens >= (depth + 1) * BLOCK:
                break
            if depth:
                holders = self._by_hash.get((space, hashes[depth - 1]), ())
            else:  # shorter than a block: the newest entries starting with the same token
                holders = sorted(self._by_first.get((space, int(tokens[0])), ()) if len(tokens) else (),
                                 reverse=True)[:SHORT_CANDIDATES]
            for entry_id in sorted(set(holders) - seen):
                seen.add(entry_id)
                if not usable(entry_id):
                    continue
                stored = self._tokens_of(entry_id)
                matched = common_prefix(tokens, stored)
                if serves is not None and matched > 0 and not serves(len(stored), matched):
                    continue
                if matched > 0 and (best is None or matched > best.tokens):
                    best = PrefixMatch(entry_id, matched)
        return best
