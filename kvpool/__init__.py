"""kvpool: a shared-memory pool of KV state, priced by the cell, shared by reference.

It knows bytes, cells, prices and budgets; it knows no engine and no session.
"""

from kvpool.budget import Budget, Device, describe_bytes, export_budget, host_memory_available
from kvpool.entry import EntryInfo, EntryView, Writer
from kvpool.errors import (DataCorrupt, EntryBusy, EntryNotFound, EntryTooLarge, LayoutError, PoolBusy,
                           PoolCorrupt, PoolError, PoolExists, PoolFormatError, PoolNotFound, ReservationError)
from kvpool.layout import ArrayTemplate, KVArray
from kvpool.pool import Pool
from kvpool.prefix import PrefixMatch
from kvpool.stats import PoolStats

# superfluid checks this before it uses the package (see engines/__init__.py).
PART_OF = "superfluid"

__all__ = [
    "ArrayTemplate", "Budget", "DataCorrupt", "Device", "EntryBusy", "EntryInfo", "EntryNotFound",
    "EntryTooLarge", "EntryView", "KVArray", "LayoutError", "Pool", "PoolBusy", "PoolCorrupt", "PoolError",
    "PoolExists", "PoolFormatError", "PoolNotFound", "PoolStats", "PrefixMatch", "ReservationError", "Writer",
    "describe_bytes", "export_budget", "host_memory_available",
]
