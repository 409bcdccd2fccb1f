"""What a prompt token costs by the size of the chunk it is fed in, early and late in a prompt.

    .venv/bin/python benchmarks/chunk_costs.py [--model PATH] [--rounds 4]

One llama.cpp engine set up as `superfluid serve` runs it (2 threads, flash attention, 65,536
cells, 8 sequences), with two other documents of 1,800 tokens resident, as in traffic.py's
documents-beside-chats shape. A third document's tokens are fed in chunks of each size (every
size divides the span, so no chunk is a runt), once over positions 0-1,024 and once over
1,024-2,048, asking for no logits as the scheduler feeds a prompt's middle; each figure is the
median over rounds, the order of the sizes turning by one each round. The planner sizes chunks
from the targets and the measured step costs; this shows what a chunk's size changes. (A forward
of fewer than 64 tokens goes through ggml's row-by-row flash-attention kernel instead of its
tiles of 64 query rows, and beside a long context costs far more a token: a span that ended in
such a piece made 128-token chunks look 17% dearer than 512-token ones, where fed evenly they
cost the same.)
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
SPANS = ((0, 1024), (1024, 2048))
OTHERS = 1800  # tokens of each document resident beside the one fed


def feed(engine: LlamaCppEngine, seq: int, tokens: list[int], start: int, end: int, chunk: int) -> float:
    """Seconds to feed tokens[start:end] to `seq` (which holds tokens[:start]) in chunks of `chunk`."""
    seconds = 0.0
    for at in range(start, end, chunk):
        piece = tokens[at:min(at + chunk, end)]
        began = time.perf_counter()
        engine.step([StepRequest(seq, piece, "none")])
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
            seq, tokens = engine.new_sequence(), engine.tokenize(text_of(OTHERS, salt=7000 + other))[:OTHERS]
            feed(engine, seq, tokens, 0, len(tokens), 512)
        needed = SPANS[-1][1]
        tokens = engine.tokenize(text_of(needed + needed // 4, salt=7100))[:needed]
        if len(tokens) < needed:
            raise SystemExit(f"the document tokenized to {len(tokens)} tokens; {needed} are needed")
        per_token: dict[tuple[int, int], list[float]] = {}
        for turn in range(args.rounds):
            for start, end in SPANS:
                for size in SIZES[turn % len(SIZES):] + SIZES[:turn % len(SIZES)]:
                    seq = engine.new_sequence()  # (a new one each time: any memory kind starts empty)
                    feed(engine, seq, tokens, 0, start, 512)
                    seconds = feed(engine, seq, tokens, start, end, size)
                    per_token.setdefault((size, start), []).append(seconds / (end - start))
                    engine.free_sequence(seq)
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
