"""The engine boundary: engines describe and read state; the host (superfluid.host.transfer) reserves,
commits, checks identity and verifies, the same way for llama.cpp and MLX."""

import numpy as np
import pytest

from engines.base import Snapshot, StepRequest
from engines.errors import EngineError, IdentityMismatch
from kvpool import DataCorrupt, EntryTooLarge, KVArray
from superfluid import transfer

TOKENS = list(range(5, 45))


@pytest.fixture(params=["llamacpp", "mlx"])
def engine(request, engine_for, tiny_mlx):
    """A tiny model on each runtime, one sequence of TOKENS prefilled."""
    if request.param == "llamacpp":
        return engine_for("f32")
    from engines.mlx.engine import MlxEngine

    opened = MlxEngine(tiny_mlx)
    request.addfinalizer(opened.close)
    return opened


def prefilled(engine) -> int:
    seq = engine.new_sequence()
    engine.step([StepRequest(seq, TOKENS, "none")])
    return seq


def test_a_snapshot_is_a_blob_or_arrays_never_half():
    array = KVArray("k", np.zeros((1, 2, 3), np.float32), 2)
    assert Snapshot(arrays=(array,)).write_blob is None
    with pytest.raises(ValueError, match="not both or half"):
        Snapshot(blob_bytes=10)
    with pytest.raises(ValueError, match="not both or half"):
        Snapshot(blob_bytes=10, write_blob=lambda target: None, arrays=(array,))


def test_a_snapshot_writes_nothing_until_the_host_gives_it_memory(engine, make_pool):
    """Taking a snapshot stores nothing; the host's export is the one copy into the pool."""
    pool = make_pool(16 << 20)
    seq = prefilled(engine)
    snapshot = engine.snapshot(seq, TOKENS)
    size = snapshot.blob_bytes if snapshot.write_blob else sum(a.data.nbytes for a in snapshot.arrays)
    assert pool.stats().bytes_written == 0 and not pool.entries()
    info = transfer.export(engine, pool, seq, TOKENS, tag="boundary")
    assert info.tag == "boundary" and info.tokens == len(TOKENS) and info.identity == engine.describe().identity
    assert pool.stats().bytes_written == info.live_bytes == size


def test_export_checks_the_tokens_and_a_pool_without_room_stores_nothing(engine, make_pool):
    seq = prefilled(engine)
    tiny = make_pool(1 << 20, budget=1024)
    with pytest.raises(EngineError, match="tokens were given"):
        transfer.export(engine, tiny, seq, TOKENS[:-1])
    with pytest.raises(EntryTooLarge):
        transfer.export(engine, tiny, seq, TOKENS)
    full = make_pool(1 << 20, budget=1 << 20)
    pinned = []
    while (more := transfer.export(engine, full, seq, TOKENS)) is not None:
        full.pin(more.id)  # held and pinned: nothing may make room for the next
        pinned.append(more.id)
    assert pinned and sorted(e.id for e in full.entries()) == pinned  # the refused one left no trace
    assert not tiny.entries() and engine.length(seq) == len(TOKENS)


def test_an_import_of_another_engines_entry_leaves_the_sequence_untouched(engine, make_pool, engine_for):
    pool = make_pool(16 << 20)
    other = engine_for("f16")  # other weights: another identity
    source = prefilled(other)
    info = transfer.export(other, pool, source, TOKENS)
    target = engine.new_sequence()
    engine.step([StepRequest(target, [1, 2, 3], "none")])
    with pool.get(info.id, verify=False) as view, pytest.raises(IdentityMismatch, match="cannot read that state"):
        transfer.import_(engine, target, view)
    assert engine.length(target) == 3


def test_corrupt_bytes_are_caught_by_the_checksum_and_the_engine_goes_on(engine, make_pool):
    pool = make_pool(16 << 20)
    info = transfer.export(engine, pool, prefilled(engine), TOKENS)
    offset = next(o for o, n, owner in pool.arena_map() if owner == f"{info.id}.data")
    pool._store.arena[offset + 64] ^= 0x40
    target = engine.new_sequence()
    with pool.get(info.id, verify=False) as view, pytest.raises(DataCorrupt):
        transfer.import_(engine, target, view)
    assert engine.length(target) == 0
    engine.step([StepRequest(target, [1, 2], "none")])
    assert engine.length(target) == 2


def test_llama_cpp_reads_no_unverified_blob(engine_for, make_pool):
    """llama.cpp reads a blob in place and aborts the process on bad bytes, so an engine handed an
    unverified view refuses it rather than trusting the caller."""
    engine = engine_for("f32")
    pool = make_pool(16 << 20)
    info = transfer.export(engine, pool, prefilled(engine), TOKENS)
    target = engine.new_sequence()
    with pool.get(info.id, verify=False) as view, pytest.raises(EngineError, match="has not been verified"):
        engine.import_(target, view)
    with pool.get(info.id, verify=False) as view:
        assert transfer.import_(engine, target, view) == len(TOKENS)


def test_a_blob_snapshot_writes_only_into_memory_of_its_size(engine_for):
    engine = engine_for("f32")
    snapshot = engine.snapshot(prefilled(engine), TOKENS)
    with pytest.raises(EngineError, match="contiguous bytes"):
        snapshot.write_blob(np.zeros(snapshot.blob_bytes - 1, np.uint8))
    target = np.zeros(snapshot.blob_bytes, np.uint8)
    snapshot.write_blob(target)
    assert target.any()
