"""The engine contract on every memory kind: plain KV, sliding window (iSWA), recurrent and
hybrid, each on a tiny random-weight model built at test time (tests/memorykinds.py) and run by
llama.cpp and, where mlx-lm has the architecture, by MLX on the same weights.

What must hold on each: a step; a fork that continues exactly as its parent; a cut back where the
memory allows it and a refusal that changes nothing where it does not; an export and import that
continue exactly as the uninterrupted sequence; a corrupt state refused before llama.cpp reads
it; and a price that equals the bytes the pool stores.
"""

from __future__ import annotations

import numpy as np
import pytest

from engines.base import StepRequest
from engines.errors import EngineError, StateError
from engines.llamacpp import memory
from engines.llamacpp.engine import LlamaCppEngine
from engines.mlx.engine import MlxEngine
from kvpool import KVArray
from kvpool import pricing
from superfluid import transfer
from tests import memorykinds, tinymodels

KINDS = ("kv", "iswa", "recurrent", "hybrid", "hybrid-iswa")


MLX_KINDS = ("iswa", "recurrent", "hybrid")  # mlx-lm has no windowed LFM2
CASES = [("llamacpp", kind) for kind in KINDS] + [("mlx", kind) for kind in MLX_KINDS]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """kind -> (the GGUF of a tiny model of that memory kind, its window or 0, its mlx-lm directory)."""
    directory = tmp_path_factory.mktemp("memory-kinds")
    kv = tinymodels.build(directory / "kv")
    models = {"kv": (kv.gguf, 0, None)}
    for kind in KINDS[1:]:
        model = memorykinds.build(kind.replace("-", "_"), directory / kind)
        models[kind] = (model.gguf, model.window or 0, model.mlx)
    return models


@pytest.fixture
def engine_of(built):
    opened = []

    def make(kind: str, runtime: str = "llamacpp", **options):
        if runtime == "mlx":
            engine = MlxEngine(built[kind][2], **options)
        else:
            engine = LlamaCppEngine(built[kind][0], n_ctx=256, n_seq_max=4, threads=1, threads_batch=1, **options)
        opened.append(engine)
        return engine

    yield make
    for engine in opened:
        engine.close()


def feed(engine, seq, tokens, chunk=7):
    """Prefill `tokens` into `seq` in chunks (several steps, as the scheduler does); last logits."""
    logits = None
    for start in range(0, len(tokens), chunk):
        logits = engine.step([StepRequest(seq, tokens[start:start + chunk])])[0][0]
    return logits


def run(engine, seq, logits, steps=6):
    """Greedy continuation: the tokens and every step's logits."""
    tokens, seen = [], []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        logits = engine.step([StepRequest(seq, tokens[-1:])])[0][0]
        seen.append(logits)
    return tokens, seen


def assert_refused_untouched(engine, pool, entry: int, tokens: list[int]) -> None:
    """Importing `entry` raises StateError, leaves the target empty, and the engine works on."""
    target = engine.new_sequence()
    with pool.get(entry) as view, pytest.raises(StateError):
        transfer.import_(engine, target, view)
    assert engine.length(target) == 0
    feed(engine, target, tokens[:4])


def prompt(length: int, salt: int = 0) -> list[int]:
    return [1 + (i * 7 + salt) % 250 for i in range(length)]


@pytest.mark.parametrize("kind", KINDS)
def test_the_kind_is_described(engine_of, built, kind):
    engine = engine_of(kind)
    if built[kind][2] is not None:  # mlx-lm reads the same kind from its cache classes
        mlx = engine_of(kind, "mlx").describe().memory
        assert (mlx.kind, mlx.window) == (engine.describe().memory.kind, engine.describe().memory.window)
        assert mlx.cuts_wrapped_window == (not mlx.window)  # a wrapped RotatingKVCache is never cut
    described = engine.describe().memory
    assert described.kind == kind and described.window == built[kind][1]
    assert described.recurrent == kind.startswith(("recurrent", "hybrid"))


@pytest.mark.parametrize("runtime, kind", CASES)
def test_a_fork_continues_as_its_parent(engine_of, runtime, kind):
    engine = engine_of(kind, runtime)
    parent = engine.new_sequence()
    logits = feed(engine, parent, prompt(40))
    child = engine.fork(parent)
    assert engine.length(child) == 40
    expected, _ = run(engine, parent, logits)
    got, _ = run(engine, child, logits)
    assert got == expected
    if runtime == "llamacpp":  # (MLX counts the copy at the first write after any fork)
        copied = engine.stats().bytes_copied
        assert (copied > 0) == engine.describe().memory.recurrent  # a recurrent state is copied, and counted


@pytest.mark.parametrize("kind", ["kv", "iswa"])
def test_a_cut_back_within_reach_is_exact(engine_of, kind):
    engine = engine_of(kind)
    tokens = prompt(60)
    seq = engine.new_sequence()
    feed(engine, seq, tokens)
    engine.truncate(seq, 57)  # within the window: every window layer still holds what 57 reads
    logits = engine.step([StepRequest(seq, tokens[57:58])])[0][0]
    cold = engine.new_sequence()
    np.testing.assert_allclose(logits, feed(engine, cold, tokens[:58]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["iswa", "recurrent", "hybrid", "hybrid-iswa"])
def test_a_cut_back_out_of_reach_is_refused_untouched(engine_of, pool, kind):
    engine = engine_of(kind)
    tokens = prompt(60)
    seq = engine.new_sequence()
    logits = feed(engine, seq, tokens)
    info = transfer.export(engine, pool, seq, tokens)
    expected, _ = run(engine, seq, logits, 3)
    restored = engine.new_sequence()
    with pool.get(info.id) as view:
        transfer.import_(engine, restored, view)  # a restored window state holds only the window's positions
    keep = 2 if kind == "iswa" else 59
    with pytest.raises(EngineError, match="cannot cut"):
        engine.truncate(restored, keep)
    assert engine.length(restored) == 60
    assert run(engine, restored, logits, 3)[0] == expected  # as it was


@pytest.mark.parametrize("runtime, kind", CASES)
@pytest.mark.parametrize("length", [10, 60])  # inside and past the 16-token window
def test_a_cut_the_memory_allows_is_made_exactly(engine_of, pool, runtime, kind, length):
    # The host picks what to fork or restore by the described rule (Memory.can_cut_restored):
    # wherever it says yes, the engine must cut a restored state there and go on as a cold one.
    engine = engine_of(kind, runtime)
    memory = engine.describe().memory
    tokens = prompt(length, salt=1)
    seq = engine.new_sequence()
    feed(engine, seq, tokens)
    info = transfer.export(engine, pool, seq, tokens)
    engine.free_sequence(seq)
    allowed = [keep for keep in (length - 1, length - 5, 2) if memory.can_cut_restored(length, keep)]
    for keep in allowed:
        restored = engine.new_sequence()
        with pool.get(info.id) as view:
            transfer.import_(engine, restored, view)
        engine.truncate(restored, keep)
        cold = engine.new_sequence()
        logits = feed(engine, cold, tokens[:keep + 1])
        got = engine.step([StepRequest(restored, tokens[keep:keep + 1])])[0][0]
        assert run(engine, restored, got, 3)[0] == run(engine, cold, logits, 3)[0]
        engine.free_sequence(restored)
        engine.free_sequence(cold)
    if kind == "kv" or (kind == "iswa" and length <= 16):
        assert len(allowed) == 3
    elif kind == "iswa" and runtime == "llamacpp":  # a restored window holds what the last position reads
        assert allowed == [length - 1]
    else:  # a wrapped RotatingKVCache, a recurrent state: never cut
        assert allowed == []


@pytest.mark.parametrize("runtime, kind", CASES)
def test_export_and_import_continue_as_the_uninterrupted_sequence(engine_of, pool, runtime, kind):
    engine = engine_of(kind, runtime)
    tokens = prompt(45, salt=3)
    seq = engine.new_sequence()
    logits = feed(engine, seq, tokens)
    info = transfer.export(engine, pool, seq, tokens, tag="kinds")
    expected, expected_logits = run(engine, seq, logits)
    engine.free_sequence(seq)
    other = engine.new_sequence()
    with pool.get(info.id) as view:
        assert transfer.import_(engine, other, view) == 45
    got, got_logits = run(engine, other, logits)
    assert got == expected
    # bit for bit where the restored cells land where the original ones were; a window cache
    # places them elsewhere, which changes the last bits of the sums (flash attention off)
    np.testing.assert_allclose(np.stack(got_logits), np.stack(expected_logits), rtol=0, atol=1e-4)


@pytest.mark.parametrize("runtime, kind", CASES)
def test_a_sequence_moved_through_the_pool_at_every_step_continues_as_the_uninterrupted_one(engine_of, pool,
                                                                                          runtime, kind):
    # What a host under churn does to a lane: swapped out after every prefill chunk and every
    # decoded token, and resumed into another sequence by import.
    engine = engine_of(kind, runtime)
    tokens = prompt(45, salt=9)
    seq = engine.new_sequence()
    expected, _ = run(engine, seq, feed(engine, seq, tokens))
    engine.free_sequence(seq)

    def moved(seq: int, held: list[int]) -> int:
        info = transfer.export(engine, pool, seq, held)
        engine.free_sequence(seq)
        target = engine.new_sequence()
        with pool.get(info.id) as view:
            assert transfer.import_(engine, target, view) == len(held)
        pool.release(info.id)
        return target

    seq, held = engine.new_sequence(), []
    for start in range(0, len(tokens), 7):
        logits = engine.step([StepRequest(seq, tokens[start:start + 7])])[0][0]
        held += tokens[start:start + 7]
        seq = moved(seq, held)
    got = []
    for _ in range(len(expected)):
        got.append(int(np.argmax(logits)))
        logits = engine.step([StepRequest(seq, got[-1:])])[0][0]
        held.append(got[-1])
        seq = moved(seq, held)
    assert got == expected


@pytest.mark.parametrize("kind", KINDS)
def test_the_price_is_what_the_pool_stores(engine_of, pool, kind):
    engine = engine_of(kind)
    described = engine.describe()
    for length in (5, 40):  # inside and (on the window models) past the window
        seq = engine.new_sequence()
        tokens = prompt(length, salt=length)
        feed(engine, seq, tokens)
        info = transfer.export(engine, pool, seq, tokens)
        priced = pricing.state_bytes(described.model_kv, length)
        assert info.live_bytes == priced + memory.state_overhead(engine._template, length, described.memory.window)
        engine.free_sequence(seq)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("damage", ["truncate", "magic", "tail", "count"])
def test_a_corrupt_state_is_refused_without_a_crash(engine_of, pool, kind, damage):
    engine = engine_of(kind)
    tokens = prompt(30, salt=5)
    seq = engine.new_sequence()
    feed(engine, seq, tokens)
    info = transfer.export(engine, pool, seq, tokens)
    with pool.get(info.id) as view:
        raw = np.array(view.blob)
    if damage == "truncate":
        raw = raw[:-40]
    elif damage == "magic":
        raw[0] ^= 0xFF
    elif damage == "tail":
        raw = np.concatenate([raw, np.zeros(12, np.uint8)])
    else:  # the first part's first count (streams, or a recurrent state's cells)
        raw[8:12] = np.frombuffer(np.uint32(1 << 20).tobytes(), np.uint8)
    forged = pool.put_blob(engine.describe().identity, tokens, raw)
    assert_refused_untouched(engine, pool, forged.id, tokens)


@pytest.mark.parametrize("kind", MLX_KINDS)
def test_mlx_refuses_a_cut_back_it_cannot_make_exactly(engine_of, kind):
    # MLX is stricter than llama.cpp: a rotating cache that has wrapped is never cut back, even
    # where llama.cpp's window cache still holds the positions; the host restores a checkpoint
    engine = engine_of(kind, "mlx")
    tokens = prompt(60)
    seq = engine.new_sequence()
    logits = feed(engine, seq, tokens)
    with pytest.raises(EngineError, match="cut back"):
        engine.truncate(seq, 30)
    assert engine.length(seq) == 60
    reference = engine.new_sequence()
    feed(engine, reference, tokens)
    assert run(engine, seq, logits, 3)[0] == run(engine, reference, logits, 3)[0]


@pytest.mark.parametrize("kind", MLX_KINDS)
def test_mlx_refuses_a_state_of_other_caches_without_a_crash(engine_of, pool, kind):
    engine = engine_of(kind, "mlx")
    tokens = prompt(30, salt=5)
    seq = engine.new_sequence()
    feed(engine, seq, tokens)
    info = transfer.export(engine, pool, seq, tokens)
    with pool.get(info.id) as view:  # the same arrays but the last one (MLX entries hold arrays)
        arrays = [KVArray(name, np.array(array)) for name, array in list(view.arrays.items())[:-1]]
    forged = pool.put(engine.describe().identity, tokens, arrays)
    assert_refused_untouched(engine, pool, forged.id, tokens)
