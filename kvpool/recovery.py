"""Reading a segment back: which entry headers to trust when a pool is attached.

Only READY headers are durable. A header is kept only if its frame checksum holds, it is of this
format version, every offset and length it names lies inside the arena (checked before anything
is read there), its side record (layout and token ids) passes its checksums, and its extents do
not overlap an entry already kept. WRITING headers are entries a process died writing: their
slots are freed. Anything else in a slot is dropped and the slot rewritten as free. Nothing here
raises for a bad entry; it is counted and skipped. Data checksums are not verified here (that
would read every byte at attach); they are verified when data is read for an engine.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np

from sortedcontainers import SortedDict

from kvpool import checksum
from kvpool.allocator import ALIGN, align_up
from kvpool.entry import TOKEN_DTYPE, meta_layout
from kvpool.errors import LayoutError
from kvpool.header import MAX_TEXT, READABLE_VERSIONS, EntryHeader, EntryState, decode_entry_header, read_slot
from kvpool.layout import Layout, decode_layout, validate

MAX_REASONS = 20


class Recovered(NamedTuple):
    """A READY entry found in a slot, with its slot generation and decoded layout."""

    slot: int
    generation: int
    header: EntryHeader
    layout: Layout


class RecoveryReport(msgspec.Struct, frozen=True):
    """What an attach found: entries kept, writers freed, slots dropped (with the first reasons)."""

    entries: int = 0
    freed_writing: int = 0
    dropped: int = 0
    reasons: tuple[str, ...] = ()


class SlotScan(NamedTuple):
    """The result of scanning the slot table."""

    entries: list[Recovered]
    generations: list[int]
    to_clear: list[int]  # slots to rewrite as free (writers and bad headers)
    report: RecoveryReport


def _check_extent(name: str, offset: int, length: int, arena_size: int) -> None:
    if offset < 0 or length <= 0 or offset % ALIGN or offset + align_up(length) > arena_size:
        raise LayoutError(f"{name} extent ({offset}, {length}) lies outside the {arena_size}-byte arena")


def check_entry(header: EntryHeader, arena: np.ndarray) -> Layout:
    """The entry's layout if every part of `header` can be trusted; LayoutError otherwise."""
    if header.version not in READABLE_VERSIONS:
        raise LayoutError(f"entry header of format version {header.version}, expected one of {READABLE_VERSIONS}")
    if (not 0 < len(header.identity.encode()) <= MAX_TEXT or len(header.tag.encode()) > MAX_TEXT
            or len(header.namespace.encode()) > MAX_TEXT or header.serial <= 0):
        raise LayoutError("identity, tag, namespace or serial out of range")
    if not 0 <= header.live <= header.capacity:
        raise LayoutError(f"live {header.live} outside 0..capacity {header.capacity}")
    _check_extent("data", header.data_offset, header.data_length, arena.nbytes)
    _check_extent("meta", header.meta_offset, header.meta_length, arena.nbytes)
    if not 0 < header.layout_length <= header.meta_length:
        raise LayoutError(f"layout record of {header.layout_length} bytes in a {header.meta_length}-byte extent")
    tokens_at, needed = meta_layout(header.layout_length, header.capacity)
    if needed > header.meta_length:
        raise LayoutError(f"side record needs {needed} bytes, its extent holds {header.meta_length}")
    meta = arena[header.meta_offset:header.meta_offset + header.meta_length]
    layout_bytes = meta[:header.layout_length]
    if checksum.digest([layout_bytes]) != header.layout_checksum:
        raise LayoutError("layout record fails its checksum")
    tokens = meta[tokens_at:tokens_at + TOKEN_DTYPE.itemsize * header.live]
    if checksum.digest([tokens]) != header.tokens_checksum:
        raise LayoutError("token ids fail their checksum")
    layout = decode_layout(layout_bytes.tobytes())
    validate(layout, header.data_length, header.capacity, header.live)
    return layout


def _overlaps(start: int, end: int, taken: SortedDict) -> bool:
    """Whether [start, end) overlaps any interval in `taken` (start -> end, disjoint)."""
    index = taken.bisect_right(start)
    if index > 0 and taken.peekitem(index - 1)[1] > start:
        return True
    return index < len(taken) and taken.peekitem(index)[0] < end


def scan_slots(slots: np.ndarray, slot_count: int, slot_size: int, arena: np.ndarray) -> SlotScan:
    """Classify every slot of the table (`slots`: the table's bytes) against `arena`."""
    kept: list[Recovered] = []
    generations = [0] * slot_count
    to_clear: list[int] = []
    freed = dropped = 0
    reasons: list[str] = []
    serials: set[int] = set()
    candidates: list[tuple[int, int, EntryHeader]] = []

    def drop(slot: int, why: str) -> None:
        nonlocal dropped
        dropped += 1
        to_clear.append(slot)
        if len(reasons) < MAX_REASONS:
            reasons.append(f"slot {slot}: {why}")

    for slot in range(slot_count):
        found = read_slot(slots[slot * slot_size:(slot + 1) * slot_size])
        if found is None:
            # Never written, or both halves torn: a slot to (re)write as free if not blank.
            if slots[slot * slot_size:(slot + 1) * slot_size].any():
                drop(slot, "no valid header")
            continue
        generation, payload = found
        generations[slot] = generation
        header = decode_entry_header(payload)
        if header is None:
            drop(slot, "header does not decode")
        elif header.state == EntryState.WRITING:
            freed += 1
            to_clear.append(slot)
        elif header.state == EntryState.READY:
            candidates.append((slot, generation, header))
        elif header.state != EntryState.FREE:
            drop(slot, f"unknown state {header.state}")

    taken = SortedDict()
    for slot, generation, header in sorted(candidates, key=lambda c: c[2].serial):
        try:
            layout = check_entry(header, arena)
        except LayoutError as exc:
            drop(slot, str(exc))
            continue
        data = (header.data_offset, header.data_offset + align_up(header.data_length))
        meta = (header.meta_offset, header.meta_offset + align_up(header.meta_length))
        if (header.serial in serials or (data[0] < meta[1] and meta[0] < data[1])
                or _overlaps(*data, taken) or _overlaps(*meta, taken)):
            drop(slot, f"entry {header.serial} repeats an id or overlaps another entry")
            continue
        serials.add(header.serial)
        taken[data[0]] = data[1]
        taken[meta[0]] = meta[1]
        kept.append(Recovered(slot, generation, header, layout))
    report = RecoveryReport(len(kept), freed, dropped, tuple(reasons))
    return SlotScan(kept, generations, to_clear, report)
