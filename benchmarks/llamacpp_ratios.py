"""llama.cpp state through the pool, against llama.cpp's own ways, measured side by side in one run.

    python benchmarks/llamacpp_ratios.py            # SmolLM2-135M at 128, 256, 1,024 and 4,096 tokens
    python benchmarks/llamacpp_ratios.py --quick    # 64 and 256 tokens (what the tests run)

For each context length:
- export (llama_state_seq_get_data into a pool entry, checksummed) and import (verify, check the
  blob, llama_state_seq_set_data from pool memory) against numpy memcpy of the same bytes;
- our export + import against the raw per-sequence API into a preallocated numpy buffer (the
  bound) and against `Llama.save_state()` + `load_state()` (what llama-cpp-python's
  LlamaRAMCache does on an insert and a hit);
- restoring from the pool against prefilling the same tokens again;
- forking a sequence (a reference in llama.cpp's unified cache: no bytes copied).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import Holder, Run  # noqa: E402
from engines import models  # noqa: E402
from engines.base import StepRequest  # noqa: E402
from engines.llamacpp.engine import LlamaCppEngine  # noqa: E402
from kvpool import Budget, Pool  # noqa: E402
from superfluid import transfer  # noqa: E402

TEXT = ("Shared memory lets several processes see the same bytes. A key-value cache holds the attention state "
        "of every token a language model has read, so that the next token costs one step. ")


def bench_length(run: Run, engine: LlamaCppEngine, pool: Pool, high_level, n: int, repeat: int) -> None:
    api, ctx = engine._api, engine._ctx
    tokens = (engine.tokenize(TEXT) * (n // 20 + 2))[:n]
    seq = engine.new_sequence()
    prefill_figure = run.measure(f"prefill {n}", lambda: _prefill(engine, seq, tokens), repeat=2 if n > 1024 else 3,
                                 warmup=0)
    size = api.llama_state_seq_get_size(ctx, seq)
    run.note(f"state bytes at {n} tokens", size)

    flat = np.empty(size, np.uint8)
    source = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    run.measure(f"memcpy {n}", lambda: np.copyto(flat, source), repeat=repeat, nbytes=size)

    pointer = flat.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    run.measure(f"raw get_data {n}", lambda: api.llama_state_seq_get_data(ctx, pointer, size, seq), repeat=repeat,
                nbytes=size)
    held = Holder(pool)
    run.measure(f"export {n}", lambda: held.hold(transfer.export(engine, pool, seq, tokens)), repeat=repeat,
                setup=held.drop, nbytes=size)
    held.drop()
    entry = transfer.export(engine, pool, seq, tokens)
    target = engine.new_sequence()

    def restore():
        with pool.get(entry.id) as view:  # checksum verified here
            transfer.import_(engine, target, view)

    run.measure(f"import {n}", restore, repeat=repeat, nbytes=size)
    run.measure(f"raw set_data {n}", lambda: api.llama_state_seq_set_data(ctx, pointer, size, target), repeat=repeat,
                nbytes=size)
    engine.free_sequence(target)

    children: list[int] = []

    def free_children():
        while children:
            engine.free_sequence(children.pop())

    copied = pool.stats().bytes_copied
    run.measure(f"fork {n}", lambda: children.append(engine.fork(seq)), repeat=repeat, setup=free_children)
    free_children()
    assert pool.stats().bytes_copied == copied  # a fork moves no bytes

    high_level.reset()
    high_level.eval(tokens)
    saved = []
    run.measure(f"Llama.save_state {n}", lambda: saved.append(high_level.save_state()), repeat=repeat)
    run.measure(f"Llama.load_state {n}", lambda: high_level.load_state(saved[-1]), repeat=repeat)
    run.note(f"Llama.save_state bytes at {n} tokens", saved[-1].llama_state_size)

    for ours, theirs in ((f"export {n}", f"memcpy {n}"), (f"import {n}", f"memcpy {n}")):
        run.ratio(f"{ours.split()[0]} / memcpy at {n}", ours=ours, baseline=theirs, goal=0.5)
    run.combine(f"ours {n}", f"export {n}", f"import {n}")
    run.combine(f"raw API {n}", f"raw get_data {n}", f"raw set_data {n}")
    run.combine(f"save+load_state {n}", f"Llama.save_state {n}", f"Llama.load_state {n}")
    run.ratio(f"raw API / ours at {n} (bound)", ours=f"ours {n}", baseline=f"raw API {n}", goal=1 / 1.2)
    run.ratio(f"save+load_state / ours at {n}", ours=f"ours {n}", baseline=f"save+load_state {n}")
    run.ratio(f"re-prefill / restore at {n}", ours=f"import {n}", baseline=prefill_figure.label,
              goal=300 if n == 1024 else None)
    engine.free_sequence(seq)
    held.hold(entry)
    held.drop()


def _prefill(engine: LlamaCppEngine, seq: int, tokens: list[int]) -> None:
    engine.truncate(seq, 0)
    engine.step([StepRequest(seq, tokens, "last")])


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 and 256 tokens (seconds, for tests)")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: SmolLM2-135M-Instruct from PyPI)")
    parser.add_argument("--out", type=Path, help="where to write the JSON (default: benchmarks/results/llamacpp.json)")
    parser.add_argument("--flash-attn", type=lambda v: v.lower() in ("1", "true", "on", "yes"), default=True,
                        help="run the engine with flash attention (default on: V by rows in the blob, which "
                             "moves about five times faster than the column layout without it)")
    args = parser.parse_args(argv)
    lengths = [64, 256] if args.quick else [128, 256, 1024, 4096]
    model = args.model or models.default_model(progress=print)
    from llama_cpp import Llama

    run = Run("llamacpp-quick" if args.quick else "llamacpp")
    run.note("model", model.name)
    run.note("flash attention", args.flash_attn)
    engine = LlamaCppEngine(model, n_ctx=min(8192, 2 * max(lengths) + 512), threads=2, threads_batch=2, n_seq_max=4,
                            flash_attn=args.flash_attn)
    high_level = Llama(str(model), n_ctx=max(lengths) + 256, n_threads=2, n_threads_batch=2, verbose=False)
    size = 512 << 20
    pool = Pool.create(f"bench-llamacpp-{os.getpid()}", size, budget=Budget(size, None, "benchmark"))
    try:
        run.note("cell price (bytes per token)", engine.describe().cell_price)
        for n in lengths:
            bench_length(run, engine, pool, high_level, n, repeat=9 if n <= 1024 else 5)
        fork_short, fork_long = (f"fork {n}" for n in (lengths[0], lengths[-1]))
        # Goal: a long fork within 2x of a short one. llama.cpp tags each cell, so it grows with n.
        run.ratio(f"fork at {lengths[0]} / fork at {lengths[-1]}", ours=fork_long, baseline=fork_short, goal=0.5)
    finally:
        pool.close()
        pool.unlink()
        engine.close()
        high_level.close()
    return run.finish(args.out)


if __name__ == "__main__":
    main()
