"""A llama GGUF file as an mlx-lm model: MLX reads GGUF natively, superfluid renames and rebuilds.

`mx.load` returns a GGUF's tensors (quantized ones in MLX's affine form: weight, scales, biases,
groups of 32) and its metadata. The tensors are renamed to the Hugging Face names mlx-lm's llama
expects, the config comes from the metadata with `rope_traditional: true` (GGUF stores llama's
Q and K for interleaved RoPE), and the tokenizer is rebuilt from the GGUF vocabulary and merges.
Quantized weights are dequantized to float32 when the `dequantize` option says so: MLX's quantized matmul does not use
BLAS and is slow on a CPU (measured: a 2,000-token SmolLM2 prefill, 134 s 4-bit against 22 s float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.errors import ModelLoadError
from engines.mlx import settings
from kvpool import host_memory_available

# GGUF tensor name (per layer, after "blk.N.") -> Hugging Face name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GROUP = 32  # GGUF's block size, which MLX keeps as its group size
CONTROL = 3  # token type of special tokens in a GGUF vocabulary


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF llama tensor ("blk.3.attn_q.scales" -> "model.layers.3.self_attn.q_proj.scales")."""
    base, _, part = gguf_name.rpartition(".")
    if base in MODEL_NAMES:
        return f"{MODEL_NAMES[base]}.{part}"
    prefix, layer, name = base.split(".", 2)
    if prefix != "blk" or name not in LAYER_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not part of a llama model superfluid can map")
    return f"model.layers.{layer}.{LAYER_NAMES[name]}.{part}"


def _number(meta: dict, key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata has no {key}")
    return value.item() if hasattr(value, "item") else value


def config_from(meta: dict, weights: dict) -> dict:
    """An mlx-lm llama config from GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"MLX loads llama GGUF files only; this one is {arch!r} (use runtime llamacpp)")
    heads = int(_number(meta, "llama.attention.head_count"))
    return {
        "model_type": "llama",
        "hidden_size": int(_number(meta, "llama.embedding_length")),
        "num_hidden_layers": int(_number(meta, "llama.block_count")),
        "intermediate_size": int(_number(meta, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_number(meta, "llama.attention.head_count_kv", heads)),
        "rms_norm_eps": float(_number(meta, "llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "rope_theta": float(_number(meta, "llama.rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "max_position_embeddings": int(_number(meta, "llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in weights,
    }


def weights_from(mx, tensors: dict, dequantize: bool) -> tuple[dict, dict[str, int]]:
    """HF-named weights, and the bits of each module kept quantized (none when `dequantize`:
    then quantized weights come back as float32)."""
    out, bits_by_module = {}, {}
    for name, array in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.scales" in tensors:
            scales, biases = tensors[f"{base}.scales"], tensors[f"{base}.biases"]
            bits = array.shape[-1] * 32 // (scales.shape[-1] * GROUP)
            if dequantize:
                out[hf_name(name)] = mx.dequantize(array, scales, biases, group_size=GROUP, bits=bits).astype(mx.float32)
            else:
                module = hf_name(name)[: -len(".weight")]
                bits_by_module[module] = bits
                out[f"{module}.weight"], out[f"{module}.scales"], out[f"{module}.biases"] = array, scales, biases
        else:
            out[hf_name(name)] = array.astype(mx.float32) if array.dtype != mx.float32 else array
    return out, bits_by_module


def tokenizer_from(meta: dict):
    """A Hugging Face fast tokenizer rebuilt from the GGUF vocabulary, merges and special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelLoadError(f"MLX can rebuild byte-level BPE (gpt2) tokenizers from GGUF, not "
                             f"{meta.get('tokenizer.ggml.model')!r}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    kinds = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # llama.cpp's "smollm" pre-tokenizer splits digits one by one before the byte-level split.
    bpe.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if meta.get("tokenizer.ggml.pre") == "smollm" else byte_level)
    bpe.decoder = decoders.ByteLevel()
    specials = [token for token, kind in zip(tokens, kinds) if kind == CONTROL]
    bpe.add_special_tokens(specials)

    def token(key: str) -> str | None:
        index = meta.get(key)
        return tokens[int(index.item() if hasattr(index, "item") else index)] if index is not None else None

    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=token("tokenizer.ggml.bos_token_id"),
                                   eos_token=token("tokenizer.ggml.eos_token_id"),
                                   chat_template=meta.get("tokenizer.chat_template"), clean_up_tokenization_spaces=False)


def float32_bytes(tensors: dict) -> int:
    """Bytes the model's weights take once every quantized tensor is float32."""
    total = 0
    for name, array in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.scales" in tensors:
            bits = array.shape[-1] * 32 // (tensors[f"{base}.scales"].shape[-1] * GROUP)
            total += array.size * 32 // bits * 4
        else:
            total += array.size * 4
    return total


def load(path: Path, dequantize: str):
    """(model, config, HF tokenizer) from a llama GGUF file; `dequantize` is the option's value
    ("auto", "on" or "off", see settings.dequantize_decision)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    try:
        tensors, meta = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises RuntimeError or ValueError for unreadable files
        raise ModelLoadError(f"MLX could not read {path} as GGUF: {exc}") from None
    config = config_from(meta, tensors)
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    as_float32 = settings.dequantize_decision(dequantize, on_cpu, float32_bytes(tensors), host_memory_available())
    weights, bits = weights_from(mx, tensors, as_float32)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    if bits:  # each quantized module at its own width (a Q4_1 file keeps some tensors in Q8_0)
        nn.quantize(model, group_size=GROUP,
                    class_predicate=lambda name, module: {"group_size": GROUP, "bits": bits[name]} if name in bits
                    else False)
        config["quantization"] = {"group_size": GROUP, "bits": sorted(set(bits.values()))}
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model, config, tokenizer_from(meta)
