"""Shared test fixtures, and the rule that no test may skip.

Every dependency is installed by scripts/setup, so a skipped test can only mean a missing feature
or a broken environment: both must fail, locally and in CI. Set SUPERFLUID_ALLOW_SKIPS=1 to see
skips as skips while working on a machine without everything installed.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import threading

import pytest
from hypothesis import settings

from engines.mlx import blas
from kvpool import Budget, Pool, segment
from tests import tinymodels

# MLX binds its BLAS when it is first imported, and the tiny MLX models are built with MLX itself:
# were a fixture to build one before any engine loaded, every MLX engine later in this process
# would run on the wheel's reference BLAS (Gemma 3 through MLX took 278 s for a test that takes
# 30 s after OpenBLAS). So OpenBLAS is loaded before anything can import MLX, whatever runs first.
blas.preload()

# CI explores the same examples every run, so a red build always means a change broke something;
# elsewhere each run explores new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
# Model hubs are out of reach: a path that does not exist must never be taken for a hub name.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("CI"):
    settings.load_profile("ci")

_names = itertools.count()

# Every host a test opens (in this process or a server it starts) keeps its disk tier in a folder
# of this run's own, removed when the run ends; hosts are told their pool's name, so each test's
# tier is its own folder inside it.
_disk_tiers = tempfile.mkdtemp(prefix="superfluid-test-disk-")
os.environ["SUPERFLUID_DISK_TIERS"] = _disk_tiers
atexit.register(shutil.rmtree, _disk_tiers, True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and os.environ.get("SUPERFLUID_ALLOW_SKIPS") != "1":
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"skipped tests fail in this project (install what is missing): {reason}"


def in_threads(work, count: int) -> list:
    """Run work(0) .. work(count - 1) on `count` threads at once; the results in order. Raises the
    first exception a thread raised, once all have ended."""
    results, errors = [None] * count, []

    def run(i):
        try:
            results[i] = work(i)
        except Exception as exc:  # re-raised in the caller's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


class ManualClock:
    """A monotonic clock that moves only when a test moves it: a Host given one parks idle lanes,
    ends timed-out generations and refuses long waits exactly when the test says, whatever the
    speed of the machine (Host(clock=...))."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock `seconds` forward."""
        self.now += seconds


@pytest.fixture
def clock():
    """A ManualClock for this test."""
    return ManualClock()


def unique_pool_name() -> str:
    """A pool name no other test or test run uses at the same time."""
    return f"test-{os.getpid()}-{next(_names)}"


def remove_segment(name: str) -> None:
    """Unlink pool `name`'s segment if it still exists."""
    if name in segment.list_pool_names():
        segment.unlink(name)


@pytest.fixture
def pool_name():
    """A fresh pool name; its segment is unlinked after the test, whatever happened."""
    name = unique_pool_name()
    yield name
    remove_segment(name)


@pytest.fixture
def make_pool():
    """Create pools with an explicit budget (default: the whole arena); all are closed and
    unlinked after the test."""
    created: list[Pool] = []

    def make(size: int = 1 << 20, *, budget: int | None = None, max_entries: int | None = 64, **kwargs) -> Pool:
        name = unique_pool_name()
        chosen = Budget(budget if budget is not None else size, None, "test budget")
        pool = Pool.create(name, size, budget=chosen, max_entries=max_entries, **kwargs)
        created.append(pool)
        return pool

    yield make
    for pool in created:
        try:
            pool.close()
        except Exception:  # a test may leave views behind on purpose; the unlink still happens
            pass
        remove_segment(pool.name)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """quant -> TinyModel, for f32, f16, q8_0 and q4_0 weights (the same random weights)."""
    directory = tmp_path_factory.mktemp("tiny")
    return {quant: tinymodels.build(directory, quant) for quant in ("f32", "f16", "q8_0", "q4_0")}


@pytest.fixture(scope="session")
def tiny_mlx(tmp_path_factory):
    """The tiny model's weights and tokenizer as an mlx-lm directory (f32), taking 16,384
    positions (the same weights as the GGUF files; only the declared context is longer)."""
    return tinymodels.build_mlx(tmp_path_factory.mktemp("tiny-mlx"), tinymodels.TinyConfig(context=16384))


@pytest.fixture(scope="session")
def wide_mlx(tmp_path_factory):
    """An mlx-lm directory whose heads are 64 wide, so a quantized KV cache's groups fit."""
    config = tinymodels.TinyConfig(hidden=128, heads=2, kv_heads=1, intermediate=256)
    return tinymodels.build_mlx(tmp_path_factory.mktemp("wide-mlx"), config)
