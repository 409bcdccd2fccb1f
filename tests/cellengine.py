"""An engine with a fixed number of KV cells and no model, for the scheduler's tests: fast and
deterministic, and exact about cells the way llama.cpp's unified cache is.

Each cell stores a token and a running hash of every token before it in its sequence; a fork
tags the parent's cells with one more sequence (no bytes move), a step that needs more cells
than are free raises NoRoom before it changes anything, and the logits of a step are a function
of the hash in the sequence's last cell. So a lane restored with the wrong state, or fed a token
twice, produces other tokens than the uninterrupted run: the tests compare outputs exactly.

Its KV travels through the real pool: its `snapshot` is the cells' tokens and hashes as two
arrays of a pool entry, and `import_` reads them back (verified first).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import NoReturn

import numpy as np

from engines.base import Descriptor, EngineStats, Packing, Snapshot, StepRequest, TokenVocabulary
from engines.errors import EngineError, Interrupted, NoRoom
from kvpool import Device, EntryView, KVArray, pricing

MASK = (1 << 32) - 1


def chain(previous: int, token: int) -> int:
    """The running hash of a sequence after `token` (32 bits, so it stores as uint32)."""
    return (previous * 1_000_003 + token + 1) & MASK


class CellEngine:
    """The Engine protocol over `cells` token positions shared by up to `max_sequences` sequences."""

    def __init__(self, cells: int = 4096, *, max_sequences: int = 16, vocab: int = 64, eos: tuple[int, ...] = (),
                 step_seconds: tuple[float, float] = (0.0, 0.0), chunks_apart: bool = False):
        self.cells, self.vocab = cells, vocab
        # A simulated clock for tests of time-bound planning: each step advances it by a fixed cost
        # (reading the weights) plus a cost per token fed, as a CPU forward does.
        self.step_seconds, self.now = step_seconds, 0.0
        self._seqs: dict[int, list[int]] = {}  # sequence -> the cell at each of its positions
        self._token: dict[int, int] = {}  # cell -> token
        self._hash: dict[int, int] = {}  # cell -> running hash up to and including its token
        self._refs: Counter = Counter()  # cell -> sequences holding it
        self._cell_ids = itertools.count()
        self._free_seqs = list(range(max_sequences))
        self.steps: list[list[tuple[int, int]]] = []  # each step's (sequence, tokens fed)
        self.kept = 0  # tokens that steps stopped part-way kept (stop_part_way)
        self.peak_cells = 0
        model_kv = pricing.uniform(1, 1, 4, "f32")
        self._descriptor = Descriptor(
            "cells", "1", f"cell-engine-{cells}-{vocab}", model_kv, pricing.bytes_per_token(model_kv), cells, vocab,
            Packing(mixes_prefill_and_decode=True, max_tokens=cells, max_sequences=max_sequences,
                    copies_on_lane_change=False, chunks_apart=chunks_apart),
            Device(), None, eos, None, kv_cells=cells, unified_cells=True)

    # ----------------------------------------------------------------------------- describe, text

    def describe(self) -> Descriptor:
        """The fixed descriptor."""
        return self._descriptor

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """One token per character."""
        return [ord(c) % self.vocab for c in text]

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """One letter per token."""
        return bytes(ord("a") + t % 26 for t in tokens)

    def vocabulary(self) -> TokenVocabulary:
        """Each token's letter, as detokenize spells it."""
        return TokenVocabulary(pieces=tuple(self.detokenize([t]) for t in range(self.vocab)))

    def tokenizer(self) -> CellEngine:
        """Itself: its text methods touch no cells, so they are safe from any thread."""
        return self

    # ----------------------------------------------------------------------------- cells

    def cells_used(self) -> int:
        """Cells some sequence holds."""
        return len(self._refs)

    def _drop(self, cells: list[int]) -> None:
        for cell in cells:
            self._refs[cell] -= 1
            if not self._refs[cell]:
                del self._refs[cell], self._token[cell], self._hash[cell]

    def _write(self, seq: int, tokens: Sequence[int], hashes: Sequence[int] | None = None) -> None:
        cells = self._seqs[seq]
        previous = self._hash[cells[-1]] if cells else 0
        for i, token in enumerate(tokens):
            cell = next(self._cell_ids)
            previous = int(hashes[i]) if hashes is not None else chain(previous, int(token))
            self._token[cell], self._hash[cell], self._refs[cell] = int(token), previous, 1
            cells.append(cell)
        self.peak_cells = max(self.peak_cells, self.cells_used())

    # ----------------------------------------------------------------------------- sequences

    def new_sequence(self) -> int:
        """A new, empty sequence (NoRoom once all are in use)."""
        if not self._free_seqs:
            raise NoRoom("all sequences are in use")
        seq = self._free_seqs.pop(0)
        self._seqs[seq] = []
        return seq

    def free_sequence(self, seq: int) -> None:
        """Drop a sequence and its cells."""
        self._drop(self._seqs.pop(seq))
        self._free_seqs.append(seq)

    def fork(self, seq: int) -> int:
        """A new sequence holding `seq`'s cells (tagged, not copied)."""
        child = self.new_sequence()
        self._seqs[child] = list(self._seqs[seq])
        self._refs.update(self._seqs[child])
        return child

    def truncate(self, seq: int, tokens: int) -> None:
        """Keep the first `tokens` positions."""
        cells = self._seqs[seq]
        self._drop(cells[tokens:])
        del cells[tokens:]

    def length(self, seq: int) -> int:
        """Positions `seq` holds."""
        return len(self._seqs[seq])

    def sequences(self) -> list[int]:
        """The sequences alive."""
        return sorted(self._seqs)

    def interrupt(self) -> bool:
        """False: a cell engine's step is instant and never stopped part-way."""
        return False

    def clear_interrupt(self) -> None:
        """Nothing to take back."""

    def step(self, requests: Sequence[StepRequest]) -> list[np.ndarray | None]:
        """Append each request's tokens; NoRoom (changing nothing) when the cells run out."""
        needed = sum(len(r.tokens) for r in requests)
        if self.cells_used() + needed > self.cells:
            raise NoRoom(f"{needed} tokens do not fit: {self.cells - self.cells_used()} of {self.cells} cells free")
        self.steps.append([(r.seq, len(r.tokens)) for r in requests])
        self.now += self.step_seconds[0] + self.step_seconds[1] * needed
        results = []
        for request in requests:
            self._write(request.seq, request.tokens)
            if request.logits == "none":
                results.append(None)
                continue
            last = self._hash[self._seqs[request.seq][-1]]
            results.append(np.random.default_rng(last).standard_normal((1, self.vocab)).astype(np.float32))
        return results

    def stop_part_way(self, requests: Sequence[StepRequest], done: float, ubatch: int) -> NoReturn:
        """Stop a step `done` (a share, 0-1) of the way through, as llama.cpp stops a forward: it
        keeps the whole ubatches of `ubatch` tokens (the step's tokens in order) that finished by
        then, drops the rest, and raises Interrupted. The tokens kept are added to `kept`."""
        keep = int(sum(len(r.tokens) for r in requests) * done) // ubatch * ubatch
        for request in requests:
            part = request.tokens[:keep]
            self._write(request.seq, part)
            self.kept += len(part)
            keep -= len(part)
        raise Interrupted("stopped for a request that goes first")

    # ----------------------------------------------------------------------------- pool

    def snapshot(self, seq: int, tokens: Sequence[int]) -> Snapshot:
        """The sequence's tokens and hashes, as the arrays of a pool entry."""
        cells = self._seqs[seq]
        if len(tokens) != len(cells):
            raise EngineError(f"sequence {seq} holds {len(cells)} positions but {len(tokens)} tokens were given")
        stored = [KVArray("tokens", np.array([self._token[c] for c in cells], np.int32), token_axis=0),
                  KVArray("hashes", np.array([self._hash[c] for c in cells], np.uint32), token_axis=0)]
        return Snapshot(arrays=tuple(stored))

    def import_(self, seq: int, view: EntryView) -> int:
        """Replace `seq`'s cells with a pool entry's (verified first: they are read in place); the
        positions restored."""
        if not view.verified:
            view.verify()
        arrays = view.arrays
        tokens, hashes = arrays["tokens"], arrays["hashes"]
        self.truncate(seq, 0)
        if self.cells_used() + len(tokens) > self.cells:
            raise NoRoom(f"{len(tokens)} cells to restore, {self.cells - self.cells_used()} free")
        if not np.array_equal(tokens, np.asarray(view.tokens)):
            raise EngineError(f"pool entry {view.info.id}: its cells hold other tokens than it claims")
        self._write(seq, tokens, hashes)
        view.count_copy_out(tokens.nbytes + hashes.nbytes)
        return len(tokens)

    def stats(self) -> EngineStats:
        """No copies of its own."""
        return EngineStats()

    def close(self) -> None:
        """Nothing to free."""

    def release_thread(self) -> None:
        """Nothing kept per thread."""
