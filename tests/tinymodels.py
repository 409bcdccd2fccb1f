"""Tiny random-weight models built at test time, with no network.

A byte-level BPE tokenizer is trained with `tokenizers` on a few lines of text; a llama-architecture
model (hidden 64, 2 layers, 4 heads, 2 KV heads) gets random weights from a seed; the same
weights are written as GGUF (f32, f16, q8_0 or q4_0) for llama.cpp and as an mlx-lm model
directory (Hugging Face names, `rope_traditional: true` because GGUF llama uses interleaved RoPE).
Building one takes well under a second. The vocabulary and merges go into both, so the engines
tokenize exactly as the trained tokenizer does, and with f32 weights their logits agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A quick brown fox jumps over the lazy dog, and the dog sleeps.",
    "superfluid keeps KV state in a shared pool so sessions fork for free.",
    "Once upon a time there was a tiny model that knew very little.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Unicode: café, naïve, 東京, 🙂.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@dataclass(frozen=True)
class TinyConfig:
    """The shape of a tiny llama model."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    context: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class TinyModel:
    """Paths and weights of a built tiny model."""

    gguf: Path
    config: TinyConfig
    vocab: list[str]
    merges: list[str]
    weights: dict[str, np.ndarray] = field(repr=False)


def train_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on CORPUS, with the ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tokenizer


def random_weights(config: TinyConfig, vocab: int) -> dict[str, np.ndarray]:
    """Random llama weights under their GGUF names (numpy row-major shapes)."""
    rng = np.random.default_rng(config.seed)
    h, hd, ff = config.hidden, config.head_dim, config.intermediate

    def matrix(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or cols ** -0.5)).astype(np.float32)

    weights = {"token_embd.weight": matrix(vocab, h, 1.0), "output_norm.weight": np.ones(h, np.float32),
               "output.weight": matrix(vocab, h)}
    for i in range(config.layers):
        weights.update({
            f"blk.{i}.attn_norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
            f"blk.{i}.attn_q.weight": matrix(config.heads * hd, h),
            f"blk.{i}.attn_k.weight": matrix(config.kv_heads * hd, h),
            f"blk.{i}.attn_v.weight": matrix(config.kv_heads * hd, h),
            f"blk.{i}.attn_output.weight": matrix(h, config.heads * hd),
            f"blk.{i}.ffn_norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
            f"blk.{i}.ffn_gate.weight": matrix(ff, h),
            f"blk.{i}.ffn_up.weight": matrix(ff, h),
            f"blk.{i}.ffn_down.weight": matrix(h, ff),
        })
    return weights


def build(directory: Path, quant: str = "f32", config: TinyConfig = TinyConfig(),
          chat_template: str = CHATML) -> TinyModel:
    """Write `directory/tiny-<quant>.gguf` (f32, f16, q8_0, q4_0, or "mixed": q8_0 embeddings and
    output, q4_0 elsewhere) with `chat_template`, and return what was built."""
    import gguf

    tokenizer = train_tokenizer()
    vocab_map = tokenizer.get_vocab()
    vocab = [token for token, _ in sorted(vocab_map.items(), key=lambda item: item[1])]
    merges = [" ".join(pair) for pair in _merges(tokenizer)]
    weights = random_weights(config, len(vocab))

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"tiny-{quant}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"superfluid-tiny-{quant}")
    writer.add_context_length(config.context)
    writer.add_embedding_length(config.hidden)
    writer.add_block_count(config.layers)
    writer.add_feed_forward_length(config.intermediate)
    writer.add_head_count(config.heads)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(len(vocab))
    writer.add_file_type({"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2, "mixed": 2}[quant])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab)
    writer.add_token_types([3 if token in SPECIALS else 1 for token in vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab_map["<|endoftext|>"])
    writer.add_eos_token_id(vocab_map["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)
    for name, array in weights.items():
        _add_tensor(writer, gguf, name, array, quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyModel(path, config, vocab, merges, weights)


def _add_tensor(writer, gguf, name: str, array: np.ndarray, quant: str) -> None:
    if quant == "mixed":  # like real Q4 files: embeddings and output in q8_0, the rest in q4_0
        quant = "q8_0" if name in ("token_embd.weight", "output.weight") else "q4_0"
    if array.ndim == 1 or quant == "f32":
        writer.add_tensor(name, array.astype(np.float32))
    elif quant == "f16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[quant]
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def _merges(tokenizer) -> list[tuple[str, str]]:
    import json

    model = json.loads(tokenizer.to_str())["model"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def build_mlx(directory: Path, config: TinyConfig = TinyConfig(), dtype: str = "float32") -> Path:
    """Write an mlx-lm model directory with the same tokenizer and weights as `build`."""
    import json

    import mlx.core as mx

    from engines.mlx.gguf import hf_name

    tokenizer = train_tokenizer()
    vocab = tokenizer.get_vocab()
    weights = random_weights(config, len(vocab))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": config.hidden, "num_hidden_layers": config.layers,
        "intermediate_size": config.intermediate, "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads, "rms_norm_eps": config.norm_eps, "vocab_size": len(vocab),
        "rope_theta": config.rope_theta, "rope_traditional": True, "tie_word_embeddings": False,
        "max_position_embeddings": config.context, "torch_dtype": dtype,
    }))
    mx.save_safetensors(str(directory / "model.safetensors"),
                        {hf_name(name): mx.array(array).astype(getattr(mx, dtype)) for name, array in weights.items()})
    _save_tokenizer(tokenizer, directory)
    return directory


def _save_tokenizer(tokenizer, directory: Path) -> None:
    import json

    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "unk_token": None, "add_bos_token": False, "chat_template": CHATML, "clean_up_tokenization_spaces": False,
    }))


HYBRID_CONFIG = {
    "model_type": "falcon_h1", "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "intermediate_size": 128, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_chunk_size": 16, "mamba_expand": 2,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": True,
}


def build_mlx_hybrid(directory: Path, seed: int = 0) -> Path:
    """A tiny Falcon-H1 as an mlx-lm directory: each layer holds a CacheList of a recurrent
    ArraysCache (the Mamba part) and a KVCache (attention), built by mlx-lm's own model class
    with random weights."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import falcon_h1

    tokenizer = train_tokenizer()
    config = dict(HYBRID_CONFIG, vocab_size=len(tokenizer.get_vocab()))
    mx.random.seed(seed)
    model = falcon_h1.Model(falcon_h1.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "model.safetensors"), {k: v for k, v in weights.items() if not k.endswith("_mup_vector")})
    _save_tokenizer(tokenizer, directory)
    return directory
