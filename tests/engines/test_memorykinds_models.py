"""The tiny memory-kind models (tests/memorykinds.py) load in llama.cpp and, where built, in mlx-lm,
and the two runtimes compute the same logits. Also pins the few facts about each kind's
per-sequence state that the models exist to exercise (sizes that grow, stay flat, or stop at the
window), so a llama.cpp upgrade that changes them fails here first."""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import pytest

from tests import memorykinds

# mlx-lm and llama.cpp agree to about 2e-5 on these f32 models (logits of magnitude ~70), except
# gemma3: ggml's CPU GELU looks its input up in an fp16 table, which moves the logits by up to a few
# 1e-3 (measured 2.7e-3 over 40 tokens; 4.5e-4 once mlx-lm's GELU is fed fp16-rounded inputs too).
# Without the window mlx-lm would be off by ~4, so the iswa tolerance still checks the window.
TOLERANCE = {"iswa": 1e-2, "recurrent": 1e-3, "hybrid": 1e-3}
EXPECTED = {  # kind -> (llama_model_is_recurrent, llama_model_is_hybrid, llama_model_n_swa)
    "iswa": (False, False, memorykinds.WINDOW),
    "recurrent": (True, False, 0),
    "hybrid": (False, True, 0),
    "hybrid_iswa": (False, True, memorykinds.WINDOW),
}
PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
MAGIC = 0xAF143CD8  # what llama-context writes before every sequence state


def tokens_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 290 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("memorykinds")
    return {kind: memorykinds.build(kind, root / kind) for kind in memorykinds.KINDS}


@pytest.fixture(scope="module")
def llama():
    """llama_cpp with llama.cpp's info chatter off (through llama-cpp-python's own log callback,
    whose logger level decides what it prints) for this module, as it was afterwards."""
    import llama_cpp
    from llama_cpp._logger import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    llama_cpp.llama_backend_init()
    yield llama_cpp
    logger.setLevel(level)


class Runner:
    """One llama.cpp model and context through the low-level API: n_ctx 256, 4 sequences, one
    unified KV buffer, f32 KV, 2 threads, a window-sized SWA cache (llama.cpp's default is
    swa_full = true, a full-size one)."""

    def __init__(self, L, path, flash: bool = False, n_ctx: int = 256, n_ubatch: int = 256, swa_full: bool = False):
        self.L = L
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, f"llama.cpp could not load {path}"
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        ctx_params = L.llama_context_default_params()
        ctx_params.n_ctx, ctx_params.n_batch, ctx_params.n_ubatch, ctx_params.n_seq_max = n_ctx, n_ubatch, n_ubatch, 4
        ctx_params.n_threads = ctx_params.n_threads_batch = 2
        ctx_params.kv_unified, ctx_params.swa_full = True, swa_full
        ctx_params.type_k = ctx_params.type_v = 0  # GGML_TYPE_F32
        ctx_params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = L.llama_init_from_model(self.model, ctx_params)
        assert self.ctx
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(n_ubatch, 0, 1)

    def decode(self, tokens: list[int], seq: int = 0, start: int | None = None) -> np.ndarray:
        """Decode `tokens` at positions from `start` (default: after what `seq` holds), in one
        batch; the logits of every token."""
        L, batch = self.L, self.batch
        if start is None:
            start = L.llama_memory_seq_pos_max(self.mem, seq) + 1
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, 1
            batch.seq_id[i][0] = seq
        assert L.llama_decode(self.ctx, batch) == 0
        return np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), (self.n_vocab,)).copy()
                         for i in range(len(tokens))])

    def state(self, seq: int, flags: int = 0) -> bytes:
        size = self.L.llama_state_seq_get_size_ext(self.ctx, seq, flags)
        buffer = (ctypes.c_uint8 * size)()
        assert self.L.llama_state_seq_get_data_ext(self.ctx, buffer, size, seq, flags) == size
        return bytes(buffer)

    def restore(self, blob: bytes, seq: int) -> int:
        buffer = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        return self.L.llama_state_seq_set_data(self.ctx, buffer, len(blob), seq)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


@pytest.fixture
def runner(llama):
    opened = []

    def make(path, **options):
        opened.append(Runner(llama, path, **options))
        return opened[-1]

    yield make
    for each in opened:
        each.close()


def mlx_logits(directory, tokens: list[int]) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(directory)
    logits = model(mx.array([tokens]))
    mx.eval(logits)
    return np.array(logits[0].astype(mx.float32))


# ----------------------------------------------------------------------------- building


def test_building_is_deterministic_and_seeded(tmp_path):
    for kind in memorykinds.KINDS:
        first = memorykinds.build(kind, tmp_path / "a" / kind)
        again = memorykinds.build(kind, tmp_path / "b" / kind)
        other = memorykinds.build(kind, tmp_path / "c" / kind, seed=1)
        assert first.gguf.read_bytes() == again.gguf.read_bytes()
        assert first.gguf.read_bytes() != other.gguf.read_bytes()
        assert first.kind == kind and len(first.vocab) == 300
        assert (first.mlx is None) == (kind == "hybrid_iswa")  # mlx-lm's lfm2 has no sliding window
    with pytest.raises(ValueError, match="unknown memory kind"):
        memorykinds.build("paged", tmp_path / "x")


def test_the_layer_patterns_are_the_ones_described(models):
    assert models["iswa"].swa_layers == (True, False, True) and models["iswa"].window == memorykinds.WINDOW
    assert models["recurrent"].recurrent_layers == (True, True) and models["recurrent"].window is None
    assert models["hybrid"].recurrent_layers == (True, False, True) and not any(models["hybrid"].swa_layers)
    assert models["hybrid_iswa"].swa_layers == (False, True, False)


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.parametrize("flash", [False, True], ids=["no-fa", "fa"])
@pytest.mark.parametrize("kind", memorykinds.KINDS)
def test_llama_cpp_loads_each_kind_and_computes_finite_logits(models, runner, llama, kind, flash):
    run = runner(models[kind].gguf, flash=flash)
    assert (bool(llama.llama_model_is_recurrent(run.model)), bool(llama.llama_model_is_hybrid(run.model)),
            llama.llama_model_n_swa(run.model)) == EXPECTED[kind]
    logits = run.decode(tokens_of(40))
    assert logits.shape == (40, 300) and np.isfinite(logits).all()
    assert np.ptp(logits, axis=1).min() > 0.1  # not a constant row: the weights do something
    assert len({row.argmax() for row in logits}) > 1  # and the context changes the prediction
    assert llama.llama_memory_seq_pos_max(run.mem, 0) == 39


@pytest.mark.parametrize("flash", [False, True], ids=["no-fa", "fa"])
@pytest.mark.parametrize("kind", memorykinds.KINDS)
def test_a_restored_state_continues_like_the_original(models, runner, kind, flash):
    """A state set into another sequence continues as the original does. With flash attention the
    logits are bit-identical; without it the restored cells sit elsewhere in the unified cache, the
    masked sum runs in another order, and the logits move by ~1e-5 (measured 7.6e-6)."""
    run = runner(models[kind].gguf, flash=flash)
    run.decode(tokens_of(40))
    blob = run.state(0)
    assert int.from_bytes(blob[:4], "little") == MAGIC and int.from_bytes(blob[4:8], "little") == 0
    assert run.restore(blob, 1) == len(blob)
    more = tokens_of(5, salt=3)
    restored, original = run.decode(more, 1), run.decode(more, 0)
    if flash or kind == "recurrent":
        np.testing.assert_array_equal(restored, original)
    else:
        np.testing.assert_allclose(restored, original, rtol=0, atol=1e-4)


def test_state_sizes_follow_the_kind(models, runner):
    """Attention state grows with the tokens, a window's stops at the window, recurrent state is flat."""
    sizes = {}
    for kind in memorykinds.KINDS:
        run = runner(models[kind].gguf)
        for n in (5, 20, 40):
            run.clear()
            run.decode(tokens_of(n))
            sizes[kind, n] = (len(run.state(0)), len(run.state(0, PARTIAL_ONLY)))
    # the window cache writes only the cells the next token can still see: min(N, window) of them
    assert sizes["iswa", 5][1] < sizes["iswa", 20][1] == sizes["iswa", 40][1]
    assert sizes["iswa", 5][0] < sizes["iswa", 20][0] < sizes["iswa", 40][0]
    # one recurrent cell per sequence whatever N is; the flag changes nothing for a pure recurrent memory
    assert sizes["recurrent", 5] == sizes["recurrent", 40] and sizes["recurrent", 5][0] == sizes["recurrent", 5][1]
    # hybrid: the attention part grows, the partial (recurrent only) part does not
    assert sizes["hybrid", 5][0] < sizes["hybrid", 40][0] and sizes["hybrid", 5][1] == sizes["hybrid", 40][1]
    assert sizes["hybrid_iswa", 20][1] == sizes["hybrid_iswa", 40][1] > sizes["hybrid_iswa", 5][1]


@pytest.mark.parametrize("kind", memorykinds.KINDS)
def test_cutting_a_sequence_back(models, runner, llama, kind):
    """Attention memories cut anywhere; a recurrent state cannot be cut back (without n_rs_seq)."""
    run = runner(models[kind].gguf)
    run.decode(tokens_of(40))
    cut = bool(llama.llama_memory_seq_rm(run.mem, 0, 30, -1))
    if models[kind].recurrent_layers and any(models[kind].recurrent_layers):
        assert not cut and llama.llama_memory_seq_pos_max(run.mem, 0) == 39  # refused, nothing removed
        assert llama.llama_memory_seq_rm(run.mem, 0, 40, -1)  # removing nothing past the end is fine
    else:
        assert cut and llama.llama_memory_seq_pos_max(run.mem, 0) == 29
    assert llama.llama_memory_seq_rm(run.mem, 0, 0, -1) and llama.llama_memory_seq_pos_max(run.mem, 0) == -1


@pytest.mark.parametrize("swa_full", [False, True], ids=["window-cache", "full-cache"])
def test_cutting_back_past_an_overwritten_window_is_silently_wrong(models, runner, llama, swa_full):
    """With n_ctx 1024 and n_ubatch 32 the window cache has PAD(min(1024, 16 * 4 + 32), 256) = 256
    cells, so 300 tokens wrap it. seq_rm back to 30 still returns true, although the cells the
    window needs (14..29) were overwritten: the caller has to check llama_memory_seq_pos_min (the
    window cache's) first, as llama-server does. A full-size window cache (swa_full) keeps them."""
    run = runner(models["iswa"].gguf, n_ctx=1024, n_ubatch=32, swa_full=swa_full)
    prompt = tokens_of(300)
    logits = np.concatenate([run.decode(prompt[i:i + 32]) for i in range(0, 300, 32)])
    assert llama.llama_memory_seq_pos_min(run.mem, 0) == (0 if swa_full else 300 - 256)
    assert llama.llama_memory_seq_rm(run.mem, 0, 30, -1)  # true either way
    # the memory's positions are the window cache's: nothing of the sequence is left there
    assert llama.llama_memory_seq_pos_max(run.mem, 0) == (29 if swa_full else -1)
    again = run.decode(prompt[30:62], start=30)
    if swa_full:
        np.testing.assert_allclose(again, logits[30:62], rtol=0, atol=1e-4)
    else:
        assert np.abs(again - logits[30:62]).max() > 0.1


# ----------------------------------------------------------------------------- mlx-lm


@pytest.mark.parametrize("kind", ["iswa", "recurrent", "hybrid"])
def test_mlx_lm_computes_the_same_logits(models, runner, kind):
    model = models[kind]
    prompt = tokens_of(40)  # more than twice the window of 16
    expected = runner(model.gguf).decode(prompt)
    got = mlx_logits(model.mlx, prompt)
    assert got.shape == expected.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE[kind])
    assert (got.argmax(axis=1) == expected.argmax(axis=1)).mean() > 0.9
