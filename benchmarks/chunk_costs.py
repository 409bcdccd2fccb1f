"""What a prompt token costs by the size of the chunk it is fed in, early and late in a prompt.

    .venv/bin/python benchmarks/chunk_costs.py [--model PATH] [--rounds 4]

One llama.cpp engine set up as `superfluid serve` runs it (2 threads, flash attention, 65,536
cells, 8 sequences), with two other documents of 1,800 tokens resident, as in traffic.py's
documents-beside-chats shape. A third document's tokens are fed in chunks of each size, once
over positions 0-800 and once over 1,000-1,800; each figure is the median over rounds, sizes
alternating within a round. The planner sizes chunks from the targets and the measured step
costs; this shows what a smaller chunk gives up. Early in a prompt the size hardly matters;
late in it, where attention over the context dominates, ggml's CPU flash-attention kernel
works in tiles of 64 query rows, and each tile converts and multiplies every key block its
rows can see however few rows it holds, so small chunks pay for more partial tiles.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.texts import text_of  # noqa: E402
from engines import models  # noqa: E402
from engines.base import StepRequest  # noqa: E402
from engines.llamacpp.engine import LlamaCppEngine  # noqa: E402

SIZES = (64, 128, 256, 512)
SPANS = ((0, 800), (1000, 1800))
DOCUMENT = 1800


def feed(engine: LlamaCppEngine, seq: int, tokens: list[int], start: int, end: int, chunk: int) -> float:
    """Seconds to feed tokens[start:end] to `seq` (which holds tokens[:start]) in chunks of `chunk`."""
    seconds = 0.0
    for at in range(start, end, chunk):
        piece = tokens[at:min(at + chunk, end)]
        began = time.perf_counter()
        engine.step([StepRequest(seq, piece, "last")])
        seconds += time.perf_counter() - began
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF model (default: SmolLM2-135M)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds over every size (default: 4)")
    args = parser.parse_args(argv)
    model = args.model or Path(models.default_model(progress=print))
    engine = LlamaCppEngine(model, n_ctx=65536, threads=2, threads_batch=2, n_seq_max=8, flash_attn=True)
    try:
        for other in range(2):  # two documents resident beside the one being fed
            seq, tokens = engine.new_sequence(), engine.tokenize(text_of(DOCUMENT, salt=7000 + other))[:DOCUMENT]
            feed(engine, seq, tokens, 0, len(tokens), 512)
        tokens = engine.tokenize(text_of(DOCUMENT, salt=7100))[:DOCUMENT]
        if len(tokens) < DOCUMENT:
            raise SystemExit(f"the document tokenized to {len(tokens)} tokens; {DOCUMENT} are needed")
        seq = engine.new_sequence()
        per_token: dict[tuple[int, int], list[float]] = {}
        for _ in range(args.rounds):
            for start, end in SPANS:
                for size in SIZES:
                    engine.truncate(seq, 0)
                    if start:
                        feed(engine, seq, tokens, 0, start, 512)
                    per_token.setdefault((size, start), []).append(feed(engine, seq, tokens, start, end, size) / (end - start))
        print(f"{model.name}: ms a prompt token, median of {args.rounds} rounds (ratio to chunks of {SIZES[-1]})")
        print("chunk | " + " | ".join(f"positions {start:,}-{end:,}" for start, end in SPANS))
        for size in SIZES:
            cells = []
            for start, _ in SPANS:
                ms = 1e3 * statistics.median(per_token[(size, start)])
                widest = 1e3 * statistics.median(per_token[(SIZES[-1], start)])
                cells.append(f"{ms:.2f} ({ms / widest:.2f})")
            print(f"{size} | " + " | ".join(cells))
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
