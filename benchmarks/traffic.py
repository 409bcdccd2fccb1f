"""Traffic as users send it: `superfluid serve` against llama.cpp's llama-server, side by side.

Each server runs in its own child process, one after the other, on the same GGUF, 2 threads and
flash attention on, in `passes` passes: every server is started afresh in each pass, and every
other pass takes them in the reverse order, so that the machine's drift over the run (10-30%
within an hour on a shared machine) falls on every server alike; a figure's samples are its
passes' together (a full run, two passes, takes about 26 minutes on 2 cores). The servers: ours
with serve's defaults (cells sized from memory), llama-server with its defaults (4 slots on
8,192 cells) and with `-np 8 --kv-unified` (8 slots sharing one cache of as many cells as ours
sized in the first pass: on 8,192 the six agents overflow it). A shape a server fails is noted
as FAILED, with its error, and the others go on. Every shape is
driven with the official openai client as OpenAI clients send it: chat completions, no priority
field, greedy, each reply exactly `reply` tokens long (`ignore_eos`, which both take).

1. one stream decoding: a short prompt, `decode_tokens` tokens streamed; tokens/s.
2. four streams decoding: four such requests at once; aggregate tokens/s.
3. conversations: `conversations` conversations of `turns` turns, each opening on its own
   ~`document`-token document, `clients` clients at once. The turns come back in rounds (every
   conversation's first turn, then every second turn, ...), so more conversations come back than
   any server holds in its cells or slots; each turn sends the whole history, as clients do.
   Wall time until the last reply.
4. documents beside chats: `documents` requests on ~`long`-token documents sent together, and a
   one-line chat every `chat_every` s while they run (at least `chats` of them). Wall time until
   the documents are done; each chat's time to first token (p50, p95); noted, when each
   document was done and how many chats were answered whole by then (the chats' work a server
   did inside the documents' time). Beside it, with no goal, the wall time until everything sent
   was answered, the documents and every chat: a server that leaves the chats waiting until its
   documents are done does their work after the documents' time, and this figure counts it.
   (A server whose documents take longer is sent more chats, one a `chat_every`: the count is
   noted.)
5. agents on a shared preamble: `agents` agents of `steps` steps each, every one on the same
   ~`preamble`-token system prompt plus its own task; each step sends the history with the last
   reply and a short tool result. Wall time until the last agent's last reply.

Ours runs twice: as serve starts by default (its disk tier on, writing parked KV in the background)
and with `--disk-tier no` (the pool's memory only), so that one run says what the tier costs or
gains in each shape.

Ratios: ours over theirs for rates, theirs over ours for times (above 1: ours ahead). The goal
(1) is set against the better of llama-server's two configurations; ours against ours without
the tier has no goal but "unchanged" where the tier only writes (1 within the spread).

    .venv/bin/python benchmarks/traffic.py [--quick]   # prints the figures and ratios
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import servers  # noqa: E402
from benchmarks.harness import Run  # noqa: E402
from benchmarks.texts import text_of  # noqa: E402

GROUP = "traffic: ours against llama.cpp's llama-server"
CHATS = "short chats beside the documents, first token"
SYSTEM = "You are terse."


@dataclass(frozen=True)
class TrafficSizes:
    """How much of each shape one run sends."""

    decode_tokens: int = 256
    decode_repeat: int = 5
    conversations: int = 24
    turns: int = 3
    document: int = 750
    clients: int = 4
    documents: int = 3
    long: int = 1800
    chat_every: float = 1.0
    chats: int = 20
    agents: int = 6
    steps: int = 5
    preamble: int = 1200
    reply: int = 32
    passes: int = 2  # every server in turn, the order reversed in the next pass


FULL = TrafficSizes()
QUICK = TrafficSizes(decode_tokens=64, decode_repeat=2, conversations=6, turns=2, document=300, clients=2,
                     documents=2, long=600, chat_every=0.5, chats=5, agents=3, steps=2, preamble=400, reply=8,
                     passes=1)


def chat(served: servers.Served, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    """One chat completion of exactly `max_tokens` tokens, as a plain client sends it; its text
    and the tokens generated."""
    reply = served.client.chat.completions.create(model=served.model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0.0, extra_body=served.exact(max_tokens))
    return reply.choices[0].message.content or "", reply.usage.completion_tokens


def streamed_tokens(served: servers.Served, prompt: str, tokens: int) -> int:
    """Stream one chat of exactly `tokens` tokens to its end; the tokens generated."""
    stream = served.client.chat.completions.create(
        model=served.model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        max_tokens=tokens, temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body=served.exact(tokens))
    generated = 0
    for chunk in stream:
        if chunk.usage is not None:
            generated = chunk.usage.completion_tokens
    return generated


def decoding(run: Run, served: servers.Served, sizes: TrafficSizes, streams: int) -> None:
    """`streams` streams decoding at once from short prompts: aggregate tokens/s, `decode_repeat` samples."""
    rates = []
    for r in range(sizes.decode_repeat):
        prompts = [f"Write about {text_of(8, salt=700 + 10 * r + i)}." for i in range(streams)]
        start = time.perf_counter()
        with ThreadPoolExecutor(streams) as workers:
            generated = sum(workers.map(lambda p: streamed_tokens(served, p, sizes.decode_tokens), prompts))
        rates.append(generated / (time.perf_counter() - start))
    run.record(f"{served.label}: {label_streams(streams)}", rates, unit="tok/s")


def label_streams(streams: int) -> str:
    return "one stream decoding, tokens/s" if streams == 1 else f"{streams} streams decoding, tokens/s"


def conversations(run: Run, served: servers.Served, sizes: TrafficSizes) -> None:
    """Every conversation's turn t, round after round, through `clients` clients; the wall time."""
    histories = [[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": f"{text_of(sizes.document, salt=2000 + c)}\n\nSummarise this."}]
                 for c in range(sizes.conversations)]

    def turn(history: list[dict], t: int) -> int:
        if t > 0:
            history.append({"role": "user", "content": f"And point {t}: {text_of(12, salt=3000 + t)}?"})
        text, generated = chat(served, history, sizes.reply)
        history.append({"role": "assistant", "content": text})
        return generated

    start = time.perf_counter()
    generated = 0
    with ThreadPoolExecutor(sizes.clients) as clients:
        for t in range(sizes.turns):
            generated += sum(clients.map(lambda h: turn(h, t), histories))
    run.record(f"{served.label}: {label_conversations(sizes)}", [time.perf_counter() - start])
    run.note(f"{served.label}: tokens generated in the conversations", generated)


def label_conversations(sizes: TrafficSizes) -> str:
    return (f"{sizes.conversations} conversations x {sizes.turns} turns (~{sizes.document}-token documents), "
            f"{sizes.clients} clients")


def document_messages(sizes: TrafficSizes, salt: int, d: int) -> list[dict]:
    """The messages of the shape's document `d` (another `salt`, another text)."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{text_of(sizes.long, salt=4000 + 100 * salt + d)}\n\nSummarise this."}]


def documents_beside_chats(run: Run, served: servers.Served, sizes: TrafficSizes, salt: int = 0) -> None:
    """`documents` long requests at once, and a one-line chat every `chat_every` s until they are
    done and `chats` chats were sent (each on a thread of its own, so none waits for a client);
    the documents' wall time, each chat's first-token time. Another `salt` sends other texts (no
    cache holds them from an earlier round)."""
    start = time.perf_counter()
    waits: list[float] = []
    answered: list[float] = []  # when each chat's whole reply was read, from the start

    def document(d: int) -> float:
        chat(served, document_messages(sizes, salt, d), sizes.reply)
        return time.perf_counter() - start

    def one_chat(c: int) -> None:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Say hello to {text_of(3, salt=1000 * salt + c)}."}]
        waits.append(servers.first_text_seconds(served.client, served.model, messages, 8, temperature=0.0,
                                                extra_body=served.exact(8)))
        answered.append(time.perf_counter() - start)

    with ThreadPoolExecutor(sizes.documents) as long_ones:
        pending = [long_ones.submit(document, d) for d in range(sizes.documents)]
        chatting = []
        while not all(p.done() for p in pending) or len(chatting) < sizes.chats:
            chatting.append(threading.Thread(target=one_chat, args=(len(chatting),)))
            chatting[-1].start()
            time.sleep(sizes.chat_every)
        finished = [p.result() for p in pending]  # (a document's failure is raised here)
        for thread in chatting:
            thread.join()
    run.record(f"{served.label}: {label_documents(sizes)}", [max(finished)])
    if len(waits) != len(chatting):
        raise RuntimeError(f"{served.label}: {len(chatting) - len(waits)} of {len(chatting)} chats failed")
    run.record(f"{served.label}: {label_everything(sizes)}", [max(finished + answered)])
    run.record(f"{served.label}: {CHATS}", sorted(waits))
    run.note(f"{served.label}: chats beside the documents", len(waits))
    # What else the server did by the documents' end: a server that answers the chats meanwhile
    # does their work inside the documents' time, one that leaves them waiting does it after.
    run.note(f"{served.label}: chats answered whole before the documents were done",
             sum(1 for moment in answered if moment <= max(finished)))
    run.note(f"{served.label}: each document done at (s)", " ".join(f"{moment:.1f}" for moment in sorted(finished)))


def label_documents(sizes: TrafficSizes) -> str:
    return f"{sizes.documents} documents (~{sizes.long} tokens) beside short chats: documents done"


def label_everything(sizes: TrafficSizes) -> str:
    return f"{sizes.documents} documents (~{sizes.long} tokens) beside short chats: documents and chats all answered"


def agents(run: Run, served: servers.Served, sizes: TrafficSizes) -> None:
    """`agents` agents at once, `steps` steps each, on one shared preamble; the wall time."""
    preamble = f"{SYSTEM} {text_of(sizes.preamble, salt=5000)}"

    def agent(a: int) -> int:
        history = [{"role": "system", "content": preamble},
                   {"role": "user", "content": f"Task {a}: {text_of(20, salt=5100 + a)}."}]
        generated = 0
        for s in range(sizes.steps):
            text, n = chat(served, history, sizes.reply)
            generated += n
            history += [{"role": "assistant", "content": text},
                        {"role": "user", "content": f"Tool result {s}: {text_of(40, salt=5200 + 10 * a + s)}"}]
        return generated

    start = time.perf_counter()
    with ThreadPoolExecutor(sizes.agents) as workers:
        generated = sum(workers.map(agent, range(sizes.agents)))
    run.record(f"{served.label}: {label_agents(sizes)}", [time.perf_counter() - start])
    run.note(f"{served.label}: tokens generated by the agents", generated)


def label_agents(sizes: TrafficSizes) -> str:
    return f"{sizes.agents} agents x {sizes.steps} steps on a shared ~{sizes.preamble}-token preamble"


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0-100) of `samples`, by the inclusive method."""
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q) - 1] if len(samples) > 1 else samples[0]


def bench(run: Run, model: Path, sizes: TrafficSizes, tick: Callable[[str], None]) -> None:
    """Every shape on each server, one server at a time, in `sizes.passes` passes (the servers'
    order reversed every other pass), then the ratios against each peer."""
    if sizes.passes < 1:
        raise ValueError(f"passes={sizes.passes}: at least 1")
    shapes = [("decoding, one stream", lambda r, s: decoding(r, s, sizes, 1)),
              ("decoding, four streams", lambda r, s: decoding(r, s, sizes, 4)),
              ("conversations", lambda r, s: conversations(r, s, sizes)),
              ("documents beside chats", lambda r, s: documents_beside_chats(r, s, sizes)),
              ("agents", lambda r, s: agents(r, s, sizes))]
    cells: dict[str, int] = {}  # what ours sized in the first pass, for the 8-slot peer in every pass
    passes: list[Run] = []
    with tempfile.TemporaryDirectory() as scratch:
        starts = [lambda: servers.start_ours(model, None, scratch),
                  lambda: servers.start_ours(model, None, scratch, extra=("--disk-tier", "no"),
                                             label=servers.OURS_NO_DISK),
                  lambda: servers.start_peer(model, servers.PEER_CONTEXT, extra=("-fa", "on")),
                  lambda: servers.start_peer(model, cells["ours"], slots=8, extra=("-fa", "on"))]
        for number in range(sizes.passes):
            this = Run(run.name)
            named = f"pass {number + 1}/{sizes.passes}: " if sizes.passes > 1 else ""
            # the first pass starts ours first, so the 8-slot peer knows the cells before it starts
            for start in starts if number % 2 == 0 else starts[::-1]:
                served = start()
                try:
                    if served.label == servers.OURS and "ours" not in cells:
                        cells["ours"] = json.loads(served.get("/health"))["kv"]["cells"]
                        run.note("cells: ours (sized from memory) and llama-server -np 8 --kv-unified (the same)",
                                 cells["ours"])
                    _every_shape(this, served, shapes, tick, named)
                finally:
                    served.stop()
            passes.append(this)
    merge_passes(run, passes)
    for label in (label_streams(1), label_streams(4), label_conversations(sizes), label_documents(sizes), CHATS,
                  label_everything(sizes), label_agents(sizes)):
        if f"{servers.OURS}: {label}" not in run.figures:
            continue
        medians = {peer: run.figures[f"{peer}: {label}"].median for peer in servers.PEERS
                   if f"{peer}: {label}" in run.figures}
        rate = run.figures[f"{servers.OURS}: {label}"].unit == "tok/s"
        better = (max if rate else min)(medians, key=medians.get) if medians else None
        for peer in medians:
            run.ratio(f"{label}: {'ours / ' + peer if rate else peer + ' / ours'}",
                      ours=f"{servers.OURS}: {label}", baseline=f"{peer}: {label}", group=GROUP,
                      goal=1 if peer == better and label != label_everything(sizes) else None)
        if f"{servers.OURS_NO_DISK}: {label}" in run.figures:
            run.ratio(f"{label}: {'ours / ours without the disk tier' if rate else 'ours without the disk tier / ours'}",
                      ours=f"{servers.OURS}: {label}", baseline=f"{servers.OURS_NO_DISK}: {label}", group=GROUP)
    for server in (servers.OURS, servers.OURS_NO_DISK, *servers.PEERS):
        if f"{server}: {CHATS}" in run.figures:
            samples = run.figures[f"{server}: {CHATS}"].samples
            run.note(f"{server}: short chats' first token p50 / p95 (s)",
                     f"{percentile(samples, 50):.3f} / {percentile(samples, 95):.3f} of {len(samples)}")


def _every_shape(run: Run, served: servers.Served, shapes: list, tick: Callable[[str], None],
                 named: str) -> None:
    """Each of `shapes` on `served`, with what each made it prefill and (ours) what its disk tier
    did; each shape's end told to `tick` after `named` (which pass it is)."""
    chat(served, [{"role": "user", "content": "Hello."}], 4)  # one-time costs go here
    tiers_before = served.metrics("superfluid_kv_tier_") if served.label == servers.OURS else None
    for name, shape in shapes:
        before = served.counts()
        try:
            shape(run, served)
        except Exception as exc:  # noqa: BLE001 - a server failing a shape is a finding, not the end
            run.note(f"{served.label}: {name} FAILED", f"{type(exc).__name__}: {exc}"[:300])
        # what its caches and slots did not hold, it prefilled: the count says which it reused
        run.note(f"{served.label}: {name}: prompt tokens evaluated", int(served.counts()["prompt"] - before["prompt"]))
        tick(f"{named}{served.label}: {name}")
    if tiers_before is not None:  # what came back from disk and what the tier wrote, over the shapes
        tiers = served.metrics("superfluid_kv_tier_")
        run.note(f"{served.label}: disk tier hits / misses / bytes written / bytes read",
                 " / ".join(f"{tiers.get(key, 0) - tiers_before.get(key, 0):.0f}" for key in (
                     'superfluid_kv_tier_hits_total{tier="disk"}', 'superfluid_kv_tier_misses_total{tier="disk"}',
                     'superfluid_kv_tier_bytes_written_total{tier="disk"}',
                     'superfluid_kv_tier_bytes_read_total{tier="disk"}')))


def merge_passes(run: Run, passes: list[Run]) -> None:
    """Each figure of `passes` into `run`, its samples those of every pass in order. A note the
    same in every pass is kept as it is; one that differs, or that some pass lacks (a shape one
    pass failed), keeps each pass's value, named: "pass 1: ... | pass 2: ..."."""
    for label in dict.fromkeys(label for this in passes for label in this.figures):
        measured = [this.figures[label] for this in passes if label in this.figures]
        run.record(label, [sample for figure in measured for sample in figure.samples], unit=measured[0].unit,
                   nbytes=measured[0].nbytes)
    for key in dict.fromkeys(key for this in passes for key in this.notes):
        values = [this.notes.get(key) for this in passes]
        if all(key in this.notes for this in passes) and all(value == values[0] for value in values):
            run.note(key, values[0])
        else:
            run.note(key, " | ".join(f"pass {number}: {this.notes[key]}"
                                     for number, this in enumerate(passes, 1) if key in this.notes))

def main(argv: list[str] | None = None) -> int:
    return servers.standalone(argv, __doc__.splitlines()[0], "bench-traffic", bench, FULL, QUICK)


if __name__ == "__main__":
    sys.exit(main())
