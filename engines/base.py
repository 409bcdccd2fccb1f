"""The Engine protocol every runtime adapter implements, and the small types it speaks.

An engine holds a model and its live KV cache, with several sequences in it. The host drives it
from one thread (the scheduler thread that created it): it steps sequences forward, forks and
truncates them, describes a sequence's state for the pool (`snapshot`) and reads one back from a
pool entry (`import_`). Engines never reserve, tag, commit or verify pool entries: the host does
(`superfluid.host.transfer`), and hands them memory of the right size. Each engine declares what one
`step` can pack, so the scheduler plans within it:

    llama.cpp  prefill chunks and decode tokens of many sequences in one forward
    mlx-lm     decode of many sequences in one forward; prefill apart; lanes joining or
               leaving a batch copy their KV (declared, so the copies can be counted)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import msgspec
import numpy as np

from kvpool import Device, EntryView, KVArray
from kvpool.pricing import ModelKV


class Packing(msgspec.Struct, frozen=True):
    """What one `step` can hold."""

    mixes_prefill_and_decode: bool  # prefill chunks and decode tokens in one forward
    max_tokens: int  # tokens per step, all sequences together
    max_sequences: int  # sequences alive at once
    copies_on_lane_change: bool  # a sequence joining or leaving a batch copies KV
    # A prompt chunk runs in a forward of its own, apart from the step's decode tokens, and its
    # attention skips only the blocks of cells its rows cannot see (llama.cpp's CPU flash
    # attention on one shared cache). So where a decode token's cell lands matters: one left
    # between a prompt's cells by a lane that then ends becomes a hole a later prompt fills, and
    # that prompt's rows see a block more (the planner lets lanes about to end decode first).
    chunks_apart: bool = False


MEMORY_KINDS = ("kv", "iswa", "recurrent", "hybrid", "hybrid-iswa")


class Memory(msgspec.Struct, frozen=True):
    """How a model's memory holds a sequence, and so what can be done with it.

        kv           plain attention: every position kept; cut back anywhere, forks share cells
        iswa         attention with a sliding window on some layers: those keep only the last
                     `window` positions, so a cut back needs the window before the cut still held
        recurrent    a fixed-size state (Mamba, RWKV): it cannot be cut back at all, and a fork
                     copies the state's bytes
        hybrid       attention layers and recurrent layers: the recurrent rules win
        hybrid-iswa  the same with windowed attention layers

    Where a cut back is impossible, the host restores a checkpoint (a state parked at or before
    the cut) and prefills the rest."""

    kind: str = "kv"
    window: int = 0  # positions a window layer keeps (0: no window layers)
    swa_full: bool = False  # llama.cpp keeps every position in the window layers' live cache too
    # A window layer that has seen `window` positions or more can still be cut back within what it
    # holds (llama.cpp's window cache); False: it cannot be cut at all (mlx-lm's RotatingKVCache
    # is trimmable only while its offset is below its size).
    cuts_wrapped_window: bool = True

    def __post_init__(self) -> None:
        if self.kind not in MEMORY_KINDS:
            raise ValueError(f"memory kind {self.kind!r} is not one of {', '.join(MEMORY_KINDS)}")

    @property
    def recurrent(self) -> bool:
        """True when part of the state is recurrent (no cut back, forks copy bytes)."""
        return self.kind in ("recurrent", "hybrid", "hybrid-iswa")

    def can_cut(self, held_from: int, held: int, keep: int) -> bool:
        """Whether a sequence holding positions `held_from`..`held - 1` in its window layers (0..
        in full ones) can be cut back to its first `keep` positions and go on exactly."""
        if keep >= held:
            return True
        if self.recurrent:
            return False
        if self.window and held >= self.window and not self.cuts_wrapped_window:
            return False
        # the next position, keep, reads keep - window + 1 .. keep - 1 in the window layers
        return not self.window or held_from <= max(0, keep - self.window + 1)

    def held_from_restored(self, tokens: int) -> int:
        """The first position a restored state of `tokens` tokens holds in its window layers: a
        state keeps only what the window still sees."""
        return max(0, tokens - self.window) if self.window else 0

    def can_cut_restored(self, tokens: int, keep: int) -> bool:
        """Whether a parked state of `tokens` tokens, once restored, can be cut to `keep`."""
        return self.can_cut(self.held_from_restored(tokens), tokens, keep)


class Descriptor(msgspec.Struct, frozen=True):
    """What a loaded engine is: runtime, identity, KV shape and price, limits, vocabulary."""

    runtime: str
    runtime_version: str
    identity: str  # digest of the weights and every setting that changes what the KV means
    model_kv: ModelKV
    cell_price: int  # bytes of KV per token, from the model's shape and cache types
    context_length: int  # positions one sequence may hold (the model's context, within the cells)
    vocab_size: int
    packing: Packing
    device: Device
    bos_token: int | None
    eos_tokens: tuple[int, ...]
    chat_template: str | None
    # KV cells the engine holds for every sequence together (0: context_length). llama.cpp: the
    # unified cache's n_ctx; MLX: the memory its caches may grow into, by the cell price.
    kv_cells: int = 0
    # Why kv_cells is that many, in words, naming the option that sets it: "8 sequences at once
    # (n_seq_max) at the model's training context of 8,192 tokens; ...". Start-up lines show it.
    kv_cells_reason: str = ""
    # One cache of cells for every sequence (llama.cpp's unified cache): a fork shares its
    # parent's cells, and every forward reads every used cell, idle sequences' included.
    unified_cells: bool = False
    memory: Memory = Memory()


class EngineStats(msgspec.Struct, frozen=True):
    """Copies of KV bytes an engine made itself, beyond its exports and imports (which the pool
    counts): MLX copying a shared buffer at its first write after a fork, batch caches copying
    lanes in or out, compaction rewriting a buffer at its live size."""

    bytes_copied: int = 0
    copies: int = 0
    bytes_reclaimed: int = 0  # KV buffer bytes given back by compaction


@dataclass(frozen=True)
class Snapshot:
    """One sequence's state as its engine stores it, not yet written anywhere: either an opaque
    blob of `blob_bytes` that `write_blob` serialises straight into the memory it is given (the
    one copy; llama.cpp), or named `arrays` (views of the engine's own buffers) with the plain
    `engine_values` that rebuild its caches, which the pool copies once (MLX). Valid only until
    the engine's next call: the views alias live buffers."""

    blob_bytes: int | None = None
    write_blob: Callable[[np.ndarray], None] | None = None
    arrays: tuple[KVArray, ...] = ()
    engine_values: dict | None = None

    def __post_init__(self) -> None:
        blob = self.write_blob is not None
        if (self.blob_bytes is not None) != blob or (blob and self.arrays):
            raise ValueError("a snapshot is a blob (blob_bytes and write_blob) or arrays, not both or half")


class StepRequest(NamedTuple):
    """Tokens to append to one sequence in a step, and which logits to return for them."""

    seq: int
    tokens: Sequence[int]
    logits: str = "last"  # "last", "all" or "none"


class TokenVocabulary(NamedTuple):
    """What a grammar engine reads of a model's tokens to tell which continue a grammar: either
    each token's bytes in id order, a control token's (an end of turn, a role marker) as
    b"\xff" followed by its text, so that no grammar can spell it; or the model's tokenizer as the
    Hugging Face `tokenizers` library serializes it (tokenizer.json), which says the same."""

    pieces: tuple[bytes, ...] | None = None
    tokenizer_json: str | None = None


@runtime_checkable
class Tokenizer(Protocol):
    """A model's text to token ids and back, safe from any thread: it never touches the engine's
    context or sequences (so a request's prompt is tokenized on the caller's side, beside the
    steps of the thread that owns the engine)."""

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text` (special tokens in the text are parsed when `special`)."""

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of `tokens`."""

    def vocabulary(self) -> TokenVocabulary:
        """Every token as a grammar engine reads it (for constrained generation)."""


@runtime_checkable
class Engine(Protocol):
    """The primitive runtime: what the host needs from llama.cpp, MLX, or anything else."""

    def describe(self) -> Descriptor:
        """The engine's descriptor (fixed once loaded)."""

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text` (special tokens in the text are parsed when `special`)."""

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of `tokens` (bytes: a character may be split across tokens)."""

    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, for any thread (the engine's own tokenize is its owner's)."""

    def new_sequence(self) -> int:
        """A new, empty sequence id (NoRoom when all are in use)."""

    def free_sequence(self, seq: int) -> None:
        """Drop a sequence and its KV."""

    def fork(self, seq: int) -> int:
        """A new sequence sharing `seq`'s KV (no bytes copied where the runtime can share)."""

    def truncate(self, seq: int, tokens: int) -> None:
        """Keep the first `tokens` positions of `seq`."""

    def length(self, seq: int) -> int:
        """Positions held by `seq`."""

    def sequences(self) -> list[int]:
        """The ids of the sequences alive (made and not yet freed), in ascending order."""

    def step(self, requests: Sequence[StepRequest]) -> list[np.ndarray | None]:
        """One forward over several sequences; per request, its logits (rows, vocab) or None."""

    def interrupt(self) -> bool:
        """Ask the step in flight (or else the next one) to stop early and raise Interrupted,
        each sequence holding what the step finished. The one call any thread may make. False
        where this engine cannot stop a step part-way: the step then runs to its end."""

    def clear_interrupt(self) -> None:
        """Take back an interrupt() that no step has taken (it would stop the next step at its
        first node). Any thread may call this."""

    def snapshot(self, seq: int, tokens: Sequence[int]) -> Snapshot:
        """`seq`'s state (covering `tokens`, one per position it holds), ready to be written into
        memory the host reserves for it."""

    def import_(self, seq: int, view: EntryView) -> int:
        """Replace `seq`'s state with a pool entry's, read from the entry's own memory (the one
        copy). The host has checked the entry's identity; a blob must be verified already, arrays
        are verified as they are copied. The positions restored; on a refusal `seq` is left
        empty (StateError for a state this engine does not write, DataCorrupt for bad bytes)."""

    def stats(self) -> EngineStats:
        """Copies this engine made of KV bytes, and what compaction gave back."""

    def close(self) -> None:
        """Free the model and its context."""

    def release_thread(self) -> None:
        """Free what the runtime keeps for the calling thread (the owner's last call)."""
