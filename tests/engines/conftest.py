"""Fixtures for engine tests: tiny models built once per session, engines closed after use."""

import pytest

from engines.llamacpp.engine import LlamaCppEngine
from tests import tinymodels


@pytest.fixture
def pool(make_pool):
    """A 64 MiB pool for engine state."""
    return make_pool(64 << 20, max_entries=256)


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory):
    """A tiny model whose heads are 64 wide: quantized KV caches need whole 32-value blocks per head."""
    config = tinymodels.TinyConfig(hidden=128, heads=2, kv_heads=1, intermediate=256)
    return tinymodels.build(tmp_path_factory.mktemp("wide"), "f32", config)


@pytest.fixture
def engine_for(tiny_models):
    """Open llama.cpp engines on the tiny models (2 threads, 1,024 cells); all closed after the test."""
    opened = []

    def make(quant="f32", **options):
        options.setdefault("n_ctx", 1024)
        options.setdefault("threads", 2)
        options.setdefault("threads_batch", 2)
        engine = LlamaCppEngine(tiny_models[quant].gguf, **options)
        opened.append(engine)
        return engine

    yield make
    for engine in opened:
        engine.close()
