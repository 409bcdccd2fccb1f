"""The disk tier: entries kept as files behind a pool, within a hard budget, found again after anything.

One folder per pool (`<cache>/disk/<pool name>`, mode 0700, files 0600), locked by the process
that owns the pool (kvpool.tier_folder), so two processes never write the same files. Each entry
is one file (kvpool.disk_format: data first, header last, checksums, written under a temporary
name and renamed once flushed). Opening a tier removes what a crash left half-written, then indexes
every file in the background (reading only headers and token ids), so a process answers at
once and finds its disk entries as the scan reaches them.

The budget is hard: an entry is written only once the tier has made room for it, evicting
entries cheapest per byte first (recompute cost over the bytes they hold, then least recently
used), and only entries worth no more per byte than the one arriving; otherwise it is refused. A
write also keeps `headroom` bytes of the file system free (the session log and everything else
on the disk need them): one that would not is refused, and one that fails anyway (the disk
filled meanwhile) leaves no file and costs only that entry.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np

from kvpool import disk_format, eviction
from kvpool.budget import default_disk_budget, default_disk_headroom
from kvpool.disk_format import DiskHeader
from kvpool.errors import DataCorrupt, EntryNotFound
from kvpool.prefix import PrefixIndex, PrefixMatch, prefix_space
from kvpool.stats import DiskCounters, DiskStats
from kvpool.tier_folder import open_locked, unlink_quietly

LOG = logging.getLogger("kvpool.disk")


class DiskEntryInfo(msgspec.Struct, frozen=True):
    """One disk entry, as listings show it."""

    id: int
    name: str
    identity: str
    namespace: str
    tag: str
    tokens: int
    file_bytes: int
    recompute_cost: float
    created_at: float


@dataclass(eq=False)
class DiskRecord:
    """The tier's in-memory record of one file."""

    id: int
    name: str
    header: DiskHeader
    tokens: np.ndarray
    file_bytes: int
    last_used: int
    readers: int = 0
    doomed: bool = False  # removed while being read: the file goes when the last reader leaves

    def info(self) -> DiskEntryInfo:
        """A snapshot for listings."""
        h = self.header
        return DiskEntryInfo(self.id, self.name, h.identity, h.namespace, h.tag, h.live, self.file_bytes,
                             h.recompute_cost, h.created_at)


class PendingWrite(NamedTuple):
    """A file written but not yet flushed and named (`DiskTier.begin`, then `finish`)."""

    name: str
    header: DiskHeader
    tokens: np.ndarray
    file_bytes: int


class DiskTier:
    """One pool's folder of entry files. Thread-safe; the owner of the pool holds it open."""

    def __init__(self, folder: str | os.PathLike, budget_bytes: int | None = None, *,
                 headroom: int | None = None, scan: bool = True,
                 stage: Callable[[str], None] = disk_format.NO_STAGE) -> None:
        """Open (creating it 0700) the tier in `folder` and lock it: PoolBusy while another process
        has it open. `budget_bytes` None: `kvpool.budget.default_disk_budget`. `scan` False leaves the files for
        `scan_now()` (tests). `stage` is handed to every write (tests kill the process there)."""
        self.folder = Path(folder)
        self._lock = threading.Lock()
        self._records: dict[int, DiskRecord] = {}
        self._by_name: dict[str, int] = {}
        self._index = PrefixIndex(lambda disk_id: self._records[disk_id].tokens)
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._counters = DiskCounters()
        self._stage = stage
        self._closed = False
        self._lock_fd = open_locked(self.folder)
        try:
            self._unreadable: dict[str, int] = {}  # files of another format version, or unreadable now
            self._writing: dict[str, int] = {}  # files being written, counted against the budget
            self._doomed: dict[str, int] = {}  # removed while being read: counted until unlinked
            # (tag, namespace or None) erased while files may still carry it unindexed: those the
            # scan has not reached, and those being written; dropped once there are none
            self._tombstones: set[tuple[str, str | None]] = set()
            self._unscanned = self._list_files()
            held = sum(self._unscanned.values())
            self.budget_bytes = default_disk_budget(self.folder, held) if budget_bytes is None else int(budget_bytes)
            if self.budget_bytes < 0:
                raise ValueError(f"disk budget {budget_bytes} is negative; give bytes >= 0")
            self.headroom = default_disk_headroom(self.folder) if headroom is None else int(headroom)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._scanner: threading.Thread | None = None
        self._stop_scan = threading.Event()
        if scan:
            self._scanner = threading.Thread(target=self.scan_now, name="kvpool-disk-scan", daemon=True)
            self._scanner.start()

    # ----------------------------------------------------------------------------- opening

    def _list_files(self) -> dict[str, int]:
        """{entry name: bytes} of the files to scan; half-written files (a crash during a write)
        are removed here, before this process writes any."""
        found: dict[str, int] = {}
        for item in os.scandir(self.folder):
            if item.name.endswith(disk_format.PARTIAL):
                unlink_quietly(item.path)
                self._counters.torn_removed += 1
            elif item.name.endswith(disk_format.SUFFIX) and item.is_file(follow_symlinks=False):
                found[item.name[:-len(disk_format.SUFFIX)]] = item.stat(follow_symlinks=False).st_size
        return found

    def scan_now(self) -> None:
        """Index every file not yet indexed (what the background scan does): a file that is torn
        or damaged is removed, one of another format version (or that cannot be read now: a
        descriptor limit, an I/O error) kept as unreadable; a file of an erased tag is removed.
        Once every file is indexed, the tier is trimmed to its budget (it may have shrunk)."""
        while not self._stop_scan.is_set():
            with self._lock:
                if not self._unscanned:
                    break
                name, size = next(iter(self._unscanned.items()))
            try:
                record = self._read_record(name)
            except DataCorrupt:
                with self._lock:
                    if self._unscanned.pop(name, None) is not None:
                        self._counters.corrupt_found += 1
                        unlink_quietly(self._path(name))
                continue
            except Exception:  # another format, or not readable now: kept, never read into an engine
                with self._lock:
                    if self._unscanned.pop(name, None) is not None:
                        self._unreadable[name] = size
                continue
            with self._lock:
                if self._unscanned.pop(name, None) is None:  # evicted while read
                    continue
                if self._erased(record.header):
                    unlink_quietly(self._path(name))
                    self._counters.erased += 1
                    continue
                record.id, record.last_used = next(self._ids), next(self._clock)
                self._add(record)
        with self._lock:
            if not self._unscanned and not self._stop_scan.is_set():
                self._trim()  # within the budget again (it may have shrunk), cheapest per byte first
                self._prune_tombstones()

    def _erased(self, header: DiskHeader) -> bool:
        """Whether an entry with `header` was erased (under the lock)."""
        return ((header.tag, None) in self._tombstones
                or (header.tag, header.namespace) in self._tombstones)

    def _prune_tombstones(self) -> None:
        if not self._unscanned and not self._writing:
            self._tombstones.clear()

    def _read_record(self, name: str) -> DiskRecord:
        """The record of file `name`: DataCorrupt for a torn or damaged one, FileUnreadable for
        another format version, OSError where it cannot be read now."""
        fd = os.open(self._path(name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            header, tokens = disk_format.read_header(fd, size, name)
        finally:
            os.close(fd)
        return DiskRecord(0, name, header, tokens, size, 0)

    def close(self) -> None:
        """Stop the scan and unlock the folder; the files stay for the next open (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_scan.set()
        if self._scanner is not None:
            self._scanner.join()
        os.close(self._lock_fd)

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------------- finding

    def lookup(self, identity: str, tokens: np.ndarray, serves: Callable[[int, int], bool] | None = None, *,
               namespace: str = "") -> PrefixMatch | None:
        """The disk entry of `identity` in `namespace` sharing the longest exact token prefix
        with `tokens` (its id, marked on_disk)."""
        with self._lock:
            found = self._index.longest(prefix_space(identity, namespace), tokens, serves=serves)
        return None if found is None else PrefixMatch(found.entry_id, found.tokens, on_disk=True)

    def find_copy(self, identity: str, namespace: str, tag: str, tokens: np.ndarray, data_checksum: int) -> int | None:
        """The id of an entry holding exactly these tokens and bytes under this tag, if the tier
        has one (an entry a pool had written before it was re-attached; another tag's copy is not
        one: it is erased with its own owner)."""
        with self._lock:
            found = self._index.longest(prefix_space(identity, namespace), tokens)
            if found is None or found.tokens != len(tokens):
                return None
            record = self._records[found.entry_id]
            same = (record.header.live == len(tokens) and record.header.data_checksum == data_checksum
                    and record.header.tag == tag)
            return record.id if same else None

    def wait_scanned(self, timeout: float | None = None) -> bool:
        """Wait until the start-up scan has indexed every file; False on timeout."""
        if self._scanner is not None:
            self._scanner.join(timeout)
            return not self._scanner.is_alive()
        return True

    def has(self, disk_id: int | None) -> bool:
        """Whether entry `disk_id` is still on disk."""
        with self._lock:
            record = self._records.get(disk_id)
            return record is not None and not record.doomed

    def tokens_of(self, disk_id: int, *, identity: str, namespace: str, tag: str) -> np.ndarray | None:
        """The token ids of entry `disk_id` if it is still on disk, of `identity` in `namespace`
        and carrying `tag`."""
        with self._lock:
            record = self._records.get(disk_id)
            if record is None or record.doomed:
                return None
            header = record.header
            return record.tokens if (header.identity, header.namespace, header.tag) == (identity, namespace, tag) else None

    def entries(self) -> list[DiskEntryInfo]:
        """Every indexed entry, by id."""
        with self._lock:
            return [self._records[k].info() for k in sorted(self._records)]

    def stats(self) -> DiskStats:
        """A snapshot of the tier."""
        with self._lock:
            return DiskStats(str(self.folder), self.budget_bytes, self._bytes_used(), len(self._records),
                             bool(self._unscanned), len(self._unreadable), **vars(self._counters))

    # ----------------------------------------------------------------------------- writing

    def write(self, header: DiskHeader, tokens: np.ndarray, runs: Iterable[np.ndarray]) -> int | None:
        """Write an entry (its header, tokens and data runs in canonical order) once room is made
        for it; its disk id, or None when it was refused (worth less per byte than everything it
        would displace, or the disk too full) or the write failed. The runs are read while this
        runs: the caller keeps them in place until it returns."""
        pending = self.begin(header, tokens, runs)
        return None if pending is None else self.finish(pending)

    def begin(self, header: DiskHeader, tokens: np.ndarray, runs: Iterable[np.ndarray]) -> PendingWrite | None:
        """The first half of `write`: room made, the file written into the page cache under a
        temporary name (a copy; nothing waits for the device); `finish` flushes and indexes it.
        None when refused or failed, as `write`."""
        size = disk_format.predicted_size(header)
        value = eviction.value_per_byte(eviction.Candidate(0, size, header.recompute_cost, 0))
        with self._lock:
            if self._closed or not self._make_room(size, value) or not self._disk_allows(size):
                self._counters.refused += 1
                return None
            name = f"{time.time_ns():x}-{secrets.token_hex(4)}"
            self._writing[name] = size
        try:
            written = disk_format.write_partial(str(self._path(name)), header, runs, tokens, self._stage)
        except Exception as exc:  # a full disk, an I/O error (or a bug of ours): only this entry is lost
            self._failed(name, exc)
            return None
        return PendingWrite(name, header, np.array(tokens, dtype=np.int32), written)

    def finish(self, pending: PendingWrite) -> int | None:
        """The second half of `write`: the file flushed to the device, named and indexed; its
        disk id (None when the flush failed, or its tag was erased meanwhile: the file is removed)."""
        try:
            disk_format.seal(str(self._path(pending.name)), self._stage)
        except Exception as exc:
            self._failed(pending.name, exc)
            return None
        with self._lock:
            self._writing.pop(pending.name, None)
            if self._erased(pending.header):
                unlink_quietly(self._path(pending.name))
                self._counters.erased += 1
                self._prune_tombstones()
                return None
            record = DiskRecord(next(self._ids), pending.name, pending.header, pending.tokens, pending.file_bytes,
                                next(self._clock))
            self._add(record)
            self._counters.writes += 1
            self._counters.bytes_written += pending.file_bytes
            self._prune_tombstones()
            return record.id

    def _failed(self, name: str, exc: BaseException) -> None:
        LOG.warning("disk tier %s: an entry was not written (%s); its KV stays only in memory", self.folder, exc)
        with self._lock:
            self._writing.pop(name, None)
            self._counters.write_failures += 1
            self._prune_tombstones()

    def _candidates(self, value: float) -> list[eviction.Candidate]:
        """The entries that may go for an arriving one worth `value` per byte, first to go first
        (under the lock)."""
        ranked = eviction.ranked(eviction.Candidate(r.id, r.file_bytes, r.header.recompute_cost, r.last_used)
                                 for r in self._records.values() if not r.readers)
        return [c for c in ranked if eviction.value_per_byte(c) <= value]  # (among equals the arriving is newest)

    def _make_room(self, size: int, value: float) -> bool:
        """Evict entries worth no more per byte than `value` (the arriving entry is the newest
        among equals) until `size` more bytes fit the budget; nothing is evicted unless that is
        enough. Files of another format go first."""
        need = self._bytes_used() + size - self.budget_bytes
        if need <= 0:
            return True
        if size > self.budget_bytes:
            return False
        order = self._candidates(value)
        if sum(self._unreadable.values()) + sum(c.stored_bytes for c in order) < need:
            return False
        self._evict(need, order)
        return True

    def _trim(self) -> None:
        """Evict down to the budget, as far as entries not being read allow (under the lock)."""
        need = self._bytes_used() - self.budget_bytes
        if need > 0:
            self._evict(need, self._candidates(float("inf")))

    def _evict(self, need: int, order: list[eviction.Candidate]) -> None:
        for name in list(self._unreadable):
            if need <= 0:
                return
            need -= self._unreadable.pop(name)
            unlink_quietly(self._path(name))
            self._counters.evictions += 1
        for candidate in order:
            if need <= 0:
                return
            need -= candidate.stored_bytes
            self._counters.evictions += 1
            self._counters.evicted_bytes += candidate.stored_bytes
            self._remove(self._records[candidate.entry_id])

    def _disk_allows(self, size: int) -> bool:
        try:
            fs = os.statvfs(self.folder)
        except OSError:  # the folder gone or unreadable: nothing can be written there
            return False
        return fs.f_bavail * fs.f_frsize - size >= self.headroom

    # ----------------------------------------------------------------------------- reading

    @contextlib.contextmanager
    def reading(self, disk_id: int) -> Iterator[tuple[DiskHeader, np.ndarray, Callable[[Iterable[np.ndarray]], int]]]:
        """(header, tokens, read_into) of entry `disk_id`, kept on disk while the block runs;
        `read_into(runs)` reads its data into the runs (one copy, verified: DataCorrupt, and the
        file is removed, when it fails). EntryNotFound once it is gone."""
        with self._lock:
            record = self._records.get(disk_id)
            if record is None or record.doomed:
                raise EntryNotFound(f"no disk entry {disk_id} in {self.folder}")
            record.readers += 1
            record.last_used = next(self._clock)
        try:
            fd = os.open(self._path(record.name), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:  # removed by hand, or not readable now
            with self._lock:
                self._left(record)
                if isinstance(exc, FileNotFoundError):
                    self._remove(record)
            raise EntryNotFound(f"disk entry {disk_id} ({record.name}) cannot be read from {self.folder}: "
                                f"{exc.strerror}") from None

        def read_into(runs: Iterable[np.ndarray]) -> int:
            try:
                done = disk_format.read_data(fd, record.header, runs, record.name)
            except DataCorrupt:
                with self._lock:
                    self._counters.corrupt_found += 1
                    self._remove(record)
                raise
            except OSError as exc:  # an I/O error: the entry is not read, nothing else changes
                raise EntryNotFound(f"disk entry {disk_id} ({record.name}) could not be read: {exc.strerror}") from None
            with self._lock:
                self._counters.loads += 1
                self._counters.bytes_read += done
            return done

        try:
            yield record.header, record.tokens, read_into
        finally:
            os.close(fd)
            with self._lock:
                self._left(record)

    def _left(self, record: DiskRecord) -> None:
        """A reader of `record` is done (under the lock): a file removed meanwhile goes now."""
        record.readers -= 1
        if record.doomed and not record.readers:
            self._doomed.pop(record.name, None)
            unlink_quietly(self._path(record.name))

    # ----------------------------------------------------------------------------- removing

    def remove(self, disk_id: int) -> None:
        """Remove entry `disk_id` and its file (a no-op once it is gone)."""
        with self._lock:
            record = self._records.get(disk_id)
            if record is not None:
                self._remove(record)

    def erase(self, *, tag: str, namespace: str | None = None, keep: Collection[int] = ()) -> int:
        """Remove every entry carrying `tag` (and, when given, of `namespace`), files included,
        but those in `keep`: what deleting a session erases. Files the start-up scan has not
        reached yet, and files being written, are removed as they are reached (nothing here waits
        for them). The indexed entries removed now."""
        with self._lock:
            doomed = [r for r in self._records.values() if r.header.tag == tag and r.id not in keep
                      and (namespace is None or r.header.namespace == namespace)]
            for record in doomed:
                self._remove(record)
            self._counters.erased += len(doomed)
            if self._unscanned or self._writing:
                self._tombstones.add((tag, namespace))
        if doomed:
            disk_format.sync_directory(self.folder)  # the removals on the device: a power cut keeps them
        return len(doomed)

    def remove_unreadable(self) -> int:
        """Remove the files of another format version (gc); how many."""
        with self._lock:
            names = list(self._unreadable)
            for name in names:
                del self._unreadable[name]
                unlink_quietly(self._path(name))
            return len(names)

    def erase_other_identities(self, identity: str) -> int:
        """Remove every entry that `identity` did not write (gc of a model no longer served);
        how many. Files not yet scanned are read first."""
        self.scan_now()
        with self._lock:
            others = [r for r in self._records.values() if r.header.identity != identity]
            for record in others:
                self._remove(record)
            return len(others)

    def _add(self, record: DiskRecord) -> None:
        self._records[record.id] = record
        self._by_name[record.name] = record.id
        self._index.add(record.id, prefix_space(record.header.identity, record.header.namespace), record.tokens)

    def _remove(self, record: DiskRecord) -> None:
        if self._records.pop(record.id, None) is None:
            return
        del self._by_name[record.name]
        self._index.remove(record.id)
        if record.readers:
            record.doomed = True  # its reader's descriptor keeps the bytes; the file goes after it
            self._doomed[record.name] = record.file_bytes
        else:
            unlink_quietly(self._path(record.name))

    def _bytes_used(self) -> int:
        return (sum(r.file_bytes for r in self._records.values()) + sum(self._unscanned.values())
                + sum(self._unreadable.values()) + sum(self._writing.values()) + sum(self._doomed.values()))

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}{disk_format.SUFFIX}"
