"""What the order of short replies and the next prompt's chunks costs: llama.cpp's cell placement.

    .venv/bin/python benchmarks/decode_placement.py [--requests 32] [--rounds 2]

The 32-clients shape of load.py in-process, on one llama.cpp engine set up as `superfluid serve`
runs it (2 threads, flash attention, 65,536 cells, 8 sequences): requests of ~870 prompt tokens
and 8 generated tokens each, their prompts fed one at a time in chunks of 200 tokens (what a
0.5 s step carries on these cores). Two orders of the same work:

    interleaved   as serve's planner ordered it before lanes about to end went first: a request
                  whose prompt has ended decodes one token a step beside the next prompt's chunks
                  (each step: a forward of the decode tokens, then the chunk), and its sequence is
                  freed after its 8th token;
    apart         as it orders them now: a request whose prompt has ended decodes its 8 tokens in
                  steps of their own before the next prompt's first chunk, then is freed.

Apart makes more forwards (8 of one token a request, 256 in all, where interleaved shares each
decode forward between the one or two requests decoding, about 170): what it gains, it gains in
spite of them.

The figures: each order's wall time, and ms a prompt token by quarter of the requests. llama.cpp
places a forward's tokens in the first free cells from where the last forward ended (or from the
first cell, when the cache has many holes behind). Interleaved, every decode token takes a cell
between two of the next prompt's chunks; when its request ends, the single cells it leaves are
taken by later prompts, whose cells end up spread over blocks of 64 that other sequences fill,
and the flash-attention kernel computes every block any row of a tile can see. The orders run
alternately, `rounds` times each, on a new engine each run (the placement starts empty).
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

PROMPT = 870  # tokens a request's prompt holds (load.py's clients: ~850 tokens of text)
REPLY = 8  # tokens each request generates (load.py's clients ask max_tokens=8)
CHUNK = 200  # prompt tokens a step feeds beside decoding lanes
ORDERS = ("interleaved", "apart")


def run_order(model: Path, order: str, requests: int) -> tuple[float, list[float]]:
    """The wall seconds of `requests` requests in `order`, and ms a prompt token by quarter."""
    engine = LlamaCppEngine(model, n_ctx=65536, threads=2, threads_batch=2, n_seq_max=8, flash_attn=True)
    try:
        prompts = [engine.tokenize(text_of(PROMPT + PROMPT // 4, salt=200 + i))[:PROMPT] for i in range(requests)]
        decoding: dict[int, int] = {}  # sequence -> tokens it still generates
        per_request: list[tuple[float, int]] = []  # (seconds in its chunks, its tokens)
        began = time.perf_counter()
        for index, tokens in enumerate(prompts + [None]):
            seq = engine.new_sequence() if tokens is not None else None
            fed, chunk_seconds = 0, 0.0
            while tokens is not None and fed < len(tokens) or tokens is None and decoding:
                if decoding:  # one token for each request still generating, in a forward of its own
                    engine.step([StepRequest(other, [100 + left], "last") for other, left in decoding.items()])
                    for other in list(decoding):
                        decoding[other] -= 1
                        if decoding[other] == 0:
                            del decoding[other]
                            engine.free_sequence(other)
                if tokens is None:
                    continue
                piece = tokens[fed:fed + CHUNK]
                start = time.perf_counter()
                engine.step([StepRequest(seq, piece, "last" if fed + len(piece) == len(tokens) else "none")])
                chunk_seconds += time.perf_counter() - start
                fed += len(piece)
            if tokens is None:
                break
            per_request.append((chunk_seconds, len(tokens)))
            if order == "apart":  # its reply before the next prompt
                for left in range(REPLY, 0, -1):
                    engine.step([StepRequest(seq, [100 + left], "last")])
                engine.free_sequence(seq)
            else:
                decoding[seq] = REPLY
        wall = time.perf_counter() - began
    finally:
        engine.close()
    bounds = [round(q * requests / 4) for q in range(5)]
    parts = [per_request[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    return wall, [1e3 * sum(s for s, _ in part) / sum(n for _, n in part) for part in parts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF model (default: SmolLM2-135M)")
    parser.add_argument("--requests", type=int, default=32, help="requests per run (default: 32)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each order, alternating (default: 2)")
    args = parser.parse_args(argv)
    model = args.model or Path(models.default_model(progress=print))
    walls: dict[str, list[float]] = {order: [] for order in ORDERS}
    print(f"{model.name}: {args.requests} requests of {PROMPT} prompt tokens and {REPLY} generated, "
          f"chunks of {CHUNK}")
    print("order | wall, s | ms a prompt token, by quarter of the requests")
    for turn in range(args.rounds):
        for order in ORDERS if turn % 2 == 0 else ORDERS[::-1]:
            wall, by_quarter = run_order(model, order, args.requests)
            walls[order].append(wall)
            print(f"{order} | {wall:.1f} | " + " / ".join(f"{ms:.2f}" for ms in by_quarter), flush=True)
    apart, interleaved = statistics.median(walls["apart"]), statistics.median(walls["interleaved"])
    print(f"median wall: interleaved {interleaved:.1f} s, apart {apart:.1f} s (apart / interleaved "
          f"{apart / interleaved:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
