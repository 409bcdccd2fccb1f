"""The pool: one shared-memory segment of entries that many holders share without copies.

    segment:  | pool header (A/B) | entry slots (A/B each) ... | arena: extents of data and side records |

An entry is written once (`put`, or `reserve` + fill + `commit`), then shared by reference count
(`share` / `release`), read through pinned zero-copy views (`get`), and evicted by cost when the
export budget needs room. Entries held by no one stay cached for the prefix index until evicted.
A crash loses only entries being written: the segment and every ready header survive, and
`Pool.attach` rebuilds the rest (free lists, counts, the index) from them.

Thread safety: one lock guards the metadata. Bulk copies into a reserved entry happen outside it
(the entry is invisible until committed); copies that move a ready entry happen inside it.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from kvpool import checksum, compaction, eviction, layout as layouts
from kvpool.allocator import ALIGN, Allocator, align_up
from kvpool.budget import Budget, Device, export_budget, host_memory_available
from kvpool.entry import TOKEN_DTYPE, EntryInfo, EntryRecord, EntryView, Writer, meta_layout
from kvpool.errors import (EntryBusy, EntryNotFound, EntryTooLarge, LayoutError, PoolBusy, PoolCorrupt,
                           PoolError, PoolFormatError)
from kvpool.header import (ENTRY_SLOT_BYTES, FORMAT_VERSION, MAX_TEXT, POOL_HEADER_HALF, EntryHeader,
                           EntryState, PoolHeader, SlotWriter, decode_pool_header, payload_version, read_slot)
from kvpool.layout import ArrayLayout, ArrayTemplate, BlobLayout, KVArray, Layout
from kvpool.prefix import PrefixIndex, PrefixMatch
from kvpool.recovery import RecoveryReport, scan_slots
from kvpool.segment import PAGE, Segment
from kvpool.stats import Counters, PoolStats

POOL_HEADER_BYTES = 2 * POOL_HEADER_HALF
SLACK_RATIO = 0.25  # reclaim an entry's slack once it is a quarter of what the entry reserves
SLACK_MIN_BYTES = 64 << 10


def default_max_entries(size_bytes: int) -> int:
    """Header slots for a pool of `size_bytes`: one per 256 KiB, between 64 and 65,536."""
    return max(64, min(65536, size_bytes // (256 << 10)))


def _tokens(tokens) -> np.ndarray:
    array = np.asarray(tokens)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise LayoutError(f"tokens must be a 1-D sequence of integers, got shape {array.shape} {array.dtype}")
    if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
        raise LayoutError("token ids must fit in int32")
    return array.astype(TOKEN_DTYPE, copy=False)


def _text(name: str, value: str, allow_empty: bool) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT or (not value and not allow_empty):
        raise LayoutError(f"{name} must be a string of {'0' if allow_empty else '1'}-{MAX_TEXT} characters")
    return value


class Pool:
    """A shared-memory KV pool. Create one with :meth:`create`, re-attach with :meth:`attach`."""

    def __init__(self, segment: Segment, header: PoolHeader, header_generation: int,
                 report: RecoveryReport = RecoveryReport()) -> None:
        """Internal: use Pool.create or Pool.attach."""
        self._segment = segment
        self._header = header
        self._lock = threading.RLock()
        self._slot_writer = SlotWriter()
        self._arena = segment.view(header.arena_offset, header.arena_size)
        self._slots = segment.view(header.slot_table_offset, header.slot_count * header.slot_size)
        self._slot_generation = [0] * header.slot_count
        self._free_slots = list(range(header.slot_count))
        self._entries: dict[int, EntryRecord] = {}
        self._writing: dict[int, EntryRecord] = {}
        self._allocator = Allocator(header.arena_size)
        self._prefix = PrefixIndex(self._live_tokens)
        self._clock = itertools.count(1)
        self._next_serial = 1
        self._bytes_used = 0
        self._counters = Counters()
        self._report = report
        self._header_generation = header_generation
        self._closed = False

    # ----------------------------------------------------------------------------- lifecycle

    @classmethod
    def create(cls, name: str, size_bytes: int, *, max_entries: int | None = None,
               budget: Budget | None = None, device: Device = Device(),
               headroom: int | None = None, cap: int | None = None) -> "Pool":
        """Create pool `name` taking `size_bytes` of shared memory up front (rounded up to a page).

        The export budget is `budget` if given, else computed for `device` from the pool's
        capacity and host memory (the pool's own reserved bytes counted as available to it).
        """
        size_bytes = align_up(size_bytes, PAGE)
        slot_count = max_entries if max_entries is not None else default_max_entries(size_bytes)
        if not 1 <= slot_count <= 1 << 22:
            raise PoolError(f"max_entries must be between 1 and {1 << 22}, got {slot_count}")
        arena_offset = align_up(POOL_HEADER_BYTES + slot_count * ENTRY_SLOT_BYTES, PAGE)
        arena_size = (size_bytes - arena_offset) // ALIGN * ALIGN
        if arena_size < PAGE:
            raise PoolError(f"a pool of {size_bytes} bytes with {slot_count} entry slots leaves no arena; "
                            f"give it at least {arena_offset + PAGE} bytes or fewer max_entries")
        segment = Segment.create(name, size_bytes)
        try:
            if budget is None:
                options = {k: v for k, v in (("headroom", headroom), ("cap", cap)) if v is not None}
                budget = export_budget(device, arena_size, host_memory_available() + size_bytes, **options)
            header = PoolHeader(FORMAT_VERSION, os.getuid(), name, size_bytes, POOL_HEADER_BYTES, slot_count,
                                ENTRY_SLOT_BYTES, arena_offset, arena_size,
                                min(budget.bytes, arena_size + slot_count * ENTRY_SLOT_BYTES),
                                budget.reason, time.time(), os.getpid())
            pool = cls(segment, header, header_generation=0)
            pool._write_pool_header(header)
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        return pool

    @classmethod
    def attach(cls, name: str) -> "Pool":
        """Attach an existing pool whose owner is gone (PoolBusy if it is alive), recovering it:
        ready entries are kept, entries caught writing are freed, bad headers are dropped."""
        segment = Segment.open(name)
        try:
            header, generation = _read_pool_header(segment, name)
            pool = cls(segment, header, generation)
            pool._recover()
            pool._write_pool_header(msgspec.structs.replace(header, owner_pid=os.getpid()))
        except BaseException:
            segment.close()
            raise
        return pool

    def close(self) -> None:
        """Detach from the segment, leaving every ready entry in it for a later attach.
        PoolBusy while entry views or writers are open."""
        with self._lock:
            if self._closed:
                return
            viewed = [r.id for r in self._entries.values() if r.views]
            if viewed or self._writing:
                raise PoolBusy(f"pool {self.name!r}: entries {viewed} have open views and {len(self._writing)} "
                               "writers are open; close those views and writers first")
            self._arena = self._slots = None  # our own views must go before the mapping can
            try:
                self._segment.close()
            except PoolBusy:
                self._arena = self._segment.view(self._header.arena_offset, self._header.arena_size)
                self._slots = self._segment.view(self._header.slot_table_offset,
                                                 self._header.slot_count * self._header.slot_size)
                raise
            self._closed = True

    def unlink(self) -> None:
        """Remove the segment's name so no one can attach it again (its memory goes with the last
        mapping). Call after close() to destroy a pool."""
        self._segment.unlink()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def name(self) -> str:
        """The pool's name."""
        return self._header.name

    @property
    def header(self) -> PoolHeader:
        """The pool header: geometry, owner and export budget."""
        return self._header

    @property
    def recovery(self) -> RecoveryReport:
        """What the last attach found (empty for a new pool)."""
        return self._report

    # ----------------------------------------------------------------------------- writing

    def put(self, identity: str, tokens, arrays: Sequence[KVArray], *, capacity: int | None = None,
            tag: str = "", recompute_cost: float | None = None) -> EntryInfo | None:
        """Store `arrays` (one copy each, hashed on the way) as a new entry held once by the caller.
        None when the budget has no room even after compaction and eviction."""
        live = layouts.live_tokens_of(arrays)
        tokens = _tokens(tokens)
        if live is not None and live != len(tokens):
            raise LayoutError(f"arrays hold {live} cells but {len(tokens)} token ids were given")
        writer = self.reserve(identity, tokens, [layouts.template_of(a) for a in arrays], capacity=capacity,
                              tag=tag, recompute_cost=recompute_cost)
        if writer is None:
            return None
        with writer:
            return writer.commit(writer.fill(arrays))

    def put_blob(self, identity: str, tokens, blob, *, tag: str = "",
                 recompute_cost: float | None = None) -> EntryInfo | None:
        """Store an engine's opaque state blob (any bytes-like) whole, hashed on the way."""
        source = np.frombuffer(blob, dtype=np.uint8) if not isinstance(blob, np.ndarray) else blob.view(np.uint8).ravel()
        writer = self.reserve_blob(identity, tokens, source.nbytes, tag=tag, recompute_cost=recompute_cost)
        if writer is None:
            return None
        with writer:
            return writer.commit(writer.fill_blob(source))

    def reserve(self, identity: str, tokens, templates: Sequence[ArrayTemplate], *, capacity: int | None = None,
                tag: str = "", recompute_cost: float | None = None) -> Writer | None:
        """Reserve a new array entry with room for `capacity` cells (default: the tokens given) and
        return a Writer whose views the engine fills directly; None when there is no room."""
        tokens = _tokens(tokens)
        capacity = len(tokens) if capacity is None else capacity
        if capacity < len(tokens):
            raise LayoutError(f"capacity {capacity} is less than the {len(tokens)} tokens given")
        layout, data_length = layouts.plan(templates, capacity)
        return self._reserve(identity, tokens, layout, data_length, capacity, tag, recompute_cost)

    def reserve_blob(self, identity: str, tokens, nbytes: int, *, tag: str = "",
                     recompute_cost: float | None = None) -> Writer | None:
        """Reserve a blob entry of `nbytes` for an engine that serialises its own state."""
        if nbytes < 0:
            raise LayoutError(f"blob size must be >= 0, got {nbytes}")
        tokens = _tokens(tokens)
        return self._reserve(identity, tokens, BlobLayout(nbytes), align_up(max(nbytes, 1)), len(tokens),
                             tag, recompute_cost)

    def extend(self, entry_id: int, tokens, *, recompute_cost: float | None = None) -> Writer:
        """A Writer for cells appended to an array entry held by at most one reference, within
        its capacity. Fill `writer.arrays` (the new cells only) and commit. `recompute_cost` is
        the entry's new cost; by default it grows by one per appended token."""
        tokens = _tokens(tokens)
        with self._lock:
            record = self._record(entry_id)
            header = record.header
            if not isinstance(record.layout, ArrayLayout):
                raise LayoutError(f"entry {entry_id} holds an engine blob, written whole; put a new entry instead")
            if record.refcount > 1 or record.extending:
                raise EntryBusy(f"entry {entry_id} is shared ({record.refcount} references) or being extended; "
                                "shared entries are immutable")
            if header.live + len(tokens) > header.capacity:
                raise LayoutError(f"entry {entry_id} has room for {header.capacity - header.live} more cells, "
                                  f"not {len(tokens)}; put a new entry with a larger capacity")
            record.extending = True
            record.pending_cost = header.recompute_cost + len(tokens) if recompute_cost is None else recompute_cost
            tokens_at, _ = meta_layout(header.layout_length, header.capacity)
            start = header.meta_offset + tokens_at + TOKEN_DTYPE.itemsize * header.live
            self._arena[start:start + tokens.nbytes] = tokens.view(np.uint8)
            data = self._arena[header.data_offset:header.data_offset + header.data_length]
            return Writer(self, record, data, header.live, header.live + len(tokens))

    # ----------------------------------------------------------------------------- reading and sharing

    def get(self, entry_id: int, *, verify: bool = True) -> EntryView:
        """Pinned, zero-copy, read-only views of an entry (a context manager). With `verify`, the
        live bytes are checked against their checksum first (DataCorrupt if they fail)."""
        with self._lock:
            record = self._record(entry_id)
            record.views += 1
            record.last_used = next(self._clock)
            self._counters.gets += 1
            header = record.header
            data = self._arena[header.data_offset:header.data_offset + header.data_length]
            view = EntryView(self, record, data, self._live_tokens(entry_id))
        if verify:
            try:
                view.verify()
            except BaseException:
                view.close()
                raise
        return view

    def info(self, entry_id: int) -> EntryInfo:
        """A snapshot of one ready entry."""
        with self._lock:
            return self._record(entry_id).info()

    def entries(self) -> list[EntryInfo]:
        """Snapshots of every ready entry, by id."""
        with self._lock:
            return [self._entries[k].info() for k in sorted(self._entries)]

    def find(self, tag: str) -> list[EntryInfo]:
        """Ready entries carrying `tag` (how a restarted host finds what it parked), by id."""
        with self._lock:
            return [self._entries[k].info() for k in sorted(self._entries) if self._entries[k].header.tag == tag]

    def share(self, entry_id: int) -> EntryInfo:
        """Take one more reference to an entry: no bytes move."""
        with self._lock:
            record = self._record(entry_id)
            record.refcount += 1
            record.last_used = next(self._clock)
            self._counters.shares += 1
            return record.info()

    def release(self, entry_id: int) -> None:
        """Drop one reference. An entry with none stays cached (evictable) until evicted."""
        with self._lock:
            record = self._record(entry_id)
            if record.refcount == 0:
                raise PoolError(f"entry {entry_id} has no references to release (released twice?)")
            record.refcount -= 1
            self._counters.releases += 1

    def pin(self, entry_id: int) -> None:
        """Keep an entry in place and in the pool: pinned entries are never evicted or moved."""
        with self._lock:
            self._record(entry_id).pins += 1

    def unpin(self, entry_id: int) -> None:
        """Undo one pin()."""
        with self._lock:
            self._unpin(self._record(entry_id))

    def evict(self, entry_id: int) -> None:
        """Remove an entry no one references or pins (EntryBusy otherwise)."""
        with self._lock:
            record = self._record(entry_id)
            if record.refcount or not self._movable(record):
                raise EntryBusy(f"entry {entry_id} has {record.refcount} references, {record.pins} pins and "
                                f"{record.views} open views; release, unpin and close them before evicting")
            self._evict(record)

    def lookup(self, identity: str, tokens) -> PrefixMatch | None:
        """The ready entry of `identity` sharing the longest exact token prefix with `tokens`."""
        with self._lock:
            return self._prefix.longest(identity, _tokens(tokens))

    def acquire_prefix(self, identity: str, tokens) -> PrefixMatch | None:
        """lookup() and share() the entry found, atomically (the caller must release it)."""
        with self._lock:
            match = self._prefix.longest(identity, _tokens(tokens))
            if match is not None:
                self.share(match.entry_id)
            return match

    # ----------------------------------------------------------------------------- compaction

    def compact(self, *, ratio: float = SLACK_RATIO, min_bytes: int = SLACK_MIN_BYTES) -> int:
        """Give back the slack of unpinned entries whose slack passes the threshold; the bytes
        returned to the free list."""
        with self._lock:
            reclaimed = 0
            candidates = [compaction.Reserved(r.id, r.live_bytes + r.slack_bytes, r.live_bytes)
                          for r in self._entries.values() if self._movable(r) and isinstance(r.layout, ArrayLayout)]
            for entry_id in compaction.slack_to_reclaim(candidates, ratio, min_bytes):
                reclaimed += self._reclaim_slack(self._entries[entry_id])
            return reclaimed

    def defragment(self, need: int) -> bool:
        """Move unpinned extents so that one free run of `need` bytes exists; False if it cannot."""
        with self._lock:
            return self._defragment(align_up(need))

    # ----------------------------------------------------------------------------- statistics

    def arena_map(self) -> list[tuple[int, int, str]]:
        """(offset, length, owner) of every extent of the arena in offset order; owner is
        "free", "<id>.data" or "<id>.meta". Lengths are as allocated (rounded up to ALIGN)."""
        with self._lock:
            rows = [(o, n, "free") for o, n in self._allocator.free_extents()]
            for record in [*self._entries.values(), *self._writing.values()]:
                h = record.header
                rows.append((h.data_offset, align_up(h.data_length), f"{record.id}.data"))
                rows.append((h.meta_offset, align_up(h.meta_length), f"{record.id}.meta"))
            return sorted(rows)


    def stats(self) -> PoolStats:
        """A snapshot of bytes, entries and counters."""
        with self._lock:
            records = list(self._entries.values())
            c = self._counters
            return PoolStats(
                name=self.name, capacity=self._header.arena_size, budget_bytes=self._header.budget_bytes,
                bytes_used=self._bytes_used, bytes_live=sum(r.live_bytes for r in records),
                bytes_slack=sum(r.slack_bytes for r in records), bytes_free=self._allocator.free_bytes,
                largest_free=self._allocator.largest_free, entries=len(records), writing=len(self._writing),
                referenced=sum(1 for r in records if r.refcount), shared=sum(1 for r in records if r.refcount > 1),
                pinned=sum(1 for r in records if r.pins or r.views),
                bytes_copied=c.bytes_written + c.bytes_read + c.bytes_moved,
                recovered_entries=self._report.entries, recovered_freed_writing=self._report.freed_writing,
                recovered_dropped=self._report.dropped, **c.as_dict())

    # ----------------------------------------------------------------------------- internals

    def _record(self, entry_id: int) -> EntryRecord:
        if self._closed:
            raise PoolError(f"pool {self.name!r} is closed")
        try:
            return self._entries[entry_id]
        except KeyError:
            raise EntryNotFound(f"no ready entry {entry_id} in pool {self.name!r}") from None

    def _live_tokens(self, entry_id: int) -> np.ndarray:
        record = self._entries.get(entry_id) or self._writing[entry_id]
        header = record.header
        tokens_at, _ = meta_layout(header.layout_length, header.capacity)
        start = header.meta_offset + tokens_at
        return self._arena[start:start + TOKEN_DTYPE.itemsize * header.live].view(TOKEN_DTYPE)

    def _movable(self, record: EntryRecord) -> bool:
        return not record.pins and not record.views and not record.extending

    def _write_pool_header(self, header: PoolHeader) -> None:
        self._header_generation += 1
        self._slot_writer.write(self._segment.view(0, POOL_HEADER_BYTES), header, self._header_generation)
        self._header = header

    def _write_entry_header(self, slot: int, header: EntryHeader) -> None:
        self._slot_generation[slot] += 1
        view = self._slots[slot * ENTRY_SLOT_BYTES:(slot + 1) * ENTRY_SLOT_BYTES]
        self._slot_writer.write(view, header, self._slot_generation[slot])

    def _clear_slot(self, slot: int) -> None:
        self._write_entry_header(slot, EntryHeader(FORMAT_VERSION, EntryState.FREE, 0))
        heapq.heappush(self._free_slots, slot)

    def _write_meta(self, offset: int, layout_bytes: bytes, tokens: np.ndarray, capacity: int) -> tuple[int, int]:
        tokens_at, length = meta_layout(len(layout_bytes), capacity)
        meta = self._arena[offset:offset + length]
        meta[:len(layout_bytes)] = np.frombuffer(layout_bytes, dtype=np.uint8)
        meta[tokens_at:tokens_at + tokens.nbytes] = tokens.view(np.uint8)
        return checksum.digest([meta[:len(layout_bytes)]]), checksum.digest([meta[tokens_at:tokens_at + tokens.nbytes]])

    def _reserve(self, identity: str, tokens: np.ndarray, layout: Layout, data_length: int, capacity: int,
                 tag: str, recompute_cost: float | None) -> Writer | None:
        _text("identity", identity, allow_empty=False)
        _text("tag", tag, allow_empty=True)
        layout_bytes = layouts.encode_layout(layout)
        _, meta_length = meta_layout(len(layout_bytes), capacity)
        stored = align_up(data_length) + align_up(meta_length) + ENTRY_SLOT_BYTES
        budget = self._header.budget_bytes
        if stored - ENTRY_SLOT_BYTES > self._header.arena_size:
            raise EntryTooLarge(f"an entry of {stored} bytes ({len(tokens)} tokens) cannot fit the pool's "
                                f"{self._header.arena_size}-byte arena; create a larger pool")
        if stored > budget:
            raise EntryTooLarge(f"an entry of {stored} bytes ({len(tokens)} tokens) exceeds the pool's export "
                                f"budget of {budget} bytes ({self._header.budget_reason}); raise the budget or "
                                "store fewer tokens")
        with self._lock:
            if self._closed:
                raise PoolError(f"pool {self.name!r} is closed")
            placed = self._make_room(stored, data_length, meta_length)
            if placed is None:
                self._counters.refused += 1
                return None
            slot, data_offset, meta_offset = placed
            layout_check, tokens_check = self._write_meta(meta_offset, layout_bytes, tokens, capacity)
            header = EntryHeader(FORMAT_VERSION, EntryState.WRITING, self._next_serial, identity, len(tokens),
                                 capacity, data_offset, data_length, meta_offset, meta_length, len(layout_bytes),
                                 layout_check, tokens_check, 0,
                                 float(len(tokens) if recompute_cost is None else recompute_cost), tag, time.time())
            self._next_serial += 1
            record = EntryRecord(slot, header, layout)
            self._write_entry_header(slot, header)
            self._writing[header.serial] = record
            self._bytes_used += record.stored_bytes
            data = self._arena[data_offset:data_offset + data_length]
        return Writer(self, record, data, 0, len(tokens))

    def _make_room(self, stored: int, data_length: int, meta_length: int) -> tuple[int, int, int] | None:
        """(slot, data offset, meta offset) for a new entry, reclaiming slack, defragmenting and
        evicting by cost as needed; None when nothing more can be freed."""
        victims: list[int] | None = None
        while True:
            if self._bytes_used + stored <= self._header.budget_bytes and self._free_slots:
                data_offset = self._allocate(data_length)
                if data_offset is not None:
                    meta_offset = self._allocate(meta_length)
                    if meta_offset is not None:
                        return heapq.heappop(self._free_slots), data_offset, meta_offset
                    self._allocator.free(data_offset, data_length)
            if victims is None:  # first shortfall: giving back slack keeps every entry
                if self.compact() > 0:
                    continue
                victims = eviction.eviction_order(
                    eviction.Candidate(r.id, r.stored_bytes, r.header.recompute_cost, r.last_used)
                    for r in self._entries.values() if not r.refcount and self._movable(r))
                victims.reverse()  # pop() from the end takes the first to evict
            if not victims:
                return None
            self._evict(self._entries[victims.pop()])

    def _allocate(self, length: int) -> int | None:
        offset = self._allocator.allocate(length)
        if offset is None and self._allocator.free_bytes >= align_up(length) and self._defragment(align_up(length)):
            offset = self._allocator.allocate(length)
        return offset

    def _commit(self, record: EntryRecord, live: int, data_checksum: int) -> EntryInfo:
        with self._lock:
            header = record.header
            if record.extending:  # appended cells: the old header stays valid until this one is whole
                tokens_at, _ = meta_layout(header.layout_length, header.capacity)
                start = header.meta_offset + tokens_at
                tokens_check = checksum.digest([self._arena[start:start + TOKEN_DTYPE.itemsize * live]])
                written = layouts.live_nbytes(record.layout, live) - record.live_bytes
                record.header = msgspec.structs.replace(header, live=live, tokens_checksum=tokens_check,
                                                        data_checksum=data_checksum,
                                                        recompute_cost=record.pending_cost)
                record.extending = False
                self._counters.extends += 1
            else:
                record.header = msgspec.structs.replace(header, state=EntryState.READY, data_checksum=data_checksum)
                del self._writing[header.serial]
                self._entries[header.serial] = record
                record.refcount = 1
                written = record.live_bytes
                self._counters.puts += 1
            self._write_entry_header(record.slot, record.header)
            record.last_used = next(self._clock)
            self._counters.bytes_written += written
            self._prefix.add(record.id, header.identity, self._live_tokens(record.id))
            return record.info()

    def _abort(self, record: EntryRecord) -> None:
        with self._lock:
            if record.extending:
                record.extending = False
                return
            del self._writing[record.id]
            self._release_storage(record)

    def _unpin(self, record: EntryRecord) -> None:
        with self._lock:
            if record.pins == 0:
                raise PoolError(f"entry {record.id} is not pinned")
            record.pins -= 1

    def _close_view(self, record: EntryRecord) -> None:
        with self._lock:
            record.views -= 1

    def _count_read(self, nbytes: int) -> None:
        with self._lock:
            self._counters.bytes_read += nbytes

    def _evict(self, record: EntryRecord) -> None:
        del self._entries[record.id]
        self._prefix.remove(record.id)
        self._counters.evictions += 1
        self._counters.evicted_bytes += record.stored_bytes
        self._release_storage(record)

    def _release_storage(self, record: EntryRecord) -> None:
        # The free header goes first: only then may the extents be handed out again.
        self._clear_slot(record.slot)
        self._allocator.free(record.header.data_offset, record.header.data_length)
        self._allocator.free(record.header.meta_offset, record.header.meta_length)
        self._bytes_used -= record.stored_bytes

    def _relocate(self, record: EntryRecord, capacity: int, allocate: Callable[[int], int | None]) -> bool:
        """Rewrite an entry's live cells and side record into new extents at `capacity` (a copy
        that verifies the checksum on the way), then switch the header and free the old extents."""
        old = record.header
        if isinstance(record.layout, ArrayLayout):
            layout, data_length = layouts.plan(layouts.templates_of(record.layout), capacity)
        else:
            layout, data_length = record.layout, old.data_length
        layout_bytes = layouts.encode_layout(layout)
        _, meta_length = meta_layout(len(layout_bytes), capacity)
        data_offset = allocate(data_length)
        meta_offset = allocate(meta_length) if data_offset is not None else None
        if meta_offset is None:
            if data_offset is not None:
                self._allocator.free(data_offset, data_length)
            return False
        source = self._arena[old.data_offset:old.data_offset + old.data_length]
        target = self._arena[data_offset:data_offset + data_length]
        hasher, moved = checksum.new_hasher(), 0
        for dst, src in zip(layouts.all_live_runs(target, layout, old.live),
                            layouts.all_live_runs(source, record.layout, old.live)):
            moved += checksum.copy_hashing(dst, src, hasher)
        if hasher.intdigest() != old.data_checksum:
            self._allocator.free(data_offset, data_length)
            self._allocator.free(meta_offset, meta_length)
            raise PoolError(f"entry {record.id} fails its checksum while being moved; evict it")
        layout_check, _ = self._write_meta(meta_offset, layout_bytes, self._live_tokens(record.id), capacity)
        before = record.stored_bytes
        record.header = msgspec.structs.replace(old, capacity=capacity, data_offset=data_offset,
                                                data_length=data_length, meta_offset=meta_offset,
                                                meta_length=meta_length, layout_length=len(layout_bytes),
                                                layout_checksum=layout_check)
        record.layout = layout
        self._write_entry_header(record.slot, record.header)
        self._allocator.free(old.data_offset, old.data_length)
        self._allocator.free(old.meta_offset, old.meta_length)
        self._bytes_used += record.stored_bytes - before
        self._counters.bytes_moved += moved
        return True

    def _reclaim_slack(self, record: EntryRecord) -> int:
        before = record.stored_bytes
        if not self._relocate(record, record.header.live, self._allocator.allocate):
            return 0
        self._counters.slack_reclaims += 1
        self._counters.bytes_reclaimed += before - record.stored_bytes
        return before - record.stored_bytes

    def _defragment(self, need: int) -> bool:
        placed = []
        for record in [*self._entries.values(), *self._writing.values()]:
            movable = record.id in self._entries and self._movable(record)
            h = record.header
            placed.append(compaction.Placed(record.id, h.data_offset, align_up(h.data_length), movable))
            placed.append(compaction.Placed(record.id, h.meta_offset, align_up(h.meta_length), movable))
        for window in compaction.windows(placed, self._header.arena_size, need):
            # Hold the window's free runs so the moved entries land outside it.
            end = window.start + need
            held = [(max(o, window.start), min(o + n, end) - max(o, window.start))
                    for o, n in self._allocator.free_extents() if o < end and o + n > window.start]
            for offset, length in held:
                self._allocator.take(offset, length)
            moved = 0
            for entry_id in dict.fromkeys(window.keys):  # an entry's two extents may share a window
                record = self._entries[entry_id]
                if not self._relocate(record, record.header.capacity, self._allocator.allocate):
                    break
                moved += 1
            for offset, length in held:
                self._allocator.free(offset, length)
            self._counters.relocations += moved
            if moved == len(dict.fromkeys(window.keys)):
                return True
        return False

    def _recover(self) -> None:
        scan = scan_slots(self._slots, self._header.slot_count, self._header.slot_size, self._arena)
        self._slot_generation = scan.generations
        used = []
        for found in scan.entries:
            record = EntryRecord(found.slot, found.header, found.layout)
            self._entries[record.id] = record
            used += [(found.header.data_offset, found.header.data_length),
                     (found.header.meta_offset, found.header.meta_length)]
            self._bytes_used += record.stored_bytes
            self._next_serial = max(self._next_serial, record.id + 1)
        self._allocator = Allocator(self._header.arena_size, used)
        taken = {found.slot for found in scan.entries}
        self._free_slots = [s for s in range(self._header.slot_count) if s not in taken]
        for slot in scan.to_clear:
            self._write_entry_header(slot, EntryHeader(FORMAT_VERSION, EntryState.FREE, 0))
        for record in self._entries.values():
            record.last_used = next(self._clock)
            self._prefix.add(record.id, record.header.identity, self._live_tokens(record.id))
        self._report = scan.report


def _read_pool_header(segment: Segment, name: str) -> tuple[PoolHeader, int]:
    """The pool header and its generation, after checking version, owner and geometry."""
    if segment.size < POOL_HEADER_BYTES:
        raise PoolFormatError(f"segment {name!r} is {segment.size} bytes: too small to be a pool")
    found = read_slot(segment.view(0, POOL_HEADER_BYTES))
    if found is None:
        raise PoolCorrupt(f"pool {name!r}: both copies of the pool header are unreadable; the segment cannot be "
                          f"recovered, remove it with `python -m kvpool rm {name}`")
    generation, payload = found
    version = payload_version(payload)
    if version != FORMAT_VERSION:
        raise PoolFormatError(f"pool {name!r} has format version {version}; this kvpool reads version "
                              f"{FORMAT_VERSION}. Use the release that wrote it, or remove it with "
                              f"`python -m kvpool rm {name}`")
    header = decode_pool_header(payload)
    if header is None:
        raise PoolCorrupt(f"pool {name!r}: the pool header does not decode; remove it with `python -m kvpool rm {name}`")
    if header.uid != os.getuid():
        raise PoolFormatError(f"pool {name!r} was created by uid {header.uid}, not this user ({os.getuid()})")
    table_end = header.slot_table_offset + header.slot_count * header.slot_size
    if (header.size != segment.size or header.name != name or header.slot_size != ENTRY_SLOT_BYTES
            or header.slot_table_offset < POOL_HEADER_BYTES or table_end > header.arena_offset
            or header.arena_offset % PAGE or header.arena_size % ALIGN or header.arena_size <= 0
            or header.arena_offset + header.arena_size > segment.size or header.budget_bytes < 0):
        raise PoolCorrupt(f"pool {name!r}: the pool header's geometry does not match the segment; remove it with "
                          f"`python -m kvpool rm {name}`")
    return header, generation

