"""pytest-benchmark figures for llama.cpp state through the pool: `pytest benchmarks/test_llamacpp_bench.py`.

For ratios measured side by side in one run, use `python benchmarks/llamacpp_ratios.py`.
"""

import ctypes
import os

import numpy as np
import pytest

from engines import models
from engines.base import StepRequest
from engines.llamacpp.engine import LlamaCppEngine
from kvpool import Budget, Pool
from superfluid import transfer

TOKENS = 1024


@pytest.fixture(scope="module")
def setup():
    engine = LlamaCppEngine(models.default_model(), n_ctx=4096, threads=2, threads_batch=2, flash_attn=True)
    size = 256 << 20
    pool = Pool.create(f"bench-llama-{os.getpid()}", size, budget=Budget(size, None, "benchmark"))
    seq = engine.new_sequence()
    tokens = (engine.tokenize("A key-value cache holds the attention state of every token. ") * 100)[:TOKENS]
    engine.step([StepRequest(seq, tokens)])
    yield engine, pool, seq, tokens
    pool.close()
    pool.unlink()
    engine.close()


def test_export(benchmark, setup):
    engine, pool, seq, tokens = setup

    def export_then_drop():
        info = transfer.export(engine, pool, seq, tokens)
        pool.release(info.id)
        pool.evict(info.id)

    benchmark(export_then_drop)


def test_import(benchmark, setup):
    engine, pool, seq, tokens = setup
    info = transfer.export(engine, pool, seq, tokens)
    target = engine.new_sequence()

    def restore():
        with pool.get(info.id) as view:
            transfer.import_(engine, target, view)

    benchmark(restore)
    engine.free_sequence(target)


def test_raw_state_api(benchmark, setup):
    engine, _, seq, _ = setup
    api, ctx = engine._api, engine._ctx
    size = api.llama_state_seq_get_size(ctx, seq)
    buffer = np.empty(size, np.uint8)
    pointer = buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    target = engine.new_sequence()

    def get_and_set():
        api.llama_state_seq_get_data(ctx, pointer, size, seq)
        api.llama_state_seq_set_data(ctx, pointer, size, target)

    benchmark(get_and_set)
    engine.free_sequence(target)


def test_fork(benchmark, setup):
    engine, _, seq, _ = setup
    benchmark(lambda: engine.free_sequence(engine.fork(seq)))
