"""Structured output on the real models (select with -m real_model): a subset of
benchmarks/structured.py's sweeps on SmolLM2 and Gemma 3 270M, on both runtimes; every output
parses and validates against its schema (a JSON Schema validator), every required tool call is a
call of an offered function whose arguments validate against its parameters, and none is cut by
max_tokens. The whole sweeps (32 schemas, 32 tool requests) are the benchmark."""

from __future__ import annotations

import pytest

from benchmarks.structured import SCHEMAS, run_sweep, run_tool_sweep
from engines import models
from superfluid import Host
from tests.conftest import remove_segment, unique_pool_name

pytestmark = pytest.mark.real_model

# a pattern, a bounded array of objects, anyOf with null, optional fields (the sweep has the rest);
# as tools, the array of objects and the optional fields (a call's prompt carries the tools'
# description: on MLX on 2 cores each costs seconds)
SUBSET = [SCHEMAS[i] for i in (4, 5, 15, 29)]
TOOL_SUBSET = [SCHEMAS[i] for i in (5, 29)]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
@pytest.mark.parametrize("runtime", ["llamacpp", "mlx"])
def test_every_output_of_real_models_validates_against_its_schema(model, runtime, tmp_path):
    path = models.default_model() if model == "smollm2" else models.gemma3_model()
    pool = unique_pool_name()
    try:
        with Host(path, runtime=runtime, pool_name=pool, pool_bytes=256 << 20, log_dir=tmp_path / "log",
                  **({"llamacpp_threads": 2, "llamacpp_n_ctx": 4096} if runtime == "llamacpp" else {})) as host:
            failed = [(what, detail) for what, ok, detail in run_sweep(host, SUBSET) + run_tool_sweep(host, TOOL_SUBSET)
                      if not ok]
    finally:
        remove_segment(pool)
    assert not failed
