"""Decode steps of a llama.cpp engine on SmolLM2 alone, beside a thread that tokenized once and
stays alive, and beside a thread tokenizing without pause, each twice. A thread that has called
llama.cpp's decode makes every step of the engine's own thread about 3x slower (OpenMP); this
measures whether tokenizing (the vocabulary, never the context) does, which decides whether a
request's prompt may be tokenized beside the scheduler thread.

    .venv/bin/python benchmarks/tokenizer_thread.py
"""

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engines import models  # noqa: E402
from engines.base import StepRequest  # noqa: E402
from engines.llamacpp.engine import LlamaCppEngine  # noqa: E402

TEXT = "The capital of France is Paris. The quick brown fox jumps over the lazy dog. " * 40
MODES = (("alone", False), ("beside a thread that tokenized once and stays alive", "once"),
         ("beside a thread tokenizing without pause", True))


def run(path: Path, tokenizing, steps: int = 200) -> tuple[float, int]:
    """Decode steps per second over `steps` steps, with no other thread (False), beside one that
    tokenized once and waits ("once"), or beside one tokenizing in a loop (True); and how many
    tokenizations that thread made."""
    engine = LlamaCppEngine(path, threads=2, n_ctx=4096)
    seq = engine.new_sequence()
    engine.step([StepRequest(seq, engine.tokenize("Once upon a time", special=True), "last")])
    stop, count = threading.Event(), [0]

    def tokenize() -> None:
        text = engine.tokenizer()
        while not stop.is_set():
            text.tokenize(TEXT)
            count[0] += 1
            if tokenizing == "once":
                stop.wait()  # alive, having called llama.cpp once

    worker = threading.Thread(target=tokenize) if tokenizing else None
    if worker is not None:
        worker.start()
    time.sleep(0.2)
    began = time.perf_counter()
    for _ in range(steps):
        engine.step([StepRequest(seq, [42], "last")])
    took = time.perf_counter() - began
    stop.set()
    if worker is not None:
        worker.join()
    engine.close()
    return steps / took, count[0]


def main() -> int:
    path = models.default_model(print)
    for round_ in (1, 2):
        for label, mode in MODES:
            rate, made = run(path, mode)
            beside = f" ({made} tokenizations of {len(TEXT)} characters meanwhile)" if mode else ""
            print(f"round {round_}, {label}: {rate:.1f} decode steps/s{beside}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
