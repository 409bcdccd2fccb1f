import pytest
from hypothesis import given, settings, strategies as st

from kvpool.allocator import ALIGN, Allocator


def test_story_best_fit_and_coalescing():
    a = Allocator(1024)
    assert [a.allocate(n) for n in (100, 64, 200, 64)] == [0, 128, 192, 448]
    assert a.free_extents() == [(512, 512)]
    a.free(128, 64)
    a.free(448, 64)  # merges with the tail
    assert a.free_extents() == [(128, 64), (448, 576)]
    assert a.allocate(50) == 128  # best fit: the 64-byte hole, not the big tail
    a.free(0, 100)
    a.free(128, 50)
    assert a.free_extents() == [(0, 192), (448, 576)]
    a.free(192, 200)
    assert a.free_extents() == [(0, 1024)]
    assert a.free_bytes == 1024 and a.largest_free == 1024


def test_none_when_nothing_fits():
    a = Allocator(256)
    assert a.allocate(128) == 0
    assert a.allocate(192) is None
    assert a.allocate(128) == 128
    assert a.allocate(1) is None


def test_double_free_and_bad_extents_are_refused():
    a = Allocator(256)
    a.allocate(64)
    a.free(0, 64)
    with pytest.raises(ValueError, match="double free"):
        a.free(0, 64)
    with pytest.raises(ValueError):
        a.free(250, 64)
    with pytest.raises(ValueError):
        a.allocate(0)


def test_rebuild_from_used_extents():
    a = Allocator(1024, used=[(512, 100), (0, 64)])
    assert a.free_extents() == [(64, 448), (640, 384)]
    with pytest.raises(ValueError, match="overlaps"):
        Allocator(1024, used=[(0, 128), (64, 64)])


def test_phased_allocation_returns_the_rest():
    a = Allocator(16384)
    assert a.allocate(100) == 0
    start = a.allocate(5000, modulus=4096, phase=2048)
    assert start == 2048 and a.free_extents() == [(128, 1920), (7104, 9280)]
    a.free(start, 5000)
    a.free(0, 100)
    assert a.free_extents() == [(0, 16384)]
    assert a.allocate(16000, modulus=4096, phase=0) is None
    with pytest.raises(ValueError):
        a.allocate(64, modulus=4096, phase=4096)


def test_take_exact_range():
    a = Allocator(1024)
    a.take(256, 128)
    assert a.free_extents() == [(0, 256), (384, 640)]
    with pytest.raises(ValueError):
        a.take(300, 64)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 700)), max_size=60))
def test_random_operations_keep_invariants(ops):
    size = 8192
    a = Allocator(size)
    held: dict[int, int] = {}
    for allocate, n in ops:
        if allocate or not held:
            offset = a.allocate(n, modulus=1024, phase=512) if n % 3 == 0 else a.allocate(n)
            assert offset is None or n % 3 or offset % 1024 == 512
            if offset is not None:
                held[offset] = n
        else:
            offset = sorted(held)[n % len(held)]
            a.free(offset, held.pop(offset))
        free = a.free_extents()
        used = sorted((o, -(-n // ALIGN) * ALIGN) for o, n in held.items())
        spans = sorted(free + used)
        # extents tile the arena exactly: no overlap, no gap
        cursor = 0
        for offset, length in spans:
            assert offset == cursor
            cursor += length
        assert cursor == size
        # free space is coalesced: no two free extents touch
        assert all(o1 + n1 < o2 for (o1, n1), (o2, _) in zip(free, free[1:]))
        assert a.free_bytes == sum(n for _, n in free)
