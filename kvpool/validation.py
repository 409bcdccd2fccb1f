"""Checks on what callers hand the pool, done before any room is made: tokens, text fields, costs."""

from __future__ import annotations

import math

import numpy as np

from kvpool.entry import TOKEN_DTYPE
from kvpool.errors import LayoutError
from kvpool.header import MAX_TEXT

_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


def token_ids(tokens) -> np.ndarray:
    """`tokens` as contiguous little-endian int32; LayoutError unless a 1-D sequence of integers."""
    array = np.asarray(tokens)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise LayoutError(f"tokens must be a 1-D sequence of integers, got shape {array.shape} {array.dtype}")
    if array.size and (array.min() < _INT32_MIN or array.max() > _INT32_MAX):
        raise LayoutError("token ids must fit in int32")
    return np.ascontiguousarray(array, dtype=TOKEN_DTYPE)


def text_field(name: str, value: str, allow_empty: bool) -> str:
    """`value` if it is a string of at most MAX_TEXT UTF-8 bytes (and not empty unless allowed)."""
    if not isinstance(value, str) or len(value.encode()) > MAX_TEXT or (not value and not allow_empty):
        raise LayoutError(f"{name} must be a string of {'0' if allow_empty else '1'}-{MAX_TEXT} UTF-8 bytes")
    return value


def recompute_cost(value: float | None, tokens: int) -> float:
    """The cost to record: `value` if finite and >= 0, else LayoutError; `tokens` when None."""
    cost = float(tokens) if value is None else value
    if not isinstance(cost, (int, float)) or not math.isfinite(cost) or cost < 0:
        raise LayoutError(f"recompute_cost must be a finite number >= 0 (seconds or tokens), got {value!r}")
    return float(cost)


MAX_ENGINE_VALUES = 4096


def engine_values(values) -> dict[str, int | str]:
    """`values` (an engine's plain values for an entry) if a dict of at most MAX_ENGINE_VALUES
    names of 1-MAX_TEXT bytes, each an int64 or a string of at most MAX_TEXT bytes."""
    values = {} if values is None else values
    if not isinstance(values, dict) or len(values) > MAX_ENGINE_VALUES:
        raise LayoutError(f"engine values must be a dict of at most {MAX_ENGINE_VALUES} entries")
    for key, value in values.items():
        text_field("an engine value's name", key, allow_empty=False)
        if isinstance(value, str):
            text_field(f"engine value {key!r}", value, allow_empty=True)
        elif isinstance(value, bool) or not isinstance(value, int) or not -(1 << 63) <= value < (1 << 63):
            raise LayoutError(f"engine value {key!r} is {value!r}; use an int64 or a short string")
    return values
