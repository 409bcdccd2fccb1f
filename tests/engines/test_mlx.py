"""The MLX adapter on tiny models built at test time: real MLX, real shared memory."""

import numpy as np
import pytest

from engines.base import StepRequest
from engines.errors import EngineError, IdentityMismatch, ModelLoadError, OptionError, StateError
from engines.mlx import settings
from engines.mlx.engine import MlxEngine
from kvpool import DataCorrupt, KVArray, pricing
from superfluid import transfer
from tests import tinymodels
from tests.conftest import in_threads

PROMPT = "The capital of France is Paris. The quick brown fox"


@pytest.fixture
def mlx_engine(tiny_mlx):
    engine = MlxEngine(tiny_mlx)
    yield engine
    engine.close()


def greedy(engine, seq, logits, steps):
    seen = []
    for _ in range(steps):
        logits = engine.step([StepRequest(seq, [int(np.argmax(logits))])])[0][0]
        seen.append(logits)
    return np.stack(seen)


def prefill(engine, text=PROMPT):
    seq = engine.new_sequence()
    tokens = engine.tokenize(text)
    return seq, tokens, engine.step([StepRequest(seq, tokens)])[0][0]


def test_describe(mlx_engine):
    info = mlx_engine.describe()
    assert info.runtime == "mlx" and info.identity.startswith("mlx:") and info.vocab_size == 300
    assert info.cell_price == pricing.bytes_per_token(pricing.uniform(2, 2, 16, "f32")) == 512
    assert info.packing.copies_on_lane_change and "im_start" in info.chat_template
    assert info.kv_cells > 0 and info.kv_cells_reason.endswith("(kv_cells=0)")  # what sized them, in words


def test_same_logits_as_llama_cpp_and_each_refuses_the_others_state(mlx_engine, engine_for, pool):
    llama = engine_for("f32", cache_type_k="f32", cache_type_v="f32")
    assert llama.tokenize(PROMPT) == mlx_engine.tokenize(PROMPT)
    seq, tokens, mlx_logits = prefill(mlx_engine)
    llama_seq = llama.new_sequence()
    llama_logits = llama.step([StepRequest(llama_seq, tokens, "all")])[0]
    all_mlx = mlx_engine.step([StepRequest(mlx_engine.new_sequence(), tokens, "all")])[0]
    np.testing.assert_allclose(all_mlx, llama_logits, rtol=0, atol=1e-4)
    np.testing.assert_allclose(mlx_logits, llama_logits[-1], rtol=0, atol=1e-4)
    from_mlx = transfer.export(mlx_engine, pool, seq, tokens)
    from_llama = transfer.export(llama, pool, llama_seq, tokens)
    with pool.get(from_mlx.id) as view, pytest.raises(IdentityMismatch):
        transfer.import_(llama, llama.new_sequence(), view)
    with pool.get(from_llama.id) as view, pytest.raises(IdentityMismatch):
        transfer.import_(mlx_engine, mlx_engine.new_sequence(), view)


def test_export_import_continues_identically_with_one_copy_each_way(mlx_engine, pool):
    seq, tokens, logits = prefill(mlx_engine)
    info = transfer.export(mlx_engine, pool, seq, tokens)
    assert info.live_bytes == len(tokens) * mlx_engine.describe().cell_price and info.slack_bytes == 0
    reference = greedy(mlx_engine, seq, logits, 6)
    other = mlx_engine.new_sequence()
    with pool.get(info.id, verify=False) as view:
        assert transfer.import_(mlx_engine, other, view) == len(tokens)
    assert pool.stats().bytes_copied == 2 * info.live_bytes  # into the pool once, out of it once
    np.testing.assert_array_equal(greedy(mlx_engine, other, logits, 6), reference)


def test_import_fills_a_step_rounded_buffer_that_grows_in_place(mlx_engine, pool):
    seq, tokens, _ = prefill(mlx_engine)
    info = transfer.export(mlx_engine, pool, seq, tokens)
    other = mlx_engine.new_sequence()
    with pool.get(info.id) as view:
        transfer.import_(mlx_engine, other, view)
    cache = mlx_engine._sequences[other][0]
    buffer_before = cache.keys
    assert buffer_before.shape[2] == 256 and cache.offset == len(tokens)
    mlx_engine.step([StepRequest(other, [5])])
    assert cache.keys.shape[2] == 256 and cache.offset == len(tokens) + 1  # appended within the buffer


def test_an_import_of_a_whole_step_leaves_room_so_the_next_token_copies_nothing(mlx_engine, pool):
    """256 cells (a full step) come back in a 512-cell buffer: mlx-lm would grow a full buffer at
    the next append by concatenating, a copy of every cell."""
    tokens = [int(t) for t in np.random.default_rng(3).integers(5, 290, 256)]
    seq = mlx_engine.new_sequence()
    mlx_engine.step([StepRequest(seq, tokens)])
    info = transfer.export(mlx_engine, pool, seq, tokens)
    other = mlx_engine.new_sequence()
    with pool.get(info.id, verify=False) as view:
        transfer.import_(mlx_engine, other, view)
    cache = mlx_engine._sequences[other][0]
    address = buffer_address(cache.keys)
    assert cache.keys.shape[2] == 512 and cache.offset == 256
    mlx_engine.step([StepRequest(other, [5])])
    assert buffer_address(cache.keys) == address and cache.offset == 257  # written in place


def test_price_comes_from_live_cells_not_the_grown_buffer(tmp_path, pool):
    """One layer whose token costs 16 bytes: measured 16, not 4,096 (a 256-token buffer step)."""
    config = tinymodels.TinyConfig(hidden=2, layers=1, heads=1, kv_heads=1, intermediate=4)
    engine = MlxEngine(tinymodels.build_mlx(tmp_path / "one-layer", config))
    assert engine.describe().cell_price == 16
    seq = engine.new_sequence()
    engine.step([StepRequest(seq, [1])])
    assert engine._sequences[seq][0].keys.nbytes == 256 * 8  # what MLX holds for one token
    info = transfer.export(engine, pool, seq, [1])
    assert info.live_bytes == 16
    engine.close()


def buffer_address(array) -> int:
    return np.asarray(array).__array_interface__["data"][0]


def test_fork_shares_arrays_then_diverges(mlx_engine):
    """The child holds the parent's buffers (new array objects, same memory); each side's later
    writes stay its own, in whichever order they come."""
    seq, tokens, logits = prefill(mlx_engine)
    child = mlx_engine.fork(seq)
    parent_keys, child_keys = mlx_engine._sequences[seq][0].keys, mlx_engine._sequences[child][0].keys
    assert child_keys is not parent_keys and buffer_address(child_keys) == buffer_address(parent_keys)
    mlx_engine.step([StepRequest(child, [11, 12, 13])])
    parent_next = mlx_engine.step([StepRequest(seq, [21])])[0][0]
    child_next = mlx_engine.step([StepRequest(child, [14])])[0][0]
    fresh_parent, fresh_child = mlx_engine.new_sequence(), mlx_engine.new_sequence()
    np.testing.assert_allclose(parent_next, mlx_engine.step([StepRequest(fresh_parent, tokens + [21])])[0][0],
                               rtol=0, atol=1e-5)
    np.testing.assert_allclose(child_next, mlx_engine.step([StepRequest(fresh_child, tokens + [11, 12, 13, 14])])[0][0],
                               rtol=0, atol=1e-5)


def test_truncate_then_continue_equals_a_fresh_prefill(mlx_engine):
    seq, tokens, _ = prefill(mlx_engine)
    keep = len(tokens) // 2
    mlx_engine.truncate(seq, keep)
    cut = mlx_engine.step([StepRequest(seq, tokens[keep:keep + 3])])[0][0]
    fresh = mlx_engine.new_sequence()
    direct = mlx_engine.step([StepRequest(fresh, tokens[:keep + 3])])[0][0]
    np.testing.assert_allclose(cut, direct, rtol=0, atol=1e-5)
    with pytest.raises(EngineError, match="cannot keep"):
        mlx_engine.truncate(seq, 10_000)


def test_prefill_in_chunks_equals_one_forward(tiny_mlx):
    chunked = MlxEngine(tiny_mlx, prefill_chunk=7)
    whole = MlxEngine(tiny_mlx)
    tokens = chunked.tokenize(PROMPT * 2)
    a = chunked.step([StepRequest(chunked.new_sequence(), tokens, "all")])[0]
    b = whole.step([StepRequest(whole.new_sequence(), tokens, "all")])[0]
    assert a.shape == b.shape == (len(tokens), 300)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_corrupt_or_foreign_pool_data_leaves_the_sequence_empty(mlx_engine, pool):
    seq, tokens, _ = prefill(mlx_engine)
    info = transfer.export(mlx_engine, pool, seq, tokens)
    offset = next(o for o, n, owner in pool.arena_map() if owner == f"{info.id}.data")
    pool._store.arena[offset + 8] ^= 0x40
    target = mlx_engine.new_sequence()
    mlx_engine.step([StepRequest(target, [1, 2])])
    with pool.get(info.id, verify=False) as view, pytest.raises(DataCorrupt):
        transfer.import_(mlx_engine, target, view)
    assert mlx_engine.length(target) == 0
    wrong = pool.put(mlx_engine.describe().identity, [1, 2], [KVArray("0.k", np.zeros((1, 2, 2, 16), np.float32), 2)])
    with pool.get(wrong.id) as view, pytest.raises(StateError, match="does not hold this model's caches"):
        transfer.import_(mlx_engine, target, view)
    assert mlx_engine.length(target) == 0
    # the right arrays, but cache values this adapter did not write: refused before any copy
    arrays = [KVArray(f"{i}.{p}", np.zeros((1, 2, 2, 16), np.float32), 2) for i in range(2) for p in "kv"]
    for values in ({"0.class": "KVCache", "1.class": "KVCache"},
                   {"0.class": "KVCache", "1.class": "KVCache", "0.offset": "two", "1.offset": 2, "0.empty": 0,
                    "1.empty": 0}):
        forged = pool.put(mlx_engine.describe().identity, [1, 2], arrays, engine_values=values)
        with pool.get(forged.id) as view, pytest.raises(StateError, match="cache value 0.(offset|empty)"):
            transfer.import_(mlx_engine, target, view)
        assert mlx_engine.length(target) == 0


def test_options_and_missing_models(tiny_mlx, tmp_path):
    with pytest.raises(OptionError, match="prefill_chunk"):
        MlxEngine(tiny_mlx, prefill_chunk=0)
    with pytest.raises(OptionError, match="unknown option 'kv_quant'"):
        MlxEngine(tiny_mlx, kv_quant=4)
    with pytest.raises(OptionError, match="kv_bits=7: MLX quantizes to 2, 3, 4, 5, 6, 8 bits"):
        MlxEngine(tiny_mlx, kv_bits=7)
    with pytest.raises(OptionError, match="kv_group_size=48: MLX quantizes in groups of 32, 64, 128"):
        MlxEngine(tiny_mlx, kv_bits=4, kv_group_size=48)
    with pytest.raises(OptionError, match="kv_bits and max_kv_size cannot be combined"):
        MlxEngine(tiny_mlx, kv_bits=4, max_kv_size=64)
    with pytest.raises(OptionError, match="kv_group_size=64 .*pick a group size dividing the head dimension"):
        MlxEngine(tiny_mlx, kv_bits=4)  # this model's heads are 16 wide
    with pytest.raises(OptionError, match="dequantize='maybe': expected one of auto, on, off"):
        MlxEngine(tiny_mlx, dequantize="maybe")
    with pytest.raises(ModelLoadError, match="no model at .*mlx-lm model directory"):
        MlxEngine(tmp_path / "nothing-here")


def test_a_prefill_leaves_the_buffer_cache_at_most_half_full(tiny_mlx):
    """Prefill temporaries would fill MLX's cache of freed buffers (1 MiB here) and make later
    allocations free and fault memory in; the engine empties it past half its limit."""
    import mlx.core as mx

    engine = MlxEngine(tiny_mlx, cache_limit_mb=1)
    try:
        seq = engine.new_sequence()
        engine.step([StepRequest(seq, [int(t) for t in np.random.default_rng(0).integers(5, 290, 1000)])])
        assert mx.get_cache_memory() <= (1 << 20) // 2
    finally:
        engine.close()


def test_cache_limit_is_restored_on_close(tiny_mlx):
    import mlx.core as mx

    before = mx.set_cache_limit(123 << 20)
    engine = MlxEngine(tiny_mlx, cache_limit_mb=64)
    assert mx.set_cache_limit(64 << 20) == 64 << 20
    engine.close()
    assert mx.set_cache_limit(before) == 123 << 20


def test_fork_copies_nothing_until_the_first_write_which_is_counted(mlx_engine):
    seq, tokens, _ = prefill(mlx_engine)
    child = mlx_engine.fork(seq)
    assert mlx_engine.stats().bytes_copied == 0
    layer_bytes = sum(c.keys.nbytes + c.values.nbytes for c in mlx_engine._sequences[seq])
    mlx_engine.step([StepRequest(child, [7])])  # writes while the parent still holds the buffers
    assert mlx_engine.stats().bytes_copied == layer_bytes and mlx_engine.stats().copies == 4
    mlx_engine.step([StepRequest(seq, [8])])  # now the sole holder: in place
    mlx_engine.step([StepRequest(child, [9])])
    assert mlx_engine.stats().bytes_copied == layer_bytes
    grandchild = mlx_engine.fork(child)
    mlx_engine.free_sequence(child)  # the grandchild is left alone with the buffers: no copy
    mlx_engine.step([StepRequest(grandchild, [10])])
    assert mlx_engine.stats().bytes_copied == layer_bytes


def test_a_cut_gives_its_slack_back(mlx_engine):
    """8,192 tokens cut to 128: the buffers shrink to one 256-token step and the freed bytes
    show in the statistics; the sequence continues as if never grown."""
    seq = mlx_engine.new_sequence()
    tokens = [(7 * i) % 290 + 3 for i in range(8192)]
    mlx_engine.step([StepRequest(seq, tokens, "none")])
    cache = mlx_engine._sequences[seq][0]
    assert cache.keys.shape[2] == 8192
    grown = sum(c.keys.nbytes + c.values.nbytes for c in mlx_engine._sequences[seq])
    mlx_engine.truncate(seq, 128)
    kept = sum(c.keys.nbytes + c.values.nbytes for c in mlx_engine._sequences[seq])
    assert cache.keys.shape[2] == 256 and kept == grown * 256 // 8192
    stats = mlx_engine.stats()
    assert stats.bytes_reclaimed == grown - kept and stats.bytes_copied == 128 * 512
    assert mlx_engine.slack_bytes(seq) == (256 - 128) * 512
    continued = mlx_engine.step([StepRequest(seq, [5])])[0][0]
    fresh = mlx_engine.new_sequence()
    direct = mlx_engine.step([StepRequest(fresh, tokens[:128] + [5])])[0][0]
    np.testing.assert_allclose(continued, direct, rtol=0, atol=1e-5)


def test_a_gguf_file_loads_on_mlx_with_the_same_tokens_and_logits(tiny_models, tiny_mlx):
    from_gguf = MlxEngine(tiny_models["f32"].gguf)
    from_dir = MlxEngine(tiny_mlx)
    assert from_gguf.tokenize(PROMPT) == from_dir.tokenize(PROMPT)
    assert from_gguf.describe().identity != from_dir.describe().identity  # other files, other identity
    a = from_gguf.step([StepRequest(from_gguf.new_sequence(), from_gguf.tokenize(PROMPT), "all")])[0]
    b = from_dir.step([StepRequest(from_dir.new_sequence(), from_dir.tokenize(PROMPT), "all")])[0]
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dequantize", ["on", "off"])
def test_a_quantized_gguf_loads_dequantized_or_quantized(tiny_models, dequantize):
    engine = MlxEngine(tiny_models["q8_0"].gguf, dequantize=dequantize)
    assert ("quantization" in engine._config) == (dequantize == "off")
    reference = MlxEngine(tiny_models["f32"].gguf)
    quantized = engine.step([StepRequest(engine.new_sequence(), engine.tokenize(PROMPT))])[0][0]
    exact = reference.step([StepRequest(reference.new_sequence(), reference.tokenize(PROMPT))])[0][0]
    assert np.isfinite(quantized).all() and np.abs(quantized - exact).max() < 0.1
    other = "off" if dequantize == "on" else "on"
    assert engine.describe().identity != MlxEngine(tiny_models["q8_0"].gguf, dequantize=other).describe().identity


def test_dequantizing_is_automatic_on_a_cpu_where_it_fits_and_refused_where_it_cannot(tiny_models, monkeypatch):
    assert "quantization" not in MlxEngine(tiny_models["q8_0"].gguf)._config  # auto, on this CPU: float32
    from engines.mlx import gguf

    monkeypatch.setattr(gguf, "host_memory_available", lambda: 64 << 10)  # a machine with 64 KiB free
    assert "quantization" in MlxEngine(tiny_models["q8_0"].gguf)._config  # auto keeps the weights quantized
    with pytest.raises(ModelLoadError, match=r"dequantizing to float32 needs 0\.00 GiB .*pass dequantize=off"):
        MlxEngine(tiny_models["q8_0"].gguf, dequantize="on")


def test_the_dequantize_decision():
    decide = settings.dequantize_decision
    assert decide("auto", True, 100, 1000) and not decide("auto", False, 100, 1000)
    assert not decide("auto", True, 600, 1000) and not decide("off", True, 1, 1000)
    assert decide("on", False, 500, 1000)
    with pytest.raises(ModelLoadError, match="needs .* GiB and only .* GiB of memory is available"):
        decide("on", True, 501, 1000)


def test_a_gguf_of_mixed_widths_runs_quantized(tmp_path, tiny_models):
    mixed = tinymodels.build(tmp_path, "mixed")
    engine = MlxEngine(mixed.gguf, dequantize="off")
    assert engine._config["quantization"]["bits"] == [4, 8]
    reference = MlxEngine(tiny_models["f32"].gguf)
    a = engine.step([StepRequest(engine.new_sequence(), engine.tokenize(PROMPT))])[0][0]
    b = reference.step([StepRequest(reference.new_sequence(), reference.tokenize(PROMPT))])[0][0]
    assert np.isfinite(a).all() and np.corrcoef(a, b)[0, 1] > 0.9


def test_gguf_files_mlx_cannot_map_are_refused(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="could not read"):
        MlxEngine(bogus)


def test_openblas_is_loaded_before_mlx_in_a_fresh_process():
    import subprocess
    import sys

    script = ("from engines.mlx.engine import _import_mlx; from engines.mlx import blas; _import_mlx();"
              "status = blas.preload(); maps = open('/proc/self/maps').read();"
              "print(status.path, 'libopenblas' in maps)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    path, mapped = done.stdout.split()
    assert path.endswith("libopenblas.so.0") and mapped == "True", done.stderr


def test_too_late_for_openblas_is_said_plainly():
    import subprocess
    import sys

    script = "import mlx.core; from engines.mlx import blas; print(blas.preload().reason)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "imported before" in done.stdout and "LD_PRELOAD" in done.stdout


def test_a_step_asking_for_unknown_logits_is_refused(engine_for, tiny_mlx):
    for engine in (engine_for("f32"), MlxEngine(tiny_mlx)):
        seq = engine.new_sequence()
        with pytest.raises(EngineError, match="logits='Last'"):
            engine.step([StepRequest(seq, [1, 2], "Last")])
        assert engine.length(seq) == 0


def test_the_cells_say_why_they_are_that_many(monkeypatch):
    monkeypatch.setattr(settings, "host_memory_available", lambda: 16 << 30)
    values = {"max_sequences": 8, "kv_cells": 0}
    assert settings.kv_cells(values, 100_000, 2048) == (
        16384, "8 sequences at once (max_sequences) at the model's context of 2,048 tokens; a quarter of the 16.00 GiB "
               "of memory available would hold 42,949 (kv_cells=0)")
    assert settings.kv_cells(values, 1_000_000, 2048) == (
        4294, "what a quarter of the 16.00 GiB of memory available holds at 1,000,000 bytes a cell (kv_cells=0)")
    assert settings.kv_cells(values | {"kv_cells": 1000}, 100_000, 2048) == (1000, "kv_cells=1000, as given")
    assert settings.kv_cells(values | {"kv_cells": 99999}, 100_000, 2048) == (
        16384, "8 sequences at once (max_sequences) at the model's context of 2,048 tokens: every cell they can use "
               "(kv_cells=99999 is more)")



def test_the_tokenizer_answers_any_thread(mlx_engine):
    text = "The capital of France is Paris.<|im_end|>"
    tokenizer = mlx_engine.tokenizer()
    tokens = mlx_engine.tokenize(text)
    elsewhere = in_threads(lambda _: (tokenizer.tokenize(text), tokenizer.detokenize(tokens)), 4)
    assert elsewhere == [(tokens, text.encode())] * 4


@pytest.mark.parametrize("text", ["日本", "café ☕", "naïve 🙂"])
def test_each_token_is_its_exact_bytes_so_a_character_split_across_tokens_streams_whole(mlx_engine, engine_for,
                                                                                      text):
    # a byte-level BPE spells a character missing from its merges in one token per byte; each
    # token alone used to come out as U+FFFD (decoded to text alone), so a reply streamed "���"
    tokenizer = mlx_engine.tokenizer()
    tokens = tokenizer.tokenize(text, special=False)
    pieces = [tokenizer.detokenize([t]) for t in tokens]
    assert b"".join(pieces) == text.encode() and any(len(p) == 1 and p[0] >= 0x80 for p in pieces)
    llama = engine_for("f32").tokenizer()  # the same vocabulary through llama.cpp
    assert pieces == [llama.detokenize([t]) for t in tokens]
