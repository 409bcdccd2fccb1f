"""What a cell of KV state costs: pure functions of the model's shape and cache types.

A *cell* is one token position of one model's KV state. Every budget and size decision in
superfluid calls these functions; the arithmetic lives nowhere else.

    bytes(n) = fixed + sum(full layers) * n + sum(window layers) * min(n, window)

Quantized cache types are priced by ggml's block arithmetic: a row of `v` values of a type with
blocks of `b` values and `s` bytes takes ceil(v / b) * s bytes.
"""

from __future__ import annotations

import math
from enum import Enum

import msgspec

# name -> (values per block, bytes per block), as ggml stores them.
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "iq4_nl": (32, 18),
    "bytes": (1, 1),  # a price an engine measured itself, in bytes (MLX's quantized cache)
}


class Attention(str, Enum):
    """How a layer holds KV state."""

    FULL = "full"  # every token stays: costs per token
    WINDOW = "window"  # sliding window: costs per token up to the window
    NONE = "none"  # recurrent, shared or attention-free: no per-token cost


class LayerKV(msgspec.Struct, frozen=True):
    """The KV shape of one layer: heads, key/value widths, cache types, attention kind."""

    kv_heads: int
    key_width: int
    value_width: int
    key_type: str = "f16"
    value_type: str = "f16"
    attention: Attention = Attention.FULL
    window: int = 0
    fixed_bytes: int = 0  # per-sequence state independent of tokens (recurrent state)

    def __post_init__(self) -> None:
        for name in ("kv_heads", "key_width", "value_width", "window", "fixed_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"LayerKV.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("key_type", "value_type"):
            if getattr(self, name) not in CACHE_TYPES:
                known = ", ".join(CACHE_TYPES)
                raise ValueError(f"unknown cache type {getattr(self, name)!r} for {name}; use one of {known}")
        if self.attention is Attention.WINDOW and self.window <= 0:
            raise ValueError("a sliding-window layer needs window > 0")


class ModelKV(msgspec.Struct, frozen=True):
    """The KV shape of a whole model: its layers and any fixed per-sequence state."""

    layers: tuple[LayerKV, ...]
    fixed_bytes: int = 0


def row_bytes(cache_type: str, values: int) -> int:
    """Bytes ggml takes to store one row of `values` values of `cache_type`."""
    try:
        block_values, block_bytes = CACHE_TYPES[cache_type]
    except KeyError:
        raise ValueError(f"unknown cache type {cache_type!r}; use one of {', '.join(CACHE_TYPES)}") from None
    return math.ceil(values / block_values) * block_bytes


def layer_bytes_per_token(layer: LayerKV) -> int:
    """Bytes one token costs in `layer` while it is held (0 for layers without KV)."""
    if layer.attention is Attention.NONE:
        return 0
    keys = row_bytes(layer.key_type, layer.kv_heads * layer.key_width)
    values = row_bytes(layer.value_type, layer.kv_heads * layer.value_width)
    return keys + values


def fixed_bytes(model: ModelKV) -> int:
    """Per-sequence bytes that do not depend on the token count."""
    return model.fixed_bytes + sum(layer.fixed_bytes for layer in model.layers)


def bytes_per_token(model: ModelKV) -> int:
    """The marginal price of a cell while every window is still filling (the first tokens)."""
    return sum(layer_bytes_per_token(layer) for layer in model.layers)


def full_bytes_per_token(model: ModelKV) -> int:
    """The marginal price of a cell once every sliding window is full (full layers only)."""
    return sum(layer_bytes_per_token(layer) for layer in model.layers if layer.attention is Attention.FULL)


def state_bytes(model: ModelKV, tokens: int) -> int:
    """Exact bytes of KV state for a sequence of `tokens` tokens."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    total = fixed_bytes(model)
    for layer in model.layers:
        held = min(tokens, layer.window) if layer.attention is Attention.WINDOW else tokens
        total += layer_bytes_per_token(layer) * held
    return total


def tokens_for_bytes(model: ModelKV, budget: int) -> int | None:
    """The most tokens whose state fits in `budget` bytes; None when unbounded (no per-token cost
    past the windows and the budget covers them all), 0 when not even the fixed part fits."""
    if budget < fixed_bytes(model):
        return 0
    if full_bytes_per_token(model) == 0:
        windows = [layer.window for layer in model.layers if layer.attention is Attention.WINDOW]
        if state_bytes(model, max(windows, default=0)) <= budget:
            return None
    # state_bytes is monotone in tokens: binary search the largest n that fits.
    low, high = 0, max(1, budget)
    while low < high:
        mid = (low + high + 1) // 2
        if state_bytes(model, mid) <= budget:
            low = mid
        else:
            high = mid - 1
    return low


def uniform(layers: int, kv_heads: int, head_dim: int, cache_type: str = "f16", *,
            value_type: str | None = None, value_width: int | None = None) -> ModelKV:
    """A model whose every layer attends fully with the same KV shape (the common case)."""
    layer = LayerKV(kv_heads, head_dim, value_width if value_width is not None else head_dim,
                    cache_type, value_type or cache_type)
    return ModelKV(tuple(layer for _ in range(layers)))
