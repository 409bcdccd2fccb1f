"""Regression tests for defects a review of the pool found (one test per finding)."""

import gc
import subprocess
import sys

import numpy as np
import pytest

from kvpool import (ArrayTemplate, EntryBusy, EntryTooLarge, KVArray, LayoutError, Pool, PoolError, segment)
from kvpool.header import PoolHeader, SlotWriter
from tests.kvpool.test_pool import fragmented_pool, heads_kv


def _consistent(pool):
    cursor = 0
    for offset, length, _ in pool.arena_map():
        assert offset == cursor
        cursor += length
    assert cursor == pool.stats().capacity
    assert pool.stats().bytes_used == sum(e.stored_bytes for e in pool.entries())


def test_extend_refuses_fixed_size_state(make_pool):
    pool = make_pool(1 << 20)
    info = pool.put("m", range(4), [KVArray("k", np.ones((4, 8), np.float32), 0),
                                    KVArray("state", np.ones(16, np.float32))], capacity=8)
    with pytest.raises(LayoutError, match="fixed-size state"):
        pool.extend(info.id, [4])
    with pool.get(info.id) as view:  # untouched, still verifies
        assert (view.arrays["state"] == 1).all()
    pool.release(info.id)
    pool.evict(info.id)  # not left marked as being extended


def test_header_size_is_checked_in_bytes_before_any_room_is_taken(make_pool):
    pool = make_pool(1 << 20)
    before = pool.stats()
    with pytest.raises(LayoutError, match="UTF-8 bytes"):
        pool.put("m", range(2), heads_kv(2), tag="é" * 60)  # 60 characters, 120 bytes
    assert pool.stats() == before
    info = pool.put("ü" * 48, range(2), heads_kv(2), tag="é" * 48)  # 96 + 96 bytes: the most allowed
    assert pool.info(info.id).tag == "é" * 48
    _consistent(pool)


def test_defragment_drops_a_corrupt_entry_it_meets_and_keeps_accounts(make_pool):
    pool, blobs = fragmented_pool(make_pool)
    for info in blobs[1::2]:
        pool.release(info.id)
    for info in blobs[1::2]:  # every entry a move could pick is corrupt
        offset = next(o for o, n, owner in pool.arena_map() if owner == f"{info.id}.data")
        pool._store.arena[offset] ^= 0xFF
    big = pool.put_blob("m", [99], np.full(2500, 99, np.uint8))
    assert big is not None
    _consistent(pool)
    assert pool.stats().corrupt_found >= 1
    assert pool.stats().entries == 1 + 3 - pool.stats().corrupt_found


def test_defragment_says_true_only_when_the_run_exists(make_pool):
    rng = np.random.default_rng(7)
    for trial in range(40):
        pool = make_pool(64 << 10, budget=1 << 20, max_entries=48)
        held = [pool.put_blob("m", [i], np.zeros(int(rng.integers(100, 3000)), np.uint8)) for i in range(30)]
        held = [h for h in held if h is not None]
        for info in held:
            pool.release(info.id)
        for info in held[::2]:
            pool.evict(info.id)
        pool.pin(held[1].id)
        need = int(rng.integers(2000, 12000))
        if pool.defragment(need):
            assert pool.stats().largest_free >= need
        _consistent(pool)
        pool.close()


def test_strided_tokens_and_bad_costs(make_pool):
    pool = make_pool(1 << 20)
    info = pool.put("m", np.arange(8, dtype=np.int32)[::2], heads_kv(4))
    with pool.get(info.id) as view:
        assert list(view.tokens) == [0, 2, 4, 6]
    before = pool.stats()
    for cost in ("x", float("nan"), -1.0, float("inf")):
        with pytest.raises(LayoutError, match="recompute_cost"):
            pool.put("m", range(4), heads_kv(4), recompute_cost=cost)
    assert pool.stats() == before


def test_views_survive_an_extend_and_sharing_waits_for_it(make_pool):
    pool = make_pool(1 << 20)
    info = pool.put("m", range(4), heads_kv(4), capacity=8)
    with pool.get(info.id) as view:
        writer = pool.extend(info.id, [4, 5])
        with pytest.raises(EntryBusy, match="being extended"):
            pool.share(info.id)
        for name, array in writer.arrays.items():
            array[...] = 3.0
        writer.commit()
        view.verify()  # the view checks what it showed: 4 cells
        assert view.info.tokens == 4
    assert pool.share(info.id).tokens == 6


def test_an_entry_that_can_never_fit_evicts_nothing(make_pool):
    pool = make_pool((1 << 20) + 2 * 4096 + 65536, budget=8 << 20, max_entries=4)
    small = pool.put_blob("m", [1], np.zeros(1000, np.uint8))
    pool.release(small.id)
    with pytest.raises(EntryTooLarge, match="arena"):
        pool.put_blob("m", [2], np.zeros(pool.header.arena_size - 2048, np.uint8))
    assert pool.stats().evictions == 0 and pool.stats().entries == 1


def test_ids_are_not_reused_after_an_attach(make_pool):
    pool = make_pool(1 << 20)
    first = pool.put("m", range(2), heads_kv(2))
    last = pool.put("m", range(2), heads_kv(2))
    pool.release(last.id)
    pool.evict(last.id)
    name = pool.name
    pool.close()
    again = Pool.attach(name)
    try:
        assert again.put("m", range(2), heads_kv(2)).id > last.id > first.id
    finally:
        again.close()


def test_matches_shorter_than_a_block(make_pool):
    pool = make_pool(1 << 20)
    info = pool.put("m", range(100), heads_kv(100))
    match = pool.lookup("m", list(range(10)) + [999])
    assert (match.entry_id, match.tokens) == (info.id, 10)
    assert pool.lookup("m", [5, 6]) is None


def test_ls_reports_a_forged_geometry_instead_of_crashing(make_pool):
    pool = make_pool(1 << 20)
    name, header = pool.name, pool.header
    pool.close()
    fields = {f: getattr(header, f) for f in header.__struct_fields__}
    import mmap
    import posix_ipc

    shm = posix_ipc.SharedMemory(segment.segment_name(name))
    with mmap.mmap(shm.fd, 4096) as mapped:
        SlotWriter().write(np.frombuffer(mapped, dtype=np.uint8), PoolHeader(**{**fields, "slot_table_offset": -4096}), 9)
    shm.close_fd()
    done = subprocess.run([sys.executable, "-m", "kvpool", "ls"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith(name))
    assert "geometry" in line


def test_closed_pools_say_so_and_other_api_edges(make_pool):
    pool = make_pool(1 << 20)
    with pytest.raises(LayoutError, match="C-contiguous"):
        pool.put_blob("m", [1], np.zeros((8, 8), np.uint8)[:, ::2])
    writer = pool.reserve("m", range(2), [ArrayTemplate("k", "<f4", (2, 4), 0)])
    del writer  # dropped without commit or abort: given back when collected
    gc.collect()
    assert pool.stats().writing == 0
    pool.close()
    for call in (lambda: pool.lookup("m", [1]), lambda: pool.acquire_prefix("m", [1]), pool.compact,
                 lambda: pool.defragment(64), lambda: pool.put("m", [1], heads_kv(1))):
        with pytest.raises(PoolError, match="closed"):
            call()
