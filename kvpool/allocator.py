"""Extents of the arena: contiguous byte runs handed out and taken back.

Free space is kept twice, in sorted containers: by offset (to coalesce a freed extent with its
neighbours) and by (length, offset) (to find the best fit: the smallest free extent that holds
the request, lowest offset first on ties). Every length is rounded up to ALIGN so copies start on
cache-line boundaries. The allocator knows nothing of entries; the pool maps entries to extents.
"""

from __future__ import annotations

from collections.abc import Iterable

from sortedcontainers import SortedDict, SortedList

ALIGN = 64


def align_up(n: int, alignment: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `alignment`."""
    return -(-n // alignment) * alignment


class Allocator:
    """Best-fit extent allocator over [0, size) with coalescing frees."""

    def __init__(self, size: int, used: Iterable[tuple[int, int]] = ()) -> None:
        """An allocator over `size` bytes; `used` lists (offset, length) extents already taken
        (a pool re-attached after a crash rebuilds its free list this way)."""
        if size < 0 or size % ALIGN:
            raise ValueError(f"arena size must be a non-negative multiple of {ALIGN}, got {size}")
        self.size = size
        self._by_offset: SortedDict = SortedDict()  # offset -> length
        self._by_size: SortedList = SortedList()  # (length, offset)
        self._free_bytes = 0
        cursor = 0
        for offset, length in sorted(used):
            if offset < cursor or offset + length > size or offset % ALIGN:
                raise ValueError(f"used extent ({offset}, {length}) overlaps another or leaves the arena")
            self._insert(cursor, offset - cursor)
            cursor = offset + align_up(length)
        self._insert(cursor, size - cursor)

    @property
    def free_bytes(self) -> int:
        """Total free bytes, in however many extents."""
        return self._free_bytes

    @property
    def largest_free(self) -> int:
        """The longest free extent: the largest allocation that can succeed without moving data."""
        return self._by_size[-1][0] if self._by_size else 0

    def free_extents(self) -> list[tuple[int, int]]:
        """Free (offset, length) extents in offset order."""
        return list(self._by_offset.items())

    def allocate(self, length: int, *, modulus: int | None = None, phase: int = 0) -> int | None:
        """Take `length` bytes (rounded up to ALIGN); the offset, or None when no extent fits.

        With `modulus`, the offset returned is congruent to `phase` modulo `modulus` (both
        multiples of ALIGN): the best fit for `length + modulus` is taken and what lies before
        and after the aligned start goes straight back to the free list.
        """
        if length <= 0:
            raise ValueError(f"allocation length must be > 0, got {length}")
        need = align_up(length)
        if modulus is not None:
            if modulus % ALIGN or phase % ALIGN or not 0 <= phase < modulus:
                raise ValueError(f"modulus {modulus} and phase {phase} must be multiples of {ALIGN}, phase < modulus")
            found = self._best_fit(need + modulus)
            if found is None:
                return None
            start = found + (phase - found) % modulus
            for offset, length in ((found, start - found), (start + need, found + modulus - start)):
                if length:
                    self.free(offset, length)  # merges with the rest of the extent it came from
            return start
        return self._best_fit(need)

    def _best_fit(self, need: int) -> int | None:
        index = self._by_size.bisect_left((need, -1))
        if index == len(self._by_size):
            return None
        have, offset = self._by_size[index]
        self._remove(offset, have)
        self._insert(offset + need, have - need)
        return offset

    def take(self, offset: int, length: int) -> None:
        """Take exactly [offset, offset + length): it must lie inside one free extent."""
        need = align_up(length)
        index = self._by_offset.bisect_right(offset) - 1
        if index < 0:
            raise ValueError(f"extent ({offset}, {length}) is not free")
        start, have = self._by_offset.peekitem(index)
        if offset + need > start + have:
            raise ValueError(f"extent ({offset}, {length}) is not free")
        self._remove(start, have)
        self._insert(start, offset - start)
        self._insert(offset + need, start + have - offset - need)

    def free(self, offset: int, length: int) -> None:
        """Give back an extent taken by allocate/take, merging it with free neighbours."""
        length = align_up(length)
        if offset < 0 or offset + length > self.size or offset % ALIGN:
            raise ValueError(f"extent ({offset}, {length}) is outside the arena")
        index = self._by_offset.bisect_right(offset)
        if index > 0:
            before, before_len = self._by_offset.peekitem(index - 1)
            if before + before_len > offset:
                raise ValueError(f"double free: extent ({offset}, {length}) overlaps free space")
            if before + before_len == offset:
                self._remove(before, before_len)
                offset, length = before, length + before_len
                index -= 1
        if index < len(self._by_offset):
            after, after_len = self._by_offset.peekitem(index)
            if offset + length > after:
                raise ValueError(f"double free: extent ({offset}, {length}) overlaps free space")
            if offset + length == after:
                self._remove(after, after_len)
                length += after_len
        self._insert(offset, length)

    def _insert(self, offset: int, length: int) -> None:
        if length > 0:
            self._by_offset[offset] = length
            self._by_size.add((length, offset))
            self._free_bytes += length

    def _remove(self, offset: int, length: int) -> None:
        del self._by_offset[offset]
        self._by_size.remove((length, offset))
        self._free_bytes -= length
