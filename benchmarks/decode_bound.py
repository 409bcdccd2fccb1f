"""The bound on decode throughput: llama.cpp's own batched step, with nothing around it.

One engine (2 threads, flash attention and 8,192 cells, as the servers run) holds a sequence per
request slot; each sample times repeated steps of one token for each of N sequences at once.
What a server reaches at N requests at once can be read against this: on these CPUs a batch of
2 costs about what two single steps cost, so no scheduler above llama.cpp can make 2 requests
decode faster than 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import Run
from benchmarks.texts import text_of
from engines.base import StepRequest
from engines.llamacpp.engine import LlamaCppEngine

LABEL = "llama.cpp batched step alone"


def bench(run: Run, model: Path, counts: list[int], steps: int, repeat: int, group: str,
          ours: Callable[[int], str], tick: Callable[[str], None]) -> None:
    """Tokens/s of `steps` one-token steps for each of `counts` sequences at once, and how close
    `ours(count)` (a figure already recorded, in tok/s) comes to it."""
    # The settings the servers compared against it run with: `superfluid serve` turns flash
    # attention on (faster on CPU; the engine's own default is off), and each server has 8,192 cells.
    engine = LlamaCppEngine(model, n_ctx=8192, threads=2, threads_batch=2, n_seq_max=max(counts), flash_attn=True)
    try:
        sequences, prompt = [], len(engine.tokenize(text_of(32)))
        for i in range(max(counts)):
            seq = engine.new_sequence()
            engine.step([StepRequest(seq, engine.tokenize(text_of(32, salt=i)), "last")])
            sequences.append(seq)
        engine.step([StepRequest(sequences[0], [100], "last")])  # a first decode's one-time costs
        engine.truncate(sequences[0], prompt)
        for count in counts:
            rates = []
            for _ in range(repeat):
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step([StepRequest(seq, [100], "last") for seq in sequences[:count]])
                rates.append(count * steps / (time.perf_counter() - start))
                for seq in sequences[:count]:
                    engine.truncate(seq, prompt)  # every sample decodes at the same positions
            run.record(f"{LABEL}: decode tokens/s, {count} at once", rates, unit="tok/s")
            run.ratio(f"decode tokens/s, {count} at once: ours / the engine's bound", ours=ours(count),
                      baseline=f"{LABEL}: decode tokens/s, {count} at once", group=group)
        first, last = counts[0], counts[-1]
        run.ratio(f"decode tokens/s: the engine alone at {last} at once / at {first}",
                  ours=f"{LABEL}: decode tokens/s, {last} at once", baseline=f"{LABEL}: decode tokens/s, {first} at once",
                  group=group)
        tick("llama.cpp batched step alone")
    finally:
        engine.close()
