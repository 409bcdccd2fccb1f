"""The llama.cpp adapter on tiny models built at test time: real llama.cpp, real shared memory."""

import threading

import numpy as np
import pytest

from engines.base import StepRequest
from engines.errors import EngineError, IdentityMismatch, Interrupted, NoRoom, OptionError, StateError, WrongThread
from engines.llamacpp import blob as blobs, library, memory
from engines.llamacpp.engine import LlamaCppEngine
from kvpool import pricing
from superfluid import transfer
from tests.conftest import in_threads

PROMPT = "The capital of France is Paris. The quick brown fox"


def greedy(engine, seq, first_logits, steps):
    """Greedy continuation from `first_logits`: the tokens chosen and the logits of each step."""
    chosen, seen, logits = [], [], first_logits
    for _ in range(steps):
        token = int(np.argmax(logits))
        chosen.append(token)
        logits = engine.step([StepRequest(seq, [token])])[0][0]
        seen.append(logits)
    return chosen, np.stack(seen)


def prefill(engine, text=PROMPT):
    seq = engine.new_sequence()
    tokens = engine.tokenize(text)
    logits = engine.step([StepRequest(seq, tokens)])[0][0]
    return seq, tokens, logits


def test_describe_prices_cells_by_cache_type(engine_for):
    engine = engine_for("f32")
    info = engine.describe()
    assert info.runtime == "llamacpp" and info.runtime_version in library.TESTED_VERSIONS
    assert info.cell_price == pricing.bytes_per_token(pricing.uniform(2, 2, 16, "f16")) == 256
    assert info.identity.startswith("llamacpp:") and info.vocab_size == 300
    assert info.packing.mixes_prefill_and_decode and info.context_length == 1024
    assert info.device.is_cpu and "im_start" in info.chat_template
    assert info.kv_cells_reason == f"n_ctx={info.kv_cells}, as given"  # the fixture gives n_ctx


@pytest.mark.parametrize("options, apart", [
    ({"flash_attn": True}, True), ({"flash_attn": True, "cache_type_k": "f32", "cache_type_v": "f32"}, True),
    ({}, False), ({"flash_attn": True, "cache_type_k": "f16", "cache_type_v": "f32"}, False),
    ({"flash_attn": True, "cache_type_k": "q8_0", "cache_type_v": "q8_0"}, False),
    ({"flash_attn": True, "cache_type_v": "q8_0"}, False)])
def test_prompt_chunks_run_apart_only_where_the_cpu_kernel_tiles_attention(wide_model, options, apart):
    # ggml's CPU flash attention tiles 64 query rows over an f16/f32 cache whose K and V share a
    # type: only there do a chunk's forward and where decode tokens' cells land matter
    engine = LlamaCppEngine(wide_model.gguf, n_ctx=512, **options)
    try:
        assert engine.describe().packing.chunks_apart is apart
    finally:
        engine.close()


@pytest.mark.parametrize("k, v, flash", [("f16", "f16", False), ("q8_0", "q8_0", True), ("q8_0", "f16", False),
                                          ("f32", "f32", False), ("q4_0", "q4_0", True)])
def test_state_size_is_price_per_cell_plus_fixed(wide_model, pool, k, v, flash):
    engine = LlamaCppEngine(wide_model.gguf, n_ctx=512, cache_type_k=k, cache_type_v=v, flash_attn=flash)
    assert engine.describe().cell_price == pricing.bytes_per_token(pricing.uniform(2, 1, 64, k, value_type=v))
    seq, tokens, _ = prefill(engine)
    info = transfer.export(engine, pool, seq, tokens)
    # [magic, seq id,] stream count, cell count, v_trans, n_layer, a 12-byte header per K and V row
    fixed = (8 if engine._template.header else 0) + 4 + 4 + 8 + 2 * 12 * 2
    assert info.live_bytes == fixed + len(tokens) * (engine.describe().cell_price + blobs.CELL_META)
    priced = pricing.state_bytes(engine.describe().model_kv, len(tokens))
    assert info.live_bytes == priced + memory.state_overhead(engine._template, len(tokens), 0)
    engine.close()


@pytest.mark.parametrize("quant", ["f32", "f16", "q8_0", "q4_0"])
def test_export_import_continues_identically(engine_for, pool, quant):
    """Restored into another sequence, in this engine or a fresh one, the state continues with
    the very same logits (bit for bit: the cells land where the original ones were)."""
    engine = engine_for(quant)
    seq, tokens, logits = prefill(engine)
    info = transfer.export(engine, pool, seq, tokens, tag="t")
    assert pool.stats().bytes_written == info.live_bytes  # one copy into the pool
    reference = greedy(engine, seq, logits, 6)
    other = engine.new_sequence()
    engine.free_sequence(seq)  # its cells are free again: the restored ones take their place
    with pool.get(info.id) as view:
        assert transfer.import_(engine, other, view) == len(tokens)
    chosen, seen = greedy(engine, other, logits, 6)  # the same first choice, then the restored KV decides
    assert chosen == reference[0]
    np.testing.assert_array_equal(seen, reference[1])

    fresh = engine_for(quant)
    target = fresh.new_sequence()
    with pool.get(info.id) as view:
        transfer.import_(fresh, target, view)
    chosen, seen = greedy(fresh, target, logits, 6)
    assert chosen == reference[0]
    np.testing.assert_array_equal(seen, reference[1])


def test_import_beside_a_live_sequence(engine_for, pool):
    """Restored beside the sequence it came from, the continuation matches to float rounding
    (its cells sit elsewhere in the cache, so sums group differently)."""
    engine = engine_for("f32")
    seq, tokens, logits = prefill(engine)
    info = transfer.export(engine, pool, seq, tokens)
    other = engine.new_sequence()
    with pool.get(info.id) as view:
        transfer.import_(engine, other, view)
    first, second = greedy(engine, seq, logits, 5), greedy(engine, other, logits, 5)
    assert first[0] == second[0]
    np.testing.assert_allclose(first[1], second[1], rtol=0, atol=1e-5)


def test_fork_then_diverge_leaves_the_parent_unchanged(engine_for):
    engine = engine_for("f32")
    seq, tokens, logits = prefill(engine)
    child = engine.fork(seq)
    assert engine.length(child) == engine.length(seq)
    engine.step([StepRequest(child, engine.tokenize(" jumps over the lazy dog"))])
    parent_next = engine.step([StepRequest(seq, [int(np.argmax(logits))])])[0][0]
    fresh = engine.new_sequence()
    engine.step([StepRequest(fresh, tokens)])
    fresh_next = engine.step([StepRequest(fresh, [int(np.argmax(logits))])])[0][0]
    np.testing.assert_allclose(parent_next, fresh_next, rtol=0, atol=1e-5)


def test_truncate_then_continue_equals_a_fresh_prefill(engine_for):
    engine = engine_for("f16")
    seq, tokens, _ = prefill(engine)
    keep = len(tokens) // 2
    engine.truncate(seq, keep)
    cut = engine.step([StepRequest(seq, tokens[keep:keep + 3])])[0][0]
    fresh = engine.new_sequence()
    direct = engine.step([StepRequest(fresh, tokens[:keep + 3])])[0][0]
    np.testing.assert_allclose(cut, direct, rtol=0, atol=1e-4)
    with pytest.raises(EngineError, match="cannot keep"):
        engine.truncate(seq, 1000)


def test_packed_step_equals_one_at_a_time(engine_for):
    engine = engine_for("f32")
    texts = ["The capital of Italy", "Once upon a time", "A quick brown", "Numbers: 1 2 3"]
    prompts = [engine.tokenize(text) for text in texts]
    alone = []
    for tokens in prompts:
        seq = engine.new_sequence()
        alone.append(engine.step([StepRequest(seq, tokens, "all")])[0])
        engine.free_sequence(seq)
    seqs = [engine.new_sequence() for _ in prompts]
    together = engine.step([StepRequest(s, t, "all") for s, t in zip(seqs, prompts)])
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    # decode tokens of several sequences and a prefill chunk in one forward
    newcomer = engine.new_sequence()
    mixed = engine.step([StepRequest(seqs[0], [5]), StepRequest(seqs[1], [6]), StepRequest(newcomer, prompts[2])])
    assert [m.shape for m in mixed] == [(1, 300), (1, 300), (1, 300)]
    np.testing.assert_allclose(mixed[2][0], together[2][-1], rtol=0, atol=1e-4)


def test_quantized_model_with_a_multi_token_batch(engine_for):
    engine = engine_for("q8_0")  # the canary at load already ran one; this checks the values too
    seq = engine.new_sequence()
    logits = engine.step([StepRequest(seq, engine.tokenize(PROMPT), "all")])[0]
    assert logits.shape[0] == len(engine.tokenize(PROMPT)) and np.isfinite(logits).all()
    assert logits.std() > 0


def test_a_long_prompt_spans_several_decodes(engine_for):
    engine = engine_for("f32", batch_size=16, ubatch_size=16)
    tokens = engine.tokenize(PROMPT * 3)
    assert len(tokens) > 16
    seq = engine.new_sequence()
    chunked = engine.step([StepRequest(seq, tokens)])[0][0]
    whole_engine = engine_for("f32")
    whole = whole_engine.step([StepRequest(whole_engine.new_sequence(), tokens)])[0][0]
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-4)


def test_identity_differs_with_cache_type_and_import_is_refused(engine_for, pool):
    f16 = engine_for("f32", cache_type_k="f16")
    seq, tokens, _ = prefill(f16)
    info = transfer.export(f16, pool, seq, tokens)
    q8 = engine_for("f32", cache_type_k="q8_0")
    assert q8.describe().identity != f16.describe().identity
    target = q8.new_sequence()
    q8.step([StepRequest(target, [1, 2, 3])])
    with pool.get(info.id) as view, pytest.raises(IdentityMismatch, match="written by"):
        transfer.import_(q8, target, view)
    assert q8.length(target) == 3  # refused before anything changed
    assert pool.info(info.id).tokens == len(tokens)


@pytest.mark.parametrize("damage", ["truncate", "magic", "cell_owners", "cell_count", "layer_count"])
def test_corrupt_state_is_refused_before_llama_cpp_reads_it(engine_for, pool, damage):
    """A blob whose checksum holds but whose structure is wrong (a bug or a forgery) never
    reaches llama.cpp, where it could abort the process."""
    engine = engine_for("f32")
    seq, tokens, _ = prefill(engine)
    state = transfer.export(engine, pool, seq, tokens)
    with pool.get(state.id) as view:
        raw = np.array(view.blob)
    cells_at = 12 if engine._template.header else 4  # after [magic, seq id,] stream count
    layers_at = cells_at + 4 + len(tokens) * blobs.CELL_META + 4
    if damage == "truncate":
        raw = raw[:-100]
    elif damage == "magic":  # the magic, or the stream count in releases without one
        raw[0] ^= 0xFF
    elif damage == "cell_owners":
        raw[cells_at + 8:cells_at + 12] = np.frombuffer(np.int32(7).tobytes(), np.uint8)
    elif damage == "cell_count":
        raw[cells_at:cells_at + 4] = np.frombuffer(np.uint32(1 << 30).tobytes(), np.uint8)
    else:
        raw[layers_at:layers_at + 4] = np.frombuffer(np.uint32(3).tobytes(), np.uint8)
    forged = pool.put_blob(engine.describe().identity, tokens, raw)
    target = engine.new_sequence()
    engine.step([StepRequest(target, [1, 2])])
    with pool.get(forged.id) as view, pytest.raises(StateError):
        transfer.import_(engine, target, view)
    assert engine.length(target) == 0
    engine.step([StepRequest(target, [1, 2])])  # the engine still works


def test_no_contiguous_room_is_an_error_not_a_crash(engine_for, pool):
    engine = engine_for("f32", n_ctx=256, n_seq_max=4)
    seq, tokens, _ = prefill(engine, PROMPT * 4)
    info = transfer.export(engine, pool, seq, tokens)
    filler = engine.new_sequence()
    engine.step([StepRequest(filler, list(range(1, 256 - len(tokens) - 5)))])
    target = engine.new_sequence()
    with pool.get(info.id) as view, pytest.raises(NoRoom, match="contiguous free cells"):
        transfer.import_(engine, target, view)
    assert engine.length(target) == 0


def test_export_checks_the_tokens_and_the_pool_may_say_no(engine_for, make_pool):
    engine = engine_for("f32")
    seq, tokens, _ = prefill(engine)
    small = make_pool(1 << 20, budget=2048)
    with pytest.raises(EngineError, match="tokens were given"):
        transfer.export(engine, small, seq, tokens[:-1])
    from kvpool import EntryTooLarge

    with pytest.raises(EntryTooLarge):
        transfer.export(engine, small, seq, tokens)


def test_tokenize_round_trip_and_special_tokens(engine_for):
    engine = engine_for("f32")
    text = "Unicode: café, 東京 🙂"
    assert engine.detokenize(engine.tokenize(text)).decode() == text
    special = engine.tokenize("<|im_start|>user")
    assert len(special) < len(engine.tokenize("<|im_start|>user", special=False))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.detokenize([10_000])


def test_sequences_run_out_and_come_back(engine_for):
    engine = engine_for("f32", n_seq_max=2)
    first = engine.new_sequence()
    engine.new_sequence()
    with pytest.raises(NoRoom, match="n_seq_max"):
        engine.new_sequence()
    engine.free_sequence(first)
    assert engine.new_sequence() == first


def test_only_the_owning_thread_may_call(engine_for):
    engine = engine_for("f32")
    caught = []
    worker = threading.Thread(target=lambda: caught.append(_call(engine.new_sequence)))
    worker.start()
    worker.join()
    assert isinstance(caught[0], WrongThread)


def _call(function):
    try:
        function()
    except Exception as exc:  # returned to the test thread for its assertion
        return exc
    return None


@pytest.mark.parametrize("options, message", [
    ({"cache_type_v": "q8_0"}, "needs flash attention"),
    ({"threads": 0}, "threads=0"),
    ({"cache_type_k": "q3_k"}, "expected one of"),
    ({"n_ctx": "lots"}, "whole number"),
    ({"flash_attn": "maybe"}, "true or false"),
    ({"ubatch_size": 1024, "batch_size": 512}, "ubatch_size"),
    ({"no_such_option": 1}, "unknown option"),
])
def test_bad_options_are_named_before_loading(tiny_models, options, message):
    with pytest.raises(OptionError, match=message):
        LlamaCppEngine(tiny_models["f32"].gguf, **options)


def test_llama_cpp_makes_no_kv_copies_of_its_own(engine_for):
    engine = engine_for("f32")
    seq, tokens, _ = prefill(engine)
    child = engine.fork(seq)
    engine.step([StepRequest(child, [3]), StepRequest(seq, [4])])
    assert engine.stats().bytes_copied == 0 and engine.stats().copies == 0


def test_a_small_context_caps_the_batch_a_step_is_split_at(engine_for):
    """llama.cpp caps n_batch at n_ctx; a step split at the option's 512 would abort the process."""
    engine = engine_for("f32", n_ctx=64, n_seq_max=1)
    assert engine.describe().packing.max_tokens == 64  # n_batch, capped at the n_ctx asked for
    # newer llama.cpp rounds the cache up to 256 cells, so a step can outgrow n_batch; older ones
    # keep 64 (and there the cap never bit)
    count = min(200, engine.describe().context_length - 1)
    seq = engine.new_sequence()
    logits = engine.step([StepRequest(seq, [5] * count, "last")])[0]
    assert logits.shape == (1, 300) and engine.length(seq) == count


def test_an_import_counts_the_copy_llama_cpp_makes_from_pool_memory(engine_for, pool):
    engine = engine_for("f32")
    seq = engine.new_sequence()
    engine.step([StepRequest(seq, list(range(3, 40)), "none")])
    info = transfer.export(engine, pool, seq, list(range(3, 40)))
    written = pool.stats().bytes_copied
    assert written == info.live_bytes
    with pool.get(info.id, verify=False) as view:
        transfer.import_(engine, engine.new_sequence(), view)
    assert pool.stats().bytes_copied == 2 * written


def test_the_tokenizer_answers_any_thread_and_refuses_once_the_model_is_closed(engine_for):
    engine = engine_for()
    text = "The capital of France is Paris.<|im_end|>"
    tokenizer = engine.tokenizer()
    tokens = engine.tokenize(text)
    elsewhere = in_threads(lambda _: (tokenizer.tokenize(text), tokenizer.detokenize(tokens)), 4)
    assert elsewhere == [(tokens, text.encode())] * 4
    with pytest.raises(WrongThread):
        in_threads(lambda _: engine.tokenize(text), 1)  # the engine's own methods stay its owner's
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        tokenizer.tokenize(text)


def test_flash_attention_steps_keep_sequences_apart_and_give_the_same_logits(engine_for):
    """With flash attention on the CPU, decode tokens and a chunk of 64 or more tokens run in
    separate forwards (a 64-row attention tile holding two sequences attends over both); the
    logits are those of the same forwards run as separate steps."""
    engines = [engine_for("f32", flash_attn=True) for _ in range(2)]
    chunk = [int(t) for t in np.arange(70) % 250 + 3]
    seqs = []
    for engine in engines:
        a, b, c = (engine.new_sequence() for _ in range(3))
        engine.step([StepRequest(a, engine.tokenize(PROMPT)), StepRequest(b, engine.tokenize("Once upon a time"))])
        seqs.append((a, b, c))
    (a, b, c), (a2, b2, c2) = seqs
    forwards = []
    decode = engines[0]._decode
    engines[0]._decode = lambda plan, results: (forwards.append({entry[1] for entry in plan}), decode(plan, results))
    together = engines[0].step([StepRequest(a, [5]), StepRequest(c, chunk), StepRequest(b, [6])])
    assert forwards == [{c}, {a, b}]
    apart = engines[1].step([StepRequest(a2, [5]), StepRequest(b2, [6])]) + engines[1].step([StepRequest(c2, chunk)])
    for mixed, alone in zip(together, [apart[0], apart[2], apart[1]]):
        np.testing.assert_allclose(mixed, alone, rtol=0, atol=1e-5)
    assert [engines[0].length(s) for s in (a, b, c)] == [engines[1].length(s) for s in (a2, b2, c2)]


def test_an_interrupted_step_keeps_what_it_finished_and_the_next_step_runs(engine_for):
    """interrupt() before a step stops it at its first node: Interrupted, the sequence as it
    was; the flag is then down, and feeding the prompt again gives the uninterrupted logits."""
    engine = engine_for("f32", ubatch_size=16, batch_size=64)
    tokens = engine.tokenize(PROMPT * 3)
    seq = engine.new_sequence()
    engine.step([StepRequest(seq, tokens[:5], "none")])
    assert engine.interrupt() is True
    with pytest.raises(Interrupted, match="interrupted"):
        engine.step([StepRequest(seq, tokens[5:], "last")])
    assert engine.length(seq) == 5
    resumed = engine.step([StepRequest(seq, tokens[5:], "last")])[0][0]
    fresh = engine_for("f32", ubatch_size=16, batch_size=64)
    whole = fresh.step([StepRequest(fresh.new_sequence(), tokens, "last")])[0][0]
    np.testing.assert_allclose(resumed, whole, rtol=0, atol=1e-4)
    assert engine.length(seq) == len(tokens)


def test_an_interrupt_taken_back_before_a_step_lets_it_run(engine_for):
    """clear_interrupt() lowers a flag no forward took: the next step runs to its end."""
    engine = engine_for("f32", ubatch_size=16, batch_size=64)
    tokens = engine.tokenize(PROMPT * 3)
    seq = engine.new_sequence()
    assert engine.interrupt() is True
    engine.clear_interrupt()
    engine.step([StepRequest(seq, tokens, "last")])
    assert engine.length(seq) == len(tokens)


def test_an_interrupt_from_another_thread_leaves_whole_ubatches(engine_for):
    """Stopped mid-step from another thread, a long prompt keeps the ubatches that finished
    (a multiple of ubatch_size) and goes on from there to the same logits; a step that ended
    before the interrupt arrived is simply complete."""
    engine = engine_for("f32", ubatch_size=16, batch_size=512)
    tokens = (engine.tokenize(PROMPT) * 40)[:480]
    seq = engine.new_sequence()
    timer = threading.Timer(0.005, engine.interrupt)
    timer.start()
    try:
        engine.step([StepRequest(seq, tokens, "last")])
        held = len(tokens)
    except Interrupted:
        held = engine.length(seq)
        assert held % 16 == 0 and held < len(tokens)
        engine.step([StepRequest(seq, tokens[held:], "last")])
    timer.join()
    assert engine.length(seq) == len(tokens)
    fresh = engine_for("f32", ubatch_size=16, batch_size=512)
    other = fresh.new_sequence()
    whole = fresh.step([StepRequest(other, tokens + [7], "last")])[0][0]
    engine.clear_interrupt()  # an interrupt that came after the step would stop the next one
    np.testing.assert_allclose(engine.step([StepRequest(seq, [7], "last")])[0][0], whole, rtol=0, atol=1e-4)
