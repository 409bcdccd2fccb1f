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
from engines.base import Descriptor, EngineStats, Packing, Snapshot, StepRequest
from engines.errors import (EngineError, ModelLoadError, NoRoom, OptionError, RuntimeUnavailable,
                            StateError)
from engines.mlx import batch as batching
from engines.mlx import blas, buffer_cache, caches, gguf, price, settings, vocab
from engines.mlx.tokenizer import HfTokenizer
from kvpool import Device, EntryView, KVArray

RUNTIME = "mlx"
ROTATING_KEEP = 4  # first tokens a rotating cache never drops (mlx-lm's own choice for max_kv_size)
INSTALL = 'pip install "mlx[cpu]==0.32.4" "mlx-lm==0.32.2" (on macOS: mlx without the [cpu] extra)'


def _import_mlx():
    blas.preload()  # must come before MLX loads: libmlx binds its BLAS then
    try:
        import mlx.core as mx
        from mlx_lm.models import cache as cache_module
        from mlx_lm.utils import load_model, load_tokenizer
    except (ImportError, OSError) as exc:
        raise RuntimeUnavailable(f"MLX runtime not usable here ({exc}); install it: {INSTALL}") from None
    return mx, cache_module, load_model, load_tokenizer


class MlxEngine(Adapter):
    """An mlx-lm model directory, or a llama GGUF file, loaded from local disk."""

    runtime = RUNTIME
    OPTIONS = settings.OPTIONS

    def __init__(self, model_path: str | Path, **options: Any) -> None:
        """Load the model directory or GGUF file at `model_path` (never a hub name) with `options`."""
        self._claim_thread()
        self._values = settings.check(options)
        self._mx, self._module, load_model, load_tokenizer = _import_mlx()
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
        self._text = HfTokenizer(self._tokenizer)
        self._previous_cache_limit = None
        self._sequences: dict[int, list] = {}
        self._sharing: dict[tuple[int, int], set[int]] = {}  # (seq, layer) -> sequences sharing its buffers
        self._batch: batching.DecodeBatch | None = None
        self._copied = self._copies = self._reclaimed = 0
        self._next_seq = 0
        self._model_kv, self._signature = self._probe()
        self._descriptor = self._describe(path)
        if self._values["cache_limit_mb"]:
            self._previous_cache_limit = self._mx.set_cache_limit(self._values["cache_limit_mb"] << 20)

    # ----------------------------------------------------------------------------- description

    def _new_caches(self) -> list:
        """A fresh cache per layer: the model's own, each plain KVCache made rotating or quantized
        where the options ask (mlx-lm's make_prompt_cache ignores max_kv_size for models that
        make their own caches, llama among them)."""
        return [self._convert(layer) for layer in self._module.make_prompt_cache(self._model)]

    def _convert(self, layer):
        codec = caches.lookup(layer)  # a class the adapter does not know is refused later, by name
        if isinstance(codec, caches.KV) and self._values["max_kv_size"]:
            return self._module.RotatingKVCache(max_size=self._values["max_kv_size"], keep=ROTATING_KEEP)
        if isinstance(codec, caches.KV) and self._values["kv_bits"]:
            return self._module.QuantizedKVCache(group_size=self._values["kv_group_size"], bits=self._values["kv_bits"])
        if isinstance(codec, caches.List):
            return self._module.CacheList(*(self._convert(member) for member in layer.caches))
        return layer

    def _probe(self):
        """Price a cell from a probe sequence's live bytes after one and two tokens, and record
        the shape of every array an export writes (an import is checked against it)."""
        layers = self._new_caches()
        lengths = []
        try:
            for token in (0, 1):
                self._model(self._mx.array([[token]]), cache=layers)
                self._mx.eval([caches.buffers(c) for c in layers])
                lengths.append(price.live_bytes(layers))
        except ValueError as exc:  # MLX's quantize refuses a group size that does not divide the head
            raise OptionError(f"mlx: the KV cache cannot be quantized with kv_group_size="
                              f"{self._values['kv_group_size']} ({exc}); pick a group size dividing the head "
                              "dimension, or kv_bits=0") from None
        signature = {p.name: (caches.stored_dtype(p.buffer), caches.fixed_shape(p.buffer.shape, p.live is not None),
                              p.token_axis)
                     for index, layer in enumerate(layers) for p in caches.parts(layer, f"{index}.")}
        signature.update({k: v for index, layer in enumerate(layers)
                          for k, v in caches.values(layer, f"{index}.").items() if k.endswith(".class")})
        return price.measure(layers, *lengths), signature

    def _describe(self, path: Path) -> Descriptor:
        versions = f"mlx {importlib.metadata.version('mlx')}, mlx-lm {importlib.metadata.version('mlx-lm')}"
        settings_used = {name: self._values[name] for name in settings.IDENTITY_OPTIONS}
        settings_used.update(dtype=str(settings.model_dtype(self._mx, self._model)),
                             config=json.dumps(self._config, sort_keys=True))
        weights = identities.file_digest(path) if path.is_file() else identities.tree_digest(path)
        ident = identities.compose(RUNTIME, weights, versions, settings_used)
        bos, eos = vocab.specials(self._tokenizer)  # a GGUF's: llama.cpp's add_bos rule and end-of-generation set
        packing = Packing(mixes_prefill_and_decode=False, max_tokens=self._values["prefill_chunk"],
                          max_sequences=self._values["max_sequences"], copies_on_lane_change=True)
        context = self._config.get("max_position_embeddings") or 0
        cell_price = price.cell_price(self._model_kv)
        cells, cells_reason = settings.kv_cells(self._values, cell_price, context)
        return Descriptor(RUNTIME, importlib.metadata.version("mlx-lm"), ident, self._model_kv,
                          cell_price, context, self._config["vocab_size"], packing, Device(),
                          bos, eos, self._tokenizer.chat_template,
                          kv_cells=cells, kv_cells_reason=cells_reason,
                          memory=caches.memory_of(self._new_caches()))

    def describe(self) -> Descriptor:
        """What this engine is (fixed once loaded)."""
        return self._descriptor

    # ----------------------------------------------------------------------------- text

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text` (no BOS added)."""
        self._check_thread()
        return self._text.tokenize(text, special=special)

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of `tokens`, special tokens rendered."""
        self._check_thread()
        return self._text.detokenize(tokens)

    def tokenizer(self) -> HfTokenizer:
        """The model's tokenizer, safe from any thread (it never touches MLX)."""
        return self._text

    # ----------------------------------------------------------------------------- sequences

    def new_sequence(self) -> int:
        """A new, empty sequence (NoRoom once max_sequences are alive)."""
        self._check_thread()
        if len(self._sequences) >= self._values["max_sequences"]:
            raise NoRoom(f"all {self._values['max_sequences']} sequences are in use; free one or raise max_sequences")
        seq = self._next_seq
        self._next_seq += 1
        self._sequences[seq] = self._new_caches()
        self._lengths[seq] = 0
        return seq

    def _own(self, seq: int) -> list:
        """`seq`'s caches, taken back out of a decode batch first if it is in one."""
        self._length(seq)
        if self._batch is not None and seq in self._batch.members:
            self._dissolve()
        return self._sequences[seq]

    def free_sequence(self, seq: int) -> None:
        """Drop `seq` and its KV."""
        self._own(seq)
        self._unshare(seq)
        del self._sequences[seq], self._lengths[seq]

    def fork(self, seq: int) -> int:
        """A new sequence whose caches share the parent's buffers (nothing copied now)."""
        parent = self._own(seq)
        child = self.new_sequence()
        self._sequences[child] = [caches.share(layer) for layer in parent]
        for layer in range(len(parent)):
            group = self._sharing.setdefault((seq, layer), {seq})
            group.add(child)
            self._sharing[(child, layer)] = group
        self._lengths[child] = self._lengths[seq]
        return child

    def _unshare(self, seq: int, count_copies: bool = False) -> None:
        """`seq` stops sharing buffers (it is about to write, or goes away). Writing while others
        still hold a buffer makes MLX copy it whole: counted when `count_copies`."""
        for layer, cache in enumerate(self._sequences[seq]):
            group = self._sharing.pop((seq, layer), None)
            if group is None:
                continue
            group.discard(seq)
            if count_copies and group:
                self._copied += caches.held_nbytes(cache)
                self._copies += len(caches.buffers(cache))
            if len(group) == 1:  # the last holder writes in place from now on
                self._sharing.pop((next(iter(group)), layer), None)

    def truncate(self, seq: int, tokens: int) -> None:
        """Keep the first `tokens` positions of `seq`."""
        length = self._length(seq)
        if not 0 <= tokens <= length:
            raise EngineError(f"cannot keep {tokens} tokens of a sequence of {length}")
        layers = self._own(seq)
        if tokens < length and not all(layer.is_trimmable() for layer in layers):
            raise EngineError(f"sequence {seq} cannot be cut back: its recurrent state or a rotating cache that "
                              "has wrapped keeps no earlier positions; start a new sequence and prefill the prefix")
        for layer in layers:
            layer.trim(length - tokens)
        self._lengths[seq] = tokens
        self.compact(seq)

    def slack_bytes(self, seq: int) -> int:
        """Bytes `seq`'s buffers hold past its live cells."""
        return sum(caches.held_nbytes(c) - caches.live_nbytes(c) for c in self._own(seq))

    def compact(self, seq: int) -> int:
        """Give back the slack of `seq`'s unshared growing buffers beyond one step past its live
        cells: each is rewritten at its live size rounded up past the next step boundary
        (caches.room_for; one counted copy of the live cells). Returns the bytes given back."""
        reclaimed = 0
        for layer, cache in enumerate(self._own(seq)):
            if (seq, layer) not in self._sharing:
                reclaimed += self._compact_cache(cache)
        self._reclaimed += reclaimed
        return reclaimed

    def _compact_cache(self, cache) -> int:
        codec = caches.codec_of(cache)
        if isinstance(codec, caches.List):
            return sum(self._compact_cache(member) for member in cache.caches)
        if not codec.grows or cache.keys is None:
            return 0
        capacity = caches.room_for(cache.offset, caches.step_of(self._module, codec.name))
        held = caches.buffers(cache)
        if held[0].shape[2] <= capacity:
            return 0
        before, live = caches.held_nbytes(cache), caches.live_nbytes(cache)
        codec.regrow(cache, lambda buffer: self._regrow(buffer, cache.offset, capacity))
        self._mx.eval(caches.buffers(cache))
        self._copied += live
        self._copies += len(held)
        return before - caches.held_nbytes(cache)

    def _regrow(self, buffer, live: int, capacity: int):
        """A fresh buffer of `capacity` cells holding `buffer`'s first `live` cells (one copy)."""
        fresh = self._mx.zeros((*buffer.shape[:2], capacity, *buffer.shape[3:]), buffer.dtype)
        if live:
            fresh[:, :, :live] = buffer[:, :, :live]
        return fresh

    def stats(self) -> EngineStats:
        """KV bytes this engine copied itself (fork copy-on-write, batch joins and leaves,
        compaction) and what compaction gave back."""
        return EngineStats(self._copied, self._copies, self._reclaimed)

    # ----------------------------------------------------------------------------- forward

    def interrupt(self) -> bool:
        """False: MLX evaluates a step's graph to its end (a step is never stopped part-way)."""
        return False

    def clear_interrupt(self) -> None:
        """Nothing to take back: interrupt() asks nothing of MLX."""

    def step(self, requests: Sequence[StepRequest]) -> list[np.ndarray | None]:
        """One token each for several sequences decodes in one batched forward; anything else runs
        request by request (prefill in chunks of prefill_chunk tokens). Per request, its logits
        rows (float32, copied) or None."""
        self._check_thread()
        self._check_requests(requests)
        context = self._descriptor.context_length
        for request in requests:
            length = self._length(request.seq)
            if context and length + len(request.tokens) > context:
                raise NoRoom(f"sequence {request.seq} would reach {length + len(request.tokens)} positions; the "
                             f"model takes {context} (max_position_embeddings): trim it or start a new one")
        seqs = tuple(r.seq for r in requests)
        if (len(requests) > 1 and len(set(seqs)) == len(seqs) and all(len(r.tokens) == 1 for r in requests)
                and batching.batchable([self._sequences[s] for s in seqs if not self._batched(s)])):
            return self._decode_together(requests)
        results = [self._forward(request) for request in requests]
        if any(len(request.tokens) > 1 for request in requests):
            # after _forward's temporaries are freed, so they go too
            buffer_cache.trim_after_prefill(self._mx, self._values["cache_limit_mb"] << 20)
        return results

    def _batched(self, seq: int) -> bool:
        return self._batch is not None and seq in self._batch.members

    def _forward(self, request: StepRequest) -> np.ndarray | None:
        mx, chunk = self._mx, self._values["prefill_chunk"]
        tokens = [int(t) for t in request.tokens]
        layers = self._own(request.seq)
        if tokens:
            self._unshare(request.seq, count_copies=True)
        rows = []
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            logits = self._model(mx.array([part]), cache=layers)[0]
            if request.logits == "all":
                rows.append(logits)
            elif request.logits == "last" and start + chunk >= len(tokens):
                rows.append(logits[-1:])
            mx.eval(rows, [caches.buffers(c) for c in layers])
            self._lengths[request.seq] += len(part)
        return np.concatenate([np.array(r.astype(mx.float32)) for r in rows]) if rows else None

    def _decode_together(self, requests: Sequence[StepRequest]) -> list[np.ndarray | None]:
        """One forward for one token of each sequence, through a batch kept while its members
        stay the same (joining and leaving copy KV; counted)."""
        mx = self._mx
        members = tuple(r.seq for r in requests)
        if self._batch is None or set(self._batch.members) != set(members):
            if self._batch is not None:
                self._dissolve()
            for seq in members:
                self._unshare(seq)  # the lane's buffers are copied into the batch, never written
            copies = batching.Copies()
            self._batch = batching.join(self._module, members, [self._sequences[s] for s in members], copies)
            for seq in members:
                self._sequences[seq] = []  # the batch holds the lane now
            self._count(copies)
        lanes = {seq: lane for lane, seq in enumerate(self._batch.members)}
        tokens = mx.array([[int(request.tokens[0])] for request in sorted(requests, key=lambda r: lanes[r.seq])])
        logits = self._model(tokens, cache=self._batch.layers)[:, -1, :]
        mx.eval(logits, [[layer.keys, layer.values] for layer in self._batch.layers])
        rows = np.array(logits.astype(mx.float32))
        for seq in members:
            self._lengths[seq] += 1
        return [None if r.logits == "none" else rows[lanes[r.seq]:lanes[r.seq] + 1].copy() for r in requests]

    def _dissolve(self) -> None:
        """Every lane of the decode batch back in its own caches (one counted copy each)."""
        copies = batching.Copies()
        self._sequences.update(batching.leave(self._mx, self._module, self._batch, copies))
        self._batch = None
        self._count(copies)

    def _count(self, copies: batching.Copies) -> None:
        self._copied += copies.bytes
        self._copies += copies.arrays

    # ----------------------------------------------------------------------------- pool

    def snapshot(self, seq: int, tokens: Sequence[int]) -> Snapshot:
        """`seq`'s live arrays as numpy aliases of MLX's own buffers (nothing copied here; the pool
        copies each once) with the plain values that rebuild its caches."""
        length = self._length(seq)
        if len(tokens) != length:
            raise EngineError(f"sequence {seq} holds {length} positions but {len(tokens)} tokens were given")
        if self._batched(seq):
            arrays, plain = self._lane_in_batch(seq)
            return Snapshot(arrays=tuple(arrays), engine_values=plain)
        layers = self._own(seq)
        self._mx.eval([caches.buffers(c) for c in layers])
        arrays, plain = [], {}
        for index, layer in enumerate(layers):
            for part in caches.parts(layer, f"{index}."):
                alias = self._alias(part.buffer)
                arrays.append(KVArray(part.name, alias if part.live is None else alias[:, :, :part.live], part.token_axis))
            plain.update(caches.values(layer, f"{index}."))
        return Snapshot(arrays=tuple(arrays), engine_values=plain)

    def _lane_in_batch(self, seq: int):
        """The arrays and plain values of a decoding lane, read in place from the batch buffers
        (exporting it does not take it out of the batch: no lane copies)."""
        lane = self._batch.members.index(seq)
        arrays, plain = [], {}
        for index, layer in enumerate(self._batch.layers):
            self._mx.eval(layer.keys, layer.values)
            start, stop = int(layer.left_padding.tolist()[lane]), layer._idx
            for part, buffer in (("k", layer.keys), ("v", layer.values)):
                arrays.append(KVArray(f"{index}.{part}", self._alias(buffer)[lane:lane + 1, :, start:stop], 2))
            plain.update({f"{index}.class": "KVCache", f"{index}.offset": stop - start, f"{index}.empty": 0})
        return arrays, plain

    def import_(self, seq: int, view: EntryView) -> int:
        """Replace `seq`'s caches with a pool entry's: each array copied once, from pool memory into
        a fresh MLX buffer (step-rounded where the cache grows), checksum verified on the way,
        then each cache built through the running mlx-lm's own state. On any refusal `seq` is
        left empty. Returns the positions restored."""
        self._own(seq)
        mx = self._mx
        self._unshare(seq)
        self._sequences[seq] = self._new_caches()
        self._lengths[seq] = 0
        n = view.info.tokens
        specs, plain = self._check_entry(view)
        buffers, destinations = {}, {}
        for spec in specs:
            shape = list(spec.shape)
            grows = self._signature[spec.name][1][2:3] == (-1,)  # axis 2 holds cells (KV), not fixed state
            stored = n if spec.token_axis == 2 else spec.shape[2] if grows else None
            if grows:
                shape[2] = caches.capacity_for(self._module, plain, spec.name.rsplit(".", 1)[0] + ".", stored)
            buffers[spec.name] = mx.zeros(shape, caches.MLX_DTYPES[spec.dtype](mx))
            destinations[spec.name] = stored
        mx.eval(list(buffers.values()))
        for name, stored in destinations.items():
            alias = self._alias(buffers[name])
            destinations[name] = alias if stored is None else alias[:, :, :stored]
        view.read_into(destinations)
        del destinations  # no numpy alias may outlive the copy: MLX writes in place only when alone
        layers = [caches.build(self._module, plain, f"{index}.", buffers) for index in range(len(self._sequences[seq]))]
        self._sequences[seq] = layers
        self._lengths[seq] = n
        return n

    def _check_entry(self, view: EntryView):
        """The entry's array specs and plain values, if they are exactly what this engine's caches
        export (names, dtypes, shapes and cache classes); StateError otherwise."""
        specs = getattr(view.layout, "arrays", ())
        plain = dict(getattr(view.layout, "engine_values", ()))
        expected = {k for k, v in self._signature.items() if not isinstance(v, str)}
        problems = sorted(expected ^ {s.name for s in specs})
        for spec in specs:
            dtype, fixed, axis = self._signature.get(spec.name, (None, None, None))
            if spec.name in expected and (spec.dtype != dtype or spec.token_axis != axis
                                          or caches.fixed_shape(spec.shape, fixed[2:3] == (-1,)) != fixed):
                problems.append(spec.name)
        problems += [k for k, v in self._signature.items() if isinstance(v, str) and plain.get(k) != v]
        if problems:
            raise StateError(f"pool entry {view.info.id} does not hold this model's caches (mismatch in "
                             f"{', '.join(problems[:4])}); it was written by another model or adapter")
        return specs, plain

    def _alias(self, array) -> np.ndarray:
        """A numpy view of an evaluated MLX array's buffer (bf16 through its 16-bit pattern)."""
        if array.dtype == self._mx.bfloat16:
            array = array.view(self._mx.uint16)
        return np.asarray(array)

    # ----------------------------------------------------------------------------- lifetime

    def release_thread(self) -> None:
        """Destroy the MLX streams this thread created: MLX used from a thread other than the
        main one otherwise aborts the process at exit now and then ("terminate called without
        an active exception"; MLX asks for clear_streams at the end of such threads)."""
        self._mx.clear_streams()

    def close(self) -> None:
        """Drop every sequence and restore MLX's cache limit if this engine changed it."""
        self._sequences.clear()
        self._lengths.clear()
        self._batch = None
        if self._previous_cache_limit is not None:
            self._mx.set_cache_limit(self._previous_cache_limit)
            self._previous_cache_limit = None
