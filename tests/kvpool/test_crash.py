"""A process killed with SIGKILL while writing: what it finished is there, verified; the rest is not."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvpool import Pool
from tests.kvpool.crash_writer import WHOLE_ENTRIES, expected_cells, expected_tokens

WRITER = Path(__file__).with_name("crash_writer.py")


def _start(pool_name, mode):
    return subprocess.Popen([sys.executable, str(WRITER), pool_name, mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _kill(child):
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL


def _check_consistent(pool):
    stats = pool.stats()
    extents = pool.arena_map()
    cursor = 0
    for offset, length, _ in extents:  # used and free extents tile the arena exactly
        assert offset == cursor
        cursor += length
    assert cursor == stats.capacity
    assert stats.bytes_free == sum(n for _, n, owner in extents if owner == "free")
    assert stats.bytes_used == sum(e.stored_bytes for e in pool.entries())
    assert stats.writing == 0 and stats.referenced == 0


def _check_entry(pool, info):
    seed = int(info.tag[1:])
    with pool.get(info.id) as view:  # verifies the data checksum
        assert np.array_equal(view.tokens, expected_tokens(seed, info.tokens))
        assert np.array_equal(view.arrays["k"], expected_cells(seed, 0, info.tokens))
        assert np.array_equal(view.arrays["v"], -expected_cells(seed, 0, info.tokens))


def test_killed_in_the_middle_of_writing_an_entry(pool_name):
    child = _start(pool_name, "torn")
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        _kill(child)
    pool = Pool.attach(pool_name)
    try:
        assert sorted(e.tag for e in pool.entries()) == [f"s{i}" for i in range(WHOLE_ENTRIES)]
        assert pool.recovery.freed_writing == 1 and pool.recovery.dropped == 0
        for info in pool.entries():
            _check_entry(pool, info)
        _check_consistent(pool)
        assert pool.lookup("m", expected_tokens(99, 300)) is None
        assert pool.lookup("m", expected_tokens(3, 300)).tokens == 300
    finally:
        pool.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_killed_at_a_random_moment_while_putting_and_extending(pool_name, seed):
    child = _start(pool_name, "forever")
    try:
        for _ in range(3):  # let it complete a few entries, then strike at a random moment
            assert child.stdout.readline().startswith("entry")
        time.sleep(random.Random(seed).uniform(0, 0.05))
    finally:
        _kill(child)
    pool = Pool.attach(pool_name)
    try:
        assert len(pool.entries()) >= 3
        for info in pool.entries():
            assert info.tokens in range(64, 257, 32)  # a whole put plus whole extends, nothing torn
            _check_entry(pool, info)
        _check_consistent(pool)
    finally:
        pool.close()
