"""pytest-benchmark figures for the pool: `pytest benchmarks/test_pool_bench.py`.

For ratios measured side by side in one run, use `python benchmarks/pool_ratios.py`.
"""

import os
import random

import numpy as np
import pytest

from kvpool import Budget, KVArray, Pool
from kvpool.allocator import Allocator

MiB = 1 << 20


@pytest.fixture(scope="module")
def pool():
    size = 1536 * MiB
    made = Pool.create(f"bench-{os.getpid()}", size, budget=Budget(size, None, "benchmark"), max_entries=256)
    yield made
    made.close()
    made.unlink()


@pytest.fixture(scope="module", params=[1, 16, 256], ids=lambda n: f"{n}MiB")
def payload(request):
    data = np.random.default_rng(0).integers(0, 255, (request.param * MiB // 4096, 4096), dtype=np.uint8)
    return [KVArray("kv", data, 0)]


def test_memcpy(benchmark, payload):
    target = np.empty_like(payload[0].data)
    benchmark(np.copyto, target, payload[0].data)


def test_put(benchmark, pool, payload):
    tokens = np.arange(payload[0].data.shape[0])

    def put_then_evict_setup():
        for info in pool.entries():
            if info.refcount:
                pool.release(info.id)
            pool.evict(info.id)
        return (), {}

    benchmark.pedantic(lambda: pool.put("bench", tokens, payload), setup=put_then_evict_setup, rounds=7)


def test_get_into(benchmark, pool, payload):
    info = pool.put("bench", np.arange(payload[0].data.shape[0]), payload)
    target = {"kv": np.empty_like(payload[0].data)}

    def read():
        with pool.get(info.id, verify=False) as view:
            view.read_into(target)

    benchmark(read)
    assert np.array_equal(target["kv"], payload[0].data)
    pool.release(info.id)
    pool.evict(info.id)


@pytest.mark.parametrize("nbytes", [MiB, 1024 * MiB], ids=["1MiB", "1GiB"])
def test_share_release(benchmark, pool, nbytes):
    writer = pool.reserve_blob("bench", [1], nbytes)
    info = writer.commit()
    copied = pool.stats().bytes_copied

    def share_release():
        pool.share(info.id)
        pool.release(info.id)

    benchmark(share_release)
    assert pool.stats().bytes_copied == copied
    pool.release(info.id)
    pool.evict(info.id)


def test_allocator_with_10000_live(benchmark):
    rng = random.Random(0)
    allocator = Allocator(64 << 30)
    held = [(allocator.allocate(n), n) for n in (rng.randint(1, MiB) for _ in range(10_000))]

    def free_then_allocate():
        offset, size = held.pop(rng.randrange(len(held)))
        allocator.free(offset, size)
        size = rng.randint(1, MiB)
        held.append((allocator.allocate(size), size))

    benchmark(free_then_allocate)
