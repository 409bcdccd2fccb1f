"""The pool: one shared-memory segment of entries that many holders share without copies.

An entry is written once (`put`, or `reserve` + fill + `commit`), then shared by reference count
(`share` / `release`), read through pinned zero-copy views (`get`), and evicted by cost when the
export budget needs room. Entries held by no one stay cached for the prefix index until evicted.
A crash loses only entries being written: the segment and every ready header survive, and
`Pool.attach` rebuilds the rest (free lists, counts, the index) from them. Where the bytes are,
and how they move crash-safely, is the Store's business (store.py); what to keep is the pool's.
One lock guards the metadata; bulk copies into a reserved (still invisible) entry happen outside it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from kvpool import checksum, eviction, layout as layouts, validation
from kvpool.allocator import align_up
from kvpool.budget import Budget, Device, export_budget, host_memory_available
from kvpool.entry import EntryInfo, EntryRecord, EntryView, Writer, meta_layout
from kvpool.errors import EntryBusy, EntryNotFound, EntryTooLarge, LayoutError, PoolBusy, PoolError
from kvpool.header import ENTRY_SLOT_BYTES, FORMAT_VERSION, EntryHeader, EntryState, PoolHeader, fits_entry_slot
from kvpool.layout import ArrayLayout, ArrayTemplate, BlobLayout, KVArray, Layout
from kvpool.prefix import PrefixIndex, PrefixMatch, common_prefix, prefix_space
from kvpool.recovery import RecoveryReport
from kvpool.maintenance import Compacting
from kvpool.segment import Segment
from kvpool.stats import Counters, PoolStats, snapshot
from kvpool.store import POOL_HEADER_BYTES, Store, plan_geometry, read_pool_header
from kvpool.tiering import Tiered

SERIAL_BLOCK = 1024  # entry ids are reserved in the pool header this many at a time


class Pool(Compacting, Tiered):
    """A shared-memory KV pool. Create one with :meth:`create`, re-attach with :meth:`attach`."""

    def __init__(self, store: Store) -> None:
        """Internal: use Pool.create or Pool.attach."""
        self._store = store
        self._lock = threading.RLock()
        self._entries: dict[int, EntryRecord] = {}
        self._writing: dict[int, EntryRecord] = {}
        self._prefix = PrefixIndex(lambda entry_id: self._store.tokens(self._entries[entry_id].header))
        self._clock = itertools.count(1)
        self._next_serial = 1
        self._bytes_used = 0
        self._counters = Counters()
        self._report = RecoveryReport()
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
        size_bytes, slot_count, arena_offset, arena_size = plan_geometry(size_bytes, max_entries)
        segment = Segment.create(name, size_bytes)
        try:
            if budget is None:
                options = {k: v for k, v in (("headroom", headroom), ("cap", cap)) if v is not None}
                entry_bytes = arena_size + slot_count * ENTRY_SLOT_BYTES  # everything entries can take
                budget = export_budget(device, entry_bytes, host_memory_available() + size_bytes, **options)
            header = PoolHeader(FORMAT_VERSION, os.getuid(), name, size_bytes, POOL_HEADER_BYTES, slot_count,
                                ENTRY_SLOT_BYTES, arena_offset, arena_size,
                                min(budget.bytes, arena_size + slot_count * ENTRY_SLOT_BYTES),
                                budget.reason, time.time(), os.getpid(), serial_limit=1)
            store = Store(segment, header)
            store.write_pool_header(header)
            pool = cls(store)
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
            header, generation = read_pool_header(segment, name)
            store = Store(segment, header, generation)
            pool = cls(store)
            pool._recover()
            pool._next_serial = max(pool._next_serial, header.serial_limit)
            # (a version-1 pool becomes version 2: see kvpool.header)
            store.write_pool_header(msgspec.structs.replace(header, version=FORMAT_VERSION, owner_pid=os.getpid(),
                                                            serial_limit=pool._next_serial))
        except BaseException:
            with contextlib.suppress(PoolBusy):  # a view held by the traceback: the mapping goes with it
                segment.close()
            raise
        return pool

    def close(self) -> None:
        """Detach from the segment, leaving every ready entry in it for a later attach; the disk
        tier's writer first writes what is queued, and the tier is closed. PoolBusy while entry
        views or writers are open."""
        self._stop_spilling()
        with self._lock:
            if self._closed:
                return
            viewed = [r.id for r in self._entries.values() if r.views]
            if viewed or self._writing:
                raise PoolBusy(f"pool {self.name!r}: entries {viewed} have open views and {len(self._writing)} "
                               "writers are open; close those views and writers first")
            self._store.close()
            self._closed = True

    def unlink(self) -> None:
        """Remove the segment's name (its memory goes with the last mapping); after close(), destroys it."""
        self._store.segment.unlink()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def name(self) -> str:
        """The pool's name."""
        return self._store.header.name

    @property
    def header(self) -> PoolHeader:
        """The pool header: geometry, owner and export budget."""
        return self._store.header

    @property
    def recovery(self) -> RecoveryReport:
        """What the last attach found (empty for a new pool)."""
        return self._report

    # ----------------------------------------------------------------------------- writing

    def put(self, identity: str, tokens, arrays: Sequence[KVArray], *, capacity: int | None = None, tag: str = "",
            recompute_cost: float | None = None, engine_values: dict | None = None,
            namespace: str = "") -> EntryInfo | None:
        """Store `arrays` (one copy each, hashed on the way) and the engine's plain `engine_values`
        as a new entry held once by the caller. None when the budget has no room even after
        compaction and eviction. Only lookups in the same `namespace` find it by prefix."""
        live = layouts.live_tokens_of(arrays)
        tokens = validation.token_ids(tokens)
        if live is not None and live != len(tokens):
            raise LayoutError(f"arrays hold {live} cells but {len(tokens)} token ids were given")
        writer = self.reserve(identity, tokens, [layouts.template_of(a) for a in arrays], capacity=capacity,
                              tag=tag, recompute_cost=recompute_cost, engine_values=engine_values, namespace=namespace)
        if writer is None:
            return None
        with writer:
            return writer.commit(writer.fill(arrays))

    def put_blob(self, identity: str, tokens, blob, *, tag: str = "", recompute_cost: float | None = None,
                 namespace: str = "") -> EntryInfo | None:
        """Store an engine's opaque state blob (any bytes-like) whole, hashed on the way."""
        if isinstance(blob, np.ndarray) and not blob.flags.c_contiguous:
            raise LayoutError("an engine blob must be C-contiguous bytes (copying it here would be a hidden copy)")
        source = blob.reshape(-1).view(np.uint8) if isinstance(blob, np.ndarray) else np.frombuffer(blob, np.uint8)
        writer = self.reserve_blob(identity, tokens, source.nbytes, tag=tag, recompute_cost=recompute_cost,
                                   namespace=namespace)
        if writer is None:
            return None
        with writer:
            return writer.commit(writer.fill_blob(source))

    def reserve(self, identity: str, tokens, templates: Sequence[ArrayTemplate], *, capacity: int | None = None,
                tag: str = "", recompute_cost: float | None = None, engine_values: dict | None = None,
                namespace: str = "") -> Writer | None:
        """Reserve a new array entry with room for `capacity` cells (default: the tokens given) and
        return a Writer whose views the engine fills directly; None when there is no room.
        `namespace`: only lookups in it find the entry by prefix (a tenant's, say)."""
        tokens = validation.token_ids(tokens)
        capacity = len(tokens) if capacity is None else capacity
        if capacity < len(tokens):
            raise LayoutError(f"capacity {capacity} is less than the {len(tokens)} tokens given")
        layout, data_length = layouts.plan(templates, capacity, validation.engine_values(engine_values))
        return self._reserve(identity, tokens, layout, data_length, capacity, tag, recompute_cost, namespace)

    def reserve_blob(self, identity: str, tokens, nbytes: int, *, tag: str = "",
                     recompute_cost: float | None = None, namespace: str = "") -> Writer | None:
        """Reserve a blob entry of `nbytes` for an engine that serialises its own state."""
        if nbytes < 0:
            raise LayoutError(f"blob size must be >= 0, got {nbytes}")
        tokens = validation.token_ids(tokens)
        return self._reserve(identity, tokens, BlobLayout(nbytes), align_up(max(nbytes, 1)), len(tokens),
                             tag, recompute_cost, namespace)

    def extend(self, entry_id: int, tokens, *, recompute_cost: float | None = None) -> Writer:
        """A Writer for cells appended to an array entry held by at most one reference, within
        its capacity. Fill `writer.arrays` (the new cells only) and commit. `recompute_cost` is
        the entry's new cost; by default it grows by one per appended token."""
        tokens = validation.token_ids(tokens)
        with self._lock:
            record = self._record(entry_id)
            header = record.header
            cost = (header.recompute_cost + len(tokens) if recompute_cost is None
                    else validation.recompute_cost(recompute_cost, 0))
            if not isinstance(record.layout, ArrayLayout):
                raise LayoutError(f"entry {entry_id} holds an engine blob, written whole; put a new entry instead")
            if any(spec.token_axis == layouts.NO_TOKEN_AXIS for spec in record.layout.arrays):
                raise LayoutError(f"entry {entry_id} holds fixed-size state, which cannot be rewritten in place "
                                  "without risking it in a crash; put a new entry instead")
            if record.refcount > 1 or record.extending:
                raise EntryBusy(f"entry {entry_id} is shared ({record.refcount} references) or being extended; "
                                "shared entries are immutable")
            if header.live + len(tokens) > header.capacity:
                raise LayoutError(f"entry {entry_id} has room for {header.capacity - header.live} more cells, "
                                  f"not {len(tokens)}; put a new entry with a larger capacity")
            self._store.write_tokens(header, header.live, tokens)  # past live: the header does not cover them yet
            record.extending = True
            record.pending_cost = cost
            return Writer(self, record, self._store.data(header), header.live, header.live + len(tokens))

    # ----------------------------------------------------------------------------- reading, sharing, statistics

    def get(self, entry_id: int, *, verify: bool = True) -> EntryView:
        """Pinned, zero-copy, read-only views of an entry (a context manager). With `verify`, the
        live bytes are checked against their checksum first (DataCorrupt if they fail)."""
        with self._lock:
            record = self._record(entry_id)
            record.views += 1
            record.last_used = next(self._clock)
            self._counters.gets += 1
            view = EntryView(self, record, self._store.data(record.header), self._store.tokens(record.header))
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
            if record.extending:
                raise EntryBusy(f"entry {entry_id} is being extended; share it once the extension is committed "
                                "(shared entries are immutable)")
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

    def supersede(self, old_id: int, new_id: int, *, tail: int = 0) -> bool:
        """Drop entry `old_id` where entry `new_id` of the same identity, namespace and tag holds its
        tokens and more, but for at most `tail` tokens at its end (its owner parked again, from
        it): every lookup it answered, the new one answers as well (a state that can be cut back,
        the caller knows; short of those last tokens). Not while anyone holds or pins it; while
        the disk tier's writer reads it, it goes when the writer is done. Its disk copy goes once
        the new entry has one, also where memory already evicted it for room. True if it went,
        or will."""
        with self._lock:
            old, new = self._entries.get(old_id), self._entries.get(new_id)
            if old is None and new is not None and old_id != new_id:
                return self._supersede_below(old_id, new, tail)
            if old is None or new is None or old is new or old.refcount or old.pins or old.extending:
                return False
            before, after = old.header, new.header
            if (before.identity, before.namespace, before.tag) != (after.identity, after.namespace, after.tag):
                return False  # (another owner's: deleting this one's owner must not take it along)
            shared = common_prefix(self._store.tokens(before), self._store.tokens(after))
            if before.live - shared > tail:
                return False
            if old.views:  # being written to disk or read: dropped once the last view closes
                old.superseded_by = new
                return True
            self._hand_down_disk_copy(old, new)
            self._drop(old)
            self._counters.superseded += 1
            return True

    def lookup(self, identity: str, tokens, serves: Callable[[int, int], bool] | None = None, *,
               namespace: str = "") -> PrefixMatch | None:
        """The ready entry of `identity` in `namespace` sharing the longest exact token prefix
        with `tokens` (only entries that `serves(entry_tokens, matched)` accepts, when given)."""
        tokens = validation.token_ids(tokens)
        with self._lock:
            self._check_open()
            found = self._prefix.longest(prefix_space(identity, namespace), tokens, serves=serves)
        return self._lookup_below(identity, tokens, serves, namespace, found)

    def acquire_prefix(self, identity: str, tokens, *, namespace: str = "") -> PrefixMatch | None:
        """lookup() and share() the entry found, atomically (the caller must release it)."""
        with self._lock:
            self._check_open()
            match = self._prefix.longest(prefix_space(identity, namespace), validation.token_ids(tokens))
            if match is not None:
                self.share(match.entry_id)
            return match

    def arena_map(self) -> list[tuple[int, int, str]]:
        """(offset, length, owner) of every extent of the arena in offset order; owner is
        "free", "<id>.data" or "<id>.meta". Lengths are as allocated (rounded up to ALIGN)."""
        with self._lock:
            return self._store.arena_map([*self._entries.values(), *self._writing.values()])

    def stats(self) -> PoolStats:
        """A snapshot of bytes, entries and counters."""
        with self._lock:
            return snapshot(self._store, list(self._entries.values()), len(self._writing), self._bytes_used,
                            self._counters, self._report)

    # ----------------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError(f"pool {self.name!r} is closed")

    def _record(self, entry_id: int) -> EntryRecord:
        self._check_open()
        try:
            return self._entries[entry_id]
        except KeyError:
            raise EntryNotFound(f"no ready entry {entry_id} in pool {self.name!r}") from None

    def _movable(self, record: EntryRecord) -> bool:
        return not record.pins and not record.views and not record.extending

    def _candidate(self, record: EntryRecord) -> eviction.Candidate:
        """`record` as the eviction policy sees it (under the lock)."""
        return eviction.Candidate(record.id, record.stored_bytes, record.header.recompute_cost, record.last_used,
                                  self._kept_below(record))

    def _reserve(self, identity: str, tokens: np.ndarray, layout: Layout, data_length: int, capacity: int,
                 tag: str, recompute_cost: float | None, namespace: str) -> Writer | None:
        # Everything that can be refused is refused here, before any room is made.
        identity = validation.text_field("identity", identity, allow_empty=False)
        tag = validation.text_field("tag", tag, allow_empty=True)
        namespace = validation.text_field("namespace", namespace, allow_empty=True)
        header = EntryHeader(FORMAT_VERSION, EntryState.WRITING, 0, identity, len(tokens), capacity, tag=tag,
                             recompute_cost=validation.recompute_cost(recompute_cost, len(tokens)),
                             created_at=time.time(), namespace=namespace)
        layout_bytes = layouts.encode_layout(layout)
        _, meta_length = meta_layout(len(layout_bytes), capacity)
        stored = align_up(data_length) + align_up(meta_length) + ENTRY_SLOT_BYTES
        pool = self._store.header
        if self._store.data_need(data_length) + align_up(meta_length) > pool.arena_size:
            raise EntryTooLarge(f"an entry of {stored} bytes ({len(tokens)} tokens) cannot fit the pool's "
                                f"{pool.arena_size}-byte arena; create a larger pool")
        if stored > pool.budget_bytes:
            raise EntryTooLarge(f"an entry of {stored} bytes ({len(tokens)} tokens) exceeds the pool's export "
                                f"budget of {pool.budget_bytes} bytes ({pool.budget_reason}); raise the budget or "
                                "store fewer tokens")
        with self._lock:
            self._check_open()
            header = msgspec.structs.replace(header, serial=self._take_serial(), meta_length=meta_length,
                                             data_length=data_length, layout_length=len(layout_bytes),
                                             data_offset=self._store.header.arena_size,
                                             meta_offset=self._store.header.arena_size)
            if not fits_entry_slot(header):
                raise LayoutError("the entry header would not fit its slot; shorten the identity, tag or namespace")
            placed = self._make_room(stored, data_length, meta_length)
            if placed is None:
                self._counters.refused += 1
                return None
            slot, data_offset, meta_offset = placed
            record = EntryRecord(slot, msgspec.structs.replace(header, data_offset=data_offset,
                                                               meta_offset=meta_offset), layout)
            try:
                layout_check, tokens_check = self._store.write_meta(meta_offset, layout_bytes, tokens, capacity)
                record.header = msgspec.structs.replace(record.header, layout_checksum=layout_check,
                                                        tokens_checksum=tokens_check)
                self._store.write_entry(record)
            except BaseException:
                self._store.release(record)
                raise
            self._writing[header.serial] = record
            self._bytes_used += record.stored_bytes
        return Writer(self, record, self._store.data(record.header), 0, len(tokens))

    def _take_serial(self) -> int:
        """The next entry id; ids are reserved in the pool header in blocks, so none is reused
        after a crash and an attach."""
        serial = self._next_serial
        if serial >= self._store.header.serial_limit:
            self._store.write_pool_header(msgspec.structs.replace(self._store.header,
                                                                  serial_limit=serial + SERIAL_BLOCK))
        self._next_serial += 1
        return serial

    def _make_room(self, stored: int, data_length: int, meta_length: int) -> tuple[int, int, int] | None:
        """(slot, data offset, meta offset) for a new entry, reclaiming slack, defragmenting and
        evicting by cost as needed; None when nothing more can be freed."""
        victims: list[int] | None = None
        while True:
            if self._bytes_used + stored <= self._store.header.budget_bytes:
                placed = self._place(data_length, meta_length)
                if placed is not None:
                    return placed
            if victims is None:  # first shortfall: giving back slack keeps every entry
                if self.compact() > 0:
                    continue
                victims = eviction.eviction_order(self._candidate(r) for r in self._entries.values()
                                                  if not r.refcount and self._movable(r))
                victims.reverse()  # pop() from the end takes the first to evict
            if not victims:
                return None
            self._evict_for_room(self._entries[victims.pop()])

    def _place(self, data_length: int, meta_length: int) -> tuple[int, int, int] | None:
        """A slot and both extents, defragmenting if the free space is there but split; or None."""
        store, allocator = self._store, self._store.allocator
        offsets = []
        for length, allocate, need in ((data_length, store.allocate_data, store.data_need(data_length)),
                                       (meta_length, allocator.allocate, align_up(meta_length))):
            offset = allocate(length)
            if offset is None and allocator.free_bytes >= need and self._defragment(need, offsets):
                offset = allocate(length)
            if offset is None:
                break
            offsets.append((offset, length))
        slot = self._store.take_slot() if len(offsets) == 2 else None
        if slot is None:
            for offset, length in offsets:
                allocator.free(offset, length)
            return None
        return slot, offsets[0][0], offsets[1][0]

    def _commit(self, record: EntryRecord, live: int, data_checksum: int) -> EntryInfo:
        with self._lock:
            old = record.header
            if record.extending:  # appended cells: the old header stays valid until this one is whole
                new = msgspec.structs.replace(old, live=live, data_checksum=data_checksum,
                                              tokens_checksum=checksum.digest([self._store.tokens(old, live)]),
                                              recompute_cost=record.pending_cost)
            else:
                new = msgspec.structs.replace(old, state=EntryState.READY, data_checksum=data_checksum)
            self._store.write_header(record.slot, new)  # durable first; then the bookkeeping follows it
            written = layouts.live_nbytes(record.layout, live) - (record.live_bytes if record.extending else 0)
            record.header = new
            if record.extending:
                record.extending = False
                record.spill_not_before = 0.0  # the cells its owner would have replaced it with are here
                self._counters.extends += 1
                self._forget_disk_copy(record)
            else:
                del self._writing[new.serial]
                self._entries[new.serial] = record
                record.refcount = 1
                self._counters.puts += 1
            self._queue_spill(record)
            record.last_used = next(self._clock)
            self._counters.bytes_written += written
            self._prefix.add(record.id, prefix_space(new.identity, new.namespace), self._store.tokens(new))
            return record.info()

    def _abort(self, record: EntryRecord) -> None:
        with self._lock:
            if record.extending:
                record.extending = False
                self._queue_spill(record)  # (the writer passes over an entry being extended)
                return
            del self._writing[record.id]
            self._release(record)

    def _unpin(self, record: EntryRecord) -> None:
        with self._lock:
            if record.pins == 0:
                raise PoolError(f"entry {record.id} is not pinned")
            record.pins -= 1

    def _close_view(self, record: EntryRecord) -> None:
        with self._lock:
            record.views -= 1
            self._drop_if_superseded(record)

    def _drop_if_superseded(self, record: EntryRecord) -> None:
        """Drop `record` if it was superseded while read, and nobody holds or reads it now."""
        new = record.superseded_by
        if (new is not None and not record.views and not record.refcount and not record.pins
                and self._entries.get(record.id) is record):
            self._hand_down_disk_copy(record, new)
            self._drop(record)
            self._counters.superseded += 1

    def _count_read(self, nbytes: int) -> None:
        with self._lock:
            self._counters.bytes_read += nbytes

    def _evict_for_room(self, record: EntryRecord) -> None:
        """Evict `record` because the budget needs its room: the disk tier keeps it."""
        self._keep_on_disk(record)
        self._evict(record)
        self._moved_below_now(record)

    def _evict(self, record: EntryRecord) -> None:
        self._counters.evictions += 1
        self._counters.evicted_bytes += record.stored_bytes
        self._drop(record)

    def _drop(self, record: EntryRecord) -> None:
        del self._entries[record.id]
        self._prefix.remove(record.id)
        self._release(record)

    def _release(self, record: EntryRecord) -> None:
        self._store.release(record)
        self._bytes_used -= record.stored_bytes

    def _recover(self) -> None:
        scan = self._store.recover()
        for found in scan.entries:
            record = EntryRecord(found.slot, found.header, found.layout, last_used=next(self._clock))
            self._entries[record.id] = record
            self._bytes_used += record.stored_bytes
            self._next_serial = max(self._next_serial, record.id + 1)
            self._prefix.add(record.id, prefix_space(record.header.identity, record.header.namespace),
                             self._store.tokens(record.header))
        self._report = scan.report
