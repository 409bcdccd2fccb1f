"""Every kind of mlx-lm cache seen one way: one codec per cache class, found through one table
(`CODECS`), that says what is live in it, how to share it and how to build it back, under either
generation of mlx-lm's cache state.

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

from collections.abc import Callable
from typing import Any, NamedTuple

from engines.base import Memory
from engines.errors import StateError

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


def speaks_meta_state(cache) -> bool:
    """True for the earlier generation (mlx-lm 0.31): settings live in `meta_state`."""
    return hasattr(cache, "meta_state")


class Codec:
    """How one mlx-lm cache class is read, shared, rebuilt and compacted. Subclasses cover one
    class each; `CODECS` maps class names to them."""

    name = ""
    grows = False  # its buffers grow by steps along axis 2, so compaction may rewrite them
    attention = True  # it holds attention positions (False: a fixed recurrent state)

    def parts(self, cache, prefix: str) -> list[Part]:
        """The live arrays (views, nothing copied), named under `prefix`."""
        raise NotImplementedError

    def values(self, cache, prefix: str) -> dict[str, int | str]:
        """Plain values beside the class name that rebuild the cache (offset, settings)."""
        return {f"{prefix}offset": cache.offset, f"{prefix}empty": int(cache.keys is None)}

    def buffers(self, cache) -> list:
        """Every MLX array the cache holds, whole."""
        return [] if cache.keys is None else [cache.keys, cache.values]

    def share(self, twin, cache) -> None:
        """Give `twin` (a shallow copy of `cache`) new array objects over the same memory."""
        if cache.keys is not None:
            twin.keys, twin.values = cache.keys[...], cache.values[...]

    def window(self, cache) -> int:
        """Positions it keeps (0: all of them)."""
        return 0

    def capacity(self, module, plain: dict, prefix: str, stored: int) -> int:
        """Cells to allocate on import for a part holding `stored` cells (see capacity_for)."""
        return room_for(stored, step_of(module, self.name))

    def build(self, module, plain: dict, prefix: str, arrays: dict[str, Any]):
        """The cache described by `plain` under `prefix`, holding `arrays` (name → MLX buffer)."""
        raise NotImplementedError

    def regrow(self, cache, rebuffer: Callable[[Any], Any]) -> None:
        """Replace each buffer of a growing cache with `rebuffer(buffer)` (compaction)."""
        raise StateError(f"mlx-lm cache {self.name} does not grow by steps; nothing to compact")


class KV(Codec):
    """The plain attention cache: keys and values grown by steps."""

    name, grows = "KVCache", True

    def parts(self, cache, prefix):
        if cache.keys is None:
            return []
        return [Part(f"{prefix}k", cache.keys, cache.offset, 2), Part(f"{prefix}v", cache.values, cache.offset, 2)]

    def build(self, module, plain, prefix, arrays):
        cache, offset = module.KVCache(), _field(plain, prefix, "offset", int)
        if _field(plain, prefix, "empty", int):
            return cache
        _load(cache, _array(arrays, f"{prefix}k"), _array(arrays, f"{prefix}v"), offset)
        return cache

    def regrow(self, cache, rebuffer):
        cache.keys, cache.values = rebuffer(cache.keys), rebuffer(cache.values)


class Quantized(Codec):
    """Quantized keys and values: a (data, scales, biases) triple each, grown by steps."""

    name, grows = "QuantizedKVCache", True

    def parts(self, cache, prefix):
        if cache.keys is None:
            return []
        return [Part(f"{prefix}{side}{j}", array, cache.offset, 2)
                for side, group in (("k", cache.keys), ("v", cache.values)) for j, array in enumerate(group)]

    def values(self, cache, prefix):
        return {**super().values(cache, prefix), f"{prefix}bits": cache.bits, f"{prefix}group_size": cache.group_size}

    def buffers(self, cache):
        return [] if cache.keys is None else [*cache.keys, *cache.values]

    def share(self, twin, cache):
        if cache.keys is not None:
            twin.keys, twin.values = tuple(a[...] for a in cache.keys), tuple(a[...] for a in cache.values)

    def build(self, module, plain, prefix, arrays):
        cache = module.QuantizedKVCache(group_size=_field(plain, prefix, "group_size", int),
                                        bits=_field(plain, prefix, "bits", int))
        offset = _field(plain, prefix, "offset", int)
        if _field(plain, prefix, "empty", int):
            return cache
        keys = tuple(_array(arrays, f"{prefix}k{j}") for j in range(3))
        vals = tuple(_array(arrays, f"{prefix}v{j}") for j in range(3))
        _load(cache, keys, vals, offset, meta=(offset, cache.group_size, cache.bits),
              settings=(cache.group_size, cache.bits))
        return cache

    def regrow(self, cache, rebuffer):
        cache.keys, cache.values = (tuple(rebuffer(b) for b in group) for group in (cache.keys, cache.values))


class Rotating(Codec):
    """A sliding window: a ring buffer of at most `max_size` cells (plus `keep` pinned ones)."""

    name = "RotatingKVCache"

    def parts(self, cache, prefix):
        if cache.keys is None:
            return []
        # Before the ring first wraps its first `offset` cells are the live ones; after, all of it.
        n = min(cache.offset, cache.keys.shape[2])
        return [Part(f"{prefix}k", cache.keys, n, NO_TOKEN_AXIS), Part(f"{prefix}v", cache.values, n, NO_TOKEN_AXIS)]

    def values(self, cache, prefix):
        return {**super().values(cache, prefix), f"{prefix}keep": cache.keep, f"{prefix}max_size": cache.max_size,
                f"{prefix}idx": cache._idx}

    def window(self, cache):
        return cache.max_size

    def capacity(self, module, plain, prefix, stored):
        if int(plain[f"{prefix}offset"]) > stored:  # wrapped: every cell is in use
            return stored
        return max(stored, min(super().capacity(module, plain, prefix, stored), int(plain[f"{prefix}max_size"])))

    def build(self, module, plain, prefix, arrays):
        cache = module.RotatingKVCache(max_size=_field(plain, prefix, "max_size", int),
                                       keep=_field(plain, prefix, "keep", int))
        offset = _field(plain, prefix, "offset", int)
        if _field(plain, prefix, "empty", int):
            return cache
        idx = _field(plain, prefix, "idx", int)
        _load(cache, _array(arrays, f"{prefix}k"), _array(arrays, f"{prefix}v"), offset,
              meta=(cache.keep, cache.max_size, offset, idx), settings=(cache.keep, cache.max_size, idx))
        return cache


class Arrays(Codec):
    """A recurrent state (Mamba's convolution and SSM arrays): fixed size at any length."""

    name, attention = "ArraysCache", False

    def parts(self, cache, prefix):
        return [Part(f"{prefix}s{j}", a, None, NO_TOKEN_AXIS) for j, a in enumerate(cache.cache) if a is not None]

    def values(self, cache, prefix):
        return {f"{prefix}size": len(cache.cache)}

    def buffers(self, cache):
        return [a for a in cache.cache if a is not None]

    def share(self, twin, cache):
        twin.cache = [None if a is None else a[...] for a in cache.cache]

    def build(self, module, plain, prefix, arrays):
        cache = module.ArraysCache(_field(plain, prefix, "size", int))
        held = [arrays.get(f"{prefix}s{j}") for j in range(len(cache.cache))]
        cache.state = held if speaks_meta_state(cache) else (held, None, None)
        return cache


class List(Codec):
    """Several caches for one layer (a hybrid layer's attention and recurrent parts)."""

    name = "CacheList"

    def parts(self, cache, prefix):
        return [p for j, member in enumerate(cache.caches) for p in parts(member, f"{prefix}{j}.")]

    def values(self, cache, prefix):
        out: dict[str, int | str] = {f"{prefix}members": len(cache.caches)}
        for j, member in enumerate(cache.caches):
            out.update(values(member, f"{prefix}{j}."))
        return out

    def buffers(self, cache):
        return [b for member in cache.caches for b in buffers(member)]

    def share(self, twin, cache):
        twin.caches = tuple(share(member) for member in cache.caches)

    def window(self, cache):
        windows = [window(member) for member in cache.caches]
        return max(windows) if all(windows) else 0

    def build(self, module, plain, prefix, arrays):
        count = _field(plain, prefix, "members", int)
        return module.CacheList(*(build(module, plain, f"{prefix}{j}.", arrays) for j in range(count)))


CODECS: dict[str, Codec] = {codec.name: codec for codec in (KV(), Quantized(), Rotating(), Arrays(), List())}
KINDS = tuple(CODECS)


def lookup(cache) -> Codec | None:
    """The codec of `cache`'s class, None for a class this adapter does not know (the one place a
    cache's class is looked at: by name, as mlx-lm's classes are not imported here)."""
    return CODECS.get(type(cache).__name__)


def codec_of(cache) -> Codec:
    """The codec of `cache`'s class, refusing classes this adapter cannot park."""
    codec = lookup(cache)
    if codec is None:
        raise StateError(f"mlx-lm cache {type(cache).__name__} cannot be parked; the adapter handles "
                         f"{', '.join(KINDS)}")
    return codec


def members(cache) -> list:
    """The caches `cache` is made of, CacheLists opened all the way down."""
    if isinstance(codec_of(cache), List):
        return [leaf for member in cache.caches for leaf in members(member)]
    return [cache]


def parts(cache, prefix: str) -> list[Part]:
    """The live arrays of `cache` (views, nothing copied), named under `prefix`."""
    return codec_of(cache).parts(cache, prefix)


def values(cache, prefix: str) -> dict[str, int | str]:
    """The plain values that rebuild `cache` beside its arrays (class, offset, settings)."""
    codec = codec_of(cache)
    return {f"{prefix}class": codec.name, **codec.values(cache, prefix)}


def buffers(cache) -> list:
    """Every MLX array the cache holds, whole (what a write after sharing copies)."""
    return codec_of(cache).buffers(cache)


def held_nbytes(cache) -> int:
    """Bytes of the buffers `cache` holds."""
    return sum(b.nbytes for b in buffers(cache))


def live_nbytes(cache) -> int:
    """Bytes of its live arrays: what an export stores."""
    return sum(p.nbytes for p in parts(cache, ""))


def window(cache) -> int:
    """Positions `cache` keeps: a rotating cache's window, 0 for one that keeps every position."""
    return codec_of(cache).window(cache)


def share(cache):
    """A cache of the same kind and position whose arrays share `cache`'s buffers: new array
    objects (an MLX write rebinds the object it goes through, so two caches must never hold the
    same one), the same memory until one of them writes."""
    codec = codec_of(cache)
    twin = type(cache).__new__(type(cache))
    twin.__dict__.update(cache.__dict__)
    codec.share(twin, cache)
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
    return _codec_named(_field(plain, prefix, "class", str)).capacity(module, plain, prefix, stored)


def build(module, plain: dict[str, int | str], prefix: str, arrays: dict[str, Any]):
    """The cache described by `plain` under `prefix`, holding `arrays` (name → MLX buffer, at
    the capacity `capacity_for` chose), built through the running mlx-lm's `state`."""
    return _codec_named(_field(plain, prefix, "class", str)).build(module, plain, prefix, arrays)


def memory_of(layer_caches: list) -> Memory:
    """The memory kind of a model whose layers keep `layer_caches` (one sequence's, as mlx-lm's
    make_prompt_cache builds them): recurrent arrays make it recurrent (hybrid beside attention
    caches), rotating caches make it a sliding window of their max_size (gemma3_text keeps a
    RotatingKVCache on its window layers and a KVCache on the others)."""
    flat = [member for cache in layer_caches for member in members(cache)]
    recurrent = any(not codec_of(cache).attention for cache in flat)
    attention = any(codec_of(cache).attention for cache in flat)
    windows = [window(cache) for cache in flat if window(cache)]
    if recurrent:
        if not attention:
            return Memory("recurrent")
        return Memory("hybrid-iswa", min(windows), cuts_wrapped_window=False) if windows else Memory("hybrid")
    # a RotatingKVCache is trimmable only while its offset is below its size: once wrapped, never
    return Memory("iswa", min(windows), cuts_wrapped_window=False) if windows else Memory("kv")


def _codec_named(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise StateError(f"pool entry names cache kind {name!r}; this adapter builds {', '.join(KINDS)}") from None


def _load(cache, keys, values, offset: int, *, meta: tuple | None = None, settings: tuple = ()) -> None:
    """Give an attention cache its arrays, offset and `settings` through the running mlx-lm's
    `state`: 0.32 takes them all in `state`; 0.31 takes the arrays there and the settings as
    strings in `meta_state` (`meta`, in its order), and a KVCache there has no meta_state."""
    if speaks_meta_state(cache):
        cache.state = (keys, values)
        if meta is not None:
            cache.meta_state = tuple(str(value) for value in meta)
        cache.offset = offset  # 0.31's KVCache takes its offset from the buffer's length
    else:
        cache.state = (keys, values, offset, *settings)


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


# How each stored dtype of the pool is built back as an MLX array (bf16 is stored as its 16-bit pattern).
MLX_DTYPES = {"<f4": lambda mx: mx.float32, "<f2": lambda mx: mx.float16, "<u2": lambda mx: mx.bfloat16,
              "<u4": lambda mx: mx.uint32}


def fixed_shape(shape, grows: bool) -> tuple[int, ...]:
    """A stored array's shape with its cell axis (2) blanked out where the cache grows there."""
    return (*shape[:2], -1, *shape[3:]) if grows else tuple(shape)


def stored_dtype(array) -> str:
    """The pool dtype an MLX array is stored as (bf16 as its 16-bit pattern)."""
    return {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "uint32": "<u4"}[str(array.dtype).split(".")[-1]]
