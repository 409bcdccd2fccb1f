"""The benchmark harness and the pool benchmark script work (their numbers are not judged here)."""

import json

import numpy as np

from benchmarks import pool_ratios
from benchmarks.harness import Run


def test_run_measures_ratios_and_writes_json(tmp_path):
    run = Run("unit", out_dir=tmp_path)
    src = np.ones(1 << 16, np.uint8)
    dst = np.empty_like(src)
    run.measure("memcpy", lambda: np.copyto(dst, src), repeat=3, nbytes=src.nbytes)
    run.record("slower", [2 * s for s in run.figures["memcpy"].samples])
    ratio = run.ratio("slower / memcpy", ours="slower", baseline="memcpy", goal=0.8)
    assert abs(ratio.value - 0.5) < 1e-9 and ratio.met is False
    both = run.combine("memcpy + slower", "memcpy", "slower")
    assert both.samples == [3 * s for s in sorted(run.figures["memcpy"].samples)]
    run.note("answer", 42)
    path = run.finish()
    data = json.loads(path.read_text())
    assert data["figures"]["memcpy"]["samples"] == 3 and data["figures"]["memcpy"]["nbytes"] == 1 << 16
    assert data["ratios"]["slower / memcpy"]["met"] is False
    assert data["machine"]["cores"] >= 1 and "numpy" in data["machine"]["libraries"]
    assert data["notes"] == {"answer": 42}
    assert "MISSED" in run.table()


def test_pool_benchmark_quick_run(tmp_path):
    path = pool_ratios.main(["--quick", "--out", str(tmp_path / "pool.json")])
    data = json.loads(path.read_text())
    assert "put / memcpy, 4 MiB kv" in data["ratios"]
    assert data["figures"]["allocator ops/s, 1,000 live extents"]["unit"] == "ops/s"
    assert all(r["value"] > 0 for r in data["ratios"].values())
