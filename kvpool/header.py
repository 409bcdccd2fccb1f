"""Pool and entry headers: msgspec Structs framed into fixed slots of the segment.

Each header lives in a slot of two halves (A/B). A write goes to the half its new generation
selects (generation % 2), so the previous version stays intact in the other half until the new
one is whole; a reader takes the valid half with the higher generation. A half that fails its
checksum is treated as absent, so a torn write loses only the change being written.

    half:  | magic "SFKV" | payload length u32 | generation u64 | xxh3 u64 | msgpack payload ... |

The checksum covers the length, the generation and the payload. Payloads are msgpack arrays
(array_like Structs); fields are only ever appended, with defaults, so an older reader decodes a
newer header and `version` says which layout wrote it.

Versions: 1 had no namespace; 2 added the entry's prefix namespace (whose requests may share its
prefix: a tenant, and a salt a request may add). A version-1 pool is read as version 2 with every
entry in the empty namespace, and its header is rewritten as version 2 by the first process that
attaches it, so a release that knows only version 1 refuses it whole rather than sharing across
namespaces it cannot see.
"""

from __future__ import annotations

import struct
from enum import IntEnum

import msgspec
import numpy as np
import xxhash

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # what attach reads (see above)
MAGIC = b"SFKV"
FRAME = struct.Struct("<4sIQQ")

POOL_HEADER_HALF = 2048  # the pool header region is 2 halves at the start of the segment
ENTRY_SLOT_HALF = 512  # each entry slot is 2 halves of this size
ENTRY_SLOT_BYTES = 2 * ENTRY_SLOT_HALF
MAX_TEXT = 96  # longest identity, tag or namespace in UTF-8 bytes, so a header fits its half


class EntryState(IntEnum):
    """Where an entry is in its life. Only READY entries survive a re-attach."""

    FREE = 0
    WRITING = 1
    READY = 2


class PoolHeader(msgspec.Struct, frozen=True, array_like=True):
    """The segment's geometry, owner and export budget, written at creation."""

    version: int
    uid: int
    name: str
    size: int
    slot_table_offset: int
    slot_count: int
    slot_size: int
    arena_offset: int
    arena_size: int
    budget_bytes: int
    budget_reason: str
    created_at: float
    owner_pid: int
    serial_limit: int = 0  # entry ids below this may have been handed out: a new owner starts here


class EntryHeader(msgspec.Struct, frozen=True, array_like=True):
    """One entry: whose KV it is, how many cells it holds and reserves, where its bytes are.

    `data_*` is the extent holding the KV arrays or the engine blob; `meta_*` the extent holding
    the side record: the layout (msgpack, `layout_length` bytes, padded to 8) followed by token
    ids as int32 for `capacity` cells. Checksums are xxh3-64: the layout over its bytes, the
    tokens over the live ones, the data over the live cells in canonical order.
    """

    version: int
    state: int
    serial: int
    identity: str = ""
    live: int = 0
    capacity: int = 0
    data_offset: int = 0
    data_length: int = 0
    meta_offset: int = 0
    meta_length: int = 0
    layout_length: int = 0
    layout_checksum: int = 0
    tokens_checksum: int = 0
    data_checksum: int = 0
    recompute_cost: float = 0.0
    tag: str = ""
    created_at: float = 0.0
    namespace: str = ""  # (version 2) only requests of this namespace find the entry by prefix


class _VersionProbe(msgspec.Struct, array_like=True):
    """The first field of every header: decodes any version's payload."""

    version: int


_encoder = msgspec.msgpack.Encoder()
_pool_decoder = msgspec.msgpack.Decoder(PoolHeader)
_entry_decoder = msgspec.msgpack.Decoder(EntryHeader)
_probe_decoder = msgspec.msgpack.Decoder(_VersionProbe)


def _frame_check(length: int, generation: int, payload) -> int:
    hasher = xxhash.xxh3_64(struct.pack("<IQ", length, generation))
    hasher.update(payload)
    return hasher.intdigest()


def fits_entry_slot(header: EntryHeader) -> bool:
    """Whether `header` fits an entry slot half, even once its checksum fields are at their
    largest (msgpack integers grow with their value)."""
    widest = msgspec.structs.replace(header, state=EntryState.READY, data_checksum=2**64 - 1,
                                     layout_checksum=2**64 - 1, tokens_checksum=2**64 - 1)
    return FRAME.size + len(_encoder.encode(widest)) <= ENTRY_SLOT_HALF


def write_half(half: np.ndarray, payload, generation: int) -> None:
    """Frame `payload` (any bytes-like) into one slot half: payload first, prefix last."""
    length = len(payload)
    if FRAME.size + length > half.nbytes:
        raise ValueError(f"header of {length} bytes does not fit a {half.nbytes}-byte slot half")
    half[FRAME.size:FRAME.size + length] = np.frombuffer(payload, dtype=np.uint8)
    prefix = FRAME.pack(MAGIC, length, generation, _frame_check(length, generation, payload))
    half[:FRAME.size] = np.frombuffer(prefix, dtype=np.uint8)


class SlotWriter:
    """Encodes headers into a reusable scratch buffer and frames them into A/B slots.

    Not thread-safe: each pool owns one and uses it under its lock.
    """

    def __init__(self) -> None:
        self._scratch = bytearray(ENTRY_SLOT_HALF)

    def write(self, slot: np.ndarray, header: msgspec.Struct, generation: int) -> None:
        """Write `header` as `generation` into the half of `slot` that generation selects."""
        _encoder.encode_into(header, self._scratch)
        half = slot.nbytes // 2
        index = generation % 2
        write_half(slot[index * half:(index + 1) * half], memoryview(self._scratch), generation)


def read_half(half: np.ndarray) -> tuple[int, bytes] | None:
    """(generation, payload) of a slot half, or None when it is empty, torn or corrupt."""
    magic, length, generation, check = FRAME.unpack(half[:FRAME.size].tobytes())
    if magic != MAGIC or length > half.nbytes - FRAME.size:
        return None
    payload = half[FRAME.size:FRAME.size + length].tobytes()
    if _frame_check(length, generation, payload) != check:
        return None
    return generation, payload


def read_slot(slot: np.ndarray) -> tuple[int, bytes] | None:
    """The newest valid (generation, payload) of an A/B slot, or None when neither half is valid."""
    half = slot.nbytes // 2
    found = [read_half(slot[:half]), read_half(slot[half:])]
    valid = [item for item in found if item is not None]
    return max(valid, key=lambda item: item[0]) if valid else None


def payload_version(payload: bytes) -> int | None:
    """The `version` field of any header payload, or None if it is not a header."""
    try:
        return _probe_decoder.decode(payload).version
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_pool_header(payload: bytes) -> PoolHeader | None:
    """A PoolHeader, or None when the payload does not decode as one."""
    try:
        return _pool_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_entry_header(payload: bytes) -> EntryHeader | None:
    """An EntryHeader, or None when the payload does not decode as one."""
    try:
        return _entry_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
