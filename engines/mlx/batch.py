"""Several MLX sequences decoding in one forward, through mlx-lm's batch caches.

mlx-lm's `BatchKVCache` holds every lane left-padded in one buffer, so a lane joining copies
its live cells in, and a lane leaving copies them out. The adapter keeps one batch alive while
the same sequences decode together step after step, and dissolves it when the set changes or
any other operation touches a member; both directions are counted:

    join    lane KV ----(merge: one copy of each lane's live cells)----> batch buffer
    leave   batch buffer --(one copy of the lane's live cells)--> a step-rounded KVCache buffer
                                                                   its next appends fill in place

Only models whose every layer is a plain `KVCache` batch; the other kinds step one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

from engines.mlx import caches


class Copies:
    """Bytes and arrays copied by one join or leave."""

    def __init__(self) -> None:
        self.bytes = 0
        self.arrays = 0

    def add(self, nbytes: int, arrays: int) -> None:
        """Count one more copy of `nbytes` bytes in `arrays` arrays."""
        self.bytes += nbytes
        self.arrays += arrays


class DecodeBatch:
    """The member sequences (in lane order) and one batch cache per layer."""

    def __init__(self, members: tuple[int, ...], layers: list) -> None:
        self.members = members
        self.layers = layers


def batchable(lanes: Sequence[list]) -> bool:
    """True when every layer of every lane is a plain KVCache (what BatchKVCache merges)."""
    return all(isinstance(caches.lookup(layer), caches.KV) for lane in lanes for layer in lane)


def join(module, members: tuple[int, ...], lanes: Sequence[list], copies: Copies) -> DecodeBatch:
    """Merge each layer of `lanes` (one cache list per member) into a batch cache."""
    layers = []
    for index in range(len(lanes[0])):
        per_lane = [lane[index] for lane in lanes]
        copies.add(sum(caches.live_nbytes(c) for c in per_lane), 2 * sum(c.keys is not None for c in per_lane))
        layers.append(module.BatchKVCache.merge(per_lane))
    return DecodeBatch(members, layers)


def leave(mx, module, batch: DecodeBatch, copies: Copies) -> dict[int, list]:
    """Every member's caches, copied out of the batch into step-rounded buffers with room for
    the next token (caches.room_for)."""
    step = caches.step_of(module, "KVCache")
    out: dict[int, list] = {seq: [] for seq in batch.members}
    for layer in batch.layers:
        padding = layer.left_padding.tolist()
        for lane, seq in enumerate(batch.members):
            cache = module.KVCache()
            live = layer._idx - padding[lane]
            if layer.keys is not None and live > 0:
                capacity = caches.room_for(live, step)
                keys, values = (_lane_copy(mx, buffer, lane, padding[lane], layer._idx, capacity)
                                for buffer in (layer.keys, layer.values))
                cache.keys, cache.values, cache.offset = keys, values, live
                copies.add(keys[..., :live, :].nbytes + values[..., :live, :].nbytes, 2)
            out[seq].append(cache)
    mx.eval([c.keys for lane in out.values() for c in lane if c.keys is not None],
            [c.values for lane in out.values() for c in lane if c.values is not None])
    return out


def _lane_copy(mx, buffer, lane: int, start: int, stop: int, capacity: int):
    fresh = mx.zeros((1, buffer.shape[1], capacity, buffer.shape[3]), buffer.dtype)
    fresh[:, :, : stop - start, :] = buffer[lane:lane + 1, :, start:stop, :]
    return fresh
