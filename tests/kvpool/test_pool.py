import numpy as np
import pytest

from kvpool import (ArrayTemplate, DataCorrupt, EntryBusy, EntryNotFound, KVArray, LayoutError, Pool, PoolBusy,
                    PoolError)


def heads_kv(tokens, seed=0, heads=2, width=8):
    rng = np.random.default_rng(seed)
    return [KVArray(f"{i}.{p}", rng.standard_normal((heads, tokens, width)).astype(np.float32), 1)
            for i in range(2) for p in "kv"]


def test_put_get_round_trip_strided_and_slack(make_pool):
    pool = make_pool(1 << 20)
    arrays = heads_kv(13, seed=1)
    info = pool.put("m", range(13), arrays, capacity=40)
    assert (info.tokens, info.capacity) == (13, 40)
    assert info.live_bytes == 4 * 2 * 13 * 8 * 4 and info.slack_bytes == 4 * 2 * 27 * 8 * 4
    with pool.get(info.id) as view:
        assert list(view.tokens) == list(range(13))
        for array in arrays:
            assert np.array_equal(view.arrays[array.name], array.data)
        with pytest.raises(ValueError):
            view.arrays["0.k"][0, 0, 0] = 1.0  # views handed out are read-only


def test_read_into_is_one_counted_copy(make_pool):
    pool = make_pool(1 << 20)
    arrays = heads_kv(9, seed=2)
    info = pool.put("m", range(9), arrays)
    before = pool.stats().bytes_copied
    targets = {a.name: np.empty_like(a.data) for a in arrays}
    with pool.get(info.id, verify=False) as view:
        assert not view.verified
        assert view.read_into(targets) == info.live_bytes
        assert view.verified
    assert all(np.array_equal(targets[a.name], a.data) for a in arrays)
    assert pool.stats().bytes_copied - before == info.live_bytes


def test_blob_entries(make_pool):
    pool = make_pool(1 << 20)
    blob = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8)
    info = pool.put_blob("llama", range(50), blob.tobytes())
    assert info.slack_bytes == 0 and info.capacity == 50
    with pool.get(info.id) as view:
        assert np.array_equal(view.blob, blob)
        out = np.empty_like(blob)
        view.read_blob_into(out)
        assert np.array_equal(out, blob)
        with pytest.raises(LayoutError):
            view.arrays
    with pytest.raises(LayoutError, match="blob"):
        pool.extend(info.id, [1])


def test_reserve_lets_an_engine_write_in_place(make_pool):
    pool = make_pool(1 << 20)
    writer = pool.reserve("m", range(4), [ArrayTemplate("k", "<f4", (2, 0, 3), 1)], capacity=8)
    assert pool.stats().writing == 1 and pool.lookup("m", range(4)) is None  # invisible until commit
    writer.arrays["k"][...] = 7.0
    info = writer.commit()
    with pool.get(info.id) as view:
        assert (view.arrays["k"] == 7.0).all() and view.arrays["k"].shape == (2, 4, 3)


def test_a_writer_left_without_commit_aborts(make_pool):
    pool = make_pool(1 << 20)
    before = pool.stats()
    with pytest.raises(RuntimeError):
        with pool.reserve("m", range(4), [ArrayTemplate("k", "<f4", (4, 3), 0)]) as writer:
            writer.arrays["k"][...] = 1
            raise RuntimeError("engine failed mid-export")
    after = pool.stats()
    assert (after.entries, after.writing, after.bytes_used, after.bytes_free) == (0, 0, 0, before.bytes_free)


def test_extend_appends_within_capacity(make_pool):
    pool = make_pool(1 << 20)
    first = heads_kv(5, seed=4)
    info = pool.put("m", range(5), first, capacity=8)
    more = heads_kv(3, seed=5)
    writer = pool.extend(info.id, [5, 6, 7])
    for array in more:
        writer.arrays[array.name][...] = array.data
    assert writer.commit().tokens == 8
    with pool.get(info.id) as view:
        for a, b in zip(first, more):
            assert np.array_equal(view.arrays[a.name], np.concatenate([a.data, b.data], axis=1))
    assert pool.lookup("m", range(10)).tokens == 8
    with pytest.raises(LayoutError, match="room for 0 more"):
        pool.extend(info.id, [8])
    pool.share(info.id)
    with pytest.raises(EntryBusy, match="immutable"):
        pool.extend(info.id, [])


def test_compaction_returns_slack_and_keeps_data(make_pool):
    pool = make_pool(1 << 20)
    arrays = heads_kv(16, seed=6)
    info = pool.put("m", range(16), arrays, capacity=1024)
    slack = pool.info(info.id).slack_bytes
    assert slack == 4 * 2 * 1008 * 8 * 4
    used = pool.stats().bytes_used
    reclaimed = pool.compact()
    assert reclaimed == used - pool.stats().bytes_used and reclaimed >= slack
    after = pool.info(info.id)
    assert (after.capacity, after.slack_bytes) == (16, 0)
    assert pool.stats().bytes_moved == info.live_bytes and pool.stats().slack_reclaims == 1
    with pool.get(info.id) as view:  # verifies the checksum too
        assert all(np.array_equal(view.arrays[a.name], a.data) for a in arrays)


def test_compaction_evicts_an_unreferenced_entry_found_corrupt(make_pool):
    pool = make_pool(4 << 20)
    held = pool.put("m", range(4), heads_kv(4), capacity=2048)
    cached = pool.put("m", range(4), heads_kv(4, seed=1), capacity=2048)
    pool.release(cached.id)
    for entry in (held, cached):
        offset = next(o for o, n, owner in pool.arena_map() if owner == f"{entry.id}.data")
        pool._store.arena[offset] ^= 0xFF
    assert pool.compact() == 0
    assert pool.stats().corrupt_found == 2
    assert [e.id for e in pool.entries()] == [held.id]  # the referenced one stays, for its holder to see


def test_compaction_skips_pinned_and_small_slack(make_pool):
    pool = make_pool(1 << 20)
    big = pool.put("m", range(4), heads_kv(4), capacity=2048)
    small = pool.put("m", range(4), heads_kv(4), capacity=6)
    pool.pin(big.id)
    assert pool.compact() == 0
    pool.unpin(big.id)
    assert pool.compact() > 0
    assert pool.info(small.id).capacity == 6


def fragmented_pool(make_pool):
    """An 8 KiB arena holding entries 2, 4 and 6 of seven 1,000-byte blobs (1,024 + 64 bytes
    each): every other one evicted, leaving holes of 1,088 bytes. (pool, all seven infos)."""
    pool = make_pool(8192 + 12288, budget=1 << 20, max_entries=8)
    blobs = [pool.put_blob("m", [i], np.full(1000, i, np.uint8)) for i in range(7)]
    for info in blobs[::2]:
        pool.release(info.id)
        pool.evict(info.id)
    return pool, blobs


def test_defragmentation_moves_extents_when_free_space_is_split(make_pool):
    pool, blobs = fragmented_pool(make_pool)
    pool.pin(blobs[1].id)
    largest = pool.stats().largest_free
    assert largest < 2500 <= pool.stats().bytes_free
    big = pool.put_blob("m", [99], np.full(2500, 99, np.uint8))
    assert big is not None
    assert pool.stats().relocations >= 1 and pool.stats().evictions == 4
    for info in blobs[1::2]:
        with pool.get(info.id) as view:
            assert (view.blob == info.id - 1).all()
    assert pool.info(blobs[1].id).id == blobs[1].id


def test_pinned_entries_are_never_evicted_or_moved(make_pool):
    pool = make_pool(20480, budget=4000, max_entries=8)
    a = pool.put_blob("m", [1], np.ones(1000, np.uint8))
    pool.release(a.id)
    with pool.get(a.id):
        with pytest.raises(EntryBusy):
            pool.evict(a.id)
        assert pool.put_blob("m", [2], np.ones(2000, np.uint8)) is None
    assert pool.put_blob("m", [2], np.ones(2000, np.uint8)) is not None
    assert pool.stats().evictions == 1


def test_close_refuses_while_views_are_open(make_pool):
    pool = make_pool(1 << 20)
    info = pool.put("m", range(3), heads_kv(3))
    view = pool.get(info.id)
    with pytest.raises(PoolBusy, match="open views"):
        pool.close()
    kept = view.arrays["0.k"]
    view.close()
    with pytest.raises(PoolBusy, match="still points into the pool"):
        pool.close()
    assert kept.shape == (2, 3, 8)  # the pool is still usable after the refusal
    del kept
    assert pool.info(info.id).pins == 0
    pool.close()
    with pytest.raises(PoolError, match="closed"):
        pool.info(info.id)


def test_corrupt_data_is_detected_on_read(make_pool):
    pool = make_pool(1 << 20)
    info = pool.put("m", range(3), heads_kv(3))
    offset = next(o for o, n, owner in pool.arena_map() if owner == f"{info.id}.data")
    pool._store.arena[offset + 5] ^= 0xFF  # a flipped bit in shared memory
    with pytest.raises(DataCorrupt, match="evict"):
        pool.get(info.id)
    assert pool.info(info.id).pins == 0  # the failed get left no pin
    with pool.get(info.id, verify=False) as view:
        with pytest.raises(DataCorrupt):
            view.read_into({a.name: np.empty_like(a.data) for a in heads_kv(3)})
    pool.release(info.id)
    pool.evict(info.id)
    assert pool.stats().entries == 0


@pytest.mark.parametrize("call, error", [
    (lambda p: p.put("", [1], heads_kv(1)), "identity"),
    (lambda p: p.put("m", [1], heads_kv(1), tag="x" * 200), "tag"),
    (lambda p: p.put("m", [[1, 2]], heads_kv(1)), "1-D"),
    (lambda p: p.put("m", [1.5], heads_kv(1)), "integers"),
    (lambda p: p.put("m", [2 ** 40], heads_kv(1)), "int32"),
    (lambda p: p.put("m", [1, 2], heads_kv(1)), "cells but 2 token"),
    (lambda p: p.put("m", [1, 2], heads_kv(2), capacity=1), "capacity"),
    (lambda p: p.reserve_blob("m", [1], -1), "blob size"),
])
def test_bad_input_is_refused_and_changes_nothing(make_pool, call, error):
    pool = make_pool(1 << 20)
    kept = pool.put("m", range(3), heads_kv(3))
    before = pool.stats()
    with pytest.raises(LayoutError, match=error):
        call(pool)
    assert pool.stats() == before
    assert pool.info(kept.id).tokens == 3


def test_unknown_entries(make_pool):
    pool = make_pool(1 << 20)
    for call in (pool.get, pool.share, pool.release, pool.evict, pool.info, pool.pin):
        with pytest.raises(EntryNotFound, match="no ready entry 42"):
            call(42)


def test_acquire_prefix_shares_atomically(make_pool):
    pool = make_pool(1 << 20)
    info = pool.put("m", range(40), heads_kv(40))
    pool.release(info.id)
    match = pool.acquire_prefix("m", list(range(20)) + [999])
    assert (match.entry_id, match.tokens) == (info.id, 20)
    assert pool.info(info.id).refcount == 1
    assert pool.acquire_prefix("other-model", range(20)) is None


def test_a_namespace_is_found_only_by_its_own_lookups_and_survives_attach(make_pool):
    # a tenant's prompt cache: another tenant sending the same tokens finds nothing
    pool = make_pool(1 << 20)
    theirs = pool.put("m", range(40), heads_kv(40), namespace="alice")
    pool.put("m", range(40), heads_kv(40, seed=1))  # the same tokens in the empty namespace
    assert pool.lookup("m", range(40), namespace="alice").entry_id == theirs.id
    assert pool.lookup("m", range(40), namespace="bob") is None
    assert pool.lookup("m", range(40)).entry_id != theirs.id
    assert pool.acquire_prefix("m", range(8), namespace="bob") is None
    assert pool.info(theirs.id).namespace == "alice"
    name = pool.name
    pool.close()
    again = Pool.attach(name)
    try:
        assert again.lookup("m", range(40), namespace="alice").entry_id == theirs.id
        assert again.lookup("m", range(40), namespace="bob") is None
    finally:
        again.close()


def test_a_namespace_too_long_for_the_header_is_refused_before_anything_is_written(make_pool):
    pool = make_pool(1 << 20)
    with pytest.raises(LayoutError, match="namespace must be a string of 0-96 UTF-8 bytes"):
        pool.put("m", range(4), heads_kv(4), namespace="x" * 97)
    assert pool.stats().entries == 0


def test_find_by_tag_and_reattach(make_pool):
    pool = make_pool(1 << 20)
    info = pool.put("m", range(5), heads_kv(5), tag="session:abc")
    pool.put("m", range(5), heads_kv(5), tag="session:def")
    name = pool.name
    pool.close()
    again = Pool.attach(name)
    try:
        assert [e.id for e in again.find("session:abc")] == [info.id]
        assert again.recovery.entries == 2
        assert again.info(info.id).refcount == 0  # references are not durable
        newer = again.put("m", range(2), heads_kv(2))
        assert newer.id > info.id + 1  # ids are not reused after a re-attach
    finally:
        again.close()


def test_budget_computed_at_creation_counts_the_pools_own_memory(pool_name):
    from kvpool.budget import host_memory_available

    pool = Pool.create(pool_name, 64 << 20, max_entries=64)
    try:
        slots = 64 * 1024
        assert pool.header.budget_bytes == pool.header.arena_size + slots  # bounded by the pool itself
        assert "capacity" in pool.header.budget_reason
        assert host_memory_available() > 0
    finally:
        pool.close()
        pool.unlink()


def test_a_device_without_free_memory_grants_nothing_and_says_why(pool_name):
    from kvpool import Device, EntryTooLarge

    pool = Pool.create(pool_name, 1 << 20, device=Device("cuda", "cuda:0", free_bytes=0), headroom=1 << 30)
    try:
        assert pool.header.budget_bytes == 0
        with pytest.raises(EntryTooLarge, match="reports no free memory.*headroom of 1.00 GiB"):
            pool.put("m", range(3), heads_kv(3))
        assert pool.stats().entries == 0
    finally:
        pool.close()
        pool.unlink()


def test_shed_evicts_cheapest_first_down_to_a_target_and_spares_held_entries(make_pool):
    pool = make_pool(1 << 20)
    cheap = pool.put("m", range(5), heads_kv(5), recompute_cost=1.0)
    dear = pool.put("m", range(5), heads_kv(5), recompute_cost=100.0)
    held = pool.put("m", range(5), heads_kv(5), recompute_cost=0.5)
    pinned = pool.put("m", range(5), heads_kv(5), recompute_cost=0.1)
    for entry in (cheap, dear, pinned):
        pool.release(entry.id)
    pool.pin(pinned.id)
    used = pool.stats().bytes_used
    assert pool.usage() == (used, pool.stats().budget_bytes)
    assert pool.pinned_bytes() == pinned.stored_bytes
    freed = pool.shed(used - 1)  # one entry's worth is enough
    assert freed == cheap.stored_bytes and {e.id for e in pool.entries()} == {dear.id, held.id, pinned.id}
    assert pool.shed(0) == dear.stored_bytes and {e.id for e in pool.entries()} == {held.id, pinned.id}
    assert pool.stats().evictions == 2
