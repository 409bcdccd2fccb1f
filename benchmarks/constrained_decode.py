"""Constrained against unconstrained decoding in the Host, side by side in one run: decode tokens/s
of 1 and of 8 streams, and the time to the first token of a request whose schema was compiled
before, on SmolLM2 (llama.cpp). The constraint is a JSON schema whose output is longer than the
tokens asked for (an array of sixty short strings), so every token of both is drawn; rounds
alternate, and the ratio of medians is printed (goal: >= 0.9 for each).

With --llama-server the same figures are measured, in the same run, on llama.cpp's llama-server
(8 slots, built as the other benchmarks build it): the same prompt (cached by it after a first
request, as ours is prefilled before timing), the same schema as `response_format`, the same
token counts; its ratio is printed beside ours.

    .venv/bin/python benchmarks/constrained_decode.py [--rounds 5] [--tokens 128] [--llama-server]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
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


def peer_decode_rate(served, streams: int, tokens: int, schema: dict | None) -> float:
    """llama-server's tokens per second of `streams` requests of `tokens` each, at once (their
    prompt in its cache already)."""
    def one(seed: int) -> int:
        reply = served.client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens, temperature=0.7,
            seed=seed, **_peer_constraint(schema), extra_body={"ignore_eos": schema is None})
        return reply.usage.completion_tokens

    began = time.perf_counter()
    with ThreadPoolExecutor(streams) as workers:
        produced = sum(workers.map(one, range(streams)))
    return produced / (time.perf_counter() - began)


def peer_first_token(served, schema: dict | None) -> float:
    """Seconds from asking llama-server to the first piece of its streamed reply."""
    began = time.perf_counter()
    stream = served.client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=2, stream=True,
        **_peer_constraint(schema))
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    seconds = time.perf_counter() - began
    stream.close()
    return seconds


def _peer_constraint(schema: dict | None) -> dict:
    return {} if schema is None else {"response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "list", "schema": schema}}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--llama-server", action="store_true", help="the same figures on llama-server, in this run")
    args = parser.parse_args(argv)
    served = None
    if args.llama_server:  # alternating with ours, round by round: the machine's noise falls on both
        from benchmarks.servers import start_peer

        served = start_peer(models.default_model(), 4096, slots=8)
        peer_decode_rate(served, 1, 1, None)  # the prompt into its cache
    ours: dict[str, dict[str, list[float]]] = {}
    theirs: dict[str, dict[str, list[float]]] = {}
    try:
        with tempfile.TemporaryDirectory() as directory, \
                Host(models.default_model(), pool_name=f"constrained-{Path(directory).name}", log_dir=directory,
                     llamacpp_threads=2, llamacpp_threads_batch=2) as host:
            constraint = Constraint.json_schema(SCHEMA)
            host.grammars.compile(constraint)  # seen before: what a repeated request finds
            for _ in range(args.rounds):
                for name, held, schema in (("unconstrained", None, None), ("constrained", constraint, SCHEMA)):
                    for streams in (1, 8):
                        figure = f"decode tokens/s, {streams} stream(s)"
                        ours.setdefault(figure, {}).setdefault(name, []).append(
                            decode_rate(host, streams, args.tokens, held))
                        if served is not None:
                            theirs.setdefault(figure, {}).setdefault(name, []).append(
                                peer_decode_rate(served, streams, args.tokens, schema))
                    ours.setdefault("first token, s", {}).setdefault(name, []).append(first_token(host, held))
                    if served is not None:
                        theirs.setdefault("first token, s", {}).setdefault(name, []).append(
                            peer_first_token(served, schema))
            host.close(remove_pool=True)
    finally:
        if served is not None:
            served.stop()
    _print("superfluid", ours)
    if served is not None:
        _print("llama-server (response_format json_schema)", theirs)
    return 0


def _print(label: str, figures: dict[str, dict[str, list[float]]]) -> None:
    print(label)
    print(f"{'figure':36} {'unconstrained':>14} {'constrained':>12} {'ratio':>7}  goal")
    for figure, sides in figures.items():
        plain, held = statistics.median(sides["unconstrained"]), statistics.median(sides["constrained"])
        ratio = held / plain if "tokens/s" in figure else plain / held  # >= 1 is better for both
        print(f"{figure:36} {plain:14.3f} {held:12.3f} {ratio:7.3f}  >= 0.9 {'met' if ratio >= 0.9 else 'MISSED'}")


if __name__ == "__main__":
    raise SystemExit(main())
