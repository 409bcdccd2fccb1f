"""Which entries to evict first when the pool needs room.

Eviction is by cost: an entry is worth what it saves (the prefill time its tokens would take to
recompute) per byte it holds. The cheapest-per-byte entries go first; among equals, the least
recently used; among those, the oldest id. Entries that are referenced or pinned are never
candidates: the pool filters them out before asking.

An entry of which a lower tier keeps a copy (the disk tier) goes before every entry of which
none does: dropping it from memory costs a read of its bytes back, far less than the prefill of
any entry's tokens (a disk reads a 1,500-token entry in tens of milliseconds, a CPU prefills it in
seconds).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Candidate(NamedTuple):
    """An evictable entry as the policy sees it."""

    entry_id: int
    stored_bytes: int
    recompute_cost: float  # seconds of prefill saved, or tokens when no timing is known
    last_used: int  # a logical clock: larger is more recent
    kept_below: bool = False  # a lower tier holds a copy: evicting it loses only a read back


def value_per_byte(candidate: Candidate) -> float:
    """What keeping the entry saves per byte it holds."""
    return candidate.recompute_cost / max(1, candidate.stored_bytes)


def ranked(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Candidates in eviction order: first to evict first."""
    return sorted(candidates, key=lambda c: (not c.kept_below, value_per_byte(c), c.last_used, c.entry_id))


def eviction_order(candidates: Iterable[Candidate]) -> list[int]:
    """Entry ids in eviction order."""
    return [candidate.entry_id for candidate in ranked(candidates)]
