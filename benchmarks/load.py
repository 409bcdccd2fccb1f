"""More work than the engine holds: `superfluid serve` against llama-cpp-python's server (both on
4,096 cells) and llama.cpp's llama-server (its defaults: 4 slots sharing 8,192 cells; and 8
slots sharing 16,384), each driven with the openai client in its own child process, one after the other.

1. idle sessions: decode tokens/s of a short request on an empty server, and again once
   `sessions` others have each run a long turn and gone idle (ours: session routes, so the
   sessions live on; theirs: completions). Ours parks idle KV out of the engine: goal >= 0.9.
2. agents and a chat: a one-line chat's time to first token on the idle server, and while
   `agents` agents keep prefilling long prompts (each sends its next as its last ends, until the
   last chat has its first token), sent as OpenAI clients send it (no priority field;
   llama-cpp-python's serves one request at a time, llama-server one per slot, so their chats
   wait for an agent to end; chats stop being sent after `chat_seconds`). Each chat goes after a
   random pause of up to `chat_gap` seconds, so it arrives at any moment of the server's step, as
   a person's message does. Goal: at most 2x idle,
   read as idle / loaded >= 0.5; and ahead of the others. The agents' requests finished and
   failed, and the chats sent, are noted. Ours runs it twice: as serve starts by default (a chat
   waits for the piece of a step in flight), and with `--arrival-wait` ARRIVAL_WAIT (the piece
   is stopped for it, and what it did thrown away: the seconds thrown away are noted).
3. clients at once: `clients` streamed chats with long prompts sent together; how many were
   served, refused before their stream (503) or failed otherwise, and the time until the last.

    .venv/bin/python benchmarks/load.py [--quick]   # prints the figures and ratios
"""

from __future__ import annotations

import itertools
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import servers  # noqa: E402
from benchmarks.harness import Run  # noqa: E402
from benchmarks.texts import text_of  # noqa: E402
from benchmarks.traffic import percentile  # noqa: E402

GROUP = "under load: ours against llama-cpp-python's server"
PEER_GROUP = servers.PEER_GROUP
N_CTX = 4096
# serve --arrival-wait of the second run of ours behind the agents: about an idle engine's
# first token for a one-line chat on 2 cores, so that a chat's first token comes within about
# twice that
ARRIVAL_WAIT = 0.05
OURS_WAIT = f"{servers.OURS} --arrival-wait {ARRIVAL_WAIT:g}"
CHATS = ["What is the capital of France?", "Which river runs through Rome?", "How many legs has a spider?",
         "Where is Mount Fuji?", "What colour is the sky?", "Who wrote Hamlet?"]


@dataclass(frozen=True)
class LoadSizes:
    """How big each load shape is."""

    sessions: int  # idle sessions beside the short one
    session_tokens: int
    decode_tokens: int
    idle_samples: int  # decode rates measured on each side of the idle sessions
    agents: int
    agent_tokens: int
    chats: int  # chat samples, idle and loaded each
    chat_seconds: float  # no chat is sent behind the agents after this long (one waiting for them each takes long)
    chat_gap: float  # each chat behind the agents waits a random pause of up to this many seconds first
    clients: int
    client_tokens: int


FULL = LoadSizes(sessions=6, session_tokens=2000, decode_tokens=128, idle_samples=6, agents=8, agent_tokens=1800,
                 chats=20, chat_seconds=300.0, chat_gap=1.5, clients=32, client_tokens=850)
QUICK = LoadSizes(sessions=2, session_tokens=200, decode_tokens=16, idle_samples=3, agents=2, agent_tokens=200,
                  chats=1, chat_seconds=60.0, chat_gap=0.2, clients=4, client_tokens=100)


def decode_rate(served: servers.Served, tokens: int, salt: int) -> float:
    """Generated tokens/s of one short completion of exactly `tokens` tokens."""
    start = time.perf_counter()
    produced = served.complete(text_of(32, salt=salt), tokens)
    return produced / (time.perf_counter() - start)


def go_idle(served: servers.Served, count: int, tokens: int) -> None:
    """`count` conversations, each one long turn, left idle."""
    for i in range(count):
        system = text_of(tokens, salt=500 + i)
        if served.label == servers.OURS:  # a session that lives on after its turn
            session = served.client.post("/sessions", cast_to=dict, body={"messages": [
                {"role": "system", "content": system}, {"role": "user", "content": "Go on."}]})
            served.client.post(f"/sessions/{session['id']}/generate", cast_to=dict, body={"max_tokens": 4})
        else:
            served.client.chat.completions.create(model=served.model, max_tokens=4, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": "Go on."}])


def first_token(served: servers.Served, system: str, question: str) -> float:
    """Seconds until the first text of a streamed one-line chat (no priority field: a plain
    OpenAI client's request)."""
    return servers.first_text_seconds(served.client, served.model, [{"role": "system", "content": system},
                                                                    {"role": "user", "content": question}], 8)


def agents_and_chat(run: Run, served: servers.Served, sizes: LoadSizes) -> None:
    """A chat's first token idle, then behind `agents` agents that keep prefilling long prompts
    until the last chat has its first token: each agent sends its next request (a new text) as
    soon as the last one ends, and each chat is sent only while every agent has a request in
    flight. (Each agent used to send one request: on a server that serves a chat only once a slot
    frees, the first chat waited for all of them and the others ran on an idle server, so
    llama-server's median read as its idle time. A chat sent after the agents is not behind them.)
    Before each chat behind the agents, a random pause (up to `chat_gap` s, the same pauses for
    every server): sent at once after the last chat's reply, a chat arrived just after the server
    began its next step, where a server that stops a step barely begun for it answers at once,
    and a person's message arrives at any moment of a step. How many agent requests finished and
    failed is noted."""
    idle = [first_token(served, f"Be brief, {i}.", CHATS[i % len(CHATS)]) for i in range(sizes.chats)]
    ours = served.label in (servers.OURS, OURS_WAIT)
    thrown_before = served.metrics("superfluid_")["superfluid_interrupted_seconds_total"] if ours else 0.0
    stop = threading.Event()
    lock = threading.Condition()
    in_flight, finished, failed = [0], [0], []

    def agent(i: int) -> None:
        for turn in itertools.count():
            if stop.is_set():
                return
            with lock:
                in_flight[0] += 1
                lock.notify_all()
            try:
                # text_of has one text per length for every 61 salts: a task number ahead of it keeps
                # every request's prompt unlike any other (nothing of it in a cache: it is prefilled)
                # and unlike the clients' prompts of the next shape
                task = f"Task {turn}.{i}:"
                reply = served.client.chat.completions.create(model=served.model, max_tokens=16, messages=[
                    {"role": "system", "content": f"{task} {text_of(sizes.agent_tokens, salt=i + turn)}"},
                    {"role": "user", "content": "Sum up."}])
            except openai.APIError as exc:
                failed.append(f"{type(exc).__name__}: {exc}"[:200])
                return  # an agent its server refuses stops (it would only be refused again)
            finally:
                with lock:
                    in_flight[0] -= 1
            with lock:
                finished[0] += bool(reply.choices and reply.choices[0].finish_reason)

    def wait_for_all_agents() -> None:
        """Return once every agent has a request in flight; RuntimeError if one was refused (it
        stops) or they are not all in flight within a minute."""
        with lock:
            lock.wait_for(lambda: in_flight[0] == sizes.agents or failed, timeout=60.0)
            if failed:
                raise RuntimeError(f"an agent was refused: {failed[0]}")
            if in_flight[0] != sizes.agents:
                raise RuntimeError(f"{in_flight[0]} of {sizes.agents} agents had a request in flight after 60 s")

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(sizes.agents)]
    for thread in threads:
        thread.start()
    loaded = []
    try:
        time.sleep(2.0)  # the agents' prompts are being read
        deadline = time.monotonic() + sizes.chat_seconds
        pauses = random.Random(25)
        for i in range(sizes.chats):
            if time.monotonic() > deadline:
                break  # (a server whose chats each wait for agents; how many were sent is noted)
            time.sleep(pauses.uniform(0.0, sizes.chat_gap))
            wait_for_all_agents()
            loaded.append(first_token(served, f"Answer shortly, {i}.", CHATS[-1 - i % len(CHATS)]))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    run.record(f"{served.label}: chat first token, idle", idle)
    run.record(f"{served.label}: chat first token behind {sizes.agents} agents", loaded)
    for side, samples in (("idle", idle), (f"behind {sizes.agents} agents", loaded)):
        run.note(f"{served.label}: chat first token {side}, p50 / p95 (ms)",
                 f"{1e3 * percentile(samples, 50):.1f} / {1e3 * percentile(samples, 95):.1f} of {len(samples)}")
    run.note(f"{served.label}: agent requests finished / failed while the chats ran", f"{finished[0]} / {len(failed)}")
    if ours:
        thrown = served.metrics("superfluid_")["superfluid_interrupted_seconds_total"] - thrown_before
        run.note(f"{served.label}: seconds of steps stopped part-way behind the agents (work thrown away)",
                 f"{thrown:.2f}")
    run.note(f"{served.label}: chats sent behind the agents (of {sizes.chats}, for at most {sizes.chat_seconds:g} s)",
             len(loaded))


def clients_at_once(run: Run, served: servers.Served, sizes: LoadSizes) -> None:
    """`clients` streamed chats sent together: served, refused (503 before the stream), failed."""

    def one(i: int) -> str:
        try:
            stream = served.client.chat.completions.create(model=served.model, max_tokens=8, stream=True, messages=[
                # (salts 18-49: text_of repeats every 61 salts, and the idle sessions' texts are salts
                # 12-17, which a client's would otherwise share its whole prompt with)
                {"role": "system", "content": text_of(sizes.client_tokens, salt=18 + i)},
                {"role": "user", "content": "Go on."}])
            chunks = list(stream)
        except openai.APIStatusError as exc:
            return "refused" if exc.status_code == 503 else f"failed: HTTP {exc.status_code} {exc.message[:80]}"
        except openai.APIError as exc:
            return f"failed: {type(exc).__name__}"
        finished = chunks and chunks[-1].choices and chunks[-1].choices[0].finish_reason
        return "served" if finished else "failed: a stream without its end"

    start = time.perf_counter()
    with ThreadPoolExecutor(sizes.clients) as workers:
        outcomes = list(workers.map(one, range(sizes.clients)))
    seconds = time.perf_counter() - start
    run.record(f"{served.label}: {sizes.clients} clients at once, served", [outcomes.count("served")], unit="requests")
    run.note(f"{served.label}: {sizes.clients} clients at once",
             {k: outcomes.count(k) for k in sorted(set(outcomes))} | {"seconds": round(seconds, 1)})


def idle_sessions(run: Run, served: servers.Served, sizes: LoadSizes) -> None:
    """A short request's decode rate on the empty server, then beside `sessions` idle ones."""
    # several samples a side: one short request's rate swings by 10-20% from one request to the
    # next on a shared machine (seven runs of six a side put the ratio anywhere from 0.87 to 1.05)
    samples = sizes.idle_samples
    empty = [decode_rate(served, sizes.decode_tokens, salt) for salt in range(1, 1 + samples)]
    go_idle(served, sizes.sessions, sizes.session_tokens)
    # one request untimed, as on the empty side (the server's one-time costs): what the first
    # request after the sessions pays once (ours: taking their lanes out of the engine) is not
    # what every request beside them pays
    decode_rate(served, sizes.decode_tokens, salt=1000)
    loaded = [decode_rate(served, sizes.decode_tokens, salt) for salt in range(1 + samples, 1 + 2 * samples)]
    run.record(f"{served.label}: decode tokens/s, empty", empty, unit="tok/s")
    run.record(f"{served.label}: decode tokens/s beside {sizes.sessions} idle sessions", loaded, unit="tok/s")


def ratio_if_measured(run: Run, label: str, *, ours: str, baseline: str, **options) -> None:
    """`run.ratio` where both figures were measured; a note where a side failed its shape."""
    if ours in run.figures and baseline in run.figures:
        run.ratio(label, ours=ours, baseline=baseline, **options)
    else:
        run.note(f"{label}: no ratio", "a side failed the shape (noted above)")


def own_folder(scratch: str, name: str) -> str:
    """A folder `name` made under `scratch`, for a server's log of its own."""
    folder = Path(scratch) / name
    folder.mkdir(exist_ok=True)
    return str(folder)


def bench(run: Run, model: Path, sizes: LoadSizes, tick: Callable[[str], None]) -> None:
    """The three shapes on each server, then the ratios."""
    every = (("idle sessions", idle_sessions), ("agents and a chat", agents_and_chat),
             (f"{sizes.clients} clients", clients_at_once))
    with tempfile.TemporaryDirectory() as scratch:
        for start, shapes in ((lambda: servers.start_ours(model, N_CTX, scratch), every),
                              # a log of its own: the first one's idle sessions are not its
                              (lambda: servers.start_ours(model, N_CTX, own_folder(scratch, "arrival-wait"),
                                                          label=OURS_WAIT, extra=("--arrival-wait", str(ARRIVAL_WAIT))),
                               every[1:2]),
                              (lambda: servers.start_theirs(model, N_CTX, cache=False), every),
                              (lambda: servers.start_peer(model, servers.PEER_CONTEXT), every),
                              # 8 slots on twice the cells: on 8,192 the 8 agents' 14,400 prompt tokens overflow the
                              # cache and every agent is refused, which leaves nothing for the chat to be behind
                              (lambda: servers.start_peer(model, 2 * servers.PEER_CONTEXT, slots=8), every)):
            served = start()
            try:
                served.complete(text_of(32, salt=999), 4)  # one-time costs go here
                for name, shape in shapes:
                    try:
                        shape(run, served, sizes)
                    except Exception as exc:  # noqa: BLE001 - a server failing a shape is a finding, not the end
                        run.note(f"{served.label}: {name} FAILED", f"{type(exc).__name__}: {exc}"[:300])
                    tick(f"{served.label}: {name}")
            finally:
                served.stop()
    for side in (servers.OURS, OURS_WAIT, servers.THEIRS, *servers.PEERS):
        if side != OURS_WAIT:  # (it runs the agents alone)
            ratio_if_measured(run, f"{side}: decode beside {sizes.sessions} idle sessions / empty",
                              ours=f"{side}: decode tokens/s beside {sizes.sessions} idle sessions",
                              baseline=f"{side}: decode tokens/s, empty",
                              group=GROUP if side in (servers.OURS, servers.THEIRS) else PEER_GROUP,
                              goal=0.9 if side == servers.OURS else None)
        ratio_if_measured(run, f"{side}: chat first token, idle / behind {sizes.agents} agents",
                          ours=f"{side}: chat first token behind {sizes.agents} agents",
                          baseline=f"{side}: chat first token, idle",
                          group=GROUP if side in (servers.OURS, OURS_WAIT, servers.THEIRS) else PEER_GROUP,
                          goal=0.5 if side in (servers.OURS, OURS_WAIT) else None)
    for theirs, group in ((servers.THEIRS, GROUP), *((peer, PEER_GROUP) for peer in servers.PEERS)):
        name = "theirs" if theirs == servers.THEIRS else theirs
        ratio_if_measured(run, f"chat first token behind {sizes.agents} agents: {name} / ours",
                          ours=f"{servers.OURS}: chat first token behind {sizes.agents} agents",
                          baseline=f"{theirs}: chat first token behind {sizes.agents} agents", group=group, goal=1)
        served_figure = run.figures.get(f"{theirs}: {sizes.clients} clients at once, served")
        if served_figure is not None and served_figure.median == 0:
            run.note(f"{sizes.clients} clients at once, served: ours / {name}", "it served none: no ratio")
            continue
        ratio_if_measured(run, f"{sizes.clients} clients at once, served: ours / {name}",
                          ours=f"{servers.OURS}: {sizes.clients} clients at once, served",
                          baseline=f"{theirs}: {sizes.clients} clients at once, served", group=group, goal=1)


def main(argv: list[str] | None = None) -> int:
    """The command line: --quick for small sizes, --model for another GGUF."""
    return servers.standalone(argv, __doc__.splitlines()[0], "bench-load", bench, FULL, QUICK)

if __name__ == "__main__":
    sys.exit(main())
