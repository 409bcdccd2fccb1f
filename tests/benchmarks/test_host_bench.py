"""The Host benchmark script runs end to end on SmolLM2 (its numbers are not judged here)."""

import json

import pytest

from benchmarks import host_ratios

pytestmark = pytest.mark.real_model


def test_host_benchmark_quick_run(tmp_path):
    path = host_ratios.main(["--quick", "--out", str(tmp_path / "host.json")])
    data = json.loads(path.read_text())
    for label in ("cold / warm lane at 128", "cold / parked at 128",
                  "4 on a shared prefix: llama-cpp-python / ours (total time)",
                  "interactive first token: idle / busy (goal: busy <= 2x idle)"):
        assert data["ratios"][label]["value"] > 0
    notes = data["notes"]
    prompt = notes["4 on a shared prefix: prompt tokens of one session"]
    assert notes["4 on a shared prefix: tokens prefilled, ours"] < 2 * prompt  # the prefix once, not four times
