"""Where a traffic shape's time goes inside `superfluid serve`: every step and every forward timed.

    .venv/bin/python benchmarks/step_trace.py [--alone | --conversations] [--targets FIRST DECODE] [--salt N]
                                              [--peer] [--trace PATH]

Starts serve as traffic.py does (llama.cpp, the default model, disk tier off) through this file,
which wraps the command: it times each step of the scheduler and each llama_decode call of the
engine into a trace file (one line each, a few microseconds). Then it sends traffic.py's
documents-beside-chats shape (3 documents of ~1,800 tokens sent together, a streamed one-line
chat every second), or with --alone the documents alone, or with --conversations traffic.py's
conversations shape (24 conversations of 3 turns through 4 clients), and prints where the
shape's wall time went: the documents' prompt chunks (forwards of 64 tokens or more), the small forwards
beside them (decode tokens, short prompts), the steps that only feed short prompts or only
decode, the steps stopped or planned again for an arrival (their work thrown away), and how
well the planner's step costs predicted each step before it ran (predicted over measured).
`--targets` passes serve's --first-token-target and --decode-step-target; `--peer` sends the same
shape to llama-server as traffic.py runs it (its times only) to set beside ours.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import servers, traffic  # noqa: E402
from benchmarks.harness import Run  # noqa: E402
from engines import models  # noqa: E402

WRAP = "--wrap"  # argv[1] when this file runs serve: --wrap TRACE_FILE serve ...
CHUNK = 64  # a forward of this many tokens or more is a prompt chunk (ggml's tile of query rows)


def _serve_traced(trace_path: str, argv: list[str]) -> int:
    """Run `superfluid <argv>` with its steps and forwards timed into `trace_path`."""
    from engines.llamacpp.engine import LlamaCppEngine
    from superfluid.cli.main import main
    from superfluid.host.planner import depth_of
    from superfluid.host.scheduler import Scheduler

    out = open(trace_path, "w", buffering=1)
    decode, step, measure = LlamaCppEngine._decode, Scheduler._step, Scheduler._measure

    def timed_decode(self, chunk, results):
        began = time.perf_counter()
        try:
            return decode(self, chunk, results)
        finally:  # F end seconds tokens sequences
            out.write(f"F {time.monotonic():.4f} {time.perf_counter() - began:.5f} {len(chunk)} "
                      f"{len({item[1] for item in chunk})}\n")

    def timed_step(self, requests):
        began, self.traced_finished = time.perf_counter(), False
        try:
            return step(self, requests)
        finally:  # P end seconds finished: every step begun, with whether its forwards all ran
            out.write(f"P {time.monotonic():.4f} {time.perf_counter() - began:.5f} {int(self.traced_finished)}\n")

    def timed_measure(self, requests, seconds):  # S end seconds predicted depth sizes...: the steps that finished
        self.traced_finished = True
        depth = depth_of(requests)
        predicted = self.planner.costs.seconds_for(sum(len(r.tokens) for _, r in requests), depth)
        out.write(f"S {time.monotonic():.4f} {seconds:.5f} {-1 if predicted is None else predicted:.5f} {depth:.1f} "
                  f"{' '.join(str(len(r.tokens)) for _, r in requests)}\n")
        return measure(self, requests, seconds)

    LlamaCppEngine._decode, Scheduler._step, Scheduler._measure = timed_decode, timed_step, timed_measure
    return main(argv)


def documents_alone(served: servers.Served, sizes: traffic.TrafficSizes, salt: int) -> float:
    """The shape's documents without the chats: their wall time."""
    start = time.perf_counter()

    def document(d: int) -> None:
        traffic.chat(served, traffic.document_messages(sizes, salt, d), sizes.reply)

    with ThreadPoolExecutor(sizes.documents) as workers:
        list(workers.map(document, range(sizes.documents)))
    return time.perf_counter() - start


def summarise(trace_path: str, began: float, ended: float, say: Callable[[str], None] = print) -> None:
    """Print where the seconds between `began` and `ended` (time.monotonic) went."""
    forwards, steps, begun, dropped, predictions = [], [], [], [], []
    with open(trace_path) as trace:
        for line in trace:
            kind, at, seconds, *rest = line.split()
            if not began <= float(at) <= ended + 0.01:
                continue
            if kind == "F":
                forwards.append((float(at), float(seconds), int(rest[0]), int(rest[1])))
            elif kind == "S":
                steps.append((float(at), float(seconds), [int(n) for n in rest[2:]]))
                if float(rest[0]) >= 0:  # what the planner's costs predicted for it before it ran
                    predictions.append((float(rest[0]) / float(seconds) if float(seconds) > 0 else 1.0,
                                        max(int(n) for n in rest[2:]) >= CHUNK))
            else:
                begun.append(float(seconds))
                if rest[0] == "0":  # stopped for an arrival, or planned again before it ran
                    dropped.append(float(seconds))
    if not forwards or not steps:
        raise RuntimeError(f"the trace holds no steps between {began:.1f} and {ended:.1f}: did serve run "
                           "through the wrapper (superfluid re-executes itself where OpenBLAS must be preloaded)?")
    chunks = [f for f in forwards if f[2] >= CHUNK]
    kinds: dict[str, list[float]] = {"feed a prompt chunk": [], "feed only short prompts": [], "only decode": []}
    beside = 0.0
    for at, seconds, sizes in steps:
        prompts = [n for n in sizes if n > 1]
        kind = ("only decode" if not prompts else
                "feed a prompt chunk" if max(prompts) >= CHUNK else "feed only short prompts")
        kinds[kind].append(seconds)
        if kind == "feed a prompt chunk":
            beside += sum(f[1] for f in forwards if f[2] < CHUNK and at - seconds - 0.0005 <= f[0] <= at + 0.0005)
    wall = ended - began
    say(f"wall time {wall:.2f} s; in steps {sum(begun):.2f} s, outside them {wall - sum(begun):.2f} s")
    if chunks:
        tokens = sum(f[2] for f in chunks)
        say(f"prompt chunks (forwards of {CHUNK}+ tokens): {sum(f[1] for f in chunks):.2f} s for {tokens} tokens, "
            f"{1e3 * sum(f[1] for f in chunks) / tokens:.2f} ms a token, {min(f[2] for f in chunks)}-"
            f"{max(f[2] for f in chunks)} tokens a forward (stopped forwards included)")
    say(f"small forwards in the steps that feed a chunk: {beside:.2f} s")
    for kind, durations in kinds.items():
        say(f"steps that {kind}: {len(durations)}, {sum(durations):.2f} s")
    say(f"steps stopped or planned again (work thrown away): {len(dropped)}, {sum(dropped):.2f} s")
    for chunked, name in ((True, "with a prompt chunk"), (False, "without")):
        ratios = sorted(ratio for ratio, kind in predictions if kind == chunked)
        if ratios:  # predicted over measured: under 1 is a step that ran past its prediction
            say(f"predicted / measured, steps {name}: median {ratios[len(ratios) // 2]:.2f}, "
                f"10th-90th percentile {ratios[len(ratios) // 10]:.2f}-{ratios[9 * len(ratios) // 10]:.2f} "
                f"({len(ratios)} steps)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == WRAP:
        return _serve_traced(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--alone", action="store_true", help="the documents without the chats")
    shape.add_argument("--conversations", action="store_true", help="traffic.py's conversations shape instead")
    parser.add_argument("--targets", nargs=2, type=float, metavar=("FIRST", "DECODE"),
                        help="serve's two targets, in seconds (default: serve's)")
    parser.add_argument("--salt", type=int, default=30, help="another number sends other texts (default: 30)")
    parser.add_argument("--peer", action="store_true", help="llama-server on the same shape instead (times only)")
    parser.add_argument("--trace", metavar="PATH", help="keep the trace in this file (default: a temporary one)")
    args = parser.parse_args(argv)
    model = Path(models.default_model(progress=print))
    sizes = traffic.FULL
    targets = (("--first-token-target", str(args.targets[0]), "--decode-step-target", str(args.targets[1]))
               if args.targets else ())
    with tempfile.TemporaryDirectory() as scratch:
        trace_path = os.path.abspath(args.trace) if args.trace else os.path.join(scratch, "trace")
        if args.peer:  # llama-server as traffic.py runs it, untraced: the same shape's times to set beside ours
            served = servers.start_peer(model, servers.PEER_CONTEXT, extra=("-fa", "on"))
        else:
            served = servers.start_ours(model, None, scratch, extra=("--disk-tier", "no", *targets),
                                        command=(sys.executable, str(Path(__file__).resolve()), WRAP, trace_path))
        try:
            traffic.chat(served, [{"role": "user", "content": "Hello."}], 4)  # one-time costs
            began = time.monotonic()
            if args.conversations:
                run = Run("step-trace")
                traffic.conversations(run, served, sizes)
                wall = run.figures[f"{served.label}: {traffic.label_conversations(sizes)}"].samples[0]
                print(f"{served.label}: the conversations done in {wall:.1f} s")
            elif args.alone:
                wall = documents_alone(served, sizes, args.salt)
                print(f"{served.label}: the documents alone done in {wall:.1f} s")
            else:
                run = Run("step-trace")
                traffic.documents_beside_chats(run, served, sizes, salt=args.salt)
                wall = run.figures[f"{served.label}: {traffic.label_documents(sizes)}"].samples[0]
                chats = run.figures[f"{served.label}: {traffic.CHATS}"].samples
                print(f"{served.label}: the documents beside chats done in {wall:.1f} s; the chats' first "
                      f"token p50 {traffic.percentile(chats, 50):.2f} s, p95 {traffic.percentile(chats, 95):.2f} s")
            if not args.peer:
                time.sleep(0.1)  # the last step's line is written after its readers were woken
                summarise(trace_path, began, began + wall)
        finally:
            served.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
