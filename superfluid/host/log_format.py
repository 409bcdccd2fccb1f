"""How the session log lies on disk: a file header, then one frame per record; and its files,
kept private.

    file      b"SFLOG\\0" + version (u16 LE), then frames
    version 2, 3  length (u32) | number (u32) | xxh3-64 of the payload (u64) | check (u32) | payload
    version 1     length (u32) | xxh3-64 of the payload (u64) | payload     (read, never written)

Version 3 frames are version 2's; what changed is what their records may say: a session's tools,
a message's tool calls and the call a tool message answers. A release that reads only versions 1
and 2 would drop those fields without a word and render the conversation otherwise, so it
refuses a version 3 log whole; this one reads a version 1 or 2 log and rewrites it as version 3
when it opens it (the compaction).

All little-endian. A version 2 frame's `check` is the low 32 bits of the xxh3-64 of the 16 bytes
before it, so a frame header detects its own damage: a flipped bit in a length can no longer
send the reader past the end of the file and make everything after it look like a torn write.
`number` counts the records of the frame's session (its Opened record is 0, the next 1, ...), so
a record lost from the middle of a session is a gap the reader sees, whichever record it was.

Reading is a scan that yields every intact frame and, between them, every damaged span: where a
frame does not check out, the next intact one is looked for byte by byte (an intact frame needs
its header check and its payload's 64-bit digest to match: chance does not make one). A damaged
span with nothing intact after it is a torn tail (a crash mid-write, or the zeros a file system
leaves past a write it never finished); any other is damage in the middle.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import xxhash

from superfluid.host.errors import LogBusy, LogCorrupt

MAGIC = b"SFLOG\0"
VERSION = 3  # the version written; 1 and 2 are still read
READABLE = (1, 2, 3)
MAX_RECORD = 64 << 20  # the largest payload a frame may carry (checked on write and on read)
_VERSION_FIELD = struct.Struct("<H")
_V1 = struct.Struct("<IQ")  # length, digest
_V2 = struct.Struct("<IIQI")  # length, number, digest, check
_V2_CHECKED = struct.Struct("<IIQ")  # the part of a version 2 header its check covers
HEADER_BYTES = {1: _V1.size, 2: _V2.size, 3: _V2.size}
FILE_NAME = "sessions.log"
LOCK_NAME = "sessions.lock"  # flock'ed by the Host using the directory (the kernel drops it with the process)


def file_header(version: int = VERSION) -> bytes:
    """The bytes a log of `version` starts with."""
    return MAGIC + _VERSION_FIELD.pack(version)


FILE_HEADER = file_header()


class Frame(NamedTuple):
    """An intact frame: its payload, at [offset, end) in the file; `number` None in version 1."""

    offset: int
    end: int
    number: int | None
    payload: bytes


class Damage(NamedTuple):
    """Bytes [offset, end) that hold no intact frame; `end` is where the next intact one starts,
    or the file's end (then it is a torn tail)."""

    offset: int
    end: int


def frame(payload: bytes, number: int) -> bytes:
    """`payload` framed as version 2 and 3 frame it, the `number`th record of its session. ValueError past
    MAX_RECORD: the reader would refuse the frame, so it is never written."""
    if len(payload) > MAX_RECORD:
        raise ValueError(f"a session log record of {len(payload)} bytes is over the {MAX_RECORD}-byte limit")
    checked = _V2_CHECKED.pack(len(payload), number, xxhash.xxh3_64_intdigest(payload))
    return checked + struct.pack("<I", xxhash.xxh3_64_intdigest(checked) & 0xFFFFFFFF) + payload


def version_of(data: bytes, path: Path | str) -> int:
    """The version of the log whose bytes are `data`; LogCorrupt naming what to do when it is not
    a session log this code reads."""
    if not data.startswith(MAGIC) or len(data) < len(FILE_HEADER):
        raise LogCorrupt(f"{path} is not a superfluid session log (no {MAGIC!r} header); point log_dir at another "
                         "directory or move the file aside")
    (version,) = _VERSION_FIELD.unpack_from(data, len(MAGIC))
    if version not in READABLE:
        raise LogCorrupt(f"{path} is a session log of format {version}; this superfluid reads formats "
                         f"{', '.join(map(str, READABLE))}: use the superfluid that wrote it")
    return version


def scan(data: bytes, version: int) -> Iterator[Frame | Damage]:
    """Every intact frame of a log of `version` in order, and a Damage for each span between
    them (and at the end) that holds none."""
    offset = len(FILE_HEADER)
    while offset < len(data):
        found = _intact(data, offset, version)
        if found is not None:
            yield found
            offset = found.end
            continue
        following = _next_intact(data, offset + 1, version)
        yield Damage(offset, following)
        offset = following


def _intact(data: bytes, offset: int, version: int) -> Frame | None:
    """The frame at `offset` if it checks out, else None."""
    header = HEADER_BYTES[version]
    if len(data) - offset < header:
        return None
    if version == 1:
        length, digest = _V1.unpack_from(data, offset)
        number = None
    else:
        length, number, digest, check = _V2.unpack_from(data, offset)
        if xxhash.xxh3_64_intdigest(data[offset:offset + _V2_CHECKED.size]) & 0xFFFFFFFF != check:
            return None
    end = offset + header + length
    if length > MAX_RECORD or end > len(data):
        return None
    payload = data[offset + header:end]
    if xxhash.xxh3_64_intdigest(payload) != digest:
        return None
    return Frame(offset, end, number, payload)


def _next_intact(data: bytes, start: int, version: int) -> int:
    """Where the first intact frame at or after `start` begins (the file's end when none does)."""
    header = HEADER_BYTES[version]
    # past the last byte that is not zero nothing can start (zeros to the end are what a file
    # system leaves of a write it never finished)
    last = len(data.rstrip(b"\0"))
    for offset in range(start, min(last, len(data) - header + 1)):
        if version == 1:
            (length,) = struct.unpack_from("<I", data, offset)
            if offset + header + length > len(data):
                continue  # cheaply ruled out: most offsets read as a length past the end
        if _intact(data, offset, version) is not None:
            return offset
    return len(data)


# ----------------------------------------------------------------------------- private files

def lock_directory(directory: Path) -> int:
    """Create `directory` (0700) if need be and take its lock file's exclusive flock; the lock's
    descriptor (closing it, or the process's end, releases the lock). LogBusy when another Host
    holds it."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = open_private(directory / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LogBusy(f"another Host is using the session log in {directory}; close it first, or give this one its "
                      "own log_dir (and pool_name)") from None
    return fd


def open_private(path: Path, flags: int) -> int:
    """os.open of a log file: created 0600 if missing, never through a symbolic link (PermissionError
    naming it: the log holds every conversation's text, and a link could send it anywhere)."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(errno.EPERM, f"{path} is a symbolic link; superfluid never opens its session log "
                                  "through one: put the file itself there, or point log_dir elsewhere") from None
        raise


def read_private(path: Path) -> bytes:
    """The bytes of a log file (FileNotFoundError when there is none), not through a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return os.close(open_private(path, os.O_RDONLY))  # raises the PermissionError naming it
        raise
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def read_from(path: Path, offset: int) -> bytes:
    """The bytes of the file at `path` from `offset` to its end (not through a link)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.pread(fd, 1 << 20, offset):
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def replace_private(path: Path, data: bytes) -> None:
    """Make `data` the content of `path` atomically: written to a new 0600 file beside it, synced,
    renamed over it, and the directory synced (a crash leaves the old file or the new one)."""
    temporary = write_beside(path, data)
    put_in_place(temporary, path)


def write_beside(path: Path, data: bytes) -> Path:
    """`data` written and synced to a new 0600 file beside `path` (the file it will replace); its path."""
    temporary = path.with_suffix(".compacting")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)  # a crash's leftover (a link there is removed, not followed)
    fd = open_private(temporary, os.O_WRONLY | os.O_EXCL)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return temporary


def put_in_place(temporary: Path, path: Path, more: bytes = b"") -> None:
    """Append `more` to `temporary` (synced), rename it over `path`, and sync the directory."""
    if more:
        fd = os.open(temporary, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            view = memoryview(more)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
