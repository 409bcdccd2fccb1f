"""The session log: a write-ahead log of every committed change to every session.

Each record is a msgspec struct (log_records.py), msgpack-encoded and framed (log_format.py: a
header that checks itself, the record's number within its session, an xxh3-64 digest of the
payload). Records are written before the change they describe is reported to anyone (a tick's records in one `write`:
see `batch`); syncing to disk is grouped by policy:

    tick     after each scheduler tick that wrote, an fsync on the log's own syncer thread, so the
             next step does not wait for the disk (the default). A process crash loses nothing
             written; a power cut may lose what the last fsync had not reached, milliseconds
    commit   fsync after every write, before anyone hears of what it wrote
    never    leave it to the kernel (a process crash keeps what was written; a power cut may not)

On open the log replays into one state per session. A torn tail (a crash mid-write: damage with
no intact frame after it) is cut off. Damage with intact frames after it, or a record missing
from a session's numbering, is damage in the middle: replay refuses to start, names the byte, and
changes nothing on disk; `superfluid log check DIR` says what a repair would keep and drop, and
`superfluid log repair DIR` does it (log_repair.py). A log of format 1 or 2 is read and rewritten as
format 3 (log_format.py). Compaction rewrites the log as one snapshot per live session (deleted sessions and
superseded records go) into a new file renamed over the old one.

The log holds every conversation's text: its directory is created 0700 and its files 0600, and
none of them is opened through a symbolic link.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from superfluid.host.errors import LogCorrupt
from superfluid.host.log_format import (FILE_HEADER, FILE_NAME, MAX_RECORD, VERSION, Damage, Frame, frame,
                                        lock_directory, open_private, put_in_place, read_from, read_private,
                                        replace_private, scan, version_of, write_beside)
from superfluid.host.log_records import (Deleted, Opened, Record, SessionState, Tokens, Trimmed, _encoder, apply,
                                         check, counter, decode_record, undo_of)

LOG = logging.getLogger(__name__)
COMPACTION_FLOOR = 1 << 20  # bytes written before compaction is considered (and between two looks)
SYNC_POLICIES = ("tick", "commit", "never")
# What to do about damage in the middle of the log, said wherever it is found.
REPAIR_ADVICE = ("Nothing was changed on disk. `superfluid log check {directory}` says what a repair keeps and "
                 "drops; `superfluid log repair {directory}` keeps every intact record (the damaged file is kept "
                 "beside it).")


class LogWriteFailed(OSError):
    """A batch of records could not be written (ENOSPC, EIO, ...): none of it is in the log, and
    the sessions it touched are as the log has them. The host goes on; their generations end."""

    def __init__(self, sessions: set[str], cause: OSError) -> None:
        super().__init__(cause.errno, f"the session log could not be written ({cause.strerror or cause}); this "
                         "generation's last tokens were not kept. Free space (or fix the disk) and retry: the "
                         "host goes on, and writes resume when the disk takes them")
        self.sessions = sessions


def damaged_in_the_middle(path: Path, damage: Damage) -> str:
    """What LogCorrupt says of damage with intact records after it."""
    return (f"session log {path} is damaged at byte {damage.offset} (to byte {damage.end}), with intact records "
            "after it: this is not a torn last write, and replaying around it could resume sessions wrongly. "
            + REPAIR_ADVICE.format(directory=path.parent))


def write_snapshot(path: Path, states, number: Callable[[Record], int]) -> None:
    """Make the log at `path` hold one snapshot of each of `states` (numbered by `number`), atomically."""
    replace_private(path, snapshot_bytes([state.snapshot() for state in states], number))


def snapshot_bytes(snapshots: list[list[Record]], number: Callable[[Record], int]) -> bytes:
    """A whole log file holding `snapshots` (each session's records), numbered by `number`."""
    frames = [FILE_HEADER]
    for records in snapshots:
        frames += [frame(_encoder.encode(record), number(record)) for record in records]
    return b"".join(frames)


class SessionLog:
    """An open session log: replayed states, appends and syncs (thread-safe)."""

    def __init__(self, directory: str | Path, sync: str = "tick") -> None:
        """Open (or create) the log in `directory` and replay it."""
        if sync not in SYNC_POLICIES:
            raise ValueError(f"log sync policy {sync!r}: use one of {', '.join(SYNC_POLICIES)}")
        self.sync_policy = sync
        self.directory = Path(directory)
        self.path = self.directory / FILE_NAME
        self._lock_fd = lock_directory(self.directory)
        try:
            self._open()
        except BaseException:
            os.close(self._lock_fd)  # the lock goes with it
            raise

    def _open(self) -> None:
        self._lock = threading.Lock()
        self._dirty = False
        self._batch: list[tuple[Record, bytes]] | None = None  # records held for one write (see batch)
        self._undo: list[Callable[[], None]] = []  # what puts the states back if that write fails
        self._batch_closed = threading.Condition(self._lock)  # a compaction's snapshot waits for it
        self._compactor: threading.Thread | None = None
        self._batch_thread: int | None = None
        self._syncer: _Syncer | None = None
        self.states: dict[str, SessionState] = {}
        self._numbers: dict[str, int] = {}  # each session's number for its next record (see log_format)
        self.truncated_bytes = 0
        self.records_replayed = 0
        superseded = self._replay()
        self._fd = open_private(self.path, os.O_WRONLY | os.O_APPEND)
        if os.fstat(self._fd).st_mode & 0o077:
            os.fchmod(self._fd, 0o600)  # written before logs were kept private: every conversation is in it
        self._written_since_compaction = 0
        self._next_compaction_check = COMPACTION_FLOOR
        if superseded:
            self.compact()

    def _replay(self) -> bool:
        """Read every frame; True when the log holds records a compaction would drop (or is of
        format 1, which the compaction rewrites as the current one)."""
        try:
            data = read_private(self.path)
        except FileNotFoundError:
            data = b""
        if not data:
            fd = open_private(self.path, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, FILE_HEADER)
            finally:
                os.close(fd)
            return False
        version = version_of(data, self.path)
        count, superseded = 0, version != VERSION
        for found in scan(data, version):
            if isinstance(found, Damage):
                if found.end < len(data):
                    raise LogCorrupt(damaged_in_the_middle(self.path, found))
                self.truncated_bytes = len(data) - found.offset  # a torn tail: cut off
                fd = open_private(self.path, os.O_WRONLY)
                try:
                    os.ftruncate(fd, found.offset)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                break
            where = f" {self.path} at byte {found.offset}"
            record = decode_record(found.payload, where)
            if found.number is not None:
                expected = self._numbers.get(record.session, 0)
                if found.number != expected:
                    raise LogCorrupt(f"session log{where}: record {found.number} of session {record.session!r} "
                                     f"where record {expected} was due: a record is missing from the middle of the "
                                     f"log. {REPAIR_ADVICE.format(directory=self.directory)}")
            apply(self.states, record, where)
            self._count(record)
            superseded = superseded or isinstance(record, (Deleted, Trimmed))
            count += 1
        self.records_replayed = count
        return superseded

    def _count(self, record: Record) -> int:
        """The number of `record` within its session, counted as written (a deletion ends the count)."""
        return counter(self._numbers)(record)

    def append(self, *records: Record) -> None:
        """Write `records` (one write call) and apply them to the states; fsync now if the policy
        is "commit". Inside `batch`, on the thread that opened it, the write waits for its end.
        ValueError for a record over the size a reader accepts (nothing is written then)."""
        encoded = [(record, _encoder.encode(record)) for record in records]
        for record, payload in encoded:
            if len(payload) > MAX_RECORD:
                raise ValueError(f"a {type(record).__name__} record of {len(payload)} bytes for session "
                                 f"{record.session!r} is over the log's {MAX_RECORD}-byte limit")
        with self._lock:
            self._check_all(records)  # nothing that contradicts the log is ever written to it
            if self._batch is not None and self._batch_thread == threading.get_ident():
                self._batch.extend(encoded)
                for record in records:  # what puts the states back if the batch's write fails
                    self._undo.append(undo_of(self.states, record))
                    apply(self.states, record)
                return
            self._write_and_count(encoded)  # (a failed write raises here: the states stay as on disk)
            for record in records:
                apply(self.states, record)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Hold what this thread appends inside the block and write it in one `write` at its end
        (the scheduler wraps a step's commits: one write per tick, not one per token). The states
        change at each append; nothing appended may be reported to anyone before the block ends.
        Appends from other threads are written at once, as always.

        LogWriteFailed when the write fails (a full disk, an I/O error): nothing of the batch is
        in the file, and the states are put back as the file has them (its records undone, the
        last first), so the log goes on and the next write may succeed; the error names every
        session whose records were in it."""
        with self._lock:
            if self._batch is not None:
                raise RuntimeError("the session log's batches do not nest")
            self._batch, self._batch_thread, self._undo = [], threading.get_ident(), []
        try:
            yield
        finally:
            with self._lock:
                held, undo = self._batch, self._undo
                self._batch, self._batch_thread, self._undo = None, None, []
                self._batch_closed.notify_all()
                if held:
                    try:
                        self._write_and_count(held)
                    except OSError as exc:
                        for step in reversed(undo):
                            step()
                        raise LogWriteFailed({record.session for record, _ in held}, exc) from exc

    def _write_and_count(self, encoded: list[tuple[Record, bytes]]) -> None:
        """Frame and write `encoded` records (the lock held), numbered in the order they reach
        the file; fsync now under the "commit" policy."""
        numbers = dict(self._numbers)
        blob = b"".join(frame(payload, self._count(record)) for record, payload in encoded)
        try:
            self._write(blob)
        except BaseException:
            self._numbers = numbers  # nothing of it reached the file
            raise
        self._written_since_compaction += len(blob)
        self._dirty = True
        if self.sync_policy == "commit":
            os.fsync(self._fd)
            self._dirty = False

    def _write(self, blob: bytes) -> None:
        """Append `blob` whole, or not at all: a short write is continued, and a failed one is cut
        back so the next record never lands after a torn frame (which replay would call damage)."""
        start = os.lseek(self._fd, 0, os.SEEK_END)
        view = memoryview(blob)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            os.ftruncate(self._fd, start)
            raise

    def _check_all(self, records) -> None:
        lengths: dict[str, int | None] = {}  # each session's tokens after the records checked so far
        for record in records:
            if record.session not in lengths:
                state = self.states.get(record.session)
                lengths[record.session] = None if state is None else len(state.tokens)
            check(record, lengths[record.session])
            if isinstance(record, Opened):
                lengths[record.session] = 0
            elif isinstance(record, Tokens):
                lengths[record.session] += len(record.tokens)
            elif isinstance(record, Trimmed):
                lengths[record.session] = min(lengths[record.session], record.length)
            elif isinstance(record, Deleted):
                lengths[record.session] = None

    def sync(self) -> bool:
        """fsync now if something was written since the last sync and the policy is "tick"; True
        if it synced."""
        with self._lock:
            if not self._dirty or self.sync_policy == "never":
                return False
            os.fsync(self._fd)
            self._dirty = False
            return True

    def sync_soon(self) -> None:
        """Under the "tick" policy, have the syncer thread fsync what was written so far (the
        caller goes on at once); nothing under the others."""
        with self._lock:
            if self._syncer is not None and self._syncer.error is not None:
                error, self._syncer.error = self._syncer.error, None
                raise error  # the disk refused an earlier fsync: whoever writes must hear of it
            if not self._dirty or self.sync_policy != "tick":
                return
            if self._syncer is None:
                self._syncer = _Syncer(self)
            self._syncer.wake()

    def _take_dirty_fd(self) -> int | None:
        """For the syncer: a duplicate of the log's descriptor if something awaits an fsync
        (marked clean now: what is written after this waits for the next one), else None. A
        duplicate, so a compaction may replace the file while the fsync runs."""
        with self._lock:
            if not self._dirty or self._fd < 0:
                return None
            self._dirty = False
            return os.dup(self._fd)

    def should_compact(self) -> bool:
        """True when the records written since the last compaction outweigh the live snapshot.
        Asked every tick, it walks the sessions at most once per COMPACTION_FLOOR bytes written:
        a tick's cost must not grow with the number of idle sessions."""
        written = self._written_since_compaction
        if written < self._next_compaction_check:
            return False
        snapshot = self._snapshot_estimate()
        if written > 2 * snapshot:
            return True
        self._next_compaction_check = max(written + COMPACTION_FLOOR, 2 * snapshot)
        return False

    def _snapshot_estimate(self) -> int:
        return sum(16 + 5 * len(s.tokens) + sum(len(m["content"]) for m in s.messages) for s in self.states.values())

    def compact(self) -> None:
        """Rewrite the log as one snapshot per live session, atomically (a new file renamed over
        it), here and now. An error leaves the log as it was."""
        with self._lock:
            numbers: dict[str, int] = {}
            write_snapshot(self.path, self.states.values(), counter(numbers))
            self._compacted(numbers)

    def _compacted(self, numbers: dict[str, int]) -> None:
        """The new file is in place (the lock held): append to it from now on."""
        if hasattr(self, "_fd"):
            os.close(self._fd)
        self._fd = open_private(self.path, os.O_WRONLY | os.O_APPEND)
        self._numbers = numbers
        self._written_since_compaction = 0
        self._next_compaction_check = COMPACTION_FLOOR
        self._dirty = False

    def compact_beside(self) -> None:
        """Compact on a thread of its own (nothing if one runs already), so the scheduler's steps
        do not wait for it. The snapshot is taken between two batches (under the lock: its lists
        copied); encoding and writing it, the slow part, run beside the appends; then, under the
        lock again, the records appended meanwhile are numbered on from the snapshot's and added,
        and the new file takes the old one's place. A disk that refuses it leaves the log as it
        is, to be tried again after COMPACTION_FLOOR more bytes."""
        with self._lock:
            if self._compactor is not None and self._compactor.is_alive():
                return
            self._next_compaction_check = self._written_since_compaction + COMPACTION_FLOOR  # not every tick
            self._compactor = threading.Thread(target=self._compact_in_background, name="superfluid-log-compact",
                                               daemon=True)
            self._compactor.start()

    def _compact_in_background(self) -> None:
        temporary = None
        try:
            with self._lock:
                while self._batch is not None:  # a step's records are applied but not yet written
                    self._batch_closed.wait()
                if self._fd < 0:
                    return  # closed meanwhile
                mark = os.fstat(self._fd).st_size
                snapshots = [state.snapshot() for state in self.states.values()]
            numbers: dict[str, int] = {}
            temporary = write_beside(self.path, snapshot_bytes(snapshots, counter(numbers)))
            with self._lock:
                if self._fd < 0:
                    return
                tail = read_from(self.path, mark)
                number = counter(numbers)
                renumbered = [frame(found.payload, number(decode_record(found.payload, "")))
                              for found in scan(FILE_HEADER + tail, VERSION) if isinstance(found, Frame)]
                put_in_place(temporary, self.path, b"".join(renumbered))
                temporary = None
                self._compacted(numbers)
        except Exception as exc:  # noqa: BLE001 - on its own thread: said, and the log goes on as it was
            LOG.warning("the session log could not be compacted (%s); it grows until the next try", exc)
        finally:
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)

    def join_compaction(self) -> None:
        """Wait for a compaction running beside the appends to end (close waits for it)."""
        compactor = self._compactor
        if compactor is not None:
            compactor.join()

    def close(self) -> None:
        """Sync (whatever the policy: a clean stop loses nothing) and close."""
        self.join_compaction()
        if self._syncer is not None:
            self._syncer.stop()
        with self._lock:
            if self._fd < 0:
                return
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.close(self._lock_fd)


class _Syncer:
    """The thread that fsyncs the log under the "tick" policy, so that no step waits for the disk.
    Wakes coalesce: writes that arrive during an fsync are covered by the next one."""

    def __init__(self, log: SessionLog) -> None:
        self._log = log
        self._wanted = threading.Condition()
        self._pending = False
        self._stopping = False
        self.error: OSError | None = None  # an fsync's failure, raised by the next sync_soon
        self._thread = threading.Thread(target=self._run, name="superfluid-log-sync", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """An fsync is wanted."""
        with self._wanted:
            self._pending = True
            self._wanted.notify()

    def stop(self) -> None:
        """Finish the fsync under way (close syncs whatever is left) and end the thread."""
        with self._wanted:
            self._stopping = True
            self._wanted.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wanted:
                while not self._pending and not self._stopping:
                    self._wanted.wait()
                if self._stopping:
                    return
                self._pending = False
            fd = self._log._take_dirty_fd()
            if fd is None:
                continue
            try:
                os.fsync(fd)
            except OSError as exc:
                with self._log._lock:
                    self.error = exc
                    self._log._dirty = True  # not on disk: the next sync (or close) tries again
            finally:
                os.close(fd)
