"""The MLX adapter over every kind of mlx-lm cache, and several sequences decoding together:
tiny models built at test time, real MLX, real shared memory. These tests run under both cache
generations (mlx-lm 0.32.2 here, 0.31.3 through test_runtime_releases)."""

import numpy as np
import pytest

from engines.base import StepRequest
from engines.errors import EngineError, NoRoom
from engines.mlx import caches
from engines.mlx.engine import MlxEngine
from kvpool.pricing import Attention
from superfluid import transfer
from tests import tinymodels

PROMPT = "The capital of France is Paris. The quick brown fox"


def tokens_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 290 + 3 for i in range(n)]


def run(engine, seq, tokens):
    """Each token in turn (decode steps); the logits after the last."""
    logits = None
    for token in tokens:
        logits = engine.step([StepRequest(seq, [token])])[0][0]
    return logits


def round_trip_continues_identically(engine, pool, prompt, more):
    """Export after `prompt`, import into a new sequence, and both continue with `more` alike."""
    seq = engine.new_sequence()
    engine.step([StepRequest(seq, prompt, "none")])
    info = transfer.export(engine, pool, seq, prompt)
    other = engine.new_sequence()
    with pool.get(info.id) as view:
        assert transfer.import_(engine, other, view) == len(prompt)
    np.testing.assert_array_equal(run(engine, other, more), run(engine, seq, more))
    return info


@pytest.fixture(scope="module")
def hybrid_mlx(tmp_path_factory):
    return tinymodels.build_mlx_hybrid(tmp_path_factory.mktemp("hybrid-mlx"))


# ----------------------------------------------------------------------------- generations


def test_the_generation_is_read_from_the_cache_instance():
    import importlib.metadata

    from mlx_lm.models import cache as module

    meta = caches.speaks_meta_state(module.KVCache())
    assert meta == hasattr(module.KVCache, "meta_state")
    assert meta == importlib.metadata.version("mlx-lm").startswith("0.31")  # what the two tested releases do


# ----------------------------------------------------------------------------- rotating


def test_a_rotating_cache_round_trips_before_and_after_it_wraps(tiny_mlx, pool):
    engine = MlxEngine(tiny_mlx, max_kv_size=64)
    layer = engine.describe().model_kv.layers[0]
    assert layer.attention is Attention.WINDOW and layer.window == 64
    seq = engine.new_sequence()
    assert type(engine._sequences[seq][0]).__name__ == "RotatingKVCache"
    round_trip_continues_identically(engine, pool, tokens_of(40), tokens_of(5, 1))  # not yet wrapped
    round_trip_continues_identically(engine, pool, tokens_of(150), tokens_of(30, 2))  # a prefill past the window
    # decoding past the window wraps the ring: what is stored is the window, not every token
    ring = engine.new_sequence()
    engine.step([StepRequest(ring, tokens_of(100), "none")])
    run(engine, ring, tokens_of(20, 5))
    info = transfer.export(engine, pool, ring, tokens_of(100) + tokens_of(20, 5))
    assert info.tokens == 120 and info.live_bytes == 64 * engine.describe().cell_price
    other = engine.new_sequence()
    with pool.get(info.id) as view:
        transfer.import_(engine, other, view)
    np.testing.assert_array_equal(run(engine, other, tokens_of(9, 6)), run(engine, ring, tokens_of(9, 6)))
    wrapped = engine.new_sequence()
    engine.step([StepRequest(wrapped, tokens_of(150), "none")])
    with pytest.raises(EngineError, match="cannot be cut back"):
        engine.truncate(wrapped, 10)
    assert engine.length(wrapped) == 150
    engine.close()


# ----------------------------------------------------------------------------- quantized


def test_a_quantized_cache_is_priced_by_its_packed_bytes_and_round_trips(wide_mlx, pool):
    engine = MlxEngine(wide_mlx, kv_bits=8, kv_group_size=64)
    # per layer, K and V each: 64 values in 16 uint32 words, plus one f32 scale and bias
    assert engine.describe().cell_price == 2 * 2 * (16 * 4 + 2 * 4)
    info = round_trip_continues_identically(engine, pool, tokens_of(37), tokens_of(4, 3))
    assert info.live_bytes == 37 * engine.describe().cell_price
    assert engine.describe().identity != MlxEngine(wide_mlx, kv_bits=4).describe().identity
    engine.close()


def test_a_cut_quantized_cache_gives_its_slack_back(wide_mlx):
    engine = MlxEngine(wide_mlx, kv_bits=4)
    seq = engine.new_sequence()
    engine.step([StepRequest(seq, tokens_of(1024), "none")])
    engine.truncate(seq, 100)
    assert engine.slack_bytes(seq) == (256 - 100) * engine.describe().cell_price
    assert engine.stats().bytes_reclaimed == (1024 - 256) * engine.describe().cell_price
    fresh = engine.new_sequence()
    engine.step([StepRequest(fresh, tokens_of(100), "none")])
    np.testing.assert_allclose(run(engine, seq, [5, 6]), run(engine, fresh, [5, 6]), rtol=0, atol=1e-5)
    engine.close()


# ----------------------------------------------------------------------------- hybrid


def test_a_hybrid_models_cache_lists_round_trip_fork_and_refuse_a_cut(hybrid_mlx, pool):
    engine = MlxEngine(hybrid_mlx)
    seq = engine.new_sequence()
    layer = engine._sequences[seq][0]
    assert [type(m).__name__ for m in layer.caches] == ["ArraysCache", "KVCache"]
    kv = engine.describe().model_kv.layers[0]
    assert kv.fixed_bytes > 0 and kv.key_width == 2 * 2 * 16 * 4  # recurrent state, plus f32 K and V per token
    info = round_trip_continues_identically(engine, pool, tokens_of(20), tokens_of(6, 4))
    assert info.live_bytes == engine.describe().cell_price * 20 + 2 * kv.fixed_bytes
    engine.step([StepRequest(seq, tokens_of(20), "none")])
    child = engine.fork(seq)
    child_next = run(engine, child, [9, 10])
    parent_next = run(engine, seq, [11])
    fresh = engine.new_sequence()
    engine.step([StepRequest(fresh, tokens_of(20), "none")])
    np.testing.assert_allclose(run(engine, fresh, [11]), parent_next, rtol=0, atol=1e-5)
    assert engine.stats().bytes_copied > 0  # the child's first write copied what it shared
    with pytest.raises(EngineError, match="cannot be cut back"):
        engine.truncate(child, 5)
    assert child_next.shape == (engine.describe().vocab_size,)
    engine.close()


# ----------------------------------------------------------------------------- batching


def test_sequences_decode_together_with_their_join_and_leave_counted(tiny_mlx, pool):
    engine = MlxEngine(tiny_mlx)
    prompts = [tokens_of(n, salt) for n, salt in ((30, 0), (7, 1), (300, 2))]
    seqs = [engine.new_sequence() for _ in prompts]
    alone = [engine.new_sequence() for _ in prompts]
    for seq, twin, prompt in zip(seqs, alone, prompts):
        engine.step([StepRequest(seq, prompt, "none")])
        engine.step([StepRequest(twin, prompt, "none")])
    price = engine.describe().cell_price
    live = sum(len(p) for p in prompts) * price
    before = engine.stats().bytes_copied
    for i in range(5):
        together = engine.step([StepRequest(s, [40 + i]) for s in seqs])
        apart = [engine.step([StepRequest(t, [40 + i])])[0] for t in alone]
        for a, b in zip(together, apart):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert engine.stats().bytes_copied - before == live  # joined once; the batch then stayed as it was
    assert [engine.length(s) for s in seqs] == [len(p) + 5 for p in prompts]
    # an export reads a lane in place; a step of one member alone takes every lane back out
    # (one copy each), and it goes on as before
    info = transfer.export(engine, pool, seqs[1], prompts[1] + [40, 41, 42, 43, 44])
    assert engine.stats().bytes_copied - before == live
    np.testing.assert_allclose(run(engine, seqs[1], [7]), run(engine, alone[1], [7]), rtol=0, atol=1e-5)
    assert engine.stats().bytes_copied - before == live + live + 3 * 5 * price
    assert info.tokens == len(prompts[1]) + 5
    # two of them go on together; the third alone
    pair = engine.step([StepRequest(seqs[0], [8]), StepRequest(seqs[2], [8], "none")])
    assert pair[1] is None
    np.testing.assert_allclose(pair[0][0], run(engine, alone[0], [8]), rtol=0, atol=1e-5)
    engine.close()


def test_quantized_caches_step_one_by_one_with_the_same_results(wide_mlx):
    engine = MlxEngine(wide_mlx, kv_bits=8)
    a, b = engine.new_sequence(), engine.new_sequence()
    engine.step([StepRequest(a, tokens_of(9), "none"), StepRequest(b, tokens_of(4, 1), "none")])
    both = engine.step([StepRequest(a, [5]), StepRequest(b, [6])])
    assert engine._batch is None and engine.stats().bytes_copied == 0
    fresh = engine.new_sequence()
    engine.step([StepRequest(fresh, tokens_of(9), "none")])
    np.testing.assert_allclose(both[0][0], run(engine, fresh, [5]), rtol=0, atol=1e-5)
    engine.close()


# ----------------------------------------------------------------------------- limits


def test_a_step_past_the_models_positions_is_refused_and_changes_nothing(tiny_models):
    engine = MlxEngine(tiny_models["f32"].gguf)  # declares 2,048 positions
    seq = engine.new_sequence()
    engine.step([StepRequest(seq, tokens_of(2040), "none")])
    with pytest.raises(NoRoom, match="would reach 2050 positions; the model takes 2048"):
        engine.step([StepRequest(seq, tokens_of(10))])
    assert engine.length(seq) == 2040
    engine.close()


def test_a_decoding_lane_is_exported_from_the_batch_without_leaving_it(tiny_mlx, pool):
    engine = MlxEngine(tiny_mlx)
    prompts = [tokens_of(20), tokens_of(9, 1)]
    seqs = [engine.new_sequence() for _ in prompts]
    for seq, prompt in zip(seqs, prompts):
        engine.step([StepRequest(seq, prompt, "none")])
    for i in range(3):
        engine.step([StepRequest(s, [40 + i]) for s in seqs])
    copied = engine.stats().bytes_copied
    info = transfer.export(engine, pool, seqs[1], prompts[1] + [40, 41, 42])
    assert engine._batch is not None and engine.stats().bytes_copied == copied  # still batched, nothing copied
    assert info.live_bytes == 12 * engine.describe().cell_price
    other = engine.new_sequence()
    with pool.get(info.id) as view:
        transfer.import_(engine, other, view)
    np.testing.assert_allclose(run(engine, other, [7]), run(engine, seqs[1], [7]), rtol=0, atol=1e-5)
    engine.close()
