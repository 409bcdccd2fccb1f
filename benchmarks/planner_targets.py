"""The planner's two targets against each other: `superfluid serve` alone on traffic.py's
"documents beside chats" shape (3 documents of ~1,800 tokens sent together, a one-line chat every
second while they run), once for each pair of targets given.

    .venv/bin/python benchmarks/planner_targets.py "1 0.5" "1 1" "2 2"

Each pair is `--first-token-target` and `--decode-step-target` (none given: serve's defaults,
"1 0.5"); the figures are the documents' wall time and the chats' first token (p50 and p95).
Longer steps carry more prompt tokens and fewer decode forwards beside them, and make an arriving
chat wait longer for the step in flight.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import servers, traffic  # noqa: E402
from benchmarks.harness import Run  # noqa: E402
from engines import models  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    pairs = [pair.split() for pair in (argv if argv is not None else sys.argv[1:])] or [["1", "0.5"]]
    model = Path(models.default_model(progress=print))
    print("first-token target, decode-step target | documents done, s | chats' first token p50 / p95, s")
    for first, decode in pairs:
        with tempfile.TemporaryDirectory() as scratch:
            served = servers.start_ours(model, None, scratch, extra=("--first-token-target", first,
                                                                     "--decode-step-target", decode))
            try:
                run = Run("planner-targets")
                traffic.chat(served, [{"role": "user", "content": "Hello."}], 4)  # one-time costs
                traffic.documents_beside_chats(run, served, traffic.FULL)
                documents = run.figures[f"{served.label}: {traffic.label_documents(traffic.FULL)}"].samples[0]
                chats = run.figures[f"{served.label}: {traffic.CHATS}"].samples
                print(f"{first}, {decode} | {documents:.1f} | {traffic.percentile(chats, 50):.2f} / "
                      f"{traffic.percentile(chats, 95):.2f}", flush=True)
            finally:
                served.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
