"""The price of a cell on MLX, measured from live state rather than derived from a config.

A probe sequence takes one token, then a second; each layer's live bytes after each (what an
export would store, never the grown buffer) give its per-token cost and its fixed part. That
covers every cache kind alike: a KV layer costs per token, a rotating one per token up to its
window, a recurrent one only its fixed state, a quantized one its packed bytes and scales.
"""

from __future__ import annotations

from collections.abc import Sequence

from engines.mlx import caches
from kvpool import pricing
from kvpool.pricing import Attention, LayerKV, ModelKV


def layer_kv(cache, after_one: int, after_two: int) -> LayerKV:
    """A layer priced from its live bytes after one and after two tokens."""
    per_token = after_two - after_one
    fixed = after_one - per_token
    if per_token == 0:
        return LayerKV(0, 0, 0, "bytes", "bytes", Attention.NONE, fixed_bytes=after_one)
    window = caches.window(cache)
    attention = Attention.WINDOW if window else Attention.FULL
    return LayerKV(1, per_token, 0, "bytes", "bytes", attention, window, fixed_bytes=max(fixed, 0))


def measure(layers: Sequence, after_one: Sequence[int], after_two: Sequence[int]) -> ModelKV:
    """The model's KV price from each layer's live bytes after one and after two tokens."""
    return ModelKV(tuple(layer_kv(c, a, b) for c, a, b in zip(layers, after_one, after_two)))


def live_bytes(layers: Sequence) -> list[int]:
    """Each layer's live bytes now."""
    return [caches.live_nbytes(c) for c in layers]


def cell_price(model_kv: ModelKV) -> int:
    """Bytes one more token costs while every window is still filling."""
    return pricing.bytes_per_token(model_kv)
