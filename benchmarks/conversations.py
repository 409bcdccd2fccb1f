"""Conversations as chat clients hold them (the whole history sent each turn, the server's own
replies in it): `superfluid serve` against llama-cpp-python's server and llama.cpp's llama-server
(its defaults, and 8 slots), each in its own child process, one after the other.

1. the second turn: a conversation opens with a long first turn; the second turn's first token
   is timed warm (right after the first, on the same server), after a restart of the server
   (ours keeps its KV in the shared-memory pool and its session log; the others keep nothing
   across a restart), and cold (a server that never saw the conversation). Goal: ours ahead of
   llama-server after a restart.
2. a long conversation: `turns` short turns; the first token of the last five turns against the
   first five (a server that re-reads the history each turn gets slower as it grows), and the
   prompt tokens the servers said came from cache. Goal: ours ahead of llama-server late in it.

    .venv/bin/python benchmarks/conversations.py [--quick]   # prints the figures and ratios
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import servers  # noqa: E402
from benchmarks.harness import Run  # noqa: E402
from benchmarks.texts import text_of  # noqa: E402

GROUP = "conversations: ours against llama-cpp-python's server and llama-server"
SERVERS = (servers.OURS, servers.THEIRS, *servers.PEERS)
REPLY_TOKENS = 16
EDGE = 5  # turns at each end of the long conversation that are compared


@dataclass(frozen=True)
class ConversationSizes:
    """How big each conversation is."""

    first_turn: int  # tokens of the opening turn's system text
    samples: int  # second-turn samples per server (each a conversation of its own)
    turns: int  # turns of the long conversation


FULL = ConversationSizes(first_turn=1500, samples=2, turns=40)
QUICK = ConversationSizes(first_turn=200, samples=1, turns=2 * EDGE)


def turn(served: servers.Served, messages: list[dict]) -> tuple[float, str, int | None]:
    """One streamed chat turn of REPLY_TOKENS tokens: (seconds to its first text, the reply, the
    prompt tokens the server said came from cache, None if it does not say)."""
    start = time.perf_counter()
    stream = served.client.chat.completions.create(
        model=served.model, messages=messages, max_tokens=REPLY_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=served.exact(REPLY_TOKENS))
    first, parts, cached = None, [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        usage = getattr(chunk, "usage", None)
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        if details is not None and getattr(details, "cached_tokens", None) is not None:
            cached = details.cached_tokens
    return (first if first is not None else time.perf_counter() - start), "".join(parts), cached


def opening(sample: int, first_turn: int) -> list[dict]:
    """A conversation's first turn: a long system text and a question."""
    return [{"role": "system", "content": text_of(first_turn, salt=3000 + sample)},
            {"role": "user", "content": "What is this text about?"}]


def second_turn(run: Run, served: servers.Served, sizes: ConversationSizes, tick: Callable[[str], None]) -> None:
    """Per sample, three conversations: one continued warm and then (its third turn) after a
    restart, and a cold one (its second turn on a server that never saw it)."""
    warm, restarted, cold = [], [], []
    for sample in range(sizes.samples):
        messages = opening(2 * sample, sizes.first_turn)
        _, reply, _ = turn(served, messages)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Say more."}]
        seconds, reply, _ = turn(served, messages)
        warm.append(seconds)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
        served.restart()
        restarted.append(turn(served, messages)[0])
        stranger = opening(2 * sample + 1, sizes.first_turn)  # never seen: its history is new to the server
        stranger += [{"role": "assistant", "content": "It is about many things."},
                     {"role": "user", "content": "Say more."}]
        cold.append(turn(served, stranger)[0])
        tick(f"{served.label}: second turn {sample + 1}/{sizes.samples}")
    label = f"{served.label}: next turn's first token after a {sizes.first_turn}-token first turn"
    run.record(f"{label}, warm", warm)
    run.record(f"{label}, after a restart", restarted)
    run.record(f"{label}, cold", cold)
    run.ratio(f"{served.label}: next turn cold / warm", ours=f"{label}, warm", baseline=f"{label}, cold", group=GROUP)
    run.ratio(f"{served.label}: next turn cold / after a restart", ours=f"{label}, after a restart",
              baseline=f"{label}, cold", group=GROUP)


def long_conversation(run: Run, served: servers.Served, sizes: ConversationSizes,
                      tick: Callable[[str], None]) -> None:
    """`turns` short turns in one conversation, each sending the whole history."""
    messages = [{"role": "system", "content": "You are a patient assistant."}]
    seconds, cached = [], []
    for i in range(sizes.turns):
        messages.append({"role": "user", "content": f"Turn {i}: {text_of(24, salt=4000 + i)}"})
        took, reply, from_cache = turn(served, messages)
        messages.append({"role": "assistant", "content": reply})
        seconds.append(took)
        cached.append(from_cache)
    tick(f"{served.label}: {sizes.turns}-turn conversation")
    label = f"{served.label}: first token in a {sizes.turns}-turn conversation"
    run.record(f"{label}, turns 1-{EDGE}", seconds[:EDGE])
    run.record(f"{label}, last {EDGE} turns", seconds[-EDGE:])
    run.ratio(f"{served.label}: {sizes.turns}-turn conversation, first token early / late",
              ours=f"{label}, last {EDGE} turns", baseline=f"{label}, turns 1-{EDGE}", group=GROUP)
    run.note(f"{served.label}: prompt tokens from cache in the last {EDGE} of {sizes.turns} turns", cached[-EDGE:])


def bench(run: Run, model: Path, sizes: ConversationSizes, tick: Callable[[str], None]) -> None:
    """Both conversations on each server, then ours against llama-server."""
    with tempfile.TemporaryDirectory() as scratch:
        for start in (lambda: servers.start_ours(model, servers.PEER_CONTEXT, scratch),
                      lambda: servers.start_theirs(model, servers.PEER_CONTEXT, cache=False),
                      lambda: servers.start_peer(model, servers.PEER_CONTEXT),
                      lambda: servers.start_peer(model, servers.PEER_CONTEXT, slots=8)):
            served = start()
            try:
                served.complete(text_of(32, salt=999), 4)  # one-time costs go here
                second_turn(run, served, sizes, tick)
                long_conversation(run, served, sizes, tick)
            finally:
                served.stop()
    after = f"next turn's first token after a {sizes.first_turn}-token first turn, after a restart"
    late = f"first token in a {sizes.turns}-turn conversation, last {EDGE} turns"
    for peer in (servers.THEIRS, *servers.PEERS):
        goal = 1 if peer in servers.PEERS else None
        run.ratio(f"next turn after a restart: {peer} / ours", ours=f"{servers.OURS}: {after}",
                  baseline=f"{peer}: {after}", group=GROUP, goal=goal)
        run.ratio(f"{sizes.turns}-turn conversation, late first token: {peer} / ours", ours=f"{servers.OURS}: {late}",
                  baseline=f"{peer}: {late}", group=GROUP, goal=goal)


def main(argv: list[str] | None = None) -> int:
    """The command line: --quick for small sizes, --model for another GGUF."""
    return servers.standalone(argv, __doc__.splitlines()[0], "bench-conversations", bench, FULL, QUICK)

if __name__ == "__main__":
    sys.exit(main())
