"""MLX through mlx-lm in the application's process: a model directory, one KV cache per sequence,
and state moved to and from the pool with one copy each way.

    export   MLX buffer --(np.asarray aliases it, no copy)--> live cells --(one memcpy)--> pool
    import   pool --(one memcpy)--> a step-rounded MLX buffer, aliased through numpy, that the
             cache's next appends fill in place (mx.array(view) would make an exactly-sized
             buffer that the next append grows by concatenation: a second full copy)

A fork shares the parent's arrays: nothing is copied at the fork, and MLX copies a buffer when
it is first written while shared. The engine counts those copies (`stats()`): after a fork, the
first of the sharing sequences to step copies each shared layer; the last one left writes in place.

Slack is the room a cache holds past its live tokens (mlx-lm grows buffers 256 tokens at a time
and a cut only moves the offset):

    after a cut from 8,192 to 128:  | 128 live | ......... 8,064 slack ......... |
    after compaction:               | 128 live | 128 |   (one step; the rest given back)
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engines import identity as identities
from engines.adapter import Adapter
from engines.base import Descriptor, EngineStats, Packing, StepRequest
from engines.errors import EngineError, IdentityMismatch, ModelLoadError, NoRoom, RuntimeUnavailable, StateError
from engines.mlx import blas, gguf, settings
from kvpool import Device, EntryInfo, EntryView, KVArray, Pool, pricing

RUNTIME = "mlx"
INSTALL = 'pip install "mlx[cpu]==0.32.4" "mlx-lm==0.32.2" (on macOS: mlx without the [cpu] extra)'
_KV_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _import_mlx():
    blas.preload()  # must come before MLX loads: libmlx binds its BLAS then
    try:
        import mlx.core as mx
        from mlx_lm.models import cache as caches
        from mlx_lm.utils import load_model, load_tokenizer
    except (ImportError, OSError) as exc:
        raise RuntimeUnavailable(f"MLX runtime not usable here ({exc}); install it: {INSTALL}") from None
    return mx, caches, load_model, load_tokenizer


class MlxEngine(Adapter):
    """An mlx-lm model directory, or a llama GGUF file, loaded from local disk."""

    runtime = RUNTIME
    OPTIONS = settings.OPTIONS

    def __init__(self, model_path: str | Path, **options: Any) -> None:
        """Load the model directory `model_path` (never a hub name) with `options`."""
        self._claim_thread()
        self._values = settings.check(options)
        self._mx, self._caches_module, load_model, load_tokenizer = _import_mlx()
        path = Path(model_path)
        if path.is_file() and path.suffix.lower() == ".gguf":
            self._model, self._config, self._tokenizer = gguf.load(path, self._values["dequantize"])
        elif path.is_dir() and (path / "config.json").is_file():
            try:
                self._model, self._config = load_model(path)
                self._tokenizer = load_tokenizer(path)._tokenizer
            except Exception as exc:  # mlx-lm raises plain errors of many kinds for a bad directory
                raise ModelLoadError(f"mlx-lm could not load {path}: {exc}") from None
        else:
            raise ModelLoadError(f"no model at {path}: MLX loads an mlx-lm model directory (config.json and "
                                 "safetensors weights) or a llama GGUF file")
        self._previous_cache_limit = None
        if self._values["cache_limit_mb"]:
            self._previous_cache_limit = self._mx.set_cache_limit(self._values["cache_limit_mb"] << 20)
        self._sequences: dict[int, list] = {}
        self._sharing: dict[tuple[int, int], set[int]] = {}  # (seq, layer) -> sequences sharing its buffers
        self._copied = self._copies = self._reclaimed = 0
        self._next_seq = 0
        self._kv_dtype = self._model_dtype()
        self._descriptor = self._describe(path)

    # ----------------------------------------------------------------------------- description

    def _model_dtype(self):
        mx = self._mx
        for _, array in _leaves(self._model.parameters()):
            if array.dtype in (mx.float32, mx.float16, mx.bfloat16):
                return array.dtype
        return mx.float32

    def _kv_shape(self) -> tuple[int, int, int]:
        config = self._config
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return config["num_hidden_layers"], kv_heads, head_dim

    def _describe(self, path: Path) -> Descriptor:
        layers, kv_heads, head_dim = self._kv_shape()
        kv_type = _KV_TYPES[str(self._kv_dtype).split(".")[-1]]
        model_kv = pricing.uniform(layers, kv_heads, head_dim, kv_type)
        versions = f"mlx {importlib.metadata.version('mlx')}, mlx-lm {importlib.metadata.version('mlx-lm')}"
        settings_used = {"kv_dtype": kv_type, "config": json.dumps(self._config, sort_keys=True)}
        weights = identities.file_digest(path) if path.is_file() else identities.tree_digest(path)
        ident = identities.compose(RUNTIME, weights, versions, settings_used)
        eos = (self._tokenizer.eos_token_id,) if self._tokenizer.eos_token_id is not None else ()
        packing = Packing(mixes_prefill_and_decode=False, max_tokens=self._values["prefill_chunk"],
                          max_sequences=self._values["max_sequences"], copies_on_lane_change=True)
        context = self._config.get("max_position_embeddings") or 0
        return Descriptor(RUNTIME, importlib.metadata.version("mlx-lm"), ident, model_kv,
                          pricing.bytes_per_token(model_kv), context, self._config["vocab_size"], packing, Device(),
                          self._tokenizer.bos_token_id, eos, self._tokenizer.chat_template)

    def describe(self) -> Descriptor:
        """What this engine is (fixed once loaded)."""
        return self._descriptor

    # ----------------------------------------------------------------------------- text

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text` (no BOS added)."""
        self._check_thread()
        return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not special))

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of `tokens`, special tokens rendered."""
        self._check_thread()
        return self._tokenizer.decode(list(tokens), skip_special_tokens=False).encode()

    # ----------------------------------------------------------------------------- sequences

    def new_sequence(self) -> int:
        """A new, empty sequence (NoRoom once max_sequences are alive)."""
        self._check_thread()
        if len(self._sequences) >= self._values["max_sequences"]:
            raise NoRoom(f"all {self._values['max_sequences']} sequences are in use; free one or raise max_sequences")
        seq = self._next_seq
        self._next_seq += 1
        self._sequences[seq] = self._caches_module.make_prompt_cache(self._model)
        self._lengths[seq] = 0
        return seq

    def free_sequence(self, seq: int) -> None:
        """Drop `seq` and its KV."""
        self._length(seq)
        self._unshare(seq)
        del self._sequences[seq], self._lengths[seq]

    def fork(self, seq: int) -> int:
        """A new sequence whose caches share the parent's arrays (nothing copied now)."""
        length = self._length(seq)
        child = self.new_sequence()
        for layer, (mine, theirs) in enumerate(zip(self._sequences[child], self._sequences[seq])):
            mine.keys, mine.values, mine.offset = theirs.keys, theirs.values, theirs.offset
            group = self._sharing.setdefault((seq, layer), {seq})
            group.add(child)
            self._sharing[(child, layer)] = group
        self._lengths[child] = length
        return child

    def _unshare(self, seq: int, count_copies: bool = False) -> None:
        """`seq` stops sharing buffers (it is about to write, or goes away). Writing while others
        still hold a buffer makes MLX copy it whole: counted when `count_copies`."""
        for layer, cache in enumerate(self._sequences[seq]):
            group = self._sharing.pop((seq, layer), None)
            if group is None:
                continue
            group.discard(seq)
            if count_copies and group and cache.keys is not None:
                self._copied += cache.keys.nbytes + cache.values.nbytes
                self._copies += 2
            if len(group) == 1:  # the last holder writes in place from now on
                self._sharing.pop((next(iter(group)), layer), None)

    def truncate(self, seq: int, tokens: int) -> None:
        """Keep the first `tokens` positions of `seq`."""
        length = self._length(seq)
        if not 0 <= tokens <= length:
            raise EngineError(f"cannot keep {tokens} tokens of a sequence of {length}")
        for cache in self._sequences[seq]:
            cache.trim(length - tokens)
        self._lengths[seq] = tokens
        self.compact(seq)

    def slack_bytes(self, seq: int) -> int:
        """Bytes `seq`'s buffers hold past its live tokens."""
        self._length(seq)
        return sum(c.keys.nbytes + c.values.nbytes - _live_nbytes(c) for c in self._sequences[seq] if c.keys is not None)

    def compact(self, seq: int) -> int:
        """Give back the slack of `seq`'s unshared buffers beyond one step past its live tokens:
        each such layer is rewritten at its live size rounded up to a step (one counted copy of
        the live cells). Returns the bytes given back."""
        self._length(seq)
        mx, step = self._mx, self._caches_module.KVCache.step
        reclaimed = 0
        for layer, cache in enumerate(self._sequences[seq]):
            if cache.keys is None or (seq, layer) in self._sharing:
                continue
            capacity = max(step, -(-cache.offset // step) * step)
            if cache.keys.shape[2] <= capacity:
                continue
            before = cache.keys.nbytes + cache.values.nbytes
            live = _live_nbytes(cache)
            cache.keys, cache.values = (self._regrow(buffer, cache.offset, capacity) for buffer in (cache.keys, cache.values))
            mx.eval(cache.keys, cache.values)
            reclaimed += before - cache.keys.nbytes - cache.values.nbytes
            self._copied += live
            self._copies += 2
        self._reclaimed += reclaimed
        return reclaimed

    def _regrow(self, buffer, live: int, capacity: int):
        """A fresh buffer of `capacity` cells holding `buffer`'s first `live` cells (one copy)."""
        mx = self._mx
        fresh = mx.zeros((*buffer.shape[:2], capacity, buffer.shape[3]), buffer.dtype)
        return mx.concatenate([buffer[:, :, :live, :], fresh[:, :, live:, :]], axis=2) if live else fresh

    def stats(self) -> EngineStats:
        """KV bytes this engine copied itself (fork copy-on-write, compaction) and gave back."""
        return EngineStats(self._copied, self._copies, self._reclaimed)

    # ----------------------------------------------------------------------------- forward

    def step(self, requests: Sequence[StepRequest]) -> list[np.ndarray | None]:
        """Each request in turn through the model (prefill in chunks of prefill_chunk tokens);
        per request, its logits rows (float32, copied) or None."""
        self._check_thread()
        self._check_requests(requests)
        mx, chunk = self._mx, self._values["prefill_chunk"]
        results = []
        for request in requests:
            self._length(request.seq)
            tokens = [int(t) for t in request.tokens]
            if tokens:
                self._unshare(request.seq, count_copies=True)
            rows = []
            for start in range(0, len(tokens), chunk):
                part = tokens[start:start + chunk]
                logits = self._model(mx.array([part]), cache=self._sequences[request.seq])[0]
                if request.logits == "all":
                    rows.append(logits)
                elif request.logits == "last" and start + chunk >= len(tokens):
                    rows.append(logits[-1:])
                mx.eval(rows, [c.keys for c in self._sequences[request.seq]])
                self._lengths[request.seq] += len(part)
            results.append(np.concatenate([np.array(r.astype(mx.float32)) for r in rows]) if rows else None)
        return results

    # ----------------------------------------------------------------------------- pool

    def export(self, seq: int, pool: Pool, tokens: Sequence[int], *, tag: str = "",
               recompute_cost: float | None = None) -> EntryInfo | None:
        """Write `seq`'s live cells into a new pool entry: numpy aliases MLX's buffers, and the
        pool copies each layer's live K and V once. None when the pool has no room."""
        length = self._length(seq)
        if len(tokens) != length:
            raise EngineError(f"sequence {seq} holds {length} positions but {len(tokens)} tokens were given")
        caches = self._sequences[seq]
        self._mx.eval([c.keys for c in caches if c.keys is not None], [c.values for c in caches if c.values is not None])
        arrays = []
        for index, cache in enumerate(caches):
            for part, buffer in (("k", cache.keys), ("v", cache.values)):
                arrays.append(KVArray(f"{index}.{part}", self._alias(buffer)[:, :, :length, :], token_axis=2))
        return pool.put(self._descriptor.identity, tokens, arrays, tag=tag, recompute_cost=recompute_cost)

    def import_(self, seq: int, view: EntryView) -> int:
        """Replace `seq`'s caches with a pool entry's: each layer's K and V copied once, from pool
        memory into a fresh step-rounded MLX buffer, checksum verified on the way. On any
        refusal `seq` is left empty. Returns the positions restored."""
        self._length(seq)
        if view.info.identity != self._descriptor.identity:
            raise IdentityMismatch(f"pool entry {view.info.id} was written by {view.info.identity}; this engine is "
                                   f"{self._descriptor.identity} (other weights, dtype or settings)")
        mx = self._mx
        self._unshare(seq)
        self._sequences[seq] = self._caches_module.make_prompt_cache(self._model)
        self._lengths[seq] = 0
        n = view.info.tokens
        layers, kv_heads, head_dim = self._kv_shape()
        names = [f"{i}.{p}" for i in range(layers) for p in "kv"]
        specs = {spec.name: spec for spec in getattr(view.layout, "arrays", ())}
        if set(specs) != set(names) or any(s.shape[:2] != (1, kv_heads) or s.shape[3] != head_dim for s in specs.values()):
            raise StateError(f"pool entry {view.info.id} does not hold this model's {layers} layers of K and V")
        step = self._caches_module.KVCache.step
        capacity = max(step, -(-n // step) * step)
        buffers = {name: mx.zeros((1, kv_heads, capacity, head_dim), self._kv_dtype) for name in names}
        mx.eval(list(buffers.values()))
        destinations = {name: self._alias(buffer)[:, :, :n, :] for name, buffer in buffers.items()}
        view.read_into(destinations)
        del destinations  # no numpy alias may outlive the copy: MLX writes in place only when alone
        for index, cache in enumerate(self._sequences[seq]):
            cache.keys, cache.values, cache.offset = buffers[f"{index}.k"], buffers[f"{index}.v"], n
        self._lengths[seq] = n
        return n

    def _alias(self, array) -> np.ndarray:
        """A numpy view of an evaluated MLX array's buffer (bf16 through its 16-bit pattern)."""
        if array.dtype == self._mx.bfloat16:
            array = array.view(self._mx.uint16)
        return np.asarray(array)

    # ----------------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Drop every sequence and restore MLX's cache limit if this engine changed it."""
        self._sequences.clear()
        self._lengths.clear()
        if self._previous_cache_limit is not None:
            self._mx.set_cache_limit(self._previous_cache_limit)
            self._previous_cache_limit = None


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}{index}.")
    else:
        yield prefix, tree


def _live_nbytes(cache) -> int:
    """Bytes of a KV cache's live cells (its offset of every buffer's token axis)."""
    keys, values = cache.keys, cache.values
    return (keys.nbytes + values.nbytes) * cache.offset // keys.shape[2]
