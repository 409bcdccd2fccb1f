"""The benchmark harness and the pool benchmark script work (their numbers are not judged here)."""

import json

import numpy as np
import pytest

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


def test_rates_and_agreements_read_the_right_way_round_and_units_must_match():
    run = Run("unit")
    run.record("ours tok/s", [90.0, 100.0, 110.0], unit="tok/s")
    run.record("theirs tok/s", [45.0, 50.0, 55.0], unit="tok/s")
    rate = run.ratio("ours / theirs", ours="ours tok/s", baseline="theirs tok/s")
    assert rate.value == 2.0 and rate.low == 90 / 55 and rate.high == 110 / 45  # more tokens/s: above 1
    run.record("stored", [1010.0], unit="B/token")
    run.record("priced", [1000.0], unit="B/token")
    agreement = run.ratio("stored / priced", ours="stored", baseline="priced", kind="agreement")
    assert agreement.value == 1.01 and agreement.as_dict()["kind"] == "agreement"
    run.record("seconds", [1.0])
    with pytest.raises(ValueError, match="tok/s"):
        run.ratio("mixed", ours="seconds", baseline="theirs tok/s")
    with pytest.raises(ValueError, match="kind"):
        run.ratio("odd", ours="stored", baseline="priced", kind="faster")


def test_pool_benchmark_quick_run(tmp_path):
    path = pool_ratios.main(["--quick", "--out", str(tmp_path / "pool.json")])
    data = json.loads(path.read_text())
    assert "put / memcpy, 4 MiB kv" in data["ratios"]
    assert data["figures"]["allocator ops/s, 1,000 live extents"]["unit"] == "ops/s"
    assert all(r["value"] > 0 for r in data["ratios"].values())
