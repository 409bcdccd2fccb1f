"""A disk tier's folder: private to its user, owned by one process at a time, removed whole.

Each pool keeps its disk entries in a folder of its own (mode 0700, files 0600). The process
that owns the pool holds an exclusive lock on the folder's lock file for as long as its tier is
open, so two processes never write the same files; a listing (`disk ls`) holds it a moment, and
a host starting meanwhile waits that out.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from pathlib import Path

from kvpool import disk_format
from kvpool.errors import PoolBusy, PoolError

LOCK_FILE = ".lock"
LOCK_TRIES, LOCK_WAIT_SECONDS = 20, 0.05  # a lock held a moment (a listing) is waited for, one held for good is not


def remove_tier(folder: str | os.PathLike) -> int:
    """Remove a closed tier's folder and every entry in it (`pool rm`, a host closed with its
    pool removed); PoolBusy while a process has it open. The bytes removed. Files that are not
    the tier's are left, and then so is the folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    fd = open_locked(folder)
    removed = 0
    try:
        for item in os.scandir(folder):
            if item.name.endswith((disk_format.SUFFIX, disk_format.PARTIAL)) and item.is_file(follow_symlinks=False):
                removed += item.stat(follow_symlinks=False).st_size
                unlink_quietly(item.path)
        unlink_quietly(folder / LOCK_FILE)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):  # not empty: someone else's files stay
        folder.rmdir()
    return removed


def open_locked(folder: Path) -> int:
    """Create `folder` (0700) if need be, check it is this user's and private, and lock it for
    this process: PoolBusy while another holds it."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.stat(folder, follow_symlinks=False)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PoolError(f"disk tier folder {folder} is not a directory of this user; remove it or give "
                        "another folder")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(folder, 0o700)  # made by an older release or by hand: entries are private
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    for attempt in range(LOCK_TRIES):  # (`disk ls` holds it for a moment: a host starting then waits it out)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            time.sleep(LOCK_WAIT_SECONDS)
    else:
        os.close(fd)
        raise PoolBusy(f"disk tier {folder} is open in another process (each pool's owner keeps its own "
                       "folder); stop it, or give this pool another name")


def unlink_quietly(path: str | os.PathLike) -> None:
    """Remove `path` if it can be: a file that cannot, on a read-only or failing disk, stays (the
    tier is a cache)."""
    # (a file that cannot be removed, on a read-only or failing disk, stays: it is a cache)
    with contextlib.suppress(OSError):
        os.unlink(path)
