"""Where a new entry goes, as the pool decides it: everything that can be refused refused first
(fields, size against the arena and the export budget), then room made within the budget (slack
given back first, which keeps every entry, then entries evicted by cost), a header slot and both
extents placed (defragmenting where the free space is there but split), and an id that is never
handed out twice, even across a crash. A mixin of Pool: it works on the pool's records under the
pool's lock.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

from kvpool import eviction, layout as layouts, validation
from kvpool.allocator import align_up
from kvpool.entry import EntryRecord, Writer, meta_layout
from kvpool.errors import EntryTooLarge, LayoutError
from kvpool.header import ENTRY_SLOT_BYTES, FORMAT_VERSION, EntryHeader, EntryState, fits_entry_slot
from kvpool.layout import Layout

SERIAL_BLOCK = 1024  # entry ids are reserved in the pool header this many at a time


class Placing:
    """Pool methods that reserve and place a new entry."""

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
