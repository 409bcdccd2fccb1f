"""How an entry's KV bytes are laid out in its data extent, and views of the live cells.

An entry holds either named arrays (an engine that exposes its KV tensors, e.g. per layer K and
V) or one opaque blob (an engine that serialises its own state). Arrays are stored with room for
`capacity` cells along their token axis; only the first `live` cells hold state:

    one array, token axis 1 (heads, tokens, dim), capacity 8, live 5:

        head 0 | t0 t1 t2 t3 t4 . . . |    each head's live run is contiguous;
        head 1 | t0 t1 t2 t3 t4 . . . |    '.' is slack: reserved, not live

Checksums and copies walk the live runs in a canonical order (arrays in layout order, then the
index over the axes before the token axis), so a checksum does not depend on the capacity: an
entry can be compacted or moved without re-hashing what it holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import NamedTuple, Union

import msgspec
import numpy as np

from kvpool.allocator import ALIGN, align_up
from kvpool.errors import LayoutError

# Plain little-endian numeric types only: no object, string or structured dtypes cross the
# shared-memory boundary. bf16 is stored as "<u2" and named by the engine's own layout.
ALLOWED_DTYPES = frozenset({"|u1", "|i1", "<u2", "<i2", "<f2", "<u4", "<i4", "<f4", "<u8", "<i8", "<f8"})
MAX_DIMS = 8
NO_TOKEN_AXIS = -1  # fixed-size state (recurrent layers): all of it is live
_ITEMSIZE = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}


class ArraySpec(msgspec.Struct, frozen=True, array_like=True):
    """One stored array: name, dtype, reserved shape, token axis (-1: none) and byte offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    token_axis: int
    offset: int


class ArrayLayout(msgspec.Struct, frozen=True, array_like=True, tag="arrays"):
    """Named arrays, each at an offset in the data extent, and the plain values an engine needs
    beside them to rebuild its cache (an MLX cache's class, offset, window, bits...)."""

    arrays: tuple[ArraySpec, ...]
    engine_values: tuple[tuple[str, Union[int, str]], ...] = ()  # (name, value) pairs, sorted by name


class BlobLayout(msgspec.Struct, frozen=True, array_like=True, tag="blob"):
    """One opaque engine blob of `length` bytes, written whole (no slack)."""

    length: int


Layout = Union[ArrayLayout, BlobLayout]
_layout_encoder = msgspec.msgpack.Encoder()
_layout_decoder = msgspec.msgpack.Decoder(Layout)


class ArrayTemplate(NamedTuple):
    """An array to reserve room for: the size of its token axis is set by the capacity."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    token_axis: int = NO_TOKEN_AXIS


class KVArray(NamedTuple):
    """A live array to store, with the axis along which it holds tokens (-1: none)."""

    name: str
    data: np.ndarray
    token_axis: int = NO_TOKEN_AXIS


def _dtype_name(dtype) -> str:
    name = np.dtype(dtype).str
    if name not in ALLOWED_DTYPES:
        raise LayoutError(f"dtype {np.dtype(dtype)} cannot be stored; use one of {sorted(ALLOWED_DTYPES)}")
    return name


def template_of(array: KVArray) -> ArrayTemplate:
    """The template that reserves room for `array`."""
    return ArrayTemplate(array.name, _dtype_name(array.data.dtype), tuple(array.data.shape), array.token_axis)


def live_tokens_of(arrays: Sequence[KVArray]) -> int | None:
    """The live token count the arrays agree on (None when none has a token axis)."""
    counts = {a.data.shape[a.token_axis] for a in arrays if a.token_axis != NO_TOKEN_AXIS}
    if len(counts) > 1:
        raise LayoutError(f"arrays disagree on their live token count: {sorted(counts)}")
    return counts.pop() if counts else None


def spec_nbytes(spec: ArraySpec) -> int:
    """Bytes the array takes at its reserved shape."""
    return math.prod(spec.shape) * _ITEMSIZE[spec.dtype]


def plan(templates: Sequence[ArrayTemplate], capacity: int,
         engine_values: dict[str, int | str] | None = None) -> tuple[ArrayLayout, int]:
    """Lay out `templates` with room for `capacity` cells: (layout, data bytes)."""
    specs, offset, names = [], 0, set()
    for template in templates:
        dtype = _dtype_name(template.dtype)
        shape = list(template.shape)
        if len(shape) > MAX_DIMS:
            raise LayoutError(f"array {template.name!r} has {len(shape)} dimensions; at most {MAX_DIMS}")
        if template.token_axis != NO_TOKEN_AXIS:
            if not 0 <= template.token_axis < len(shape):
                raise LayoutError(f"array {template.name!r}: token axis {template.token_axis} is not one of "
                                  f"its {len(shape)} axes")
            shape[template.token_axis] = capacity
        if template.name in names:
            raise LayoutError(f"two arrays are named {template.name!r}")
        names.add(template.name)
        spec = ArraySpec(template.name, dtype, tuple(int(d) for d in shape), template.token_axis, offset)
        specs.append(spec)
        offset = align_up(offset + spec_nbytes(spec), ALIGN)
    return ArrayLayout(tuple(specs), tuple(sorted((engine_values or {}).items()))), max(offset, ALIGN)


def templates_of(layout: ArrayLayout) -> list[ArrayTemplate]:
    """Templates that reproduce `layout` at another capacity."""
    return [ArrayTemplate(s.name, s.dtype, s.shape, s.token_axis) for s in layout.arrays]


def encode_layout(layout: Layout) -> bytes:
    """msgpack bytes of a layout record."""
    return _layout_encoder.encode(layout)


def decode_layout(payload: bytes) -> Layout:
    """A layout record from its bytes; LayoutError when it does not decode."""
    try:
        return _layout_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LayoutError(f"layout record does not decode: {exc}") from None


def validate(layout: Layout, data_length: int, capacity: int, live: int) -> None:
    """Raise LayoutError unless every byte the layout names lies inside the data extent."""
    if not 0 <= live <= capacity:
        raise LayoutError(f"live cells {live} outside 0..capacity {capacity}")
    if isinstance(layout, BlobLayout):
        if not 0 <= layout.length <= data_length or capacity != live:
            raise LayoutError(f"blob of {layout.length} bytes in a {data_length}-byte extent, "
                              f"capacity {capacity} live {live}")
        return
    for spec in layout.arrays:
        if spec.dtype not in ALLOWED_DTYPES or len(spec.shape) > MAX_DIMS:
            raise LayoutError(f"array {spec.name!r}: dtype {spec.dtype!r} or rank {len(spec.shape)} not allowed")
        if any(d < 0 for d in spec.shape) or spec.offset < 0:
            raise LayoutError(f"array {spec.name!r}: negative shape or offset")
        if spec.token_axis != NO_TOKEN_AXIS:
            if not 0 <= spec.token_axis < len(spec.shape) or spec.shape[spec.token_axis] != capacity:
                raise LayoutError(f"array {spec.name!r}: token axis {spec.token_axis} does not hold "
                                  f"{capacity} cells")
        if spec.offset + spec_nbytes(spec) > data_length:
            raise LayoutError(f"array {spec.name!r} ends at {spec.offset + spec_nbytes(spec)}, "
                              f"past its {data_length}-byte extent")


def full_view(data: np.ndarray, spec: ArraySpec) -> np.ndarray:
    """The whole reserved array over the data extent (uint8), zero-copy."""
    raw = data[spec.offset:spec.offset + spec_nbytes(spec)]
    return raw.view(spec.dtype).reshape(spec.shape)


def live_view(data: np.ndarray, spec: ArraySpec, live: int) -> np.ndarray:
    """The live cells of one array (token axis cut to `live`), zero-copy."""
    array = full_view(data, spec)
    if spec.token_axis == NO_TOKEN_AXIS:
        return array
    index = [slice(None)] * array.ndim
    index[spec.token_axis] = slice(0, live)
    return array[tuple(index)]


def live_runs(data: np.ndarray, spec: ArraySpec, live: int) -> Iterator[np.ndarray]:
    """The contiguous pieces of an array's live cells, in canonical order (one piece when the
    entry has no slack: a hash over the pieces equals a hash over their concatenation)."""
    view = live_view(data, spec, live)
    if spec.token_axis in (NO_TOKEN_AXIS, 0) or view.flags.c_contiguous:
        yield view
        return
    for index in np.ndindex(*view.shape[:spec.token_axis]):
        yield view[index]


def paired_runs(data: np.ndarray, spec: ArraySpec, live: int, other: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(pool run, matching piece of `other`) pairs, where `other` has the live shape."""
    view = live_view(data, spec, live)
    if spec.token_axis in (NO_TOKEN_AXIS, 0) or view.flags.c_contiguous:
        yield view, other
        return
    for index in np.ndindex(*view.shape[:spec.token_axis]):
        yield view[index], other[index]


def all_live_runs(data: np.ndarray, layout: Layout, live: int) -> Iterator[np.ndarray]:
    """Every live run of every array (or the blob), in canonical (checksum) order."""
    if isinstance(layout, BlobLayout):
        yield data[:layout.length]
        return
    for spec in layout.arrays:
        yield from live_runs(data, spec, live)


def live_nbytes(layout: Layout, live: int) -> int:
    """Bytes of live state the layout holds at `live` cells."""
    if isinstance(layout, BlobLayout):
        return layout.length
    per_cell, fixed = _cell_bytes(layout)
    return fixed + per_cell * live


@lru_cache(maxsize=4096)
def _cell_bytes(layout: ArrayLayout) -> tuple[int, int]:
    """(bytes per cell, bytes independent of cells) of an array layout."""
    per_cell = fixed = 0
    for spec in layout.arrays:
        if spec.token_axis == NO_TOKEN_AXIS:
            fixed += spec_nbytes(spec)
        else:
            others = math.prod(d for axis, d in enumerate(spec.shape) if axis != spec.token_axis)
            per_cell += others * _ITEMSIZE[spec.dtype]
    return per_cell, fixed
