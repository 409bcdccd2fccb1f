"""This user's disk tiers, as the tools list them: what each holds, by model; and their cleaning.

A tier in use (its pool's owner holds its lock) is only counted from outside: its owner removes
what it must. A tier not in use is opened, scanned and cleaned here: `gc` removes what a crash
left half-written, damaged files and files of another format version, and with `keep_identity`
every entry another model wrote (the KV of a model this pool no longer serves: its bytes count
against the budget and no engine of this model can read them).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import msgspec

from kvpool import disk_format, places
from kvpool.disk import DiskTier
from kvpool.errors import PoolBusy


class TierInfo(msgspec.Struct, frozen=True):
    """One pool's disk tier as `disk ls` shows it."""

    name: str
    folder: str
    in_use: bool
    files: int
    bytes: int
    identities: dict[str, int] = {}  # entries by the identity that wrote them (a tier not in use)
    unreadable: int = 0  # files of another format version
    removed: int = 0  # files gc removed (torn, damaged, of another format or another identity)


def tier_folders(root: Path | None = None) -> list[Path]:
    """Every tier folder under `root` (default: places.disk_tiers_root())."""
    root = places.disk_tiers_root() if root is None else root
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())


def describe(folder: Path, *, clean: bool = False, keep_identity: str | None = None) -> TierInfo:
    """What tier `folder` holds; with `clean`, what gc removes is removed first (not in use only)."""
    try:
        tier = DiskTier(folder, 0, headroom=0, scan=False)
    except PoolBusy:
        sizes = [entry.stat().st_size for entry in os.scandir(folder) if entry.name.endswith(disk_format.SUFFIX)]
        return TierInfo(folder.name, str(folder), True, len(sizes), sum(sizes))
    with tier:
        tier.scan_now()
        stats = tier.stats()
        removed = stats.torn_removed + stats.corrupt_found
        if clean:
            removed += tier.remove_unreadable()
            if keep_identity is not None:
                removed += tier.erase_other_identities(keep_identity)
        entries = tier.entries()
        stats = tier.stats()
        return TierInfo(folder.name, str(folder), False, len(entries) + stats.unreadable, stats.bytes_used,
                        dict(Counter(e.identity for e in entries)), stats.unreadable, removed if clean else 0)


def list_tiers(root: Path | None = None) -> list[TierInfo]:
    """Every disk tier of this user (a scan of the ones not in use removes torn files on the way)."""
    return [describe(folder) for folder in tier_folders(root)]


def collect_garbage(root: Path | None = None, keep_identity: str | None = None) -> list[TierInfo]:
    """Clean every tier not in use (see the module docstring); what each held after, and removed."""
    return [describe(folder, clean=True, keep_identity=keep_identity) for folder in tier_folders(root)]
