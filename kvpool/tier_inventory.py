"""This user's disk tiers, as the tools list them: what each holds, by model; and their cleaning.

A tier in use (its pool's owner holds its lock) is only counted from outside: its owner removes
what it must. A tier not in use is opened, scanned and cleaned here: `gc` removes what a crash
left half-written, damaged files and files of another format version, and with `keep_identity`
every entry another model wrote (the KV of a model this pool no longer serves: its bytes count
against the budget and no engine of this model can read them).
"""

from __future__ import annotations

import fcntl
import os
from collections import Counter
from pathlib import Path

import msgspec

from kvpool import disk_format, places
from kvpool.disk import DiskTier
from kvpool.errors import PoolBusy, PoolError
from kvpool.tier_folder import LOCK_FILE


UNBOUNDED = 1 << 62


class TierInfo(msgspec.Struct, frozen=True):
    """One pool's disk tier as `disk ls` shows it."""

    name: str
    folder: str
    in_use: bool
    files: int
    bytes: int
    identities: dict[str, int] = {}  # entries by the identity that wrote them (a tier not in use)
    unreadable: int = 0  # files of another format version, or that could not be read
    removed: int = 0  # files gc removed (torn, damaged, of another format or another identity)


def tier_folders(root: Path | None = None) -> list[Path]:
    """Every tier folder under `root` (default: places.disk_tiers_root())."""
    root = places.disk_tiers_root() if root is None else root
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())


def describe(folder: Path) -> TierInfo:
    """What tier `folder` holds, read without its lock and without changing anything (its owner
    may be writing: a file that fails to read now is counted as unreadable)."""
    identities: Counter[str] = Counter()
    files = size = unreadable = 0
    for item in os.scandir(folder):
        if not item.name.endswith(disk_format.SUFFIX) or not item.is_file(follow_symlinks=False):
            continue
        files += 1
        try:
            fd = os.open(item.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                length = os.fstat(fd).st_size
                size += length
                identities[disk_format.read_header(fd, length, item.name)[0].identity] += 1
            finally:
                os.close(fd)
        except (PoolError, OSError):
            unreadable += 1
    return TierInfo(folder.name, str(folder), _in_use(folder), files, size, dict(identities), unreadable)


def clean(folder: Path, keep_identity: str | None = None) -> TierInfo:
    """Clean tier `folder` if no process has it open (see the module docstring); what it holds
    after, and how many files went."""
    try:
        tier = DiskTier(folder, UNBOUNDED, headroom=0, scan=False)  # (cleaning trims nothing to a budget)
    except PoolBusy:
        return msgspec.structs.replace(describe(folder), in_use=True)
    with tier:
        tier.scan_now()
        stats = tier.stats()
        removed = stats.torn_removed + stats.corrupt_found + tier.remove_unreadable()
        if keep_identity is not None:
            removed += tier.erase_other_identities(keep_identity)
        entries = tier.entries()
        return TierInfo(folder.name, str(folder), False, len(entries), tier.stats().bytes_used,
                        dict(Counter(e.identity for e in entries)), 0, removed)


def _in_use(folder: Path) -> bool:
    """Whether a process holds the tier's lock (a shared lock taken and dropped at once)."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def list_tiers(root: Path | None = None) -> list[TierInfo]:
    """Every disk tier of this user, as it is (nothing removed)."""
    return [describe(folder) for folder in tier_folders(root)]


def collect_garbage(root: Path | None = None, keep_identity: str | None = None) -> list[TierInfo]:
    """Clean every tier not in use (see the module docstring); what each held after, and removed."""
    return [clean(folder, keep_identity) for folder in tier_folders(root)]
