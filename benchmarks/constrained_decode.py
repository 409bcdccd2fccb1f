"""Constrained against unconstrained decoding in the Host, side by side in one run: decode tokens/s
of 1 and of 8 streams, and the time to the first token of a request whose schema was compiled
before, on SmolLM2 (llama.cpp). The constraint is a JSON schema whose output is longer than the
tokens asked for (an array of sixty short strings), so every token of both is drawn; rounds
alternate, and the ratio of medians is printed (goal: >= 0.9 for each).

    .venv/bin/python benchmarks/constrained_decode.py [--rounds 5] [--tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines import models  # noqa: E402
from superfluid import Host  # noqa: E402
from superfluid.host.constraints import Constraint  # noqa: E402

SCHEMA = {"type": "array", "minItems": 60, "maxItems": 60, "items": {"type": "string", "maxLength": 24}}
PROMPT = "List sixty kinds of fruit and vegetables as a JSON array of strings."


def decode_rate(host: Host, streams: int, tokens: int, constraint) -> float:
    """Tokens per second of `streams` generations of `tokens` each, at once (after their prompts)."""
    sessions = []
    for i in range(streams):
        session = host.session(temperature=0.7, seed=i)
        session.append_user(PROMPT)
        session.complete(max_tokens=1)  # the prompt is in: what follows is decode
        sessions.append(session)
    began = time.perf_counter()
    generations = [s.generate(max_tokens=tokens, ignore_eos=constraint is None, constraint=constraint)
                   for s in sessions]
    produced = sum(len(g.collect()) and len(g.tokens) for g in generations)
    seconds = time.perf_counter() - began
    for session in sessions:
        host.delete(session.id)
    return produced / seconds


def first_token(host: Host, constraint) -> float:
    """Seconds from asking to the first piece of a new session's reply."""
    session = host.session()
    session.append_user(PROMPT)
    began = time.perf_counter()
    generation = session.generate(max_tokens=2, constraint=constraint)
    next(iter(generation))
    seconds = time.perf_counter() - began
    generation.collect()
    host.delete(session.id)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory, \
            Host(models.default_model(), pool_name=f"constrained-{Path(directory).name}", log_dir=directory,
                 llamacpp_threads=2, llamacpp_threads_batch=2) as host:
        schema = Constraint.json_schema(SCHEMA)
        host.grammars.compile(schema)  # seen before: what a repeated request finds
        figures: dict[str, dict[str, list[float]]] = {}
        for _ in range(args.rounds):
            for name, constraint in (("unconstrained", None), ("constrained", schema)):
                for streams in (1, 8):
                    figures.setdefault(f"decode tokens/s, {streams} stream(s)", {}).setdefault(name, []).append(
                        decode_rate(host, streams, args.tokens, constraint))
                figures.setdefault("first token, s", {}).setdefault(name, []).append(first_token(host, constraint))
        host.close(remove_pool=True)
    print(f"{'figure':36} {'unconstrained':>14} {'constrained':>12} {'ratio':>7}  goal")
    for figure, sides in figures.items():
        plain, held = statistics.median(sides["unconstrained"]), statistics.median(sides["constrained"])
        ratio = held / plain if "tokens/s" in figure else plain / held  # >= 1 is better for both
        print(f"{figure:36} {plain:14.3f} {held:12.3f} {ratio:7.3f}  >= 0.9 {'met' if ratio >= 0.9 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
