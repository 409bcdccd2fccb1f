"""One POSIX shared-memory segment: created with its memory reserved, mapped, locked by its owner.

The segment is named from the user id and the pool name (`/sf-<uid>-<name>`), mode 0600. Its
memory is reserved at creation with posix_fallocate: posix-ipc sizes a segment with ftruncate,
which reserves nothing, and a tmpfs that cannot back a page later kills the process with SIGBUS
on the first write. Reserving up front turns that into an error here. Pages are then pre-faulted
so copies into the pool run at memcpy speed instead of page-fault speed.

The owner holds an exclusive flock on its descriptor; the kernel drops it when the process dies,
which is how a later attach tells a live owner from a crashed one.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import stat

import numpy as np
import posix_ipc

from kvpool.budget import describe_bytes
from kvpool.errors import PoolBusy, PoolError, PoolExists, PoolFormatError, PoolNotFound, ReservationError

SHM_DIR = "/dev/shm"
PREFIX = "sf"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
PAGE = mmap.PAGESIZE


def check_pool_name(name: str) -> str:
    """`name` if it is a valid pool name, else a PoolError saying what a name may hold."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise PoolError(f"invalid pool name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
                        "starting with a letter or digit")
    return name


def segment_name(name: str, uid: int | None = None) -> str:
    """The POSIX shared-memory name of pool `name` for user `uid` (this user by default)."""
    return f"/{PREFIX}-{os.getuid() if uid is None else uid}-{check_pool_name(name)}"


def list_pool_names(uid: int | None = None) -> list[str]:
    """Names of this user's pool segments, from the shared-memory directory."""
    prefix = f"{PREFIX}-{os.getuid() if uid is None else uid}-"
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(entry[len(prefix):] for entry in entries if entry.startswith(prefix) and _NAME.match(entry[len(prefix):]))


class Segment:
    """A mapped shared-memory segment and the flock its owner holds."""

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, size: int, locked: bool) -> None:
        self.name = name
        self._shm = shm
        self.size = size
        self.locked = locked
        self._mmap = mmap.mmap(shm.fd, size)
        self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        """Create, reserve, lock and pre-fault a new segment of `size` bytes."""
        if size <= 0 or size % PAGE:
            raise PoolError(f"pool size must be a positive multiple of {PAGE} bytes, got {size}")
        try:
            shm = posix_ipc.SharedMemory(segment_name(name), posix_ipc.O_CREX, mode=0o600, size=0)
        except posix_ipc.ExistentialError:
            raise PoolExists(f"pool {name!r} already exists; attach to it, or remove it with "
                             f"`python -m kvpool rm {name}`") from None
        try:
            os.set_inheritable(shm.fd, False)
            _lock(shm.fd, name)
            try:
                os.posix_fallocate(shm.fd, 0, size)
            except OSError as exc:
                free = os.statvfs(SHM_DIR)
                raise ReservationError(
                    f"cannot reserve {describe_bytes(size)} for pool {name!r} in {SHM_DIR} "
                    f"({os.strerror(exc.errno)}; {describe_bytes(free.f_bavail * free.f_frsize)} free there): "
                    "choose a smaller pool size or enlarge /dev/shm") from None
            segment = cls(name, shm, size, locked=True)
        except BaseException:
            shm.close_fd()
            shm.unlink()
            raise
        segment._prefault(writable=True)
        return segment

    @classmethod
    def open(cls, name: str) -> "Segment":
        """Open an existing segment of this user and take its owner lock (PoolBusy if held)."""
        shm = _open_existing(name)
        try:
            os.set_inheritable(shm.fd, False)
            _check_owner_uid(shm.fd, name)
            _lock(shm.fd, name)
            size = shm.size
            if size <= 0:
                raise PoolFormatError(f"segment {name!r} is empty: not a pool (remove it with "
                                      f"`python -m kvpool rm {name}`)")
            segment = cls(name, shm, size, locked=True)
        except BaseException:
            shm.close_fd()
            raise
        segment._prefault(writable=False)
        return segment

    def _prefault(self, writable: bool) -> None:
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            if writable:  # a fresh segment is all zeros: writing one byte per page maps it
                self.buffer[::PAGE] = 0
            else:
                int(self.buffer[::PAGE].sum())  # read-fault every page, preserving contents

    def view(self, offset: int, length: int) -> np.ndarray:
        """A zero-copy uint8 view of [offset, offset + length); bounds are checked first."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise PoolError(f"range ({offset}, {length}) lies outside the {self.size}-byte segment")
        return self.buffer[offset:offset + length]

    def close(self) -> None:
        """Unmap and close; PoolBusy while numpy views of the segment are still alive."""
        if self._mmap is None:
            return
        self.buffer = None
        try:
            self._mmap.close()
        except BufferError:
            self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)
            raise PoolBusy(f"pool {self.name!r}: a numpy array still points into the pool (an entry view "
                           "kept past its `with` block); drop it before close()") from None
        self._mmap = None
        self._shm.close_fd()  # drops the owner lock

    def unlink(self) -> None:
        """Remove the segment's name; its memory goes once every mapping is closed."""
        try:
            posix_ipc.unlink_shared_memory(segment_name(self.name))
        except posix_ipc.ExistentialError:
            pass


def _open_existing(name: str) -> posix_ipc.SharedMemory:
    try:
        return posix_ipc.SharedMemory(segment_name(name))
    except posix_ipc.ExistentialError:
        raise PoolNotFound(f"no pool named {name!r} for this user (see `python -m kvpool ls`)") from None
    except posix_ipc.PermissionsError:
        raise PoolFormatError(f"pool {name!r} exists but is not readable by this user") from None


def _check_owner_uid(fd: int, name: str) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise PoolFormatError(f"segment {name!r} belongs to uid {info.st_uid} with mode "
                              f"{stat.S_IMODE(info.st_mode):o}; a pool must be this user's and mode 600")


def _lock(fd: int, name: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise PoolBusy(f"pool {name!r} is owned by a live process; close it there first, "
                           "or use another pool name") from None
        raise


def owner_alive(name: str) -> bool:
    """True when a live process holds pool `name`'s owner lock."""
    shm = _open_existing(name)
    try:
        fcntl.flock(shm.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(shm.fd, fcntl.LOCK_UN)
        return False
    finally:
        shm.close_fd()


def read_prefix(name: str, length: int) -> bytes:
    """The first `length` bytes of segment `name` (or fewer if it is smaller), read-only."""
    shm = _open_existing(name)
    try:
        length = min(length, shm.size)
        if length <= 0:
            return b""
        with mmap.mmap(shm.fd, length, prot=mmap.PROT_READ) as mapped:
            return mapped[:length]
    finally:
        shm.close_fd()


def unlink(name: str) -> None:
    """Remove segment `name`; PoolNotFound if it does not exist."""
    try:
        posix_ipc.unlink_shared_memory(segment_name(name))
    except posix_ipc.ExistentialError:
        raise PoolNotFound(f"no pool named {name!r} for this user") from None
