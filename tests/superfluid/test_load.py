"""More work than the engine holds, on an engine of a fixed number of cells (tests/cellengine.py):
admission by cells, swap through the pool, idle lanes leaving the engine, short prompts first,
interactive preemption, and a bounded wait queue. Fast and deterministic: nothing here depends
on how fast the machine is.

Every prompt's KV is a hash chain over its tokens and the logits follow from it, so "the same
tokens as alone" means every swap, fork and restore put back exactly the right state.
"""

from __future__ import annotations

import itertools
import math
import threading
import time

import numpy as np

import pytest

from engines.errors import EngineError, Interrupted
from superfluid import ContextFull, Host
from superfluid.host import interruption, planner, scheduler
from superfluid.host.churn import Churn
from superfluid.host.host import _policy
from superfluid.host.errors import Overloaded
from superfluid.host.interruption import Arrival, StepInFlight, worth_interrupting
from superfluid.host.request import GenerateRequest, Priority
from superfluid.host.sampling import SamplingError
from tests.cellengine import CellEngine
from tests.gate import WAIT_SECONDS, Gate, decode_steps_of
from tests.conftest import remove_segment, unique_pool_name


@pytest.fixture
def cell_host(tmp_path, clock):
    """cell_host(cells, **host options) -> (host, engine): a Host on a CellEngine of that many cells,
    its idle timer on the test's clock (it fires only where a test moves the clock), its steps
    behind `gate` if one is given (tests/gate.py)."""
    opened = []

    def make(cells: int = 4096, *, max_sequences: int = 16, step_seconds: tuple[float, float] = (0.0, 0.0),
             gate: Gate | None = None, engine_class: type = CellEngine, chunks_apart: bool = False, **options):
        engines = []

        def factory():
            engines.append(engine_class(cells, max_sequences=max_sequences, step_seconds=step_seconds,
                                        chunks_apart=chunks_apart))
            return engines[0] if gate is None else gate.wrap(engines[0])

        name = unique_pool_name()
        options = {"clock": clock, "pool_bytes": 32 << 20, **options}
        host = Host("cell-engine", engine_factory=factory, pool_name=name,
                    log_dir=tmp_path / f"log-{len(opened)}", **options)
        opened.append((host, name))
        return host, engines[0]

    yield make
    for host, name in opened:
        host.close()
        remove_segment(name)


def prompt(i: int, length: int) -> list[int]:
    """A prompt of `length` tokens that shares no prefix with prompt(j) for j != i (i < 64)."""
    return [i] + [(i * 7 + j * 13) % 64 for j in range(1, length)]


def start(host, prompts, **generate):
    """A session per prompt, all generations queued in one scheduler command (so none starts
    before the last is queued). Each entry is a Generation, or the Overloaded it was refused with."""
    sessions = [host.session(temperature=0.8, seed=i) for i in range(len(prompts))]
    for session, tokens in zip(sessions, prompts):
        session.append_tokens(tokens)

    def queue_all():
        out = []
        for session in sessions:
            try:
                out.append(host.commands.generate(session.id, GenerateRequest.of(
                    max_tokens=generate.get("max_tokens", 16), ignore_eos=True, priority=generate.get("priority"),
                    streamed=generate.get("streamed", True))))
            except Overloaded as exc:
                out.append(exc)
        return out

    return sessions, host.call(queue_all)


def alone(cell_host, prompts, max_tokens):
    """What each prompt generates on an idle engine of ample cells, one at a time."""
    host, _ = cell_host(cells=1 << 16)
    out = []
    for i, tokens in enumerate(prompts):
        s = host.session(temperature=0.8, seed=i)
        s.append_tokens(tokens)
        g = s.generate(max_tokens=max_tokens, ignore_eos=True)
        g.collect()
        out.append(g.tokens)
    return out


def test_eight_long_prompts_on_4096_cells_all_finish_as_they_would_alone(cell_host):
    host, engine = cell_host(cells=4096)
    prompts = [prompt(i, 1800) for i in range(8)]
    _, generations = start(host, prompts, max_tokens=300)
    for g in generations:
        g.collect()
        assert g.finish_reason == "length"
    assert [g.tokens for g in generations] == alone(cell_host, prompts, 300)
    stats = host.stats()
    assert stats.preemptions >= 1 and stats.imports >= stats.preemptions  # lanes were swapped out and back in
    assert stats.prefill_tokens == 8 * 1800  # a resumed lane re-prefills nothing
    assert engine.peak_cells <= 4096


def test_a_generation_waits_for_cells_instead_of_failing(cell_host):
    host, engine = cell_host(cells=4096)
    _, (first, second) = start(host, [prompt(0, 3000), prompt(1, 3000)], max_tokens=8)
    first.collect()
    second.collect()
    assert [(g.finish_reason, len(g.tokens)) for g in (first, second)] == [("length", 8), ("length", 8)]
    seqs = [[i for i, step in enumerate(engine.steps) if any(s == seq for s, _ in step)] for seq in (0, 1)]
    assert max(seqs[0]) < min(seqs[1])  # the second's 3,000 cells were not free: it waited for the first
    assert engine.peak_cells <= 4096 and host.stats().waiting == 0


def test_a_full_wait_queue_refuses_before_anything_starts_and_serves_the_rest(cell_host):
    host, _ = cell_host(cells=4096, max_waiting=8)
    prompts = [prompt(i, 850) for i in range(32)]
    _, outcomes = start(host, prompts, max_tokens=12)
    refused = [o for o in outcomes if isinstance(o, Overloaded)]
    served = [o for o in outcomes if not isinstance(o, Overloaded)]
    assert len(served) == 8 and len(refused) == 24  # queued in one command: eight wait, the rest are refused
    assert "max_waiting=8" in str(refused[0]) and refused[0].retry_after >= 1
    for g in served:
        g.collect()
        assert g.finish_reason == "length" and len(g.tokens) == 12
    assert host.stats().rejected == 24
    assert [g.tokens for g in served] == alone(cell_host, [prompts[i] for i, o in enumerate(outcomes)
                                                           if o in served], 12)


def test_a_generation_that_cannot_start_in_max_wait_seconds_is_refused_untouched(cell_host, clock):
    host, _ = cell_host(cells=4096, max_wait_seconds=1)
    session = host.session()
    session.append_tokens(prompt(0, 100))

    def queue_and_wait_too_long():  # on the scheduler thread: no tick admits it before the clock moves
        generation = host.commands.generate(session.id, GenerateRequest(max_tokens=4))
        clock.advance(1.5)
        return generation

    cold = host.call(queue_and_wait_too_long)
    with pytest.raises(Overloaded, match="max_wait_seconds=1"):
        next(iter(cold))
    assert cold.tokens == [] and session.tokens == prompt(0, 100)  # nothing generated, nothing lost


def waiting_session(host, tokens: list[int]):
    """A session holding `tokens`, made before the engine is held at a gate (a call waits for the
    scheduler thread, which waits at the gate)."""
    session = host.session()
    session.append_tokens(tokens)
    return session


def test_an_interactive_arrival_preempts_and_the_preempted_lane_resumes_exactly(cell_host):
    gate = Gate(decode_steps_of(lanes=2, count=1))  # both run
    host, _ = cell_host(cells=4096, gate=gate)
    prompts = [prompt(0, 1950), prompt(1, 1950)]
    urgent = waiting_session(host, prompt(2, 100))
    _, background = start(host, prompts, max_tokens=100, priority="background")
    quick = gate.generate_while_held(host, urgent, max_tokens=5, priority="interactive")
    quick.collect()
    assert quick.finish_reason == "length"
    for g in background:
        g.collect()
    stats = host.stats()
    assert stats.preemptions >= 1 and stats.prefill_tokens == 1950 * 2 + 100
    assert [g.tokens for g in background] == alone(cell_host, prompts, 100)


def test_a_default_arrival_waits_rather_than_preempting(cell_host):
    gate = Gate(decode_steps_of(lanes=2, count=1))
    host, _ = cell_host(cells=4096, gate=gate)
    late = waiting_session(host, prompt(2, 100))
    _, background = start(host, [prompt(0, 1950), prompt(1, 1950)], max_tokens=40, priority="background")
    reply = gate.generate_while_held(host, late, max_tokens=3)
    reply.collect()
    assert len(reply.tokens) == 3
    for g in background:
        g.collect()
    assert host.stats().preemptions == 0


def test_a_short_prompt_overtakes_long_prefills(cell_host):
    host, engine = cell_host(cells=1 << 15, prefill_budget=256)
    prompts = [prompt(i, 1800) for i in range(4)] + [prompt(4, 20)]
    sessions, generations = start(host, prompts, max_tokens=4)
    for g in generations:
        g.collect()
    seq_of = {}  # the short prompt's sequence: the one fed exactly 20 tokens at once
    first_step, second_step = engine.steps[:2]
    assert [n for _, n in first_step] == [20]  # the short one first, whole, and alone: its first token owed
    seq_of["short"] = first_step[0][0]
    # then its decode token beside the long prompts' chunks, within the budget
    assert second_step[0] == (seq_of["short"], 1) and sum(n for _, n in second_step[1:]) == 256


def on_simulated_time(monkeypatch, engine) -> None:
    """Time the scheduler's steps by the engine's simulated clock (deterministic costs)."""
    monkeypatch.setattr(scheduler, "perf_counter", lambda: engine.now)


def fed_to(engine, seq: int) -> list[int]:
    """The tokens each step fed to sequence `seq`, in order."""
    return [n for step in engine.steps for s, n in step if s == seq]


def prompt_chunks(fed: list[int], prompt_tokens: int) -> list[int]:
    """The prefill steps among a lane's `fed` counts: those until its prompt is all in."""
    chunks = []
    while sum(chunks) < prompt_tokens:
        chunks.append(fed[len(chunks)])
    return chunks


def test_steps_beside_a_decoding_lane_last_the_decode_step_target_without_a_runt_tail(cell_host, monkeypatch):
    # 5 ms a token: a 50 ms step holds 10 tokens, the decoding lane's one among them
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), decode_step_target=0.05)
    on_simulated_time(monkeypatch, engine)
    _, generations = start(host, [prompt(0, 1003), prompt(1, 10)], max_tokens=200)  # decoding throughout
    for g in generations:
        g.collect()
    (short, fed), = engine.steps[0]  # the short prompt first, alone (its first token is owed)
    long = engine.steps[1][1][0]
    assert fed_to(engine, short)[:1] == [10] and set(fed_to(engine, short)[1:]) == {1}
    # 9 a step beside the decoding lane's token (a moving average may move the cut by one), and
    # no runt tail: the last chunk takes what a step-sized one would have left
    chunks = prompt_chunks(fed_to(engine, long), 1003)
    assert all(8 <= n <= 10 for n in chunks[:-1]) and len(chunks) > 90
    assert planner.MIN_PREFILL_CHUNK <= chunks[-1] < 10 + planner.MIN_PREFILL_CHUNK


def test_beside_a_reply_read_whole_steps_last_the_first_token_target(cell_host, monkeypatch):
    # Nobody reads the decoding lane's tokens as they come (an HTTP request without `stream`,
    # Session.complete): the decode-step target (50 ms, 10 tokens) does not bound the steps it
    # decodes in; the first-token target (0.5 s: 100 tokens at 5 ms) does.
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), decode_step_target=0.05,
                             first_token_target=0.5)
    on_simulated_time(monkeypatch, engine)
    _, generations = start(host, [prompt(0, 1003), prompt(1, 10)], max_tokens=200, streamed=False)
    for g in generations:
        g.collect()
    long = engine.steps[1][1][0]
    assert fed_to(engine, engine.steps[0][0][0])[1:20] == [1] * 19  # the short one decodes meanwhile
    chunks = prompt_chunks(fed_to(engine, long), 1003)
    assert all(98 <= n <= 100 for n in chunks[:-1]) and len(chunks) == 11  # 10 of 99, the 13 left


def test_the_targets_never_cut_prefill_below_the_smallest_chunk(cell_host, monkeypatch):
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.0, 0.05), decode_step_target=0.05)  # 1 token a step
    on_simulated_time(monkeypatch, engine)
    _, generations = start(host, [prompt(0, 600), prompt(1, 10)], max_tokens=30)
    for g in generations:
        g.collect()
    long = engine.steps[1][1][0]
    chunks = prompt_chunks(fed_to(engine, long), 600)
    # beside the short one's 29 decode steps, the smallest chunk; then, with nobody decoding,
    # 20 a step (the first-token target, 1 s); the tail takes what a step would have left
    assert chunks[:29] == [planner.MIN_PREFILL_CHUNK] * 29 and set(chunks[29:-1]) == {20}


def test_with_no_lane_decoding_a_step_lasts_the_first_token_target(cell_host, monkeypatch):
    # 50 ms a token: 2.5 s hold 50 tokens; nobody decodes, so only the first-token target bounds a step
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.0, 0.05), first_token_target=2.5,
                             decode_step_target=0.05)
    on_simulated_time(monkeypatch, engine)
    session = host.session()
    session.append_tokens(prompt(0, 700))
    session.generate(max_tokens=1, ignore_eos=True).collect()
    assert [n for step in engine.steps for _, n in step] == [512, 50, 50, 50, 38]
    session.append_tokens(prompt(1, 40))  # the next turn of a conversation: one step
    session.generate(max_tokens=1, ignore_eos=True).collect()
    assert [n for step in engine.steps[5:] for _, n in step] == [40 + 1]  # with the last reply token


def test_a_step_carries_what_the_measured_costs_fit_in_the_target_with_a_fixed_cost_per_step(cell_host, monkeypatch):
    # 40 ms a step whatever it carries, 5 ms a token: 0.5 s hold 92 tokens, 1 s hold 192
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.04, 0.005))
    on_simulated_time(monkeypatch, engine)
    _, generations = start(host, [prompt(0, 1500), prompt(1, 10)], max_tokens=200)
    for g in generations:
        g.collect()
    long = engine.steps[1][1][0]
    chunks = prompt_chunks(fed_to(engine, long), 1500)
    # beside the short one's decoding, within the default decode-step target (0.5 s): its token and
    # 91 of the prompt. The first sized step is guessed from the short prompt's 10-token step
    # alone (its cost per token, 9 ms, which counts the fixed cost ten times over: 54 tokens);
    # from then on the steps measured near that size predict it.
    assert chunks[0] == 54 and all(n in (90, 91) for n in chunks[2:-1])
    assert all(engine.step_seconds[0] + engine.step_seconds[1] * (n + 1) <= 0.5 + 1e-9 for n in chunks[2:-1])


def test_the_step_that_ends_a_waiting_prompt_carries_no_piece_of_a_longer_one(cell_host, monkeypatch, clock):
    # 5 ms a token, a 1 s first-token target: a long prompt alone goes 200 tokens a step. A short
    # one arrives during such a step and waits for it: its own step then carries its 10 tokens
    # alone (50 ms), not 190 of the long prompt's beside them.
    steps = itertools.count()
    gate = Gate(lambda requests: next(steps) == 2)  # the long prompt's third step, its costs measured
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), first_token_target=1.0, gate=gate)
    on_simulated_time(monkeypatch, engine)
    short = waiting_session(host, prompt(9, 10))
    _, (long,) = start(host, [prompt(0, 3000)], max_tokens=2)
    gate.wait_reached()
    queued = host.submit(host.commands.generate, short.id, GenerateRequest.of(max_tokens=2, ignore_eos=True))
    clock.advance(0.8)  # what it waited for the step in flight
    gate.open()
    queued.result().collect()
    long.collect()
    carrying = next(step for step in engine.steps if any(n == 10 for _, n in step))
    assert [n for _, n in carrying] == [10]
    assert any(sum(n for _, n in step) == 200 for step in engine.steps[1:4])  # before it: whole-second steps


def test_a_short_interactive_prompt_is_prefilled_in_one_step_when_steps_are_slow(cell_host, monkeypatch):
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), decode_step_target=0.05)
    on_simulated_time(monkeypatch, engine)
    start(host, [prompt(0, 600)], max_tokens=1)[1][0].collect()  # the cost is measured
    sessions = [host.session() for _ in range(3)]
    for session, tokens in zip(sessions, [prompt(1, 1500), prompt(2, 1500), prompt(3, 40)]):
        session.append_tokens(tokens)
    queued = len(engine.steps)
    generations = host.call(lambda: [host.commands.generate(s.id, GenerateRequest.of(max_tokens=2, ignore_eos=True,
                                                                                     priority=priority))
                                     for s, priority in zip(sessions, ["background", "background", "interactive"])])
    for g in generations:
        g.collect()
    after = engine.steps[queued:]
    assert [n for _, n in after[0]] == [40]  # the chat first, whole, alone
    # the long ones sized to the decode-step target beside a decoding lane (0.05 s: 10 tokens);
    # with none decoding, to the first-token target (1 s: 200 tokens)
    beside = [step for step in after[2:] if any(n == 1 for _, n in step) and any(n > 1 for _, n in step)]
    assert beside and all(n <= 10 + 7 for step in beside for _, n in step)
    assert all(sum(n for _, n in step) <= 200 for step in after[2:])


def test_a_short_request_is_not_held_behind_long_prompts_that_hold_every_sequence(cell_host):
    # Four long prompts of the default class hold all four sequences; a short one of the same
    # class, with no priority, arrives while they are being prefilled: it swaps the least urgent
    # out (its KV parked and held, resumed by import later), and is answered before they finish.
    steps = itertools.count()
    gate = Gate(lambda requests: next(steps) == 2)  # the long prompts' third prefill step
    host, engine = cell_host(cells=1 << 15, max_sequences=4, prefill_budget=64, gate=gate)
    short = waiting_session(host, prompt(9, 20))
    steps_when_chat_ended = []
    finish = host._scheduler.finish

    def recording_finish(live, reason, error=None):  # on the scheduler thread, as the chat ends
        if live.state.id == short.id:
            steps_when_chat_ended.append(len(engine.steps))
        return finish(live, reason, error)

    host._scheduler.finish = recording_finish
    sessions, long = start(host, [prompt(i, 1500) for i in range(4)], max_tokens=8)
    chat = gate.generate_while_held(host, short, max_tokens=4)
    chat.collect()
    outputs = [g.collect() for g in long]
    assert all(len(g.tokens) == 8 for g in long) and len(chat.tokens) == 4
    stats = host.stats()
    # one long lane swapped out (the one with the least fed: nothing to copy), and no prompt token
    # fed twice
    assert stats.preemptions == 1 and stats.prefill_tokens == 4 * 1500 + 20
    # the chat ended long before the long prompts did (counted where it ended: the test thread
    # may read the steps only after the scheduler took many more)
    assert steps_when_chat_ended[0] < len(engine.steps) - 10
    # the swapped-out lane's output is what it would have been without the swap
    alone, _ = cell_host(cells=1 << 15, max_sequences=4, prefill_budget=64)
    again, generations = start(alone, [prompt(i, 1500) for i in range(4)], max_tokens=8)
    assert [g.collect() for g in generations] == outputs


def test_a_swapped_out_prompt_that_had_made_progress_resumes_from_its_exported_kv(cell_host):
    # One sequence, held by a long prompt already partly prefilled; a short one of the same
    # class arrives: the long lane's KV so far is exported to the pool (held), the short one is
    # answered, and the long one resumes by import where it stopped, feeding nothing twice.
    steps = itertools.count()
    gate = Gate(lambda requests: next(steps) == 4)  # the long prompt's fifth prefill step
    host, engine = cell_host(cells=1 << 15, max_sequences=1, prefill_budget=64, gate=gate)
    short = waiting_session(host, prompt(9, 20))
    _, (long,) = start(host, [prompt(0, 1500)], max_tokens=8)
    chat = gate.generate_while_held(host, short, max_tokens=4)
    chat.collect()
    output = long.collect()
    assert len(chat.tokens) == 4 and len(long.tokens) == 8
    fed_before_swap = sum(n for step in engine.steps[:4] for _, n in step)
    assert fed_before_swap >= 4 * 8  # it had made progress: four steps of prefill
    stats = host.stats()
    assert stats.preemptions == 1 and stats.prefill_tokens == 1500 + 20  # nothing fed twice
    assert stats.imports >= 1  # it came back from the pool, not by a prefill
    alone, _ = cell_host(cells=1 << 15, max_sequences=1, prefill_budget=64)
    _, (again,) = start(alone, [prompt(0, 1500)], max_tokens=8)
    assert again.collect() == output  # the same reply as without the swap


def test_same_sized_prompts_never_swap_each_other_out(cell_host):
    gate = Gate(lambda requests: True)
    host, _ = cell_host(cells=1 << 15, max_sequences=2, prefill_budget=64, gate=gate)
    third = waiting_session(host, prompt(9, 1000))
    start(host, [prompt(i, 1500) for i in range(2)], max_tokens=4)
    late = gate.generate_while_held(host, third, max_tokens=4)
    late.collect()
    assert host.stats().preemptions == 0  # 1,000 tokens against 1,500 left: it waits its turn


def test_decode_is_never_held_back_by_prefill(cell_host):
    host, engine = cell_host(cells=1 << 15, prefill_budget=128)
    _, generations = start(host, [prompt(0, 10)] + [prompt(i, 1500) for i in (1, 2, 3)], max_tokens=60)
    for g in generations:
        g.collect()
    seq = engine.steps[0][0][0]  # the short prompt goes first
    carrying = [index for index, step in enumerate(engine.steps) if any(s == seq for s, _ in step)]
    assert len(carrying) == 60 and carrying == list(range(carrying[0], carrying[0] + 60))  # every step while it ran
    beside = [i for i in carrying if any(n > 1 for _, n in engine.steps[i])]
    assert beside == carrying[:len(beside)] and len(beside) >= 30  # the 4,500 prompt tokens prefilled beside it


def test_an_interactive_lane_runs_without_other_classes_prefill(cell_host):
    gate = Gate(lambda requests: True)  # the background's first prefill step
    host, engine = cell_host(cells=1 << 15, prefill_budget=128, gate=gate)
    urgent = waiting_session(host, prompt(5, 10))
    _, background = start(host, [prompt(i, 1500) for i in range(2)], max_tokens=2, priority="background")
    quick = gate.generate_while_held(host, urgent, max_tokens=8, priority="interactive")
    quick.collect()
    for g in background:
        g.collect()
    sizes = {n for step in engine.steps for _, n in step}
    urgent_steps = [step for step in engine.steps if (10 in [n for _, n in step])]
    assert urgent_steps and 10 in sizes
    seq = next(s for s, n in urgent_steps[0] if n == 10)
    with_urgent = [step for step in engine.steps if any(s == seq for s, _ in step)]
    assert all(n == 1 or s == seq for step in with_urgent for s, n in step)
    background_prefill = [i for i, step in enumerate(engine.steps) if any(s != seq and n > 1 for s, n in step)]
    assert background_prefill[-1] > engine.steps.index(urgent_steps[0])  # it came while they were prefilling


def test_idle_lanes_leave_the_engine_while_others_decode_and_come_back_by_import(cell_host):
    host, engine = cell_host(cells=8192)
    idle = []
    for i in range(3):
        s = host.session(seed=i)
        s.append_tokens(prompt(i, 2000))
        s.generate(max_tokens=3, ignore_eos=True).collect()
        idle.append(s)
    stats = host.stats()
    assert (stats.lanes, stats.idle_parks) == (1, 2)  # each turn parked the one before; the last stays warm
    active = host.session()
    active.append_tokens(prompt(9, 10))
    g = active.generate(max_tokens=20, ignore_eos=True)
    next(g)
    assert engine.cells_used() <= 10 + 20 + 64  # only the active lane's cells
    g.collect()
    stats = host.stats()
    assert stats.idle_parks == 3 and stats.lanes == 1 and stats.parked_sessions == 3
    before = host.stats().prefill_tokens
    again = idle[0]
    again.append_tokens([1, 2, 3])
    turn = again.generate(max_tokens=2)
    turn.collect()
    # one import of the 2,002 tokens fed before; prefilled: the last reply token and the 3 new ones
    assert turn.cached_tokens == 2002 and host.stats().prefill_tokens - before == 4
    assert host.stats().imports == 1


def test_a_request_resumed_from_a_cached_prefix_checkpoints_only_what_follows_it(cell_host):
    # A chat client's next request is a new session whose history the pool holds: the import is
    # the one copy it costs until its own tokens reach checkpoint_tokens.
    host, _ = cell_host(cells=8192, checkpoint_tokens=32)
    first = host.session()
    first.append_tokens(prompt(0, 600))
    first.generate(max_tokens=4, ignore_eos=True).collect()
    history = first.tokens
    host.call(host.commands.retire, first.id)  # as a one-shot request ends: its KV parked, it is gone
    before = host.stats()
    following = host.session()
    following.append_tokens(history + [5, 6, 7])
    turn = following.generate(max_tokens=20, ignore_eos=True)
    turn.collect()
    after = host.stats()
    assert turn.cached_tokens == len(history) - 1 and after.imports - before.imports == 1
    assert after.exports == before.exports  # 3 + 20 tokens of its own: under the 32 of a checkpoint
    following.generate(max_tokens=20, ignore_eos=True).collect()
    assert host.stats().exports == before.exports + 1  # past 32 of its own: checkpointed once


def test_a_lane_idle_past_idle_park_seconds_is_parked(cell_host, clock):
    host, engine = cell_host(cells=4096, idle_park_seconds=5)
    s = host.session()
    s.append_tokens(prompt(0, 300))
    s.generate(max_tokens=2).collect()
    assert host.stats().lanes == 1
    clock.advance(5)
    deadline = time.monotonic() + 60
    while host.stats().lanes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host.stats().lanes == 0 and engine.cells_used() == 0 and host.stats().parked_sessions == 1


def test_only_a_session_longer_than_every_cell_is_context_full(cell_host):
    host, _ = cell_host(cells=1024)
    s = host.session()
    with pytest.raises(ContextFull, match="appending 1100 tokens would pass the 1024"):
        s.append_tokens(prompt(0, 1100))  # refused whole: nothing could ever be done with it
    s.append_tokens(prompt(0, 1024))  # one session's whole: no room left to generate
    with pytest.raises(ContextFull, match="at most 1024"):
        s.generate(max_tokens=4)
    fits = host.session()
    fits.append_tokens(prompt(1, 1000))
    others = host.session()
    others.append_tokens(prompt(2, 1000))
    a, b = fits.generate(max_tokens=4), others.generate(max_tokens=4)  # together they do not fit: one waits
    a.collect()
    b.collect()
    assert [(g.finish_reason, len(g.tokens)) for g in (a, b)] == [("length", 4), ("length", 4)]


def check_cells(host, engine) -> None:
    """The KV manager counts exactly the cells the engine holds (forks' shared cells once)."""
    assert host.stats().cells_used == engine.cells_used()


def test_cells_are_counted_exactly_through_forks_trims_and_imports(cell_host):
    host, engine = cell_host(cells=4096)
    parent = host.session(seed=1)
    parent.append_tokens(prompt(0, 100))
    parent.generate(max_tokens=4).collect()
    child = parent.fork()  # shares the parent's cells
    check_cells(host, engine)
    parent.trim(50)  # the child still holds the cells past 50
    check_cells(host, engine)
    for s in (parent, child):
        s.append_tokens(prompt(1, 30))
        s.generate(max_tokens=20).collect()
        check_cells(host, engine)
    grandchild = child.fork()
    grandchild.trim(10)
    grandchild.append_tokens(prompt(2, 200))
    grandchild.generate(max_tokens=5).collect()
    check_cells(host, engine)
    host.retire(parent.id)  # parked, its cells freed; the forks keep theirs
    check_cells(host, engine)


def test_every_load_story_ends_with_the_cells_counted_as_the_engine_holds_them(cell_host):
    host, engine = cell_host(cells=4096)
    _, generations = start(host, [prompt(i, 1200) for i in range(6)], max_tokens=120)
    urgent = host.session()
    urgent.append_tokens(prompt(9, 50))
    quick = urgent.generate(max_tokens=3, priority="interactive")
    for g in [*generations, quick]:
        g.collect()
    check_cells(host, engine)
    assert host.stats().cells_reserved == 0


class BrokenAfterToken(CellEngine):
    """A CellEngine whose step gives NaN logits wherever the last token fed is `broken` (as a
    step that overflowed would)."""

    broken = 63

    def step(self, requests):
        """The cell engine's step, with NaN logits after the broken token."""
        results = super().step(requests)
        return [None if logits is None else (logits * np.nan if request.tokens[-1] == self.broken else logits)
                for request, logits in zip(requests, results)]


def test_a_step_with_nothing_to_sample_ends_its_generation_and_the_others_go_on(tmp_path):
    name = unique_pool_name()
    host = Host("cell-engine", engine_factory=lambda: BrokenAfterToken(4096), pool_name=name, pool_bytes=32 << 20,
                log_dir=tmp_path / "log")
    try:
        broken, healthy = host.session(), host.session()
        broken.append_tokens(prompt(0, 20) + [BrokenAfterToken.broken])
        healthy.append_tokens(prompt(1, 20))
        failing = broken.generate(max_tokens=8, ignore_eos=True)
        going = healthy.generate(max_tokens=8, ignore_eos=True)
        with pytest.raises(SamplingError, match="all NaN or -inf"):
            failing.collect()
        going.collect()
        assert len(going.tokens) == 8 and host.alive()
        again = healthy.generate(max_tokens=2, ignore_eos=True)  # the host still serves
        again.collect()
        assert len(again.tokens) == 2 and broken.tokens[-1] == BrokenAfterToken.broken
    finally:
        host.close()
        remove_segment(name)


class RefusesToCutRestoredState(CellEngine):
    """A CellEngine that cannot cut back a sequence it restored from the pool (as mlx-lm's wrapped
    rotating cache cannot), although its memory says it can."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.restored: set[int] = set()

    def import_(self, seq, view):
        """The cell engine's import, remembered."""
        self.restored.add(seq)
        return super().import_(seq, view)

    def truncate(self, seq, tokens):
        """Refused for a restored sequence."""
        if seq in self.restored and tokens < self.length(seq):
            raise EngineError(f"sequence {seq} was restored and cannot be cut back")
        super().truncate(seq, tokens)

    def free_sequence(self, seq):
        """The cell engine's, forgetting that it was restored."""
        self.restored.discard(seq)
        super().free_sequence(seq)


def test_a_restored_state_the_engine_will_not_cut_is_prefilled_on_a_lane_of_its_own(tmp_path, cell_host):
    # The pool's entry holds more than the new session shares with it, so it is imported and cut
    # back; the engine refuses the cut. The lane must be reopened empty and prefilled (it once
    # kept naming the freed sequence: "no sequence N"); churn checks the bookkeeping every tick.
    name = unique_pool_name()
    host = Host("cell-engine", engine_factory=lambda: RefusesToCutRestoredState(4096), pool_name=name,
                pool_bytes=32 << 20, log_dir=tmp_path / "log", churn=Churn())
    try:
        first = host.session(temperature=0.0)
        first.append_tokens(prompt(0, 300))  # parked whole at the end of its prompt (publish_tokens)
        first.complete(max_tokens=2)
        second = host.session(temperature=0.0)
        second.append_tokens(prompt(0, 200) + prompt(1, 20))
        before = host.stats()
        reply = second.generate(max_tokens=4, ignore_eos=True)
        reply.collect()
        after = host.stats()
        assert after.imports == before.imports + 1 and after.prefill_tokens - before.prefill_tokens == 220
        reference = cell_host()[0].session(temperature=0.0)
        reference.append_tokens(second.tokens[:-4])
        expected = reference.generate(max_tokens=4, ignore_eos=True)
        expected.collect()
        assert reply.tokens == expected.tokens
    finally:
        host.close()
        remove_segment(name)


class StoppableCellEngine(CellEngine):
    """A cell engine whose second step of 64 or more tokens waits until interrupt() stops it
    (Interrupted, nothing fed) or the test lets it run (`release`): the first step measures the
    costs a step in flight is predicted by."""

    def __init__(self, cells: int, **options) -> None:
        super().__init__(cells, **options)
        self.held, self.interrupted, self._go = threading.Event(), threading.Event(), threading.Event()
        self._large_steps = 0

    def interrupt(self) -> bool:
        """Stop the held step (as llama.cpp stops a forward at its next node)."""
        self.interrupted.set()
        self._go.set()
        return True

    def clear_interrupt(self) -> None:
        """Take back an interrupt() the held step did not take."""
        self.interrupted.clear()

    def release(self) -> None:
        """Let the held step run to its end."""
        self._go.set()

    def step(self, requests):
        """Hold the second large step until interrupted or released; a step interrupted feeds nothing."""
        if sum(len(request.tokens) for request in requests) >= 64:
            self._large_steps += 1
            if self._large_steps == 2:
                self.held.set()
                assert self._go.wait(WAIT_SECONDS), "the test neither interrupted nor released the step"
        if self.interrupted.is_set():
            self.interrupted.clear()
            raise Interrupted("stopped for a request that goes first")
        return super().step(requests)


def test_a_short_arrival_stops_the_prefill_step_in_flight_and_goes_first(cell_host, monkeypatch):
    # 5 ms a token on the engine's simulated clock: a step of 256 prompt tokens is predicted to
    # last 1.28 s, and the arrival comes as it begins
    host, engine = cell_host(cells=1 << 15, prefill_budget=256, step_seconds=(0.0, 0.005),
                             engine_class=StoppableCellEngine)
    on_simulated_time(monkeypatch, engine)
    short = waiting_session(host, prompt(9, 20))
    _, (long,) = start(host, [prompt(0, 1500)], max_tokens=4)
    assert engine.held.wait(WAIT_SECONDS)
    before = len(engine.steps)
    chat = host.submit(host.commands.generate, short.id, GenerateRequest.of(max_tokens=4),
                       arrival=Arrival(Priority.DEFAULT, 20)).result()
    chat.collect()
    output = long.collect()
    short_seq, fed = engine.steps[before][0]
    assert fed == 20  # the step after the stopped one feeds the chat's whole prompt first
    stats = host.stats()
    assert stats.interrupted_steps == 1 and stats.interrupted_seconds >= 0
    assert stats.prefill_tokens == 1500 + 20  # the stopped step fed nothing, and nothing twice
    assert short_seq not in {seq for step in engine.steps[:before] for seq, _ in step}
    alone, _ = cell_host(cells=1 << 15, prefill_budget=256)
    _, (again,) = start(alone, [prompt(0, 1500)], max_tokens=4)
    assert again.collect() == output  # the long prompt's reply as without the interruption


class ArrivalsCellEngine(CellEngine):
    """A cell engine that calls `arrive(requests)` on the scheduler thread as each step begins
    (before it feeds anything), so a test queues a request in the middle of a chosen step; it
    counts the calls to interrupt() (and stops nothing)."""

    def __init__(self, cells: int, **options) -> None:
        super().__init__(cells, **options)
        self.arrive = lambda requests: None
        self.interrupts = 0

    def interrupt(self) -> bool:
        """Counted; False: the step runs to its end."""
        self.interrupts += 1
        return False

    def step(self, requests):
        """Call `arrive`, then step as a cell engine does (it cannot be stopped part-way)."""
        self.arrive(requests)
        return super().step(requests)


def sizes(steps) -> list[list[int]]:
    return [[n for _, n in step] for step in steps]


def run_long_prompt(host, engine, arrive, queued: list) -> tuple[list, list[list[int]]]:
    """A 3,000-token prompt's generation on `host`, `arrive(requests)` called as each of
    `engine`'s steps begins; then every generation `arrive` queued (futures in `queued`) read to
    its end. The long prompt's tokens, and the sizes each step fed."""
    engine.arrive = arrive
    _, (long,) = start(host, [prompt(0, 3000)], max_tokens=4)
    output = long.collect()
    for future in queued:
        future.result().collect()
    return output, sizes(engine.steps)


@pytest.mark.parametrize("second", [Arrival(Priority.DEFAULT, 20), Arrival(Priority.DEFAULT, 2000),
                                    Arrival(Priority.BACKGROUND, 20)],
                         ids=["a short prompt", "a longer prompt", "a less urgent class"])
def test_while_short_requests_arrive_a_step_runs_in_pieces_and_stops_between_two_for_one(cell_host, monkeypatch,
                                                                                         second):
    # 5 ms a token and a 2 s first-token target: a long prompt alone goes 400 tokens a step. A
    # short chat arriving in such a step waits for it (nothing to stop part-way on a cell engine);
    # from then on, steps run in pieces of 133 tokens, and a second request arriving during a
    # piece goes right after it where it goes first, with nothing thrown away
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), first_token_target=2.0,
                             engine_class=ArrivalsCellEngine)
    on_simulated_time(monkeypatch, engine)
    first, other = waiting_session(host, prompt(9, 20)), waiting_session(host, prompt(10, second.prompt_tokens))
    queued = []

    def arrive(requests):
        fed = sum(len(request.tokens) for request in requests)
        if not queued and len(engine.steps) == 2:  # the long prompt's second 400-token step
            queued.append(host.submit(host.commands.generate, first.id, GenerateRequest.of(max_tokens=2),
                                      arrival=Arrival(Priority.DEFAULT, 20)))
        elif len(queued) == 1 and fed == 133 and sizes(engine.steps[-1:]) == [[133]]:  # a step's second piece
            queued.append(host.submit(host.commands.generate, other.id, GenerateRequest.of(max_tokens=2),
                                      arrival=second))

    output, steps = run_long_prompt(host, engine, arrive, queued)
    # no pieces before a request went first: the first chat asks to stop the ~400-token step in
    # flight (which this engine cannot), then waits for it; the second, where it goes first, asks
    # to stop the piece it arrives in as that begins (nor can it), then waits for that piece
    assert steps[2][0] > 2 * planner.MIN_PIECE and steps[3] == [20]
    assert engine.interrupts == (2 if second == Arrival(Priority.DEFAULT, 20) else 1)
    cut = steps.index([133])  # then whole-second steps run as pieces of a third
    assert steps[cut + 1] == [133]
    stats = host.stats()
    assert stats.interrupted_steps == 0 and stats.prefill_tokens == 3000 + 20 + second.prompt_tokens
    if second == Arrival(Priority.DEFAULT, 20):  # it goes first: right after the piece in flight
        assert steps[cut + 2] == [20] and stats.yielded_steps == 1
    else:  # it does not: every piece of that step runs
        assert steps[cut + 2] in ([133], [134]) and stats.yielded_steps == 0
    alone, _ = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), first_token_target=2.0)
    _, (again,) = start(alone, [prompt(0, 3000)], max_tokens=4)
    assert again.collect() == output  # the long prompt's reply as without the pieces and stops


class StoppingArrivalsCellEngine(ArrivalsCellEngine):
    """An ArrivalsCellEngine that can be stopped: interrupt() during `arrive` makes the step
    raise Interrupted, keeping the whole ubatches of 32 tokens that finished in the simulated
    time `arrive` let pass (as llama.cpp keeps them)."""

    UBATCH = 32

    def __init__(self, cells: int, **options) -> None:
        super().__init__(cells, **options)
        self.stop = False

    def interrupt(self) -> bool:
        """Counted; the step in flight stops (or else the next one, as in llama.cpp)."""
        self.interrupts += 1
        self.stop = True
        return True

    def clear_interrupt(self) -> None:
        """Take back an interrupt() no step took."""
        self.stop = False

    def step(self, requests):
        """Call `arrive`; stopped there: Interrupted, with what finished meanwhile kept."""
        began = self.now
        self.arrive(requests)
        if self.stop:
            self.stop = False
            fixed, per_token = self.step_seconds
            predicted = fixed + per_token * sum(len(request.tokens) for request in requests)
            self.stop_part_way(requests, min(1.0, (self.now - began) / predicted), self.UBATCH)
        return CellEngine.step(self, requests)


@pytest.mark.parametrize("wait", [0.1, None], ids=["an arrival wait of 0.1 s", "no arrival wait"])
def test_with_an_arrival_wait_a_piece_well_under_way_is_stopped_for_a_request_that_goes_first(cell_host, monkeypatch,
                                                                                               wait):
    # As above (5 ms a token, a 2 s first-token target, pieces of 133 tokens once a request went
    # first), on an engine that can stop a forward. More short chats arrive one after another,
    # each 0.3 s into the first piece of the long prompt after the last chat's prompt: past the
    # piece's first quarter, so without a wait each piece runs on and the chat goes after it;
    # with arrival_wait 0.1 s (0.365 s left) the piece is stopped, and the chat goes next. Each
    # stop throws away 0.3 s (all but the ubatches of 32 tokens that finished): once the stops of
    # the last 4 s threw away half of them (2 s, after 7 stops in 2.8 s), the next chat's piece
    # is not stopped, so chats arriving more often than a piece lasts cannot stop every piece.
    # (No decode-step target: a chat's last decode token would shorten each step after it, and
    # with it the piece the next chat arrives in.)
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), first_token_target=2.0, arrival_wait=wait,
                             decode_step_target=None, engine_class=StoppingArrivalsCellEngine)
    on_simulated_time(monkeypatch, engine)
    stops = math.ceil(interruption.THROWN_SHARE * interruption.THROWN_WINDOW / 0.3)  # pieces stopped 0.3 s in
    chats = [waiting_session(host, prompt(9 + i, 20)) for i in range(stops + 2)]
    queued, arrived_in = [], []

    def chat(i):
        queued.append(host.submit(host.commands.generate, chats[i].id, GenerateRequest.of(max_tokens=2),
                                  arrival=Arrival(Priority.DEFAULT, 20)))

    def arrive(requests):
        fed = sum(len(request.tokens) for request in requests)
        if not queued and len(engine.steps) == 2:  # the long prompt's second 400-token step
            chat(0)
        elif ((len(queued) == 1 and fed == 133 and sizes(engine.steps[-1:]) == [[133]])  # a step's second piece
              or (1 < len(queued) < len(chats) and fed > 64 and 20 in sizes(engine.steps[-1:])[0])):  # after a chat
            engine.now += 0.3
            arrived_in.append(len(engine.steps))
            chat(len(queued))

    output, steps = run_long_prompt(host, engine, arrive, queued)
    # the first chat stops the 400-token step as it begins (barely begun, with or without a wait)
    assert steps[2] == [20] and len(arrived_in) == stops + 1
    stats = host.stats()
    # (a chat's prompt goes beside the last chat's decode token, if it has one left)
    if wait is not None:  # those pieces stopped: each of those chats is the next step fed
        assert [steps[at][-1] for at in arrived_in[:stops]] == [20] * stops and steps[arrived_in[0] - 1] == [133]
        assert engine.interrupts == stops + 1 and stats.interrupted_steps == stops + 1
        assert stats.interrupted_seconds == pytest.approx(0.3 * stops)
        assert engine.kept > 0  # the ubatches the stopped pieces finished: counted once, not fed again
        ran_on = arrived_in[stops:]  # past the budget: the last chat's piece runs to its end
    else:  # every piece runs to its end, and the step ends after it
        assert engine.interrupts == 1 and stats.interrupted_steps == 1 and engine.kept == 0
        ran_on = arrived_in
    assert all(steps[at][-1] > 64 and steps[at + 1][-1] == 20 for at in ran_on)
    assert stats.prefill_tokens == 3000 + len(chats) * 20
    alone, _ = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), first_token_target=2.0)
    _, (again,) = start(alone, [prompt(0, 3000)], max_tokens=4)
    assert again.collect() == output  # the long prompt's reply as without the stops


class LateArrivalsCellEngine(StoppingArrivalsCellEngine):
    """A StoppingArrivalsCellEngine that also calls `late(requests)` once a step has fed
    everything, before it returns (an arrival after a forward's last node), with the simulated
    clock back where the step began: its prediction says it has barely begun."""

    def __init__(self, cells: int, **options) -> None:
        super().__init__(cells, **options)
        self.late = lambda requests: None

    def step(self, requests):
        """Step as a StoppingArrivalsCellEngine, then call `late` at the step's start time."""
        began = self.now
        results = super().step(requests)
        ran, self.now = self.now, began
        self.late(requests)
        self.now = ran
        return results


def test_an_interrupt_asked_after_a_step_ended_does_not_stop_the_next_one(cell_host, monkeypatch):
    # A chat that goes first is queued as the long prompt's step ends, while the step still looks
    # in flight and barely begun (a forward far quicker than predicted): the engine is asked to
    # stop it, too late. The ask is taken back as the step ends, and the next step (the chat's
    # prompt) runs; the ask used to stay raised and stop that step at its first node
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), first_token_target=2.0,
                             engine_class=LateArrivalsCellEngine)
    on_simulated_time(monkeypatch, engine)
    short = waiting_session(host, prompt(9, 20))
    queued = []

    def late(requests):
        if not queued and len(engine.steps) == 2:  # the long prompt's second step
            queued.append(host.submit(host.commands.generate, short.id, GenerateRequest.of(max_tokens=2),
                                      arrival=Arrival(Priority.DEFAULT, 20)))

    engine.late = late
    output, steps = run_long_prompt(host, engine, lambda requests: None, queued)
    assert engine.interrupts == 1 and steps[2] == [20]
    stats = host.stats()
    assert stats.interrupted_steps == 0 and stats.prefill_tokens == 3000 + 20
    alone, _ = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), first_token_target=2.0)
    _, (again,) = start(alone, [prompt(0, 3000)], max_tokens=4)
    assert again.collect() == output


def test_a_short_arrival_is_not_hidden_by_a_longer_one_queued_after_it(cell_host, monkeypatch):
    # As in the test of pieces above: a chat that goes first arrives at the start of a piece, and
    # before the piece ends a long request arrives that would not go first. The step still ends
    # after the piece for the chat (the most urgent arrival since the last look is kept; the
    # later one used to replace it, and the chat waited for every piece of the step)
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), first_token_target=2.0,
                             engine_class=ArrivalsCellEngine)
    on_simulated_time(monkeypatch, engine)
    first, short, other = (waiting_session(host, prompt(9, 20)), waiting_session(host, prompt(10, 20)),
                           waiting_session(host, prompt(11, 2000)))
    queued, arrived_in = [], []

    def arrive(requests):
        fed = sum(len(request.tokens) for request in requests)
        if not queued and len(engine.steps) == 2:
            queued.append(host.submit(host.commands.generate, first.id, GenerateRequest.of(max_tokens=2),
                                      arrival=Arrival(Priority.DEFAULT, 20)))
        elif len(queued) == 1 and fed == 133 and sizes(engine.steps[-1:]) == [[133]]:  # a step's second piece
            arrived_in.append(len(engine.steps))
            queued.append(host.submit(host.commands.generate, short.id, GenerateRequest.of(max_tokens=2),
                                      arrival=Arrival(Priority.DEFAULT, 20)))
            queued.append(host.submit(host.commands.generate, other.id, GenerateRequest.of(max_tokens=2),
                                      arrival=Arrival(Priority.DEFAULT, 2000)))

    _, steps = run_long_prompt(host, engine, arrive, queued)
    assert steps[arrived_in[0]] == [133] and steps[arrived_in[0] + 1] == [20]
    assert host.stats().yielded_steps == 1


@pytest.mark.parametrize("arrival", [Arrival(Priority.DEFAULT, 2000), Arrival(Priority.BACKGROUND, 20)],
                         ids=["a longer prompt", "a less urgent class"])
def test_an_arrival_that_would_not_go_first_lets_the_step_run(cell_host, monkeypatch, arrival):
    host, engine = cell_host(cells=1 << 15, prefill_budget=256, step_seconds=(0.0, 0.005),
                             engine_class=StoppableCellEngine)
    on_simulated_time(monkeypatch, engine)
    other = waiting_session(host, prompt(9, arrival.prompt_tokens))
    _, (long,) = start(host, [prompt(0, 1500)], max_tokens=4)
    assert engine.held.wait(WAIT_SECONDS)
    queued = host.submit(host.commands.generate, other.id, GenerateRequest.of(max_tokens=4), arrival=arrival)
    assert not engine.interrupted.is_set()  # hurry() ran in submit, on this thread
    engine.release()
    queued.result().collect()
    long.collect()
    assert host.stats().interrupted_steps == 0


@pytest.mark.parametrize("elapsed, arrival, expected", [
    (0.0, Arrival(Priority.DEFAULT, 20), True),  # shorter, same class, just begun
    (0.2, Arrival(Priority.DEFAULT, 20), True),
    (0.3, Arrival(Priority.DEFAULT, 20), False),  # over a quarter of the step done: it runs on
    (0.0, Arrival(Priority.DEFAULT, 900), False),  # not shorter than what the step feeds
    (0.0, Arrival(Priority.DEFAULT, 300), False),  # shorter, but longer than the step: not a short prompt
    (0.0, Arrival(Priority.INTERACTIVE, 5000), True),  # a more urgent class, however long
    (0.0, Arrival(Priority.BACKGROUND, 1), False),  # a less urgent class
])
def test_which_arrivals_stop_a_step(elapsed, arrival, expected):
    flight = StepInFlight(began=10.0, predicted=1.0, first=(Priority.DEFAULT, 900), tokens=256)
    assert worth_interrupting(flight, arrival, 10.0 + elapsed) is expected
    assert worth_interrupting(None, arrival, 10.0) is False  # no prompt being fed
    short_step = StepInFlight(began=10.0, predicted=0.04, first=(Priority.DEFAULT, 900), tokens=256)
    assert worth_interrupting(short_step, arrival, 10.0) is False  # too little left to save


def test_an_arrival_wait_stops_what_has_more_than_it_left_besides_what_has_barely_begun():
    flight = StepInFlight(began=10.0, predicted=1.0, first=(Priority.DEFAULT, 900), tokens=256)
    chat = Arrival(Priority.DEFAULT, 20)
    assert worth_interrupting(flight, chat, 10.3, wait=0.5) is True  # 0.7 s left
    assert worth_interrupting(flight, chat, 10.3) is False  # (past its first quarter: no wait, no stop)
    assert worth_interrupting(flight, chat, 10.6, wait=0.5) is False  # 0.4 s left
    assert worth_interrupting(flight, chat, 10.1, wait=2.0) is True  # barely begun, as without a wait
    assert worth_interrupting(flight, chat, 10.96, wait=0.0) is False  # 0.04 s left: too little to save
    assert worth_interrupting(flight, Arrival(Priority.DEFAULT, 900), 10.3, wait=0.5) is False  # does not go first


def test_a_stream_of_short_prompts_cannot_hold_the_long_ones_back(cell_host):
    # The step that ends a short prompt carries no piece of the long one; but never two such
    # steps in a row: a short prompt arriving as the first one is answered ends in a step that
    # feeds the long prompt too.
    steps = itertools.count()
    gate = Gate(lambda requests: next(steps) == 0)  # the first step: the first short prompt's, held
    host, engine = cell_host(cells=1 << 15, prefill_budget=64, gate=gate)
    late = waiting_session(host, prompt(8, 12))
    _, (long, first) = start(host, [prompt(0, 1500), prompt(1, 10)], max_tokens=2)
    chat = gate.generate_while_held(host, late, max_tokens=2)
    for generation in (long, first, chat):
        generation.collect()
    first_step, second_step = ([n for _, n in step] for step in engine.steps[:2])
    assert first_step == [10]  # the first short prompt alone
    assert 12 in second_step and sum(second_step) == 1 + 64  # its decode token, the late prompt, the long one's chunk


def short_prompt_behind_a_long_one(cell_host, held_step: int, short_tokens: int):
    """A 1,500-token prompt fed 64 tokens a step, and a prompt of `short_tokens` queued while its
    step number `held_step` (from 0) is held; both generate 2 tokens. (engine, long, short)."""
    steps = itertools.count()
    gate = Gate(lambda requests: next(steps) == held_step)
    host, engine = cell_host(cells=1 << 15, prefill_budget=64, gate=gate)
    late = waiting_session(host, prompt(8, short_tokens))
    _, (long,) = start(host, [prompt(0, 1500)], max_tokens=2)
    short = gate.generate_while_held(host, late, max_tokens=2)
    for generation in (long, short):
        generation.collect()
    return engine, long, short


def test_a_short_prompt_is_not_held_behind_a_long_one_that_aged_near_its_end(cell_host):
    # Aging makes a long prompt more urgent than a fresh short one once enough has been fed since
    # it arrived (here 1,408 of its 1,500 tokens: 92 left, less 140.8 of age, against the short
    # one's 12). It still must not take the whole step from a prompt that step could end.
    engine, long, _ = short_prompt_behind_a_long_one(cell_host, 21, 12)  # 22 steps of 64: 1,408 fed
    assert [n for _, n in engine.steps[21]] == [64]
    assert [n for _, n in engine.steps[22]] == [12]  # the short prompt, at once and alone
    assert [n for _, n in engine.steps[23]] == [1, 64]  # then the long one's chunk, beside its token
    assert long.tokens == alone(cell_host, [prompt(0, 1500)], 2)[0]


@pytest.mark.parametrize("short_tokens", [5, 8])
def test_the_step_that_ends_a_short_prompt_leaves_the_end_of_a_much_longer_one_to_the_next(cell_host, short_tokens):
    # Both prompts could end in one step of 64 (the long one's last 28 tokens, the short one's 5
    # or 8); the short one's first token must not wait for the end of a prompt more than four
    # times its own, even where that end is not (28 < 4 x 8): on llama.cpp a chat's 19 tokens
    # and an agent's last 54 of 1,823 in one forward took 0.55 s, the chat's alone 0.08 s.
    engine, _, _ = short_prompt_behind_a_long_one(cell_host, 22, short_tokens)  # 23 steps of 64: 1,472 fed
    assert [[n for _, n in step] for step in engine.steps[22:25]] == [[64], [short_tokens], [1, 28]]


def test_the_last_chunk_of_a_long_prompt_shares_its_step_with_the_next_prompt(cell_host):
    # Only a prompt fed whole earns a step of its own: the tail of one fed over many steps
    # (40 of 1,000 here) leaves the rest of the step to the prompt behind it.
    host, engine = cell_host(cells=1 << 15, prefill_budget=64)
    _, generations = start(host, [prompt(0, 1000), prompt(1, 1500)], max_tokens=1)
    for generation in generations:
        generation.collect()
    fed = [sum(n for _, n in step) for step in engine.steps]
    assert sum(fed) == 2500 and all(n >= 64 for n in fed[:-1])
    assert [40, 24] in [[n for _, n in step] for step in engine.steps]


@pytest.mark.parametrize("chunks_apart", [False, True])
def test_lanes_about_to_end_decode_before_the_next_chunks_where_chunks_run_apart(cell_host, monkeypatch, chunks_apart):
    # 5 ms a token, steps of 50 ms beside streamed decoding (10 tokens). A 30-token prompt goes
    # first, whole; its 7 tokens left then take 35 ms of steps, within one step's time. Where the
    # engine runs prompt chunks apart from decode tokens (llama.cpp's CPU flash attention), those
    # 7 go in steps of their own and the 300-token prompt's chunks follow: each decode token's
    # cell lands beside its own lane's instead of between two chunks. Elsewhere a step carries both.
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.0, 0.005), decode_step_target=0.05,
                             chunks_apart=chunks_apart)
    on_simulated_time(monkeypatch, engine)
    _, generations = start(host, [prompt(0, 30), prompt(1, 300)], max_tokens=8)
    for g in generations:
        g.collect()
    short, long = (engine.steps[0][0][0], next(s for step in engine.steps for s, n in step if n > 30))
    ending = [i for i, step in enumerate(engine.steps) if (short, 1) in step]
    assert fed_to(engine, short) == [30] + [1] * 7 and len(ending) == 7
    beside = [i for i in ending if any(s == long for s, _ in engine.steps[i])]
    if chunks_apart:
        assert beside == [] and ending == list(range(1, 8))  # right after its prompt, alone
        assert prompt_chunks(fed_to(engine, long), 300)[0] > 10  # then, nobody decoding: longer steps
    else:
        assert beside == ending  # each beside a chunk of the long prompt
    assert [g.tokens for g in generations] == alone(cell_host, [prompt(0, 30), prompt(1, 300)], 8)


def test_lanes_ending_one_after_another_hold_a_long_prompt_back_for_one_steps_time_at_most(cell_host, monkeypatch):
    # 10 ms a step and 5 ms a token, steps of 0.2 s beside streamed decoding. Eight short requests
    # end one after another (4, 8, ..., 32 tokens), so some lane is always within a step's time of
    # its end; a 2,000-token prompt beside them still gets a chunk after about 0.2 s of their steps
    # alone (the bound is on predicted time: one step past it at most).
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.01, 0.005), decode_step_target=0.2, chunks_apart=True)
    on_simulated_time(monkeypatch, engine)
    sessions = [host.session(temperature=0.8, seed=i) for i in range(9)]
    for i, session in enumerate(sessions):
        session.append_tokens(prompt(i, 2000 if i == 0 else 10))
    generations = host.call(lambda: [host.commands.generate(s.id, GenerateRequest.of(
        max_tokens=2 if i == 0 else 4 * i, ignore_eos=True)) for i, s in enumerate(sessions)])
    for g in generations:
        g.collect()
    long = next(s for step in engine.steps for s, n in step if n > 10)
    feeding = [i for i, step in enumerate(engine.steps) if any(s == long and n > 1 for s, n in step)]
    waits = [sum(0.01 + 0.005 * sum(n for _, n in engine.steps[j]) for j in range(a + 1, b))
             for a, b in zip(feeding, feeding[1:])]
    # held (in steps that each fed the eight lanes' tokens), never past the bound by a whole step
    assert max(waits) >= 0.1 and all(w <= 0.2 + 0.01 + 0.005 * 8 for w in waits), waits
    assert [g.tokens for g in generations][0] == alone(cell_host, [prompt(0, 2000)], 2)[0]


class ArrivingCellEngine(CellEngine):
    """A CellEngine that calls `before_step` (if set) on the scheduler thread before each step:
    a test queues a request there, so one arrives at every step whatever the machine's speed."""

    before_step = None

    def step(self, requests):
        if self.before_step is not None:
            self.before_step()
        return super().step(requests)


def test_a_short_request_arriving_at_every_step_does_not_keep_a_long_prompt_held(cell_host, monkeypatch):
    # 10 ms a step and 5 ms a token, steps of 0.2 s beside streamed decoding. A 10-token request
    # of 4 tokens arrives at every step: each is fed whole at once and ends within a step's time,
    # so some lane is always about to end. A 1,500-token prompt still gets a chunk after at most
    # 0.2 s of the steps it is held out of (plus the short prompts' own steps between them).
    host, engine = cell_host(cells=1 << 15, step_seconds=(0.01, 0.005), decode_step_target=0.2,
                             chunks_apart=True, engine_class=ArrivingCellEngine)
    on_simulated_time(monkeypatch, engine)
    shorts = iter([waiting_session(host, prompt(i, 10)) for i in range(1, 61)])
    arrived = []

    def arrive():
        session = next(shorts, None)
        if session is not None:
            arrived.append(host.submit(host.commands.generate, session.id,
                                       GenerateRequest.of(max_tokens=4, ignore_eos=True)))

    engine.before_step = arrive
    _, (long,) = start(host, [prompt(0, 1500)], max_tokens=2)
    long.collect()
    for queued in arrived:
        queued.result().collect()
    seq = next(s for step in engine.steps for s, n in step if n > 10)
    feeding = [i for i, step in enumerate(engine.steps) if any(s == seq and n > 1 for s, n in step)]
    held = [[engine.steps[j] for j in range(a + 1, b)] for a, b in zip(feeding, feeding[1:])]
    cost = lambda step: engine.step_seconds[0] + engine.step_seconds[1] * sum(n for _, n in step)  # noqa: E731
    assert any(held)  # it was held out of some steps, but never for long: at most 0.2 s of
    # steps held for the ending lanes, and between them the short prompts' own steps (never two
    # in a row), so under 0.4 s and one step; without the bound it would wait for every arrival
    assert max(sum(cost(step) for step in gap) for gap in held) <= 0.4 + max(cost(s) for gap in held for s in gap)
    assert long.tokens == alone(cell_host, [prompt(0, 1500)], 2)[0]


@pytest.mark.parametrize("wait", [-0.1, float("nan")])
def test_a_bad_arrival_wait_is_refused_by_name(wait):
    settings = {name: getattr(scheduler.Policy(), name) for name in scheduler.Policy.__dataclass_fields__}
    settings["arrival_wait"] = wait
    with pytest.raises(ValueError, match="arrival_wait"):
        _policy(**settings)
