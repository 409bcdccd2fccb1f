"""This user's pool segments, as the tools list them: owner, size, entries; and their removal.

A segment whose owner died still holds its entries (a restarted host re-attaches it), and still
holds its RAM until someone unlinks it. `gc` removes the segments that no live process owns.
"""

from __future__ import annotations

import os

import msgspec
import numpy as np

from kvpool import segment
from kvpool.errors import PoolBusy, PoolError
from kvpool.header import EntryState, decode_entry_header, read_slot
from kvpool.store import POOL_HEADER_BYTES, parse_pool_header


class SegmentInfo(msgspec.Struct, frozen=True):
    """One segment as `ls` shows it. `problem` is set when it cannot be read as a pool."""

    name: str
    size: int
    owner_alive: bool
    owner_pid: int | None = None
    entries: int | None = None
    budget_bytes: int | None = None
    created_at: float | None = None
    problem: str | None = None


def describe(name: str) -> SegmentInfo:
    """Read segment `name`'s headers without attaching it (its owner may be alive)."""
    alive = segment.owner_alive(name)
    size = os.stat(f"{segment.SHM_DIR}/{segment.segment_name(name)[1:]}").st_size
    prefix = segment.read_prefix(name, POOL_HEADER_BYTES)
    if len(prefix) < POOL_HEADER_BYTES:
        return SegmentInfo(name, size, alive, problem=f"{size} bytes: too small to be a pool")
    try:
        header, _ = parse_pool_header(np.frombuffer(prefix, dtype=np.uint8), size, name)
    except PoolError as exc:
        return SegmentInfo(name, size, alive, problem=str(exc))
    table_end = header.slot_table_offset + header.slot_count * header.slot_size  # checked: inside the segment
    table = np.frombuffer(segment.read_prefix(name, table_end), dtype=np.uint8)[header.slot_table_offset:]
    entries = 0
    for index in range(header.slot_count):
        slot = read_slot(table[index * header.slot_size:(index + 1) * header.slot_size])
        entry = decode_entry_header(slot[1]) if slot else None
        entries += bool(entry and entry.state == EntryState.READY)
    return SegmentInfo(name, size, alive, header.owner_pid, entries, header.budget_bytes, header.created_at)


def list_segments() -> list[SegmentInfo]:
    """Every pool segment of this user."""
    found = []
    for name in segment.list_pool_names():
        try:
            found.append(describe(name))
        except (PoolError, OSError, ValueError) as exc:  # one unreadable segment must not hide the rest
            found.append(SegmentInfo(name, 0, False, problem=str(exc)))
    return found


def remove(name: str, *, force: bool = False) -> None:
    """Unlink segment `name`; PoolBusy if a live process owns it, unless `force`."""
    if not force and segment.owner_alive(name):
        raise PoolBusy(f"pool {name!r} is owned by a live process; stop it first, or pass --force "
                       "(its owner keeps its mapping, the name goes)")
    segment.unlink(name)


def collect_garbage() -> list[SegmentInfo]:
    """Unlink every segment of this user that no live process owns; what was removed."""
    removed = []
    for info in list_segments():
        if not info.owner_alive:
            segment.unlink(info.name)
            removed.append(info)
    return removed
