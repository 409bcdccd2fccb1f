"""The llama.cpp per-sequence state blob: its structure, checked before llama.cpp reads it.

llama.cpp trusts a blob handed to `llama_state_seq_set_data`; a corrupt one can reach a
GGML_ASSERT and abort the whole process before any bounds check. So every blob is walked here
first, against the layout this engine expects (llama.cpp 0.3.36's KV cache format):

    [u32 magic 0xaf143cd8 | i32 seq_id]     (releases since late 2025; probed at load)
    u32 n_stream
    per stream:  u32 cell_count
                 cell_count x (i32 pos | u32 n_seq_id | n_seq_id x i32 seq_id)
                 u32 v_trans | u32 n_layer
                 n_layer x (i32 k_type | u64 k_row | cell_count x k_row bytes)
                 v_trans = 0:  n_layer x (i32 v_type | u64 v_row | cell_count x v_row bytes)
                 v_trans = 1:  n_layer x (i32 v_type | u32 v_elem | u32 n_embd_v | n_embd_v x cell_count x v_elem)
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from engines.errors import StateError

MAGIC = 0xAF143CD8
CELL_META = 12  # pos, n_seq_id = 1, seq_id: what one exported cell carries besides its K/V rows


class Expected(NamedTuple):
    """What a blob from this engine must look like."""

    layers: int
    k_type: int
    v_type: int
    k_row: int  # bytes of one cell's keys in one layer
    v_row: int
    v_elem: int  # bytes of one V element (transposed V)
    v_embd: int  # V values per cell per layer (transposed V)
    v_trans: bool
    max_cells: int
    header: bool = True  # the magic and sequence id before the stream count


def fixed_bytes(expected: Expected) -> int:
    """Bytes of a one-stream blob that do not depend on its cell count."""
    prefix = 12 if expected.header else 4  # [magic, seq id,] stream count
    return prefix + 4 + 8 + expected.layers * (12 + 12)  # K and V headers are 12 bytes either way


class _Reader:
    def __init__(self, blob: np.ndarray) -> None:
        self.data = memoryview(blob)
        self.at = 0

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise StateError(f"state blob ends at byte {len(self.data)}, inside a field at {self.at}")
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return values

    def skip(self, size: int) -> None:
        if size < 0 or self.at + size > len(self.data):
            raise StateError(f"state blob ends at byte {len(self.data)}, inside {size} bytes of KV at {self.at}")
        self.at += size


def check(blob: np.ndarray, expected: Expected) -> int:
    """The number of cells the blob holds, after checking every field against `expected`
    (StateError, naming the field, otherwise). Nothing here trusts a length before checking it."""
    reader = _Reader(blob)
    if expected.header:
        magic, _seq = reader.take("<Ii")
        if magic != MAGIC:
            raise StateError(f"not a llama.cpp sequence state (magic {magic:#x})")
    (streams,) = reader.take("<I")
    if streams != 1:
        raise StateError(f"state from a cache of {streams} streams; this engine keeps one unified cache")
    (cells,) = reader.take("<I")
    if cells > expected.max_cells:
        raise StateError(f"state holds {cells} cells; this context has {expected.max_cells}")
    if cells == 0:
        _finish(reader)
        return 0
    meta = np.frombuffer(reader.data[reader.at:reader.at + cells * CELL_META], dtype="<i4")
    if meta.size != cells * 3:
        raise StateError("state blob ends inside its cell table")
    positions, counts = meta[0::3], meta[1::3]
    if (counts != 1).any():
        raise StateError("state cells must belong to exactly one sequence")
    # Cells come in cache order, which a truncate and a refill can shuffle: any order of 0..n-1.
    if not np.array_equal(np.sort(positions), np.arange(cells, dtype="<i4")):
        raise StateError("state cells do not hold positions 0..n-1 exactly once each")
    reader.skip(cells * CELL_META)
    v_trans, layers = reader.take("<II")
    if bool(v_trans) != expected.v_trans or layers != expected.layers:
        raise StateError(f"state of {layers} layers with v_trans={v_trans}; this engine has {expected.layers} "
                         f"layers with v_trans={int(expected.v_trans)} (flash attention differs?)")
    for _ in range(layers):
        k_type, k_row = reader.take("<iQ")
        if (k_type, k_row) != (expected.k_type, expected.k_row):
            raise StateError(f"K rows of type {k_type} and {k_row} bytes; expected type {expected.k_type}, "
                             f"{expected.k_row} bytes")
        reader.skip(cells * k_row)
    for _ in range(layers):
        if expected.v_trans:
            v_type, v_elem, v_embd = reader.take("<iII")
            if (v_type, v_elem, v_embd) != (expected.v_type, expected.v_elem, expected.v_embd):
                raise StateError(f"V of type {v_type}, {v_elem}-byte elements x {v_embd}; expected "
                                 f"{expected.v_type}, {expected.v_elem} x {expected.v_embd}")
            reader.skip(v_embd * cells * v_elem)
        else:
            v_type, v_row = reader.take("<iQ")
            if (v_type, v_row) != (expected.v_type, expected.v_row):
                raise StateError(f"V rows of type {v_type} and {v_row} bytes; expected type {expected.v_type}, "
                                 f"{expected.v_row} bytes")
            reader.skip(cells * v_row)
    _finish(reader)
    return cells


def _finish(reader: _Reader) -> None:
    if reader.at != len(reader.data):
        raise StateError(f"state blob has {len(reader.data) - reader.at} bytes past its end")
