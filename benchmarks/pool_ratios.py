"""kvpool against memcpy, measured side by side in one run.

    python benchmarks/pool_ratios.py            # 1 MiB .. 256 MiB, share at 1 MiB and 1 GiB
    python benchmarks/pool_ratios.py --quick    # small sizes only (what the tests run)

Figures:
- put (copy into the pool with the checksum computed on the way) and get (copy out of the pool,
  verifying the checksum on the way: what an engine's import costs), each against numpy's
  memcpy of the same bytes, for a contiguous entry and for a KV-shaped one (16 layers x K/V x
  4 heads x 64 f16, token axis inside the heads, so each head is one run);
- share + release of a 1 MiB and a 1 GiB entry (a reference count: no bytes move);
- allocator operations per second with 10,000 live extents.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import Holder, Run  # noqa: E402
from kvpool import Budget, KVArray, Pool  # noqa: E402
from kvpool.allocator import Allocator  # noqa: E402

MiB = 1 << 20
LAYERS, HEADS, WIDTH = 16, 4, 64
KV_BYTES_PER_TOKEN = LAYERS * 2 * HEADS * WIDTH * 2


def contiguous(nbytes: int) -> list[KVArray]:
    rows = nbytes // 4096
    return [KVArray("kv", np.random.default_rng(0).integers(0, 255, (rows, 4096), dtype=np.uint8), 0)]


def kv_shaped(nbytes: int) -> list[KVArray]:
    tokens = nbytes // KV_BYTES_PER_TOKEN
    rng = np.random.default_rng(1)
    return [KVArray(f"{layer}.{part}", rng.standard_normal((HEADS, tokens, WIDTH)).astype(np.float16), 1)
            for layer in range(LAYERS) for part in "kv"]


def bench_put_get(run: Run, pool: Pool, label: str, arrays: list[KVArray], repeat: int) -> None:
    nbytes = sum(a.data.nbytes for a in arrays)
    tokens = np.arange(arrays[0].data.shape[arrays[0].token_axis])
    flat = np.concatenate([a.data.reshape(-1).view(np.uint8) for a in arrays])
    target = np.empty_like(flat)
    run.measure(f"memcpy {label}", lambda: np.copyto(target, flat), repeat=repeat, nbytes=nbytes)

    held = Holder(pool)
    run.measure(f"put {label}", lambda: held.hold(pool.put("bench", tokens, arrays)), repeat=repeat,
                setup=held.drop, nbytes=nbytes)
    held.drop()
    entry = pool.put("bench", tokens, arrays)
    destinations = {a.name: np.empty_like(a.data) for a in arrays}

    def get_into():
        with pool.get(entry.id, verify=False) as view:
            view.read_into(destinations)

    run.measure(f"get {label}", get_into, repeat=repeat, nbytes=nbytes)
    assert all(np.array_equal(destinations[a.name], a.data) for a in arrays)
    pool.release(entry.id)
    pool.evict(entry.id)


def bench_share(run: Run, pool: Pool, label: str, nbytes: int) -> None:
    writer = pool.reserve_blob("bench", np.arange(16), nbytes)
    writer.blob[::4096] = 1  # an engine would have written it all; the content does not matter here
    info = writer.commit()
    before = pool.stats().bytes_copied
    rounds = 2000

    def share_release():
        for _ in range(rounds):
            pool.share(info.id)
            pool.release(info.id)

    figure = run.measure(f"share+release {label} (x{rounds})", share_release, repeat=7)
    figure.samples = [s / rounds for s in figure.samples]  # per pair
    assert pool.stats().bytes_copied == before, "sharing copied bytes"
    pool.release(info.id)
    pool.evict(info.id)


def bench_allocator(run: Run, live: int, operations: int) -> None:
    rng = random.Random(0)
    allocator = Allocator(64 << 30)
    held = [(allocator.allocate(size), size) for size in (rng.randint(1, 1 << 20) for _ in range(live))]
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(operations // 2):
            offset, size = held.pop(rng.randrange(len(held)))
            allocator.free(offset, size)
            size = rng.randint(1, 1 << 20)
            held.append((allocator.allocate(size), size))
        rates.append(operations / (time.perf_counter() - start))
    run.record(f"allocator ops/s, {live:,} live extents", rates, unit="ops/s")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only (seconds, for tests)")
    parser.add_argument("--out", type=Path, help="where to write the JSON (default: benchmarks/results/pool.json)")
    args = parser.parse_args(argv)
    sizes = [1 * MiB, 4 * MiB] if args.quick else [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
    share_sizes = [1 * MiB, 16 * MiB] if args.quick else [1 * MiB, 1024 * MiB]
    run = Run("pool-quick" if args.quick else "pool")
    run.note("kv shape", f"{LAYERS} layers x K/V x {HEADS} heads x {WIDTH} f16, token axis 1")
    pool_bytes = max(sizes) * 3 + max(share_sizes) + 64 * MiB
    name = f"bench-{os.getpid()}"
    pool = Pool.create(name, pool_bytes, budget=Budget(pool_bytes, None, "benchmark"), max_entries=1024)
    try:
        for nbytes in sizes:
            repeat = 9 if nbytes <= 16 * MiB else 5
            for kind, make in (("contiguous", contiguous), ("kv", kv_shaped)):
                label = f"{nbytes // MiB} MiB {kind}"
                bench_put_get(run, pool, label, make(nbytes), repeat)
                for op in ("put", "get"):
                    run.ratio(f"{op} / memcpy, {label}", ours=f"{op} {label}", baseline=f"memcpy {label}",
                              goal=0.8 if nbytes >= 16 * MiB else None)
        for nbytes in share_sizes:
            bench_share(run, pool, f"{nbytes // MiB} MiB", nbytes)
        small, large = (f"share+release {n // MiB} MiB (x2000)" for n in share_sizes)
        run.ratio("share small / share large (1 = equal)", ours=small, baseline=large)
        bench_allocator(run, 10_000 if not args.quick else 1_000, 20_000 if not args.quick else 2_000)
        run.note("pool bytes_copied by sharing", 0)
    finally:
        pool.close()
        pool.unlink()
    return run.finish(args.out)


if __name__ == "__main__":
    main()
