"""One entry of the disk tier as a file: the bytes first, the header last, checksums for all.

    | data: the live cells, canonical order | token ids (int32) | header (msgpack) | trailer |

The data is exactly what the entry's data checksum covers in the pool (its live runs in
canonical order: kvpool.layout), so an entry is written and read back without re-hashing in
between and without its slack. The header names the identity, namespace, tag, layout and every
checksum; the trailer (magic, header length, the header's own checksum, the file's length) is the
last thing written. A file is written under a `.partial` name, flushed to the device, then
renamed: a crash at any point leaves either a `.partial` (removed at the next open) or a whole
file whose trailer, header and tokens check out. The data's checksum is verified as it is read
back, before anything can import it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable

import msgspec
import numpy as np
import xxhash

from kvpool import checksum
from kvpool.entry import TOKEN_DTYPE
from kvpool.errors import DataCorrupt, LayoutError, PoolFormatError
from kvpool.layout import Layout, decode_layout, encode_layout

FILE_VERSION = 1
READABLE_FILE_VERSIONS = (1,)
MAGIC = b"SFKD"
TRAILER = struct.Struct("<4sIQQ")  # magic, header length, header xxh3, file length
SUFFIX = ".kv"
PARTIAL = ".partial"
MAX_HEADER_BYTES = 1 << 20  # a header is a few hundred bytes; past this the trailer is garbage
NO_STAGE: Callable[[str], None] = lambda stage: None  # noqa: E731


class DiskHeader(msgspec.Struct, frozen=True, array_like=True):
    """What a disk entry holds: whose KV (identity, namespace), how many cells, how they are laid
    out, and the checksums of its data and tokens."""

    version: int
    identity: str
    namespace: str
    tag: str
    live: int
    layout: bytes  # kvpool.layout's encoding, planned for `live` cells (no slack)
    data_length: int
    data_checksum: int
    tokens_checksum: int
    recompute_cost: float
    created_at: float

    @property
    def file_length(self) -> int:
        """Bytes of the file this header ends (before its own bytes and the trailer)."""
        return self.data_length + TOKEN_DTYPE.itemsize * self.live

    def decoded_layout(self) -> Layout:
        """The entry's layout record."""
        return decode_layout(self.layout)


class _VersionProbe(msgspec.Struct, array_like=True):
    version: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DiskHeader)
_probe = msgspec.msgpack.Decoder(_VersionProbe)


def header_for(identity: str, namespace: str, tag: str, live: int, layout: Layout, data_length: int,
               data_checksum: int, tokens: np.ndarray, recompute_cost: float, created_at: float) -> DiskHeader:
    """The header of an entry holding `tokens` and `data_length` bytes of data laid out as `layout`."""
    return DiskHeader(FILE_VERSION, identity, namespace, tag, live, encode_layout(layout), data_length,
                      data_checksum, checksum.digest([tokens]), float(recompute_cost), created_at)


def predicted_size(header: DiskHeader) -> int:
    """The bytes of the file `write` makes for `header`."""
    return header.file_length + len(_encoder.encode(header)) + TRAILER.size


def write(path: str, header: DiskHeader, runs: Iterable[np.ndarray], tokens: np.ndarray,
          stage: Callable[[str], None] = NO_STAGE) -> int:
    """Write one entry to `path` crash-consistently (see the module docstring); the file's bytes.
    `stage(name)` is called between the steps ("data", "tokens", "header", "synced", "renamed"):
    tests kill the process there. OSError (a full disk, say) leaves no file behind."""
    total = write_partial(path, header, runs, tokens, stage)
    seal(path, stage)
    return total


def write_partial(path: str, header: DiskHeader, runs: Iterable[np.ndarray], tokens: np.ndarray,
                  stage: Callable[[str], None] = NO_STAGE) -> int:
    """The first half of `write`: the whole file under its `.partial` name, in the page cache (a
    copy, no wait for the device); `seal` makes it an entry. OSError leaves no file behind."""
    partial = path + PARTIAL
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        written = 0
        for run in runs:
            written += _write_all(fd, run)
        if written != header.data_length:
            raise ValueError(f"{written} bytes of data written where the header promises {header.data_length}")
        stage("data")
        _write_all(fd, np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE))
        stage("tokens")
        encoded = _encoder.encode(header)
        _write_all(fd, np.frombuffer(encoded, np.uint8))
        stage("header")
        total = header.file_length + len(encoded) + TRAILER.size
        trailer = TRAILER.pack(MAGIC, len(encoded), xxhash.xxh3_64_intdigest(encoded), total)
        _write_all(fd, np.frombuffer(trailer, np.uint8))
    except BaseException:
        _remove_quietly(partial)
        raise
    finally:
        os.close(fd)
    return total


def seal(path: str, stage: Callable[[str], None] = NO_STAGE) -> None:
    """The second half of `write`: flush the `.partial` file to the device, then give it the name
    a scan trusts. OSError removes it."""
    partial = path + PARTIAL
    try:
        fd = os.open(partial, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)  # whole on the device before it has the name a scan trusts
        finally:
            os.close(fd)
        stage("synced")
        os.rename(partial, path)
    except BaseException:
        _remove_quietly(partial)
        raise
    sync_directory(os.path.dirname(path))  # the name on the device too: a power cut keeps the entry
    stage("renamed")


def sync_directory(folder: str | os.PathLike) -> None:
    """fsync a folder, so that names made or removed in it survive a power cut (best effort)."""
    try:
        fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # (the entry is whole either way; only its name may be lost to a power cut)
    finally:
        os.close(fd)


def _write_all(fd: int, array: np.ndarray) -> int:
    view = memoryview(array.reshape(-1).view(np.uint8)) if array.nbytes else memoryview(b"")
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
    return done


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class FileUnreadable(PoolFormatError):
    """A disk entry of another format version: kept for the release that wrote it, never read."""


def read_header(fd: int, size: int, name: str) -> tuple[DiskHeader, np.ndarray]:
    """The header and token ids of the entry file open as `fd` (`size` bytes), each checked:
    DataCorrupt for a torn or damaged file, FileUnreadable for another format version."""
    tail = os.pread(fd, TRAILER.size, size - TRAILER.size) if size >= TRAILER.size else b""
    if len(tail) != TRAILER.size:
        raise DataCorrupt(f"disk entry {name}: {size} bytes, shorter than its trailer (a torn write)")
    magic, length, check, total = TRAILER.unpack(tail)
    if magic != MAGIC or total != size or not 0 < length <= min(MAX_HEADER_BYTES, size - TRAILER.size):
        raise DataCorrupt(f"disk entry {name}: no valid trailer (a torn or foreign file)")
    encoded = os.pread(fd, length, size - TRAILER.size - length)
    if xxhash.xxh3_64_intdigest(encoded) != check:
        raise DataCorrupt(f"disk entry {name}: its header fails its checksum")
    try:
        version = _probe.decode(encoded).version
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise DataCorrupt(f"disk entry {name}: its header does not decode") from None
    if version not in READABLE_FILE_VERSIONS:
        raise FileUnreadable(f"disk entry {name} is of format {version}; this release reads "
                             f"{', '.join(map(str, READABLE_FILE_VERSIONS))} (a newer release wrote it)")
    try:
        header = _decoder.decode(encoded)
        header.decoded_layout()
    except (msgspec.DecodeError, msgspec.ValidationError, LayoutError):
        raise DataCorrupt(f"disk entry {name}: its header does not decode") from None
    if header.file_length + length + TRAILER.size != size or header.live < 0:
        raise DataCorrupt(f"disk entry {name}: its header's lengths do not add up to the file's {size} bytes")
    tokens = np.frombuffer(os.pread(fd, TOKEN_DTYPE.itemsize * header.live, header.data_length), TOKEN_DTYPE)
    if len(tokens) != header.live or checksum.digest([tokens]) != header.tokens_checksum:
        raise DataCorrupt(f"disk entry {name}: its token ids fail their checksum")
    return header, tokens


def read_data(fd: int, header: DiskHeader, runs: Iterable[np.ndarray], name: str) -> int:
    """Read the entry's data from `fd` into `runs` (its live runs in canonical order, writable
    and together `header.data_length` bytes): one copy, hashed as it lands. DataCorrupt when the
    bytes fail their checksum (the runs then hold garbage). The bytes read."""
    hasher = checksum.new_hasher()
    offset = 0
    for run in runs:
        view = memoryview(run.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):  # in chunks hashed while they are still in cache
            chunk = view[done:done + checksum.CHUNK_BYTES]
            got = os.preadv(fd, [chunk], offset + done)
            if got == 0:
                raise DataCorrupt(f"disk entry {name}: the file ends inside its data (truncated)")
            hasher.update(chunk[:got])
            done += got
        offset += done
    if offset != header.data_length or hasher.intdigest() != header.data_checksum:
        raise DataCorrupt(f"disk entry {name}: its data fails its checksum; it is removed and its tokens "
                          "are computed again")
    return offset
