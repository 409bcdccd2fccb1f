"""A story on a tiny pool: exact extents, reference counts and eviction order.

Arena of 8,192 bytes, budget 6,000 bytes. One array of 16 bytes per token; with the 22-byte
layout record and its 1,024-byte header slot, an entry of n tokens stores
align64(16n) + align64(24 + 4n) + 1024 bytes: 10 tokens 1,280, 20 tokens 1,472, 30 tokens 1,728.
"""

import numpy as np
import pytest

from kvpool import EntryTooLarge, KVArray


def kv(n, fill):
    return [KVArray("kv", np.full((n, 16), fill, np.uint8), token_axis=0)]


@pytest.fixture
def pool(make_pool):
    return make_pool(20480, budget=6000, max_entries=8)


def test_story(pool):
    assert pool.header.arena_size == 8192
    a = pool.put("m", range(10), kv(10, 1))
    b = pool.put("m", range(100, 120), kv(20, 2))
    c = pool.put("m", range(200, 230), kv(30, 3))
    pool.release(b.id)
    pool.release(c.id)
    d = pool.put("m", range(300, 310), kv(10, 4))
    assert (a.stored_bytes, b.stored_bytes, c.stored_bytes) == (1280, 1472, 1728)
    assert pool.arena_map() == [
        (0, 192, "1.data"), (192, 64, "1.meta"), (256, 320, "2.data"), (576, 128, "2.meta"),
        (704, 512, "3.data"), (1216, 192, "3.meta"), (1408, 192, "4.data"), (1600, 64, "4.meta"),
        (1664, 6528, "free")]
    assert pool.stats().bytes_used == 5760

    with pool.get(b.id):  # b is now the most recently used, but still the cheapest per byte
        pass
    e = pool.put("m", range(400, 420), kv(20, 5))
    assert [x.id for x in pool.entries()] == [a.id, c.id, d.id, e.id]
    # e fills b's old extents exactly (best fit)
    assert (256, 320, "5.data") in pool.arena_map() and (576, 128, "5.meta") in pool.arena_map()

    f = pool.put("m", range(500, 540), [KVArray("kv", np.full((40, 16), 6, np.uint8), 0)], recompute_cost=1000.0)
    assert pool.stats().evictions == 2 and c.id not in [x.id for x in pool.entries()]

    pool.release(a.id)
    pool.release(f.id)
    g = pool.put("m", range(600, 610), kv(10, 7))
    # a saves 10 tokens for 1,280 bytes, f saves 1,000 for 1,856: a goes, f stays
    assert [x.id for x in pool.entries()] == [d.id, e.id, f.id, g.id]
    stats = pool.stats()
    assert (stats.entries, stats.evictions, stats.refused, stats.bytes_used) == (4, 3, 0, 5888)
    assert stats.evicted_bytes == 1472 + 1728 + 1280

    # Everything left is referenced except f, which alone cannot make room for 30 tokens.
    pool.share(f.id)
    assert pool.put("m", range(700, 730), kv(30, 8)) is None
    assert pool.stats().refused == 1 and pool.stats().entries == 4

    with pytest.raises(EntryTooLarge, match="budget of 6000 bytes"):
        pool.put("m", range(400), kv(400, 9))

    for entry, fill in ((d, 4), (e, 5), (g, 7)):
        with pool.get(entry.id) as view:
            assert (view.arrays["kv"] == fill).all()
    assert pool.arena_map() == [
        (0, 192, "7.data"), (192, 64, "7.meta"), (256, 320, "5.data"), (576, 128, "5.meta"),
        (704, 640, "6.data"), (1344, 64, "free"), (1408, 192, "4.data"), (1600, 64, "4.meta"),
        (1664, 192, "6.meta"), (1856, 6336, "free")]


def test_sharing_copies_nothing_and_counts_references(pool):
    a = pool.put("m", range(10), kv(10, 1))
    copied = pool.stats().bytes_copied
    assert copied == 160
    for expected in (2, 3, 4):
        assert pool.share(a.id).refcount == expected
    assert pool.stats().bytes_copied == copied
    assert pool.stats().shared == 1
    for _ in range(4):
        pool.release(a.id)
    assert pool.info(a.id).refcount == 0
    with pytest.raises(Exception, match="no references"):
        pool.release(a.id)
