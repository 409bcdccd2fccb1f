"""A child process for the crash tests: fills a pool with entries whose content follows from
their tag, and reports progress on stdout so the parent knows when to kill it.

    python crash_writer.py POOL_NAME torn     # N whole entries, then stops in mid-write
    python crash_writer.py POOL_NAME forever  # puts and extends until killed

Cell t of the entry tagged "s<seed>" holds expected_cells(seed, t): any prefix can be checked.
"""

import sys

import numpy as np

from kvpool import ArrayTemplate, Budget, KVArray, Pool

HEADS, WIDTH = 2, 32
WHOLE_ENTRIES = 5


def expected_cells(seed: int, start: int, stop: int) -> np.ndarray:
    """(heads, stop - start, width) float32 cells of entry `seed` for tokens [start, stop)."""
    t = np.arange(start, stop, dtype=np.float32)[None, :, None]
    h = np.arange(HEADS, dtype=np.float32)[:, None, None]
    w = np.arange(WIDTH, dtype=np.float32)[None, None, :]
    return seed * 1e4 + t * 10 + h * 0.5 + w * 1e-3 + np.zeros((HEADS, stop - start, WIDTH), np.float32)


def expected_tokens(seed: int, stop: int) -> np.ndarray:
    return (np.arange(stop) * 7 + seed) % 30000


def arrays(seed: int, start: int, stop: int) -> list[KVArray]:
    cells = expected_cells(seed, start, stop)
    return [KVArray("k", cells, 1), KVArray("v", -cells, 1)]


def main(name: str, mode: str) -> None:
    pool = Pool.create(name, 16 << 20, budget=Budget(16 << 20, None, "crash test"), max_entries=256)
    if mode == "torn":
        for seed in range(WHOLE_ENTRIES):
            pool.put("m", expected_tokens(seed, 300), arrays(seed, 0, 300), tag=f"s{seed}")
        templates = [ArrayTemplate(name, "<f4", (HEADS, 0, WIDTH), 1) for name in ("k", "v")]
        writer = pool.reserve("m", expected_tokens(99, 300), templates, tag="s99")
        writer.arrays["k"][:, :150] = 1.0
        print("writing", flush=True)
        sys.stdin.read()  # wait to be killed
        return
    seed = 0
    while True:
        seed += 1
        info = pool.put("m", expected_tokens(seed, 64), arrays(seed, 0, 64), capacity=256, tag=f"s{seed}")
        if info is None:
            raise SystemExit("pool full: every entry should be evictable")
        for start in range(64, 256, 32):
            writer = pool.extend(info.id, expected_tokens(seed, start + 32)[start:])
            for array in arrays(seed, start, start + 32):
                writer.arrays[array.name][...] = array.data
            writer.commit()
        pool.release(info.id)
        print(f"entry {seed}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
