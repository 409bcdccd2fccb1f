"""A lane that decoded through a burst of long prompts, its cells placed past theirs in llama.cpp's
unified cache, moves down to the cache's start once the burst ends (superfluid/host/seats.py), and
goes on exactly as if it had not moved. Where the runtime keeps each sequence's cache apart (MLX),
nothing moves. llama.cpp says where its cells are only in its debug log: with
LLAMA_KV_CACHE_DEBUG=1 it logs, before placing each forward's tokens, the cells up to the highest
in use (`n`, what every forward reads) and the cells in use (`used`)."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

from engines.errors import NoRoom
from kvpool import PoolError
from superfluid.host import seats, transfer
from superfluid.host.lane import Span
from superfluid.host.request import GenerateRequest
from tests.gate import Gate, decode_steps_of

FIND_SLOT = re.compile(r"find_slot: stream\[\d+\], n = +(\d+), used = +(\d+)")
BURST, BURST_PROMPT = 3, 2000  # prompts the scheduler feeds one after another: 2,000 cells at a time
REPLY = 600  # tokens the reply decodes, most of them after the burst (STRANDED_TOKENS is 256)


def prompt(i: int, length: int) -> list[int]:
    """A prompt of `length` tokens that shares no prefix with prompt(j), j != i (of the tiny vocabulary)."""
    return [10 + i] + [10 + (i * 7 + j * 13) % 64 for j in range(1, length)]


def reply_through_a_burst(host, gate: Gate) -> tuple[list[int], list]:
    """A reply decoding, then a burst of long prompts of 2 tokens each queued while it decodes: the
    reply's tokens once everything ended, and the burst's generations."""
    burst = []
    for i in range(BURST):  # (made before the gate holds the scheduler thread)
        session = host.session()
        session.append_tokens(prompt(1 + i, BURST_PROMPT))
        burst.append(session)
    reply = host.session(temperature=0.8, seed=5)
    reply.append_tokens(prompt(0, 40))
    running = reply.generate(max_tokens=REPLY, ignore_eos=True)
    gate.wait_reached()
    queued = [host.submit(host.commands.generate, s.id, GenerateRequest.of(max_tokens=2, ignore_eos=True))
              for s in burst]
    gate.open()
    done = [q.result() for q in queued]
    for generation in done:
        generation.collect()
    running.collect()
    return running.tokens, done


def alone(open_host, tmp_path) -> list[int]:
    """The reply's tokens on an idle host."""
    host = open_host(pool_name="reseat-alone", log_dir=tmp_path / "alone-log")
    reply = host.session(temperature=0.8, seed=5)
    reply.append_tokens(prompt(0, 40))
    generation = reply.generate(max_tokens=REPLY, ignore_eos=True)
    generation.collect()
    return generation.tokens


@pytest.mark.parametrize("runtime", ["llamacpp"])
def test_a_reply_decoding_through_a_burst_moves_to_the_cache_start_once_the_burst_ends(open_host, runtime, tmp_path,
                                                                                         monkeypatch, caplog):
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "1")  # read as llama.cpp makes its cache
    caplog.set_level(logging.DEBUG, logger="llama.cpp")
    gate = Gate(decode_steps_of(lanes=1, count=3))
    host = open_host(gate=gate, llamacpp_n_ctx=16384)
    tokens, burst = reply_through_a_burst(host, gate)
    stats = host.stats()
    placements = [(int(m.group(1)), int(m.group(2))) for record in caplog.records
                  if record.name == "llama.cpp" and (m := FIND_SLOT.search(record.getMessage()))]
    # (one move after each burst prompt that freed enough cells below the reply: one or more)
    assert stats.reseats >= 1 and all(len(g.tokens) == 2 for g in burst)
    # the reply's decode tokens went past a burst prompt's cells, and forwards read far more than
    # the cells in use once that prompt's were freed ...
    assert any(n - used > seats.STRANDED_CELLS for n, used in placements)
    # ... and after the move every forward read only the cells in use: the reply's, from the start
    last = placements[-(REPLY // 2):]
    assert all(n == used for n, used in last), last[:5]
    assert tokens == alone(open_host, tmp_path)  # token for token, as if it had never moved


@pytest.mark.parametrize("runtime", ["mlx"])
def test_mlx_sequences_keep_their_own_caches_and_nothing_moves(open_host, runtime, tmp_path):
    gate = Gate(decode_steps_of(lanes=1, count=3))
    host = open_host(gate=gate)
    tokens, burst = reply_through_a_burst(host, gate)
    assert host.stats().reseats == 0 and all(len(g.tokens) == 2 for g in burst)
    assert tokens == alone(open_host, tmp_path)


@pytest.mark.parametrize("runtime", ["llamacpp"])
def test_a_move_the_engine_refuses_becomes_a_swap_and_the_reply_goes_on_exactly(open_host, runtime, tmp_path,
                                                                                 monkeypatch):
    gate = Gate(decode_steps_of(lanes=1, count=3))
    host = open_host(gate=gate, llamacpp_n_ctx=16384)
    imports, real = [], transfer.import_

    def refuse_the_move(engine, seq, view):  # the first import (the move's) finds no contiguous room
        imports.append(seq)
        if len(imports) == 1:
            raise NoRoom("llama.cpp needs contiguous free cells (refused by the test)")
        return real(engine, seq, view)

    monkeypatch.setattr(transfer, "import_", refuse_the_move)
    tokens, _ = reply_through_a_burst(host, gate)
    stats = host.stats()
    # the lane waited with its parked KV held and was imported by admission (nothing prefilled
    # again); each later move imported it once more
    assert stats.import_failures == 1 and len(imports) == 2 + stats.reseats
    assert stats.prefill_tokens == 40 + BURST * BURST_PROMPT
    monkeypatch.setattr(transfer, "import_", real)
    assert tokens == alone(open_host, tmp_path)


@pytest.mark.parametrize("runtime", ["llamacpp"])
def test_a_move_the_pool_refuses_leaves_the_lane_where_it_is_and_is_not_retried_every_step(open_host, runtime,
                                                                                            tmp_path, monkeypatch):
    gate = Gate(decode_steps_of(lanes=1, count=3))
    host = open_host(gate=gate, llamacpp_n_ctx=16384)
    exports = []

    def pool_full(engine, pool, seq, tokens, **kwargs):  # every export refused, as by a pool with no room left
        exports.append(len(tokens))
        raise PoolError("the pool has no room for this entry (refused by the test)")

    monkeypatch.setattr(transfer, "export", pool_full)
    tokens, _ = reply_through_a_burst(host, gate)
    stats = host.stats()
    assert stats.reseats == 0 and stats.export_failures == len(exports)
    assert any(count < BURST_PROMPT for count in exports)  # the reply's move was tried (the burst's are longer) ...
    assert len(exports) < 20  # ... once or twice, beside the burst's parks: not at every step of its 600
    monkeypatch.undo()
    assert tokens == alone(open_host, tmp_path)


def lane(seat_mark: int, kv: int, *, left: int = 1000, pending: int = 1, group: int = 1, borrowed=()):
    """What `seats.stranded` reads of a lane."""
    job = SimpleNamespace(request=SimpleNamespace(max_tokens=left), produced=0)
    return SimpleNamespace(job=job, seq=0, kv=kv, seat_mark=seat_mark, pending=pending,
                           own=Span(group, 0, kv), borrowed=list(borrowed))


def test_only_decoding_lanes_far_below_their_mark_with_work_left_are_stranded():
    far = seats.STRANDED_CELLS + 1000
    moved = lane(far + 500, 500)
    assert seats.stranded([moved], 500) == [moved]
    assert seats.stranded([lane(seats.STRANDED_CELLS - 1 + 500, 500)], 500) == []  # not far enough
    assert seats.stranded([lane(far + 500, 3000)], 500) == []  # its copies would cost more than twice it saves
    assert seats.stranded([lane(far + 500, 500, left=seats.STRANDED_TOKENS - 1)], 500) == []  # about to end
    assert seats.stranded([lane(far + 500, 500, pending=300)], 500) == []  # still prefilling
    parent, child = lane(far + 500, 500, group=1), lane(far + 500, 600, group=2, borrowed=[Span(1, 0, 500)])
    assert seats.stranded([parent, child], 500) == []  # cells a fork shares stay where they were written
    # ... but once nobody else holds them (the parent ended, or a cut turned its own cells into a
    # span it borrows from itself), the lane moves with them
    assert seats.stranded([child], 500) == [child]
    idle = lane(far + 500, 500)
    idle.job = None
    assert seats.stranded([idle], 500) == []  # an idle lane is parked instead
