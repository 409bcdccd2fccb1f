"""The llama.cpp benchmark script runs end to end on SmolLM2 (its numbers are not judged here)."""

import json

import pytest

from benchmarks import llamacpp_ratios

pytestmark = pytest.mark.real_model


def test_llamacpp_benchmark_quick_run(tmp_path):
    path = llamacpp_ratios.main(["--quick", "--out", str(tmp_path / "llamacpp.json")])
    data = json.loads(path.read_text())
    for label in ("export / memcpy at 256", "raw API / ours at 256 (bound)", "save+load_state / ours at 256",
                  "re-prefill / restore at 256", "fork at 64 / fork at 256"):
        assert data["ratios"][label]["value"] > 0
    assert data["notes"]["state bytes at 256 tokens"] > 256 * data["notes"]["cell price (bytes per token)"]
