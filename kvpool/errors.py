"""The pool's exception types.

Every error the pool raises derives from :class:`PoolError`, so callers (and the fuzz tests)
can tell "the pool refused this, and said why" from a bug. Messages name what to change.
"""


class PoolError(Exception):
    """Base class of every error raised by kvpool."""


class PoolExists(PoolError):
    """A pool of that name already exists for this user."""


class PoolNotFound(PoolError):
    """No pool of that name exists for this user."""


class PoolBusy(PoolError):
    """The pool is owned by a live process, or still has views handed out."""


class PoolFormatError(PoolError):
    """The segment is of another format version, another user, or not a pool at all."""


class PoolCorrupt(PoolError):
    """The pool header cannot be read back (both copies fail their checksum or bounds)."""


class ReservationError(PoolError):
    """The memory for a pool could not be reserved (a full or small /dev/shm)."""


class EntryNotFound(PoolError, KeyError):
    """No ready entry has that id."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "entry not found"


class EntryBusy(PoolError):
    """The entry is referenced or pinned, so it cannot be evicted, moved or changed."""


class EntryTooLarge(PoolError):
    """The entry could never fit: it is larger than the export budget or the arena."""


class DataCorrupt(PoolError):
    """An entry's stored bytes no longer match their checksum."""

    def __init__(self, message: str, entry_id: int | None = None) -> None:
        super().__init__(message)
        self.entry_id = entry_id


class LayoutError(PoolError):
    """Arrays or a layout record that the pool cannot store or trust."""
