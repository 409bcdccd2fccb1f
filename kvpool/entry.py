"""Entries as the pool tracks them, and the handles it gives out: views to read, writers to fill.

An entry's durable part is its header in the segment; everything in :class:`EntryRecord` beyond
the header (reference count, pins, last use) is derived and rebuilt on attach. Handles talk to the
pool only through its small private protocol (`_commit`, `_abort`, `_close_view`, `_count_read`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from kvpool import checksum, layout as layouts
from kvpool.allocator import align_up
from kvpool.errors import DataCorrupt, LayoutError
from kvpool.header import ENTRY_SLOT_BYTES, EntryHeader
from kvpool.layout import ArrayLayout, BlobLayout, Layout

if TYPE_CHECKING:
    from kvpool.pool import Pool

TOKEN_DTYPE = np.dtype("<i4")


def meta_layout(layout_length: int, capacity: int) -> tuple[int, int]:
    """(offset of the token ids, total bytes) of a side record: layout, padding to 8, tokens."""
    tokens_at = align_up(layout_length, 8)
    return tokens_at, tokens_at + TOKEN_DTYPE.itemsize * capacity


class EntryInfo(msgspec.Struct, frozen=True):
    """What a caller learns about an entry: a snapshot, not a handle."""

    id: int
    identity: str
    tokens: int
    capacity: int
    stored_bytes: int
    live_bytes: int
    slack_bytes: int
    refcount: int
    pins: int  # explicit pins plus open views
    tag: str
    recompute_cost: float
    namespace: str = ""  # only lookups in this namespace find it by prefix


@dataclass(eq=False)
class EntryRecord:
    """The pool's in-memory record of one entry."""

    slot: int
    header: EntryHeader
    layout: Layout
    refcount: int = 0
    pins: int = 0  # explicit pin() calls
    views: int = 0  # open EntryViews (they pin too)
    last_used: int = 0
    extending: bool = False  # a Writer is appending cells
    pending_cost: float = 0.0  # the recompute cost the entry will have once they are committed
    disk_id: int | None = None  # the disk tier's copy of these cells, if it has one
    supersedes: list[int] = field(default_factory=list)  # disk copies of shorter entries it replaced: go once it has one
    superseded_by: "EntryRecord | None" = None  # replaced while being read: dropped when the last view closes
    erased: bool = False  # its owner was deleted: never written to disk
    spill_not_before: float = 0.0  # (monotonic) its owner expects to replace it before then: not written sooner

    @property
    def id(self) -> int:
        """The entry's id."""
        return self.header.serial

    @property
    def stored_bytes(self) -> int:
        """Every byte the entry takes: both extents (aligned) and its header slot."""
        return align_up(self.header.data_length) + align_up(self.header.meta_length) + ENTRY_SLOT_BYTES

    @property
    def live_bytes(self) -> int:
        """Bytes of the live cells (what a copy of the entry moves)."""
        return layouts.live_nbytes(self.layout, self.header.live)

    @property
    def slack_bytes(self) -> int:
        """Bytes reserved for cells not yet live."""
        return layouts.live_nbytes(self.layout, self.header.capacity) - self.live_bytes

    def info(self) -> EntryInfo:
        """A snapshot of the entry for callers."""
        h = self.header
        return EntryInfo(h.serial, h.identity, h.live, h.capacity, self.stored_bytes, self.live_bytes,
                         self.slack_bytes, self.refcount, self.pins + self.views, h.tag, h.recompute_cost,
                         h.namespace)


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class EntryView:
    """Zero-copy, read-only views of a ready entry's live state. Pins the entry until closed.

    Use it as a context manager; arrays taken from it must not outlive the `with` block.
    """

    def __init__(self, pool: "Pool", record: EntryRecord, data: np.ndarray, tokens: np.ndarray) -> None:
        self._pool = pool
        self._record = record
        self._header = record.header  # the entry as it was when viewed: an extend adds cells, not to us
        self._layout = record.layout
        self._data = data
        self.info = record.info()
        self.tokens = _read_only(tokens)
        self.verified = False  # set once the live bytes have matched their checksum
        self._closed = False

    @property
    def layout(self) -> Layout:
        """The entry's layout record (array names, dtypes, reserved shapes, or the blob length)."""
        return self._layout

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Each stored array's live cells, read-only (array entries only)."""
        if not isinstance(self.layout, ArrayLayout):
            raise LayoutError(f"entry {self.info.id} holds an engine blob, not arrays")
        live = self.info.tokens
        return {spec.name: _read_only(layouts.live_view(self._data, spec, live)) for spec in self.layout.arrays}

    @property
    def blob(self) -> np.ndarray:
        """The engine blob, read-only (blob entries only)."""
        if not isinstance(self.layout, BlobLayout):
            raise LayoutError(f"entry {self.info.id} holds arrays, not an engine blob")
        return _read_only(self._data[:self.layout.length])

    def verify(self) -> None:
        """Raise DataCorrupt unless the live bytes match the checksum written with them."""
        found = checksum.digest(layouts.all_live_runs(self._data, self.layout, self.info.tokens))
        if found != self._header.data_checksum:
            raise DataCorrupt(f"entry {self.info.id} ({self.info.tag or 'untagged'}): stored bytes fail their "
                              "checksum; evict it and recompute its tokens", self.info.id)
        self.verified = True

    def read_into(self, destinations: Mapping[str, np.ndarray]) -> int:
        """Copy each array's live cells into `destinations[name]` (same shape), verifying the
        checksum on the way: one copy, the import's. Raises DataCorrupt after the copy if the
        bytes do not match (the destinations then hold garbage). Returns the bytes copied."""
        if not isinstance(self.layout, ArrayLayout):
            raise LayoutError(f"entry {self.info.id} holds an engine blob; use read_blob_into")
        missing = {spec.name for spec in self.layout.arrays} - set(destinations)
        if missing:
            raise LayoutError(f"no destination for arrays {sorted(missing)}")
        pairs = [(dst, src) for spec in self.layout.arrays
                 for src, dst in layouts.paired_runs(self._data, spec, self.info.tokens, destinations[spec.name])]
        return self._finish_read(*checksum.copy_checksummed(pairs))

    def read_blob_into(self, destination: np.ndarray) -> int:
        """Copy the engine blob into `destination` (uint8, same length), verifying on the way."""
        return self._finish_read(*checksum.copy_checksummed([(destination, self._data[:self.layout.length])]))

    def _finish_read(self, found: int, copied: int) -> int:
        self._pool._count_read(copied)
        if found != self._header.data_checksum:
            raise DataCorrupt(f"entry {self.info.id}: bytes read fail their checksum; evict it and recompute",
                              self.info.id)
        self.verified = True
        return copied

    def count_copy_out(self, nbytes: int) -> None:
        """Count `nbytes` an engine copied out of this entry's memory itself (llama.cpp reads its
        blob straight from the view), so the pool's bytes_copied covers every import."""
        self._pool._count_read(nbytes)

    def close(self) -> None:
        """Unpin the entry (idempotent)."""
        if not self._closed:
            self._closed = True
            self._data = self.tokens = None
            self._pool._close_view(self._record)

    def __enter__(self) -> "EntryView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Writer:
    """Writable views of cells being stored: a new entry (`reserve`) or cells appended to one
    (`extend`). Fill `arrays` (or `blob`), then `commit()`; leaving a `with` block without a
    commit aborts, and nothing half-written becomes visible."""

    def __init__(self, pool: "Pool", record: EntryRecord, data: np.ndarray, first_cell: int, live: int) -> None:
        self._pool = pool
        self._record = record
        self._data = data
        self._first = first_cell
        self.live = live
        self._done = False

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Writable views of the cells to fill, per array (shape: the new cells only)."""
        if not isinstance(self._record.layout, ArrayLayout):
            raise LayoutError("this entry holds an engine blob; write into `blob`")
        views = {}
        for spec in self._record.layout.arrays:
            full = layouts.full_view(self._data, spec)
            if spec.token_axis == layouts.NO_TOKEN_AXIS:
                views[spec.name] = full
            else:
                index = [slice(None)] * full.ndim
                index[spec.token_axis] = slice(self._first, self.live)
                views[spec.name] = full[tuple(index)]
        return views

    @property
    def blob(self) -> np.ndarray:
        """The writable blob region (blob entries only)."""
        if not isinstance(self._record.layout, BlobLayout):
            raise LayoutError("this entry holds arrays; write into `arrays`")
        return self._data[:self._record.layout.length]

    def live_runs(self) -> list[np.ndarray]:
        """Writable views of the cells to fill, as contiguous runs in canonical (checksum) order:
        what a reader of an entry's stored bytes (the disk tier) fills in one pass."""
        if self._first:
            raise LayoutError("live_runs fills a new entry whole; an extension writes `arrays`")
        return list(layouts.all_live_runs(self._data, self._record.layout, self.live))

    def fill(self, arrays: Sequence[layouts.KVArray]) -> int:
        """Copy each array's live cells into the entry, hashing on the way; the data checksum.
        `arrays` come in the order the entry was reserved with."""
        if not isinstance(self._record.layout, ArrayLayout):
            raise LayoutError("this entry holds an engine blob; use fill_blob")
        if [a.name for a in arrays] != [s.name for s in self._record.layout.arrays]:
            raise LayoutError("arrays do not match the entry's layout, name for name")
        pairs = [pair for array, spec in zip(arrays, self._record.layout.arrays)
                 for pair in layouts.paired_runs(self._data, spec, self.live, array.data)]
        return checksum.copy_checksummed(pairs)[0]

    def fill_blob(self, source: np.ndarray) -> int:
        """Copy an engine blob (uint8) into the entry, hashing on the way; the data checksum."""
        return checksum.copy_checksummed([(self.blob, source)])[0]

    def commit(self, data_checksum: int | None = None) -> EntryInfo:
        """Make the cells durable and visible. `data_checksum` is for callers that hashed while
        copying (`Pool.put`); otherwise the live cells are hashed here."""
        if self._done:
            raise LayoutError("this writer was already committed or aborted")
        if data_checksum is None:
            data_checksum = checksum.digest(layouts.all_live_runs(self._data, self._record.layout, self.live))
        self._done = True
        self._data = None
        return self._pool._commit(self._record, self.live, data_checksum)

    def abort(self) -> None:
        """Give the cells back; the pool is as if the writer never existed (idempotent)."""
        if not self._done:
            self._done = True
            self._data = None
            self._pool._abort(self._record)

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def __del__(self) -> None:
        # A writer dropped without commit or abort would hold its extents until close() refused.
        if not getattr(self, "_done", True):
            try:
                self.abort()
            except Exception:  # interpreter shutdown, or the pool already closed
                pass
