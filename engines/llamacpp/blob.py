"""The llama.cpp per-sequence state blob, walked and checked before llama.cpp reads it.

llama.cpp trusts a blob handed to `llama_state_seq_set_data`; a corrupt one can reach a
GGML_ASSERT and abort the whole process before any bounds check. So every blob is walked here
first. What `llama_state_seq_get_data` writes (llama.cpp as vendored in llama-cpp-python 0.3.36):

    [u32 magic 0xaf143cd8 | i32 seq_id]       (releases since late 2025; probed at load)
    then each part of the model's memory, in order (see memory.py for which parts a kind has):

    a KV cache part (plain attention, or the base or the window half of a sliding-window cache)
        u32 n_stream (1 in a unified cache)
        per stream:  u32 cell_count            (nothing more when it is 0)
                     cell_count x (i32 pos | u32 n_seq_id = 1 | i32 seq_id)
                     u32 v_trans | u32 n_layer
                     n_layer x (i32 k_type | u64 k_row | cell_count x k_row bytes)
                     v_trans = 0:  n_layer x (i32 v_type | u64 v_row | cell_count x v_row bytes)
                     v_trans = 1:  n_layer x (i32 v_type | u32 v_elem | u32 n_embd_v |
                                              n_embd_v x cell_count x v_elem bytes)
    a recurrent part (Mamba-style state: a fixed size whatever the length)
        u32 cell_count (1 for a sequence that has seen a token)
        cell_count x (i32 pos | u32 n_seq_id = 0)
        u32 s_trans = 0 | u32 n_layer
        per recurrent layer: i32 r_type | u64 r_row | cell_count x r_row bytes     (conv state)
        per recurrent layer: i32 s_type | u64 s_row | cell_count x s_row bytes     (SSM state)

A window part holds only the cells the window still sees (positions n - window .. n - 1): cells
older than the window are left out even when the live cache still has them.

The walk is structural (every length checked before it is trusted); `Template` then compares a
blob with the one this engine wrote for its own probe sequence at load: the same parts, layers,
types and row sizes, and positions that make a sequence of n tokens.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from engines.errors import StateError

MAGIC = 0xAF143CD8
CELL_META = 12  # pos, n_seq_id = 1, seq_id: what one exported KV cell carries besides its rows
RECURRENT_CELL_META = 8  # pos, n_seq_id = 0

KV, RECURRENT = "kv", "recurrent"


class KVPart(NamedTuple):
    """One KV cache part of a blob as walked."""

    cells: int
    positions: np.ndarray  # int32, in cache order
    v_trans: bool
    k_rows: tuple[tuple[int, int], ...]  # (type, bytes per cell) per layer
    v_rows: tuple[tuple[int, int], ...]  # (type, bytes per cell) per layer (transposed V: elem x n_embd_v)

    @property
    def bytes_per_cell(self) -> int:
        """K and V bytes one cell takes in this part."""
        return sum(row for _, row in self.k_rows) + sum(row for _, row in self.v_rows)


class RecurrentPart(NamedTuple):
    """One recurrent part of a blob as walked."""

    cells: int
    positions: np.ndarray
    layers: int  # the model's layer count as written (layers without state are skipped)
    rows: tuple[tuple[int, int], ...]  # (type, bytes) of each conv row, then of each SSM row

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state."""
        return sum(row for _, row in self.rows)


class _Reader:
    def __init__(self, blob: np.ndarray) -> None:
        self.data = memoryview(blob).cast("B")
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
            raise StateError(f"state blob ends at byte {len(self.data)}, inside {size} bytes of state at {self.at}")
        self.at += size

    def ints(self, count: int) -> np.ndarray:
        end = self.at + 4 * count
        if count < 0 or end > len(self.data):
            raise StateError(f"state blob ends at byte {len(self.data)}, inside its cell table at {self.at}")
        values = np.frombuffer(self.data[self.at:end], dtype="<i4")
        self.at = end
        return values

    @property
    def left(self) -> int:
        return len(self.data) - self.at


def walk(blob: np.ndarray, parts: tuple[str, ...], *, header: bool, max_cells: int) -> list:
    """The blob's parts (KVPart or RecurrentPart, as `parts` names them), after checking that every
    field fits where it claims to; StateError names the first that does not."""
    reader = _Reader(blob)
    if header:
        magic, _seq = reader.take("<Ii")
        if magic != MAGIC:
            raise StateError(f"not a llama.cpp sequence state (magic {magic:#x})")
    walked = [_kv(reader, max_cells) if part == KV else _recurrent(reader) for part in parts]
    if reader.left:
        raise StateError(f"state blob has {reader.left} bytes past its end")
    return walked


def _kv(reader: _Reader, max_cells: int) -> KVPart:
    (streams,) = reader.take("<I")
    if streams != 1:
        raise StateError(f"state from a cache of {streams} streams; this engine keeps one unified cache")
    (cells,) = reader.take("<I")
    if cells > max_cells:
        raise StateError(f"state holds {cells} cells; this context has {max_cells}")
    if cells == 0:
        return KVPart(0, np.zeros(0, np.int32), False, (), ())
    meta = reader.ints(cells * 3)
    if (meta[1::3] != 1).any():
        raise StateError("state cells must belong to exactly one sequence")
    v_trans, layers = reader.take("<II")
    if v_trans not in (0, 1) or layers > 4096:
        raise StateError(f"state part claims v_trans={v_trans} and {layers} layers")
    k_rows = []
    for _ in range(layers):
        k_type, k_row = reader.take("<iQ")
        reader.skip(cells * k_row)
        k_rows.append((k_type, k_row))
    v_rows = []
    for _ in range(layers):
        if v_trans:
            v_type, v_elem, v_embd = reader.take("<iII")
            reader.skip(v_embd * cells * v_elem)
            v_rows.append((v_type, v_elem * v_embd))
        else:
            v_type, v_row = reader.take("<iQ")
            reader.skip(cells * v_row)
            v_rows.append((v_type, v_row))
    return KVPart(cells, meta[0::3], bool(v_trans), tuple(k_rows), tuple(v_rows))


def _recurrent(reader: _Reader) -> RecurrentPart:
    (cells,) = reader.take("<I")
    if cells > 1:
        raise StateError(f"recurrent state of {cells} cells; one sequence keeps one")
    meta = reader.ints(cells * 2)
    if (meta[1::2] != 0).any():
        raise StateError("recurrent state cells must not name other sequences")
    s_trans, layers = reader.take("<II")
    if s_trans != 0:
        raise StateError("recurrent state with a transposed SSM part (s_trans=1) is not supported yet")
    rows = []
    while reader.left >= 12 and len(rows) < 2 * layers:
        r_type, r_row = reader.take("<iQ")
        reader.skip(cells * r_row)
        rows.append((r_type, r_row))
    return RecurrentPart(cells, meta[0::2], layers, tuple(rows))


class Template(NamedTuple):
    """What every blob of this engine must look like, learned from its own probe state."""

    parts: tuple[str, ...]
    header: bool
    max_cells: int
    v_trans: bool
    kv_rows: tuple  # per KV part: (k_rows, v_rows)
    recurrent_rows: tuple  # per recurrent part: (layers, rows)

    @classmethod
    def learn(cls, probe: np.ndarray, parts: tuple[str, ...], *, header: bool, max_cells: int) -> Template:
        """The template of the blob this engine wrote for a sequence that has seen tokens."""
        walked = walk(probe, parts, header=header, max_cells=max_cells)
        kv = [part for part in walked if isinstance(part, KVPart)]
        if any(part.cells == 0 for part in kv):
            raise StateError("the probe state left a KV part empty: it cannot serve as a template")
        return cls(parts, header, max_cells, kv[0].v_trans if kv else False,
                   tuple((part.k_rows, part.v_rows) for part in kv),
                   tuple((part.layers, part.rows) for part in walked if isinstance(part, RecurrentPart)))

    def check(self, blob: np.ndarray, window: int) -> int:
        """The tokens the blob holds, after checking it part by part against this template and
        its positions against a sequence of that length; StateError names what differs."""
        walked = walk(blob, self.parts, header=self.header, max_cells=self.max_cells)
        kv = [part for part in walked if isinstance(part, KVPart)]
        recurrent = [part for part in walked if isinstance(part, RecurrentPart)]
        tokens = _length(kv, recurrent)
        for index, (part, (k_rows, v_rows)) in enumerate(zip(kv, self.kv_rows)):
            if part.cells and (part.v_trans != self.v_trans or (part.k_rows, part.v_rows) != (k_rows, v_rows)):
                raise StateError(f"state part {index} has {len(part.k_rows)} layers of K rows {part.k_rows[:1]} "
                                 f"with v_trans={int(part.v_trans)}; this engine writes {len(k_rows)} of "
                                 f"{k_rows[:1]} with v_trans={int(self.v_trans)} (other cache types or flash "
                                 "attention?)")
            # the window half of a sliding-window cache holds the last `window` positions only
            first = max(0, tokens - window) if index == 1 and window else 0
            expected = np.arange(first, tokens, dtype=np.int32)
            if not np.array_equal(np.sort(part.positions), expected):
                raise StateError(f"state part {index} does not hold positions {first}..{tokens - 1} exactly once each")
        for part, (layers, rows) in zip(recurrent, self.recurrent_rows):
            if part.cells and (part.layers, part.rows) != (layers, rows):
                raise StateError(f"recurrent state of {len(part.rows)} rows {part.rows[:1]} over {part.layers} "
                                 f"layers; this engine writes {len(rows)} rows {rows[:1]} over {layers}")
            if part.cells and int(part.positions[0]) != tokens - 1:
                raise StateError(f"recurrent state at position {int(part.positions[0])} beside KV of {tokens} tokens")
        return tokens


def _length(kv: list[KVPart], recurrent: list[RecurrentPart]) -> int:
    """The sequence length a blob's parts claim: the full KV part's cell count, else the
    recurrent state's position + 1."""
    if kv:
        return kv[0].cells
    part = recurrent[0]
    return int(part.positions[0]) + 1 if part.cells else 0
