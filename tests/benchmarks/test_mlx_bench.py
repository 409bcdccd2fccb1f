"""The MLX benchmark script runs end to end on SmolLM2 (its numbers are not judged here)."""

import json

import pytest

from benchmarks import mlx_ratios

pytestmark = pytest.mark.real_model


def test_mlx_benchmark_quick_run(tmp_path):
    path = mlx_ratios.main(["--quick", "--out", str(tmp_path / "mlx.json")])
    data = json.loads(path.read_text())
    for label in ("prefill speed: dequantized + openblas / as shipped", "export / memcpy at 32",
                  "save+load_prompt_cache / ours at 32", "LRUPromptCache fetch+step / fork+step at 32"):
        assert data["ratios"][label]["value"] > 0
