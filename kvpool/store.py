"""The bytes of one pool: its header slots, the arena's extents, and entries moved between them.

    segment:  | pool header (A/B) | entry slots (A/B each) ... | arena: extents of data and side records |

The store knows where everything is and writes it so that a crash at any instant leaves each
entry either as it was or as it became: data first, header last, and a move copies to new
extents, switches the header, and only then frees the old extents. It decides nothing about what
to keep; the Pool does (references, budget, eviction, the prefix index).
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterable

import msgspec
import numpy as np

from kvpool import checksum, compaction, layout as layouts
from kvpool.allocator import ALIGN, Allocator, align_up
from kvpool.entry import TOKEN_DTYPE, EntryRecord, meta_layout
from kvpool.errors import DataCorrupt, PoolBusy, PoolCorrupt, PoolError, PoolFormatError
from kvpool.header import (ENTRY_SLOT_BYTES, FORMAT_VERSION, POOL_HEADER_HALF, READABLE_VERSIONS, EntryHeader,
                           EntryState, PoolHeader, SlotWriter, decode_pool_header, payload_version, read_slot)
from kvpool.layout import ArrayLayout
from kvpool.recovery import SlotScan, scan_slots
from kvpool.segment import PAGE, Segment

POOL_HEADER_BYTES = 2 * POOL_HEADER_HALF
_FREE = EntryHeader(FORMAT_VERSION, EntryState.FREE, 0)

# glibc's memcpy drops from ~7.5 to ~3 GB/s here on large copies whose destination lies a few
# bytes past the source within a page (its 4K-aliasing guard). numpy arrays start 16 bytes into
# a page and MLX buffers at a page: data of large entries starts half a page in, far from both.
LARGE_DATA_BYTES = 1 << 20
COPY_PHASE = PAGE // 2
DEFRAGMENT_ATTEMPTS = 4


def default_max_entries(size_bytes: int) -> int:
    """Header slots for a pool of `size_bytes`: one per 256 KiB, between 64 and 65,536."""
    return max(64, min(65536, size_bytes // (256 << 10)))


def plan_geometry(size_bytes: int, max_entries: int | None) -> tuple[int, int, int, int]:
    """(segment size rounded to a page, slot count, arena offset, arena size) for a new pool."""
    size_bytes = align_up(size_bytes, PAGE)
    slot_count = max_entries if max_entries is not None else default_max_entries(size_bytes)
    if not 1 <= slot_count <= 1 << 22:
        raise PoolError(f"max_entries must be between 1 and {1 << 22}, got {slot_count}")
    arena_offset = align_up(POOL_HEADER_BYTES + slot_count * ENTRY_SLOT_BYTES, PAGE)
    arena_size = (size_bytes - arena_offset) // ALIGN * ALIGN
    if arena_size < PAGE:
        raise PoolError(f"a pool of {size_bytes} bytes with {slot_count} entry slots leaves no arena; "
                        f"give it at least {arena_offset + PAGE} bytes or fewer max_entries")
    return size_bytes, slot_count, arena_offset, arena_size


class Store:
    """Header slots and arena extents of one mapped segment. Not thread-safe: the pool locks."""

    def __init__(self, segment: Segment, header: PoolHeader, header_generation: int = 0) -> None:
        self.segment = segment
        self.header = header
        self._header_generation = header_generation
        self._writer = SlotWriter()
        self._map_views()
        self._slot_generation = [0] * header.slot_count
        self._free_slots = list(range(header.slot_count))
        self.allocator = Allocator(header.arena_size)

    def _map_views(self) -> None:
        h = self.header
        self.arena = self.segment.view(h.arena_offset, h.arena_size)
        self.slots = self.segment.view(h.slot_table_offset, h.slot_count * h.slot_size)

    # ----------------------------------------------------------------------------- headers

    def write_pool_header(self, header: PoolHeader) -> None:
        """Write the pool header into the half its next generation selects."""
        self._header_generation += 1
        self._writer.write(self.segment.view(0, POOL_HEADER_BYTES), header, self._header_generation)
        self.header = header

    def take_slot(self) -> int | None:
        """The lowest free header slot, or None when every slot holds an entry."""
        return heapq.heappop(self._free_slots) if self._free_slots else None

    def write_entry(self, record: EntryRecord) -> None:
        """Write `record.header` into its slot (the other half keeps the previous version)."""
        self._write_slot(record.slot, record.header)

    def write_header(self, slot: int, header: EntryHeader) -> None:
        """Write an entry header into `slot` (the other half keeps the previous version)."""
        self._write_slot(slot, header)

    def _write_slot(self, slot: int, header: EntryHeader) -> None:
        self._slot_generation[slot] += 1
        view = self.slots[slot * ENTRY_SLOT_BYTES:(slot + 1) * ENTRY_SLOT_BYTES]
        self._writer.write(view, header, self._slot_generation[slot])

    def release(self, record: EntryRecord) -> None:
        """Free an entry's slot and extents. The free header goes first: only then may the
        extents be handed out again."""
        self._write_slot(record.slot, _FREE)
        heapq.heappush(self._free_slots, record.slot)
        self.allocator.free(record.header.data_offset, record.header.data_length)
        self.allocator.free(record.header.meta_offset, record.header.meta_length)

    # ----------------------------------------------------------------------------- extents

    def allocate_data(self, length: int) -> int | None:
        """An extent for an entry's data: half a page into a page when it is large."""
        if length < LARGE_DATA_BYTES:
            return self.allocator.allocate(length)
        return self.allocator.allocate(length, modulus=PAGE, phase=(COPY_PHASE - self.header.arena_offset) % PAGE)

    @staticmethod
    def data_need(length: int) -> int:
        """The free run `allocate_data(length)` needs."""
        return align_up(length) + (PAGE if length >= LARGE_DATA_BYTES else 0)

    # ----------------------------------------------------------------------------- bytes

    def data(self, header: EntryHeader) -> np.ndarray:
        """The entry's data extent, zero-copy."""
        return self.arena[header.data_offset:header.data_offset + header.data_length]

    def tokens(self, header: EntryHeader, live: int | None = None) -> np.ndarray:
        """The first `live` (default: the header's live count) token ids of an entry, zero-copy."""
        tokens_at, _ = meta_layout(header.layout_length, header.capacity)
        start = header.meta_offset + tokens_at
        count = header.live if live is None else live
        return self.arena[start:start + TOKEN_DTYPE.itemsize * count].view(TOKEN_DTYPE)

    def write_tokens(self, header: EntryHeader, first: int, tokens: np.ndarray) -> None:
        """Write token ids from cell `first` on (cells past the header's live count are not yet
        covered by its checksum, so this cannot tear what the header promises)."""
        tokens_at, _ = meta_layout(header.layout_length, header.capacity)
        start = header.meta_offset + tokens_at + TOKEN_DTYPE.itemsize * first
        self.arena[start:start + tokens.nbytes] = tokens.view(np.uint8)

    def write_meta(self, offset: int, layout_bytes: bytes, tokens: np.ndarray, capacity: int) -> tuple[int, int]:
        """Write a side record (layout, then token ids) at `offset`; its two checksums."""
        tokens_at, length = meta_layout(len(layout_bytes), capacity)
        meta = self.arena[offset:offset + length]
        meta[:len(layout_bytes)] = np.frombuffer(layout_bytes, dtype=np.uint8)
        meta[tokens_at:tokens_at + tokens.nbytes] = tokens.view(np.uint8)
        return (checksum.digest([meta[:len(layout_bytes)]]),
                checksum.digest([meta[tokens_at:tokens_at + tokens.nbytes]]))

    # ----------------------------------------------------------------------------- moving entries

    def relocate(self, record: EntryRecord, capacity: int) -> int | None:
        """Rewrite an entry's live cells and side record into new extents sized for `capacity`,
        verifying the checksum on the way, then switch the header and free the old extents.
        The bytes moved, or None when the new extents do not fit (nothing changed)."""
        old = record.header
        if isinstance(record.layout, ArrayLayout):
            layout, data_length = layouts.plan(layouts.templates_of(record.layout), capacity,
                                               dict(record.layout.engine_values))
        else:
            layout, data_length = record.layout, old.data_length
        layout_bytes = layouts.encode_layout(layout)
        _, meta_length = meta_layout(len(layout_bytes), capacity)
        data_offset = self.allocate_data(data_length)
        meta_offset = self.allocator.allocate(meta_length) if data_offset is not None else None
        if meta_offset is None:
            if data_offset is not None:
                self.allocator.free(data_offset, data_length)
            return None
        target = self.arena[data_offset:data_offset + data_length]
        if isinstance(layout, ArrayLayout):
            pairs = [pair for new, previous in zip(layout.arrays, record.layout.arrays)
                     for pair in layouts.paired_runs(target, new, old.live,
                                                     layouts.live_view(self.data(old), previous, old.live))]
        else:
            pairs = [(target[:layout.length], self.data(old)[:layout.length])]
        found, moved = checksum.copy_checksummed(pairs)
        if found != old.data_checksum:
            self.allocator.free(data_offset, data_length)
            self.allocator.free(meta_offset, meta_length)
            raise DataCorrupt(f"entry {record.id} fails its checksum while being moved; evict it", record.id)
        layout_check, _ = self.write_meta(meta_offset, layout_bytes, self.tokens(old), capacity)
        record.header = msgspec.structs.replace(old, capacity=capacity, data_offset=data_offset,
                                                data_length=data_length, meta_offset=meta_offset,
                                                meta_length=meta_length, layout_length=len(layout_bytes),
                                                layout_checksum=layout_check)
        record.layout = layout
        self.write_entry(record)
        self.allocator.free(old.data_offset, old.data_length)
        self.allocator.free(old.meta_offset, old.meta_length)
        return moved

    def defragment(self, need: int, movable: Iterable[EntryRecord], fixed: Iterable[EntryRecord],
                   taken: Iterable[tuple[int, int]] = ()) -> tuple[bool, int, int]:
        """Move `movable` entries out of the way until one free run of `need` bytes exists;
        `fixed` entries and the `taken` (offset, length) extents stay where they are.
        (done, entries moved, bytes moved). DataCorrupt if an entry fails its checksum on the way
        (it is left where it was)."""
        by_id = {record.id: record for record in movable}
        fixed = list(fixed)
        taken = [compaction.Placed(None, offset, align_up(length), False) for offset, length in taken]
        tried: set[int] = set()
        entries = moved_bytes = 0
        for _ in range(DEFRAGMENT_ATTEMPTS):
            placed = taken + [compaction.Placed(r.id, offset, align_up(length), r.id in by_id)
                              for r in [*by_id.values(), *fixed]
                              for offset, length in ((r.header.data_offset, r.header.data_length),
                                                     (r.header.meta_offset, r.header.meta_length))]
            window = next((w for w in compaction.windows(placed, self.header.arena_size, need) if w.start not in tried),
                          None)
            if window is None:
                break
            tried.add(window.start)
            done, moved = self._clear_window(window.start, need, [by_id[k] for k in dict.fromkeys(window.keys)])
            entries, moved_bytes = entries + done, moved_bytes + moved
            if self.allocator.largest_free >= need:
                return True, entries, moved_bytes
        return False, entries, moved_bytes

    def _clear_window(self, start: int, need: int, inside: list[EntryRecord]) -> tuple[int, int]:
        """Relocate `inside` out of [start, start + need): the window's free space is held while
        they move, including what each move frees, so nothing lands back in it."""
        held: list[tuple[int, int]] = []

        def hold_free_space_in_window() -> None:
            end = start + need
            for offset, length in self.allocator.free_extents():
                if offset < end and offset + length > start:
                    part = (max(offset, start), min(offset + length, end) - max(offset, start))
                    self.allocator.take(*part)
                    held.append(part)

        done = moved_bytes = 0
        try:
            hold_free_space_in_window()
            for record in inside:
                moved = self.relocate(record, record.header.capacity)
                if moved is None:
                    break
                done, moved_bytes = done + 1, moved_bytes + moved
                hold_free_space_in_window()
        finally:
            for offset, length in held:
                self.allocator.free(offset, length)
        return done, moved_bytes

    # ----------------------------------------------------------------------------- attach and close

    def recover(self) -> SlotScan:
        """Scan the slot table after an attach: keep ready entries, free the rest, rebuild the
        free lists. Returns what was found."""
        scan = scan_slots(self.slots, self.header.slot_count, self.header.slot_size, self.arena)
        self._slot_generation = scan.generations
        used = [(f.header.data_offset, f.header.data_length) for f in scan.entries]
        used += [(f.header.meta_offset, f.header.meta_length) for f in scan.entries]
        self.allocator = Allocator(self.header.arena_size, used)
        taken = {found.slot for found in scan.entries}
        self._free_slots = [slot for slot in range(self.header.slot_count) if slot not in taken]
        for slot in scan.to_clear:
            self._write_slot(slot, _FREE)
        return scan

    def arena_map(self, records: Iterable[EntryRecord]) -> list[tuple[int, int, str]]:
        """(offset, length, owner) of every extent in offset order; owner is "free",
        "<id>.data" or "<id>.meta"."""
        rows = [(offset, length, "free") for offset, length in self.allocator.free_extents()]
        for record in records:
            h = record.header
            rows.append((h.data_offset, align_up(h.data_length), f"{record.id}.data"))
            rows.append((h.meta_offset, align_up(h.meta_length), f"{record.id}.meta"))
        return sorted(rows)

    def close(self) -> None:
        """Unmap the segment (PoolBusy, with the store still usable, while foreign views live)."""
        self.arena = self.slots = None  # our own views must go before the mapping can
        try:
            self.segment.close()
        except PoolBusy:
            self._map_views()
            raise


def read_pool_header(segment: Segment, name: str) -> tuple[PoolHeader, int]:
    """The pool header of a mapped segment and its generation, checked (see parse_pool_header)."""
    if segment.size < POOL_HEADER_BYTES:
        raise PoolFormatError(f"segment {name!r} is {segment.size} bytes: too small to be a pool")
    # A copy of 4 KiB: an error raised while parsing must not keep a view of the mapping alive.
    region = np.frombuffer(segment.view(0, POOL_HEADER_BYTES).tobytes(), dtype=np.uint8)
    return parse_pool_header(region, segment.size, name)


def parse_pool_header(region: np.ndarray, segment_size: int, name: str) -> tuple[PoolHeader, int]:
    """The pool header in `region` (the first POOL_HEADER_BYTES of a segment of `segment_size`
    bytes) and its generation, after checking version, owner and geometry; nothing beyond the
    region is read here, and nothing the geometry names lies outside the segment."""
    found = read_slot(region)
    remove = f"remove it with `python -m kvpool rm {name}`"
    if found is None:
        raise PoolCorrupt(f"pool {name!r}: both copies of the pool header are unreadable; the segment cannot be "
                          f"recovered, {remove}")
    generation, payload = found
    version = payload_version(payload)
    if version not in READABLE_VERSIONS:
        raise PoolFormatError(f"pool {name!r} has format version {version}; this kvpool reads versions "
                              f"{', '.join(map(str, READABLE_VERSIONS))}. Use the release that wrote it, or {remove}")
    header = decode_pool_header(payload)
    if header is None:
        raise PoolCorrupt(f"pool {name!r}: the pool header does not decode; {remove}")
    if header.uid != os.getuid():
        raise PoolFormatError(f"pool {name!r} was created by uid {header.uid}, not this user ({os.getuid()})")
    table_end = header.slot_table_offset + header.slot_count * header.slot_size
    if (header.size != segment_size or header.name != name or header.slot_size != ENTRY_SLOT_BYTES
            or header.slot_count <= 0 or header.slot_table_offset < POOL_HEADER_BYTES or table_end > header.arena_offset
            or header.arena_offset % PAGE or header.arena_size % ALIGN or header.arena_size <= 0
            or header.arena_offset + header.arena_size > segment_size or header.budget_bytes < 0):
        raise PoolCorrupt(f"pool {name!r}: the pool header's geometry does not match the segment; {remove}")
    return header, generation
