"""Every kind of mlx-lm cache seen one way: its live arrays, its plain values, how to share it
and how to build it back, under either generation of mlx-lm's cache state.

Kinds and what is live in each:

    KVCache            keys and values cut to `offset`                    token axis 2
    QuantizedKVCache   the (data, scales, biases) of keys and values,
                       each cut to `offset`                               token axis 2
    RotatingKVCache    the ring buffer as it is (cut to `offset` before
                       it first wraps), with keep, max_size and _idx      no token axis
    ArraysCache        its recurrent arrays, a fixed per-sequence part    no token axis
    CacheList          each member, as above                              (members')

Generations: mlx-lm 0.32 puts a cache's offset and settings in its `state` beside the arrays
(a grown KVCache's state holds the whole buffer); 0.31 kept `state` to the live arrays and the
settings, as strings, in `meta_state`. Which one a cache speaks is read from the instance (does
it have `meta_state`?), never from a version number. Reading goes through the attributes that
both generations share; building goes through `state` (and `meta_state`) as the running mlx-lm
defines them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from engines.base import Memory
from engines.errors import StateError

KINDS = ("KVCache", "QuantizedKVCache", "RotatingKVCache", "ArraysCache", "CacheList")
NO_TOKEN_AXIS = -1


class Part(NamedTuple):
    """One live array of a cache: its stored name, the whole MLX buffer, how many cells of its
    axis 2 are live (None: all of it) and its token axis (NO_TOKEN_AXIS for state that does not
    grow per token). The buffer is given whole so numpy can alias it before cutting."""

    name: str
    buffer: Any
    live: int | None
    token_axis: int

    @property
    def nbytes(self) -> int:
        """Bytes of the live cells."""
        if self.live is None:
            return self.buffer.nbytes
        return self.buffer.nbytes // self.buffer.shape[2] * self.live


def kind(cache) -> str:
    """The cache's kind, refusing the ones this adapter cannot park."""
    name = type(cache).__name__
    if name not in KINDS:
        raise StateError(f"mlx-lm cache {name} cannot be parked; the adapter handles {', '.join(KINDS)}")
    return name


def speaks_meta_state(cache) -> bool:
    """True for the earlier generation (mlx-lm 0.31): settings live in `meta_state`."""
    return hasattr(cache, "meta_state")


def _stored_ring_length(cache) -> int:
    # Before the ring first wraps its first `offset` cells are the live ones; after, all of it.
    return min(cache.offset, cache.keys.shape[2])


def parts(cache, prefix: str) -> list[Part]:
    """The live arrays of `cache` (views, nothing copied), named under `prefix`."""
    name = kind(cache)
    if name == "CacheList":
        return [p for j, member in enumerate(cache.caches) for p in parts(member, f"{prefix}{j}.")]
    if name == "ArraysCache":
        return [Part(f"{prefix}s{j}", a, None, NO_TOKEN_AXIS) for j, a in enumerate(cache.cache) if a is not None]
    if cache.keys is None:
        return []
    if name == "KVCache":
        return [Part(f"{prefix}k", cache.keys, cache.offset, 2), Part(f"{prefix}v", cache.values, cache.offset, 2)]
    if name == "QuantizedKVCache":
        return [Part(f"{prefix}{side}{j}", array, cache.offset, 2)
                for side, group in (("k", cache.keys), ("v", cache.values)) for j, array in enumerate(group)]
    n = _stored_ring_length(cache)
    return [Part(f"{prefix}k", cache.keys, n, NO_TOKEN_AXIS), Part(f"{prefix}v", cache.values, n, NO_TOKEN_AXIS)]


def values(cache, prefix: str) -> dict[str, int | str]:
    """The plain values that rebuild `cache` beside its arrays (class, offset, settings)."""
    name = kind(cache)
    out: dict[str, int | str] = {f"{prefix}class": name}
    if name == "CacheList":
        out[f"{prefix}members"] = len(cache.caches)
        for j, member in enumerate(cache.caches):
            out.update(values(member, f"{prefix}{j}."))
    elif name == "ArraysCache":
        out[f"{prefix}size"] = len(cache.cache)
    else:
        out[f"{prefix}offset"] = cache.offset
        out[f"{prefix}empty"] = int(cache.keys is None)
        if name == "QuantizedKVCache":
            out[f"{prefix}bits"], out[f"{prefix}group_size"] = cache.bits, cache.group_size
        elif name == "RotatingKVCache":
            out[f"{prefix}keep"], out[f"{prefix}max_size"], out[f"{prefix}idx"] = cache.keep, cache.max_size, cache._idx
    return out


def buffers(cache) -> list:
    """Every MLX array the cache holds, whole (what a write after sharing copies)."""
    name = kind(cache)
    if name == "CacheList":
        return [b for member in cache.caches for b in buffers(member)]
    if name == "ArraysCache":
        return [a for a in cache.cache if a is not None]
    if cache.keys is None:
        return []
    if name == "QuantizedKVCache":
        return [*cache.keys, *cache.values]
    return [cache.keys, cache.values]


def held_nbytes(cache) -> int:
    """Bytes of the buffers `cache` holds."""
    return sum(b.nbytes for b in buffers(cache))


def live_nbytes(cache) -> int:
    """Bytes of its live arrays: what an export stores."""
    return sum(p.nbytes for p in parts(cache, ""))


def share(cache):
    """A cache of the same kind and position whose arrays share `cache`'s buffers: new array
    objects (an MLX write rebinds the object it goes through, so two caches must never hold the
    same one), the same memory until one of them writes."""
    name = kind(cache)
    twin = type(cache).__new__(type(cache))
    twin.__dict__.update(cache.__dict__)
    if name == "CacheList":
        twin.caches = tuple(share(member) for member in cache.caches)
    elif name == "ArraysCache":
        twin.cache = [None if a is None else a[...] for a in cache.cache]
    elif cache.keys is not None:
        if name == "QuantizedKVCache":
            twin.keys, twin.values = tuple(a[...] for a in cache.keys), tuple(a[...] for a in cache.values)
        else:
            twin.keys, twin.values = cache.keys[...], cache.values[...]
    return twin


def step_of(module, name: str) -> int:
    """The growth step of a cache kind (256 in the mlx-lm releases tested)."""
    return getattr(getattr(module, name), "step", 256)


def room_for(cells: int, step: int) -> int:
    """A growing buffer's capacity for `cells` live cells: the next multiple of `step` strictly
    above them. A buffer filled exactly would make the very next append grow it, and mlx-lm grows
    a KVCache by concatenating: a copy of every cell (at 256 tokens, 1,024, 4,096...)."""
    return (cells // step + 1) * step


def capacity_for(module, plain: dict[str, int | str], prefix: str, stored: int) -> int:
    """Cells to allocate along the token axis for a part holding `stored` cells on import: a
    growing cache gets a step-rounded buffer its next appends fill in place (room_for); a ring
    that has wrapped gets exactly what it held."""
    name = plain[f"{prefix}class"]
    step = step_of(module, name)
    rounded = room_for(stored, step)
    if name == "RotatingKVCache":
        if int(plain[f"{prefix}offset"]) > stored:  # wrapped: every cell is in use
            return stored
        return max(stored, min(rounded, int(plain[f"{prefix}max_size"])))
    return rounded


def build(module, plain: dict[str, int | str], prefix: str, arrays: dict[str, Any]):
    """The cache described by `plain` under `prefix`, holding `arrays` (name → MLX buffer, at
    the capacity `capacity_for` chose), built through the running mlx-lm's `state`."""
    name = _field(plain, prefix, "class", str)
    if name not in KINDS:
        raise StateError(f"pool entry names cache kind {name!r}; this adapter builds {', '.join(KINDS)}")
    cls = getattr(module, name)
    if name == "CacheList":
        count = _field(plain, prefix, "members", int)
        return cls(*(build(module, plain, f"{prefix}{j}.", arrays) for j in range(count)))
    if name == "ArraysCache":
        cache = cls(_field(plain, prefix, "size", int))
        held = [arrays.get(f"{prefix}s{j}") for j in range(len(cache.cache))]
        cache.state = held if speaks_meta_state(cache) else (held, None, None)
        return cache
    offset = _field(plain, prefix, "offset", int)
    if name == "KVCache":
        cache = cls()
    elif name == "QuantizedKVCache":
        cache = cls(group_size=_field(plain, prefix, "group_size", int), bits=_field(plain, prefix, "bits", int))
    else:
        cache = cls(max_size=_field(plain, prefix, "max_size", int), keep=_field(plain, prefix, "keep", int))
    if _field(plain, prefix, "empty", int):
        return cache
    if name == "QuantizedKVCache":
        keys = tuple(_array(arrays, f"{prefix}k{j}") for j in range(3))
        vals = tuple(_array(arrays, f"{prefix}v{j}") for j in range(3))
    else:
        keys, vals = _array(arrays, f"{prefix}k"), _array(arrays, f"{prefix}v")
    if speaks_meta_state(cache):
        cache.state = (keys, vals)
        if name == "QuantizedKVCache":
            cache.meta_state = (str(offset), str(cache.group_size), str(cache.bits))
        elif name == "RotatingKVCache":
            idx = _field(plain, prefix, "idx", int)
            cache.meta_state = tuple(str(v) for v in (cache.keep, cache.max_size, offset, idx))
        cache.offset = offset  # 0.31's KVCache takes its offset from the buffer's length
    elif name == "KVCache":
        cache.state = (keys, vals, offset)
    elif name == "QuantizedKVCache":
        cache.state = (keys, vals, offset, cache.group_size, cache.bits)
    else:
        cache.state = (keys, vals, offset, cache.keep, cache.max_size, _field(plain, prefix, "idx", int))
    return cache


def _field(plain, prefix, key, kind_):
    try:
        value = plain[f"{prefix}{key}"]
    except KeyError:
        raise StateError(f"pool entry lacks the cache value {prefix}{key}; it was not written by this "
                         "adapter's export") from None
    if not isinstance(value, kind_):
        raise StateError(f"pool entry's cache value {prefix}{key} is {value!r}, not a {kind_.__name__}")
    return value


def _array(arrays, name):
    try:
        return arrays[name]
    except KeyError:
        raise StateError(f"pool entry lacks the array {name} its cache values call for") from None


def memory_of(layer_caches: list) -> Memory:
    """The memory kind of a model whose layers keep `layer_caches` (one sequence's, as mlx-lm's
    make_prompt_cache builds them): recurrent arrays make it recurrent (hybrid beside attention
    caches), rotating caches make it a sliding window of their max_size (gemma3_text keeps a
    RotatingKVCache on its window layers and a KVCache on the others)."""
    flat = []
    for cache in layer_caches:
        flat.extend(cache.caches if kind(cache) == "CacheList" else [cache])
    names = {kind(cache) for cache in flat}
    windows = [cache.max_size for cache in flat if kind(cache) == "RotatingKVCache"]
    attention = names & {"KVCache", "QuantizedKVCache", "RotatingKVCache"}
    if "ArraysCache" in names:
        if not attention:
            return Memory("recurrent")
        return Memory("hybrid-iswa", min(windows)) if windows else Memory("hybrid")
    return Memory("iswa", min(windows)) if windows else Memory("kv")
