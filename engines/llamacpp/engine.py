"""llama.cpp in the application's process: one model, one context, several sequences in one
unified KV cache, and their state moved to and from the pool with exactly one copy each way.

Everything here calls llama.cpp from the thread that created the engine and from no other: on
the portable build a second calling thread makes every decode step about three times slower
(measured: 31 ms a SmolLM2 step instead of 10.7, through OpenMP). Calls from another thread raise
WrongThread. The one exception is `tokenizer()`, which reads the vocabulary and never the context
(engines/llamacpp/tokenizer.py).
"""

from __future__ import annotations

import ctypes
import heapq
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engines import identity as identities
from engines.adapter import Adapter
from engines.base import Descriptor, EngineStats, Packing, Snapshot, StepRequest
from engines.errors import EngineError, Interrupted, ModelLoadError, NoRoom, RuntimeUnavailable, StateError
from engines.llamacpp import blob, canary, forwards, interrupt, library, log, memory, settings
from engines.llamacpp.tokenizer import LlamaTokenizer
from kvpool import Device, EntryView, host_memory_available, pricing

RUNTIME = "llamacpp"
CANARY_TOKENS = 8


def resolve_device(n_gpu_layers: int, offload_supported: bool, gpu_name: str = "gpu",
                   gpu_free_bytes: int | None = None) -> Device:
    """Where the model's layers and live KV end up: the CPU unless layers are offloaded to a
    device this build supports (whose reported free memory then bounds the export budget)."""
    if n_gpu_layers == 0 or not offload_supported:
        return Device()
    return Device("gpu", gpu_name, gpu_free_bytes)


class LlamaCppEngine(Adapter):
    """A GGUF model loaded through llama-cpp-python's low-level API (not its `Llama` class)."""

    runtime = RUNTIME
    OPTIONS = settings.OPTIONS

    def __init__(self, model_path: str | Path, **options: Any) -> None:
        """Load `model_path` with `options` (checked before anything loads)."""
        self._claim_thread()
        self._values = settings.check(options)
        self._lib = library.load()
        self._api = api = self._lib.api
        path = Path(model_path)
        if not path.is_file():
            raise ModelLoadError(f"no model file at {path}")
        canary.ensure(path)  # a build that crashes on this model does so in a child, not here
        model_params, self._keep_alive = settings.model_params(api, self._values)
        self._model = api.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {path}: is it a GGUF model this llama.cpp "
                                 f"({self._lib.version}) supports?")
        self._ctx = None
        self._batch = None
        self._interrupt: interrupt.Interrupt | None = None
        try:
            self._kind = memory.kind_of(self._meta("general.architecture") or "llama",
                                        recurrent=bool(api.llama_model_is_recurrent(self._model)),
                                        # (a release without the call knows no hybrid memory)
                                        hybrid=bool(getattr(api, "llama_model_is_hybrid", lambda m: False)(self._model)),
                                        window=max(0, api.llama_model_n_swa(self._model)))
            self._window = max(0, api.llama_model_n_swa(self._model)) if "iswa" in self._kind else 0
            self._open_context(path)
        except BaseException:
            self.close()
            raise

    def _open_context(self, path: Path) -> None:
        api, values = self._api, self._values
        self._model_kv = self._read_model_kv()  # priced before the context exists: it sizes n_ctx = -1
        n_ctx, self._cells_reason = settings.context_cells(
            values["n_ctx"], api.llama_model_n_ctx_train(self._model), values["n_seq_max"],
            pricing.bytes_per_token(self._model_kv), host_memory_available())
        # One unified cache of n_ctx cells serves every sequence, and each is capped at the trained
        # context (_context_length): llama.cpp's "n_ctx_seq > n_ctx_train" warning does not apply.
        with log.expecting(r"n_ctx_seq \(\d+\) > n_ctx_train \(\d+\)"):
            self._ctx = api.llama_init_from_model(self._model, settings.context_params(api, values, n_ctx,
                                                                                     self._lib.version))
        if not self._ctx:
            raise ModelLoadError(f"llama.cpp could not create a context of {n_ctx} cells for {path}; "
                                 "lower n_ctx, or check the cache types and flash_attn")
        self._n_ctx = api.llama_n_ctx(self._ctx)
        # A step may be stopped part-way only where llama.cpp can remove the positions of the
        # ubatch it stopped in: plain KV. A window cache may have dropped the cells the removed
        # positions displaced, and a recurrent state is overwritten in place.
        self._interrupt = (interrupt.Interrupt(api, self._ctx)
                           if self._kind == "kv" and interrupt.supported(api) else None)
        self._vocab = api.llama_model_get_vocab(self._model)
        self._n_vocab = api.llama_vocab_n_tokens(self._vocab)
        self._text = LlamaTokenizer(api, self._vocab, self._n_vocab)
        self._memory = self._lib.memory
        self._mem = self._memory.handle(self._ctx)
        # llama.cpp caps n_batch at n_ctx: a step split at the option's value could overrun it
        self._n_batch = min(values["batch_size"], api.llama_n_batch(self._ctx))
        # ggml's CPU flash-attention kernel computes 64 query rows at a time over the union of
        # their sequences' cells: steps are then grouped into forwards that keep sequences apart.
        # It tiles only an f16 or f32 cache whose K and V share a type; over any other (quantized,
        # bf16) it computes each row apart, cell by cell, whatever shares the forward.
        self._tiled_attention = (bool(values["flash_attn"]) and values["n_gpu_layers"] == 0
                                 and values["cache_type_k"] == values["cache_type_v"] in ("f16", "f32"))
        self._batch = api.llama_batch_init(self._n_batch, 0, 1)
        self._tokens_in = np.ctypeslib.as_array(self._batch.token, shape=(self._n_batch,))
        self._pos_in = np.ctypeslib.as_array(self._batch.pos, shape=(self._n_batch,))
        self._logits_in = np.ctypeslib.as_array(self._batch.logits, shape=(self._n_batch,))
        np.ctypeslib.as_array(self._batch.n_seq_id, shape=(self._n_batch,))[:] = 1
        self._seq_slots = [self._batch.seq_id[i] for i in range(self._n_batch)]
        # llama.cpp's logits rows, read through a view kept per buffer: building one from a ctypes
        # pointer (np.ctypeslib.as_array) took ~30 us a token with the caches cold after a forward
        self._logits_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
            ctypes.cast(api.llama_get_logits, ctypes.c_void_p).value)
        self._logits_views: dict[tuple[int, int], np.ndarray] = {}
        self._slot_seq = [-1] * self._n_batch
        self._free_seqs = list(range(values["n_seq_max"]))
        self._copied = self._copies = 0  # recurrent state copied by forks
        self._template = self._learn_template(self._probe_blob_header())
        self._model_kv = memory.model_kv(self._template, self._window)  # exact, from the rows it writes
        self._descriptor = self._describe(path)

    # ----------------------------------------------------------------------------- description

    def _meta(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(256)
        n = self._api.llama_model_meta_val_str(self._model, key.encode(), buffer, len(buffer))
        return buffer.value.decode() if n >= 0 else None

    def _read_model_kv(self) -> pricing.ModelKV:
        """An estimate of the price from the model's metadata, for sizing the cells before the
        context exists (the exact one is learned from the state the context writes)."""
        api, values = self._api, self._values
        layers = api.llama_model_n_layer(self._model)
        heads = api.llama_model_n_head(self._model)
        kv_heads = api.llama_model_n_head_kv(self._model)
        arch = self._meta("general.architecture") or "llama"
        if heads <= 0 or kv_heads <= 0:  # no attention (a recurrent model): nothing costs per token
            return pricing.ModelKV(())
        key_width = int(self._meta(f"{arch}.attention.key_length") or api.llama_model_n_embd(self._model) // heads)
        value_width = int(self._meta(f"{arch}.attention.value_length") or key_width)
        return pricing.uniform(layers, kv_heads, key_width, values["cache_type_k"],
                               value_type=values["cache_type_v"], value_width=value_width)

    def _probe_blob_header(self) -> bool:
        """Whether this release prefixes sequence state with a magic and the sequence id (since
        late 2025): read from the state of an empty sequence."""
        seq = self.new_sequence()
        try:
            state = self._state_of(seq)
        finally:
            self.free_sequence(seq)
        if len(state) >= 4 and int.from_bytes(state[:4].tobytes(), "little") == blob.MAGIC:
            return True
        if self._kind == "kv" and len(state) == 8:  # an older release: stream count, cell count
            return False
        raise RuntimeUnavailable(f"llama-cpp-python {self._lib.version} writes sequence state superfluid cannot "
                                 f"read ({len(state)} bytes for an empty sequence of memory kind {self._kind}); "
                                 f"{library.INSTALL}")

    def _state_of(self, seq: int) -> np.ndarray:
        size = self._api.llama_state_seq_get_size(self._ctx, seq)
        state = np.empty(size, np.uint8)
        written = self._api.llama_state_seq_get_data(self._ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                     size, seq)
        if written != size:
            raise StateError(f"llama.cpp wrote {written} of {size} state bytes for sequence {seq}")
        return state

    def _learn_template(self, header: bool) -> blob.Template:
        """Run the canary (a multi-token batch: a build that returns garbage here, the native
        build's fault on these CPUs, is refused now) and learn from its sequence's state what
        every blob of this engine looks like."""
        seq = self.new_sequence()
        try:
            tokens = [t % self._n_vocab for t in range(1, CANARY_TOKENS + 1)]
            logits = self.step([StepRequest(seq, tokens, "all")])[0]
            if not np.isfinite(logits).all():
                raise RuntimeUnavailable(f"llama.cpp {self._lib.version} returns non-finite logits for a "
                                         f"{CANARY_TOKENS}-token batch on this machine; rebuild it portable: "
                                         f"{library.INSTALL}")
            template = blob.Template.learn(self._state_of(seq), memory.PARTS[self._kind], header=header,
                                           max_cells=self._n_ctx)
            if template.check(self._state_of(seq), self._window) != CANARY_TOKENS:
                raise StateError(f"llama.cpp's state of a {CANARY_TOKENS}-token sequence does not read back as one")
            return template
        finally:
            self.free_sequence(seq)

    def _describe(self, path: Path) -> Descriptor:
        api, values = self._api, self._values
        template = api.llama_model_chat_template(self._model, None)
        bos = api.llama_vocab_bos(self._vocab) if api.llama_vocab_get_add_bos(self._vocab) else None
        # every end-of-generation token llama.cpp knows (eos, eot, <end_of_turn>, <|im_end|>, ...)
        # (the model's own eos first: chat templates render it as eos_token)
        is_eog, first = api.llama_vocab_is_eog, api.llama_vocab_eos(self._vocab)
        eos = tuple(sorted((t for t in range(self._n_vocab) if is_eog(self._vocab, t)), key=lambda t: (t != first, t)))
        # the memory kind and window decide what a state blob holds, so they are part of what it means
        settings_used = {name: values[name] for name in settings.IDENTITY_OPTIONS} | {
            "kv_unified": True, "memory": self._kind, "window": self._window}
        identity = identities.compose(RUNTIME, identities.file_digest(path), self._lib.version, settings_used)
        device = resolve_device(values["n_gpu_layers"], bool(api.llama_supports_gpu_offload()))
        packing = Packing(mixes_prefill_and_decode=True, max_tokens=self._n_batch,
                          max_sequences=values["n_seq_max"], copies_on_lane_change=False,
                          chunks_apart=self._tiled_attention)
        return Descriptor(RUNTIME, self._lib.version, identity, self._model_kv,
                          pricing.bytes_per_token(self._model_kv), self._context_length(), self._n_vocab, packing,
                          device,
                          bos, eos, template.decode() if template else None, kv_cells=self._n_ctx, unified_cells=True,
                          kv_cells_reason=self._cells_reason,
                          memory=memory.memory(self._kind, self._window, values["swa_full"]))

    def _context_length(self) -> int:
        """Positions one sequence may hold: the cells, but never past the model's training
        context (a cache sized for many sessions must not stretch one beyond what RoPE learned)."""
        trained = self._api.llama_model_n_ctx_train(self._model)
        return min(self._n_ctx, trained) if trained > 0 else self._n_ctx

    def describe(self) -> Descriptor:
        """What this engine is (fixed once loaded)."""
        return self._descriptor

    @property
    def library_version(self) -> str:
        """The llama-cpp-python release driving this engine."""
        return self._lib.version

    # ----------------------------------------------------------------------------- text

    def tokenize(self, text: str, *, special: bool = True, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it are parsed when `special`."""
        self._check_thread()
        return self._text.tokenize(text, special=special, add_bos=add_bos)

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of `tokens`, special tokens rendered."""
        self._check_thread()
        return self._text.detokenize(tokens)

    def tokenizer(self) -> LlamaTokenizer:
        """The model's tokenizer, safe from any thread (it reads the vocabulary, never the context)."""
        return self._text

    # ----------------------------------------------------------------------------- sequences

    def new_sequence(self) -> int:
        """A new, empty sequence (NoRoom once n_seq_max are alive)."""
        self._check_thread()
        if not self._free_seqs:
            raise NoRoom(f"all {self._values['n_seq_max']} sequences are in use; free one or raise n_seq_max")
        seq = heapq.heappop(self._free_seqs)
        self._lengths[seq] = 0
        return seq

    def free_sequence(self, seq: int) -> None:
        """Drop `seq` and its cells."""
        self._length(seq)
        self._memory.seq_rm(self._mem, seq, -1, -1)
        del self._lengths[seq]
        heapq.heappush(self._free_seqs, seq)

    def fork(self, seq: int) -> int:
        """A new sequence sharing `seq`'s cells: llama.cpp tags them with a second sequence id
        in its unified cache; no KV bytes move. A recurrent state is copied (counted)."""
        length = self._length(seq)
        child = self.new_sequence()
        self._memory.seq_cp(self._mem, seq, child, -1, -1)
        self._lengths[child] = length
        if self._descriptor.memory.recurrent and length:
            self._copied += pricing.fixed_bytes(self._model_kv)
            self._copies += 1
        return child

    def truncate(self, seq: int, tokens: int) -> None:
        """Keep the first `tokens` positions of `seq`. EngineError, changing nothing, where the
        memory cannot be cut there: a recurrent state never can, and a window layer only while it
        still holds the window before the cut."""
        length = self._length(seq)
        if not 0 <= tokens <= length:
            raise EngineError(f"cannot keep {tokens} tokens of a sequence of {length}")
        if tokens == length:
            return
        kind = self._descriptor.memory
        held_from = max(0, self._memory.seq_pos_min(self._mem, seq)) if kind.window else 0
        if not kind.can_cut(held_from, length, tokens):
            raise EngineError(f"cannot cut sequence {seq} back from {length} to {tokens} tokens: its {kind.kind} "
                              f"memory no longer holds what comes before (restore a checkpoint instead)")
        if not self._memory.seq_rm(self._mem, seq, tokens, -1):
            raise EngineError(f"llama.cpp cannot cut sequence {seq} at {tokens}; recompute it from its tokens instead")
        self._lengths[seq] = tokens

    # ----------------------------------------------------------------------------- forward

    def step(self, requests: Sequence[StepRequest]) -> list[np.ndarray | None]:
        """One step over several sequences: llama_decode calls of at most batch_size tokens,
        grouped so that no forward's attention tiles mix sequences (forwards.py); per request,
        its logits rows (float32, copied) or None."""
        self._check_thread()
        self._check_requests(requests)
        for request in requests:
            end = self._length(request.seq) + len(request.tokens)
            if end > self._n_ctx:
                raise NoRoom(f"sequence {request.seq} would reach {end} positions; the context holds "
                             f"{self._n_ctx} (n_ctx)")
        results: list[list[np.ndarray]] = [[] for _ in requests]
        try:
            for group in forwards.group([len(request.tokens) for request in requests], self._tiled_attention):
                plan = []  # (request index, seq, token, position, wants logits)
                for index in group:
                    request = requests[index]
                    start, count = self._length(request.seq), len(request.tokens)
                    for offset, token in enumerate(request.tokens):
                        wants = request.logits == "all" or (request.logits == "last" and offset == count - 1)
                        plan.append((index, request.seq, int(token), start + offset, wants))
                for chunk_start in range(0, len(plan), self._n_batch):
                    self._decode(plan[chunk_start:chunk_start + self._n_batch], results)
        finally:
            if self._interrupt is not None:  # an interruption asked for after the last node is moot
                self._interrupt.clear()
        # one row (a decode step, a prompt's last token): a view of its forward's block, not a copy
        return [None if not rows else rows[0][np.newaxis] if len(rows) == 1 else np.stack(rows) for rows in results]

    def interrupt(self) -> bool:
        """Stop the step in flight at the next node of its forward (or the next step at its
        first): it raises Interrupted, and each sequence holds the ubatches that finished. Any
        thread may call this. False where the memory cannot drop a stopped ubatch (window,
        recurrent) or the bindings lack the callback: the step runs to its end."""
        if self._interrupt is None:
            return False
        self._interrupt.set()
        return True

    def clear_interrupt(self) -> None:
        """Lower the flag interrupt() raised, if no forward has taken it yet."""
        if self._interrupt is not None:
            self._interrupt.clear()

    def _decode(self, chunk: list[tuple], results: list[list[np.ndarray]]) -> None:
        n = len(chunk)
        indices, seqs, tokens, positions, wants = zip(*chunk)
        self._tokens_in[:n] = tokens
        self._pos_in[:n] = positions
        self._logits_in[:n] = wants
        for slot, seq in enumerate(seqs):
            if self._slot_seq[slot] != seq:
                self._seq_slots[slot][0] = seq
                self._slot_seq[slot] = seq
        self._batch.n_tokens = n
        status = self._api.llama_decode(self._ctx, self._batch)
        if status != 0:
            self._resync_lengths(set(seqs))
            if status == 2:
                raise Interrupted(f"the step was interrupted; its sequences hold "
                                  f"{', '.join(f'{seq}: {self._lengths[seq]}' for seq in sorted(set(seqs)))} positions")
            if status == 1:
                raise NoRoom(f"llama.cpp found no room in its KV cache for {n} tokens (n_ctx {self._n_ctx}); "
                             "free or truncate sequences, or raise n_ctx")
            raise EngineError(f"llama_decode failed with status {status}")
        # Every row this forward returns is copied, in one block: llama.cpp overwrites its own at
        # the next decode. Its rows are those the batch asked for, in the batch's order.
        rows = sum(wants)
        block = self._logits_rows(rows).copy() if rows else None
        row_index = 0
        for slot in range(n):
            self._lengths[seqs[slot]] = positions[slot] + 1
            if wants[slot]:
                results[indices[slot]].append(block[row_index])
                row_index += 1

    def _logits_rows(self, rows: int) -> np.ndarray:
        """The last forward's logits, `rows` rows, as a view of llama.cpp's buffer (valid until the
        next decode; the buffer moves only when llama.cpp grows it, and a view is kept per place)."""
        address = self._logits_address(self._ctx)
        view = self._logits_views.get((address, rows))
        if view is None:
            if len(self._logits_views) > 64:  # (old places: the buffer grew)
                self._logits_views.clear()
            floats = (ctypes.c_float * (rows * self._n_vocab)).from_address(address)
            view = self._logits_views[address, rows] = np.ctypeslib.as_array(floats).reshape(rows, self._n_vocab)
        return view

    def _resync_lengths(self, seqs: set[int]) -> None:
        for seq in seqs:
            self._lengths[seq] = self._memory.seq_pos_max(self._mem, seq) + 1

    # ----------------------------------------------------------------------------- pool

    def snapshot(self, seq: int, tokens: Sequence[int]) -> Snapshot:
        """`seq`'s state as llama.cpp serialises it: a blob of llama_state_seq_get_size bytes,
        written straight into the memory the host reserves (the one copy)."""
        length = self._length(seq)
        if len(tokens) != length:
            raise EngineError(f"sequence {seq} holds {length} positions but {len(tokens)} tokens were given")
        size = self._api.llama_state_seq_get_size(self._ctx, seq)

        def write(target: np.ndarray) -> None:
            self._check_thread()
            if target.nbytes != size or not target.flags.c_contiguous:
                raise EngineError(f"sequence {seq}'s state needs {size} contiguous bytes; {target.nbytes} were given")
            written = self._api.llama_state_seq_get_data(self._ctx, target.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                         size, seq)
            if written != size:
                raise StateError(f"llama.cpp wrote {written} of {size} state bytes for sequence {seq}")

        return Snapshot(blob_bytes=size, write_blob=write)

    def import_(self, seq: int, view: EntryView) -> int:
        """Replace `seq`'s state with a pool entry's verified blob: its structure is walked and
        checked against this model's first, and only then llama.cpp reads it, from pool memory
        (the one copy). On a refusal `seq` is left empty. Returns the positions restored."""
        self._length(seq)
        if not view.verified:
            raise EngineError(f"pool entry {view.info.id} has not been verified; llama.cpp reads a blob in place and "
                              "aborts the process on bad bytes, so check it first (EntryView.verify)")
        self._memory.seq_rm(self._mem, seq, -1, -1)
        self._lengths[seq] = 0
        state = view.blob
        cells = self._template.check(state, self._window)
        if cells != view.info.tokens:
            raise StateError(f"pool entry {view.info.id} holds {cells} cells but claims {view.info.tokens} tokens")
        read = self._api.llama_state_seq_set_data(self._ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                  state.nbytes, seq)
        if read == 0:
            self._memory.seq_rm(self._mem, seq, -1, -1)
            raise NoRoom(f"llama.cpp needs {cells} contiguous free cells to restore pool entry {view.info.id} and "
                         "has not got them; free or truncate sequences, or raise n_ctx")
        view.count_copy_out(state.nbytes)
        self._lengths[seq] = cells
        return cells

    def stats(self) -> EngineStats:
        """The KV copies llama.cpp made here: forks tag cells in the unified cache (nothing
        copied) but copy a recurrent state; everything else moves through export and import
        (which the pool counts)."""
        return EngineStats(self._copied, self._copies)

    # ----------------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Free the batch, the context and the model (idempotent)."""
        api = self._api
        if self._batch is not None:
            api.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            api.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            model, self._model = self._model, None
            text = getattr(self, "_text", None)  # none yet when loading failed before the vocabulary
            if text is None:
                api.llama_model_free(model)
            else:
                text.close(lambda: api.llama_model_free(model))  # once no other thread is tokenizing

