"""Planning for compaction: which slack to give back, and which extents to move.

Two kinds of waste, two remedies, both planned here as pure functions and carried out by the pool
(which copies live cells only, writes the new header, then frees the old extents, so a crash at
any point leaves either the old or the new entry whole):

* **Slack**: cells an entry reserves but does not hold. An entry whose slack passes a threshold
  is rewritten at its live size.

      before:  | live live live . . . . . . . |   capacity 10, live 3
      after:   | live live live |                  capacity 3; 7 cells back on the free list

* **Fragmentation**: enough free bytes in total, but no run long enough. The pool picks a window
  of the arena as long as the request, holding no pinned extent and the fewest bytes to move,
  and moves the extents inside it elsewhere, never onto their own bytes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Hashable, Iterable
from itertools import accumulate
from typing import NamedTuple


class Placed(NamedTuple):
    """A used extent as the planner sees it."""

    key: Hashable
    offset: int
    length: int
    movable: bool


class Window(NamedTuple):
    """A run [start, start + length) and the extents to move out of it."""

    start: int
    moved_bytes: int
    keys: tuple[Hashable, ...]


class Reserved(NamedTuple):
    """An entry's reservation as the slack policy sees it."""

    key: Hashable
    reserved_bytes: int
    live_bytes: int


def slack_to_reclaim(entries: Iterable[Reserved], ratio: float, min_bytes: int) -> list[Hashable]:
    """Entries whose slack is at least `min_bytes` and at least `ratio` of what they reserve,
    largest slack first."""
    chosen = [(e.reserved_bytes - e.live_bytes, e.key) for e in entries
              if e.reserved_bytes - e.live_bytes >= max(min_bytes, ratio * e.reserved_bytes)]
    chosen.sort(key=lambda item: -item[0])
    return [key for _, key in chosen]


def windows(placed: Iterable[Placed], arena_size: int, need: int, limit: int = 8) -> list[Window]:
    """Up to `limit` windows of `need` bytes that hold no immovable extent, fewest bytes to move
    first. A window starts at the arena's start or at the end of a used extent (where free space
    begins), so each one begins with whatever free run is there."""
    extents = sorted(placed, key=lambda p: p.offset)
    if need <= 0 or need > arena_size:
        return []
    offsets = [p.offset for p in extents]
    used_before = [0, *accumulate(p.length for p in extents)]
    pinned_before = [0, *accumulate(0 if p.movable else 1 for p in extents)]
    found: list[Window] = []
    first = 0  # first extent that ends after the window's start
    for start in sorted({0, *(p.offset + p.length for p in extents)}):
        end = start + need
        if end > arena_size:
            break
        while first < len(extents) and extents[first].offset + extents[first].length <= start:
            first += 1
        last = bisect_right(offsets, end - 1)  # extents starting before the window's end
        if pinned_before[last] - pinned_before[first]:
            continue
        moved = used_before[last] - used_before[first]
        found.append(Window(start, moved, tuple(p.key for p in extents[first:last])))
    found.sort(key=lambda w: (w.moved_bytes, w.start))
    return found[:limit]
