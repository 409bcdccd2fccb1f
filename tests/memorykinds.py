"""Tiny random-weight models for llama.cpp's memory kinds other than the plain KV cache.

`tests/tinymodels.py` builds a llama, whose llama.cpp memory is one `llama_kv_cache`. Other
architectures get other memories (`llama_model::create_memory`), and each one writes a different
per-sequence state (`llama_state_seq_get_data`). This module builds one tiny model per kind:

  kind          architecture                       llama.cpp memory            mlx-lm model
  "iswa"        gemma3, 3 layers, window 16,       llama_kv_cache_iswa         gemma3_text
                pattern 2 (layers 0, 2 windowed,   (a full cache for layer 1,
                layer 1 global)                     a window cache for 0 and 2)
  "recurrent"   mamba (v1), 2 layers               llama_memory_recurrent      mamba
  "hybrid"      lfm2, 3 layers (short conv,        llama_memory_hybrid         lfm2
                attention, short conv)             (kv cache + recurrent)
  "hybrid_iswa" lfm2 as above with a sliding       llama_memory_hybrid_iswa    none: mlx-lm's lfm2
                window of 16 on its attention      (iswa cache + recurrent)    has no window
                layer

LFM2 stands in for the hybrid kind rather than Falcon-H1 (whose MLX side `build_mlx_hybrid`
builds): it has a handful of hyperparameters and no muP multipliers to fold, so the same numpy
weights go into both runtimes as they are. It is also the cheapest architecture that reaches
`llama_memory_hybrid_iswa`: any hybrid whose GGUF carries a sliding window gets that memory.

Weights are random f32 from the seed, drawn once in GGUF layout and written both as GGUF and (where
mlx-lm has the architecture) as an mlx-lm directory under Hugging Face names, so both runtimes run
the same model. The tokenizer and the way the vocabulary goes into GGUF are tinymodels'. Building
takes a few tens of milliseconds and needs no network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tests import tinymodels

KINDS = ("iswa", "recurrent", "hybrid", "hybrid_iswa")
WINDOW = 16  # small, so a test crosses it after a few dozen tokens
HIDDEN = 64


@dataclass(frozen=True)
class MemoryKindModel:
    """A built tiny model of one memory kind: where its files are and what its layers are."""

    kind: str
    arch: str  # the GGUF general.architecture
    gguf: Path
    mlx: Path | None  # an mlx-lm directory with the same weights, or None where mlx-lm lacks the architecture
    window: int | None  # the sliding window, where the model has one
    vocab: list[str] = field(repr=False)
    swa_layers: tuple[bool, ...] = ()  # per layer: attends through the window cache
    recurrent_layers: tuple[bool, ...] = ()  # per layer: keeps recurrent state instead of KV


def build(kind: str, directory: Path, seed: int = 0) -> MemoryKindModel:
    """Write `directory/<kind>.gguf` (and `directory/<kind>-mlx/` where mlx-lm has the architecture)
    for kind in KINDS, with random f32 weights from `seed`, and return what was built."""
    if kind not in KINDS:
        raise ValueError(f"unknown memory kind {kind!r}; one of {KINDS}")
    tokenizer = tinymodels.train_tokenizer()
    vocab_map = tokenizer.get_vocab()
    vocab = [token for token, _ in sorted(vocab_map.items(), key=lambda item: item[1])]
    rng = np.random.default_rng(seed)
    spec = {"iswa": _gemma3, "recurrent": _mamba, "hybrid": _lfm2, "hybrid_iswa": _lfm2_window}[kind](rng, len(vocab))

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{kind}.gguf"
    _write_gguf(path, spec, tokenizer, vocab, kind)
    mlx_dir = None
    if spec.mlx_config is not None:
        mlx_dir = directory / f"{kind}-mlx"
        _write_mlx(mlx_dir, spec, tokenizer, len(vocab))
    return MemoryKindModel(kind, spec.arch, path, mlx_dir, spec.window, vocab, spec.swa_layers, spec.recurrent_layers)


# ----------------------------------------------------------------------------- the architectures


@dataclass
class _Spec:
    arch: str
    metadata: list  # (GGUFWriter method name, value), written in order
    weights: dict[str, np.ndarray]  # GGUF names, numpy row-major (ggml's ne reversed)
    hf_names: dict[str, str]  # GGUF name -> mlx-lm parameter name
    mlx_config: dict | None
    window: int | None = None
    swa_layers: tuple[bool, ...] = ()
    recurrent_layers: tuple[bool, ...] = ()
    to_hf: dict = field(default_factory=dict)  # GGUF name -> function from the GGUF array to the mlx-lm array


def _matrix(rng, rows, cols, scale=None):
    return (rng.standard_normal((rows, cols)) * (scale or cols ** -0.5)).astype(np.float32)


def _vector(rng, n, scale=0.1, offset=0.0):
    return (offset + scale * rng.standard_normal(n)).astype(np.float32)


def _gemma3(rng, vocab: int) -> _Spec:
    """Gemma 3: 3 layers, pattern 2 (layer i is windowed unless i % 2 == 1), window 16. Windowed
    layers rotate with base 10 000 and global ones with 1 000 000, as in the real models, so a
    mix-up of the two shows in the logits."""
    layers, heads, kv_heads, head_dim, ff, pattern = 3, 4, 2, 16, 128, 2
    swa = tuple(i % pattern < pattern - 1 for i in range(layers))  # llama_hparams::set_swa_pattern
    weights = {"token_embd.weight": _matrix(rng, vocab, HIDDEN, 1.0),
               # Gemma's RMSNorm multiplies by (1 + w); GGUF stores 1 + w, mlx-lm stores w (see to_hf)
               "output_norm.weight": _vector(rng, HIDDEN, offset=1.0)}
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in range(layers):
        layer = {
            "attn_norm": (_vector(rng, HIDDEN, offset=1.0), "input_layernorm"),
            "attn_q": (_matrix(rng, heads * head_dim, HIDDEN), "self_attn.q_proj"),
            "attn_k": (_matrix(rng, kv_heads * head_dim, HIDDEN), "self_attn.k_proj"),
            "attn_v": (_matrix(rng, kv_heads * head_dim, HIDDEN), "self_attn.v_proj"),
            "attn_q_norm": (_vector(rng, head_dim, offset=1.0), "self_attn.q_norm"),
            "attn_k_norm": (_vector(rng, head_dim, offset=1.0), "self_attn.k_norm"),
            "attn_output": (_matrix(rng, HIDDEN, heads * head_dim), "self_attn.o_proj"),
            "post_attention_norm": (_vector(rng, HIDDEN, offset=1.0), "post_attention_layernorm"),
            "ffn_norm": (_vector(rng, HIDDEN, offset=1.0), "pre_feedforward_layernorm"),
            "ffn_gate": (_matrix(rng, ff, HIDDEN), "mlp.gate_proj"),
            "ffn_up": (_matrix(rng, ff, HIDDEN), "mlp.up_proj"),
            "ffn_down": (_matrix(rng, HIDDEN, ff), "mlp.down_proj"),
            "post_ffw_norm": (_vector(rng, HIDDEN, offset=1.0), "post_feedforward_layernorm"),
        }
        for name, (array, hf) in layer.items():
            weights[f"blk.{i}.{name}.weight"] = array
            names[f"blk.{i}.{name}.weight"] = f"model.layers.{i}.{hf}.weight"
    # the output matrix is tied to the embeddings in both runtimes (no output.weight, no lm_head)
    norm_minus_one = {name: (lambda a: a - np.float32(1)) for name in weights if name.endswith("norm.weight")}
    metadata = [
        ("add_context_length", 4096), ("add_embedding_length", HIDDEN), ("add_block_count", layers),
        ("add_feed_forward_length", ff), ("add_head_count", heads), ("add_head_count_kv", kv_heads),
        ("add_key_length", head_dim), ("add_value_length", head_dim),
        ("add_rope_freq_base", 1_000_000.0), ("add_rope_freq_base_swa", 10_000.0),
        ("add_layer_norm_rms_eps", 1e-6), ("add_sliding_window", WINDOW), ("add_sliding_window_pattern", pattern),
    ]
    config = {
        "model_type": "gemma3_text", "hidden_size": HIDDEN, "num_hidden_layers": layers, "intermediate_size": ff,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": head_dim,
        "sliding_window": WINDOW, "sliding_window_pattern": pattern, "max_position_embeddings": 4096,
    }
    return _Spec("gemma3", metadata, weights, names, config, WINDOW, swa, (False,) * layers, norm_minus_one)


def _mamba(rng, vocab: int) -> _Spec:
    """Mamba (v1): 2 layers, d_inner 128 (llama.cpp supports only an expansion of 2), d_state 16,
    d_conv 4, dt_rank 4. Per sequence and layer that is a conv state of 3 x 128 floats and an SSM
    state of 16 x 128 floats."""
    layers, d_inner, d_state, d_conv, dt_rank = 2, 2 * HIDDEN, 16, 4, 4
    weights = {"token_embd.weight": _matrix(rng, vocab, HIDDEN, 1.0), "output_norm.weight": _vector(rng, HIDDEN, offset=1.0)}
    names = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight"}
    to_hf = {}
    for i in range(layers):
        # A = -exp(A_log) with the usual S4D-real init (A_log = log 1..d_state) plus noise;
        # GGUF stores A itself (the converter's -exp), mlx-lm stores A_log
        a_log = (np.log(np.arange(1, d_state + 1, dtype=np.float32))[None, :]
                 + 0.1 * rng.standard_normal((d_inner, d_state))).astype(np.float32)
        # dt = softplus(dt_proj(...) + bias) around 0.01-0.1, as Mamba's init aims for
        dt_bias = np.log(np.expm1(np.exp(rng.uniform(np.log(1e-2), np.log(1e-1), d_inner)))).astype(np.float32)
        layer = {
            "attn_norm.weight": (_vector(rng, HIDDEN, offset=1.0), "norm.weight"),
            "ssm_in.weight": (_matrix(rng, 2 * d_inner, HIDDEN), "mixer.in_proj.weight"),
            # ggml {d_conv, d_inner}; mlx-lm's depthwise Conv1d weight is (d_inner, d_conv, 1)
            "ssm_conv1d.weight": (_matrix(rng, d_inner, d_conv), "mixer.conv1d.weight"),
            "ssm_conv1d.bias": (_vector(rng, d_inner), "mixer.conv1d.bias"),
            "ssm_x.weight": (_matrix(rng, dt_rank + 2 * d_state, d_inner), "mixer.x_proj.weight"),
            "ssm_dt.weight": (_matrix(rng, d_inner, dt_rank), "mixer.dt_proj.weight"),
            "ssm_dt.bias": (dt_bias, "mixer.dt_proj.bias"),
            "ssm_a": (-np.exp(a_log).astype(np.float32), "mixer.A_log"),
            "ssm_d": (_vector(rng, d_inner, offset=1.0), "mixer.D"),
            "ssm_out.weight": (_matrix(rng, HIDDEN, d_inner), "mixer.out_proj.weight"),
        }
        for name, (array, hf) in layer.items():
            weights[f"blk.{i}.{name}"] = array
            names[f"blk.{i}.{name}"] = f"backbone.layers.{i}.{hf}"
        to_hf[f"blk.{i}.ssm_conv1d.weight"] = lambda a: a[:, :, None]
        # recover A_log from the stored A rather than keeping a second copy: log(-A) rounds back to
        # within an ulp of A_log, and mlx-lm recomputes A = -exp(A_log) from it
        to_hf[f"blk.{i}.ssm_a"] = lambda a: np.log(-a).astype(np.float32)
    metadata = [
        ("add_context_length", 1 << 20), ("add_embedding_length", HIDDEN), ("add_block_count", layers),
        # what convert_hf_to_gguf.py writes for Mamba: no attention, no separate feed-forward
        ("add_feed_forward_length", 0), ("add_head_count", 0),
        ("add_ssm_conv_kernel", d_conv), ("add_ssm_inner_size", d_inner), ("add_ssm_state_size", d_state),
        ("add_ssm_time_step_rank", dt_rank), ("add_layer_norm_rms_eps", 1e-5),
    ]
    config = {
        "model_type": "mamba", "hidden_size": HIDDEN, "intermediate_size": d_inner, "state_size": d_state,
        "num_hidden_layers": layers, "conv_kernel": d_conv, "use_bias": False, "use_conv_bias": True,
        "time_step_rank": dt_rank, "tie_word_embeddings": True,
    }
    return _Spec("mamba", metadata, weights, names, config, None, (False,) * layers, (True,) * layers, to_hf)


def _lfm2(rng, vocab: int, window: int | None = None) -> _Spec:
    """LFM2: 3 layers, short conv / attention / short conv, conv kernel (L_cache) 3. llama.cpp tells
    the layers apart by a per-layer KV head count of 0; mlx-lm by `layer_types`."""
    layer_types = ["conv", "full_attention", "conv"]
    heads, kv_heads, ff, l_cache = 4, 2, 128, 3
    head_dim = HIDDEN // heads
    recurrent = tuple(t == "conv" for t in layer_types)
    weights = {"token_embd.weight": _matrix(rng, vocab, HIDDEN, 1.0),
               # LFM2's final norm is "embedding_norm" in HF and (a historical misname) token_embd_norm in GGUF
               "token_embd_norm.weight": _vector(rng, HIDDEN, offset=1.0)}
    names = {"token_embd.weight": "model.embed_tokens.weight", "token_embd_norm.weight": "model.embedding_norm.weight"}
    to_hf = {}
    for i, conv in enumerate(recurrent):
        layer = {
            "attn_norm.weight": (_vector(rng, HIDDEN, offset=1.0), "operator_norm.weight"),
            "ffn_norm.weight": (_vector(rng, HIDDEN, offset=1.0), "ffn_norm.weight"),
            "ffn_gate.weight": (_matrix(rng, ff, HIDDEN), "feed_forward.w1.weight"),
            "ffn_up.weight": (_matrix(rng, ff, HIDDEN), "feed_forward.w3.weight"),
            "ffn_down.weight": (_matrix(rng, HIDDEN, ff), "feed_forward.w2.weight"),
        }
        if conv:
            layer.update({
                "shortconv.in_proj.weight": (_matrix(rng, 3 * HIDDEN, HIDDEN), "conv.in_proj.weight"),
                # ggml {L_cache, n_embd}; mlx-lm's depthwise Conv1d weight is (n_embd, L_cache, 1)
                "shortconv.conv.weight": (_matrix(rng, HIDDEN, l_cache), "conv.conv.weight"),
                "shortconv.out_proj.weight": (_matrix(rng, HIDDEN, HIDDEN), "conv.out_proj.weight"),
            })
            to_hf[f"blk.{i}.shortconv.conv.weight"] = lambda a: a[:, :, None]
        else:
            layer.update({
                "attn_q.weight": (_matrix(rng, heads * head_dim, HIDDEN), "self_attn.q_proj.weight"),
                "attn_k.weight": (_matrix(rng, kv_heads * head_dim, HIDDEN), "self_attn.k_proj.weight"),
                "attn_v.weight": (_matrix(rng, kv_heads * head_dim, HIDDEN), "self_attn.v_proj.weight"),
                "attn_q_norm.weight": (_vector(rng, head_dim, offset=1.0), "self_attn.q_layernorm.weight"),
                "attn_k_norm.weight": (_vector(rng, head_dim, offset=1.0), "self_attn.k_layernorm.weight"),
                "attn_output.weight": (_matrix(rng, HIDDEN, heads * head_dim), "self_attn.out_proj.weight"),
            })
        for name, (array, hf) in layer.items():
            weights[f"blk.{i}.{name}"] = array
            names[f"blk.{i}.{name}"] = f"model.layers.{i}.{hf}"
    metadata = [
        ("add_context_length", 4096), ("add_embedding_length", HIDDEN), ("add_block_count", len(layer_types)),
        ("add_feed_forward_length", ff), ("add_head_count", heads),
        # a per-layer array: 0 KV heads marks a short-conv (recurrent) layer
        ("add_head_count_kv", [0 if conv else kv_heads for conv in recurrent]),
        ("add_rope_freq_base", 1_000_000.0), ("add_layer_norm_rms_eps", 1e-5), ("add_shortconv_l_cache", l_cache),
    ]
    config = {
        "model_type": "lfm2", "hidden_size": HIDDEN, "num_hidden_layers": len(layer_types),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 4096,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": l_cache, "block_dim": HIDDEN, "block_ff_dim": ff,
        "block_multiple_of": 1, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
        "rope_theta": 1_000_000.0, "layer_types": layer_types, "tie_word_embeddings": True,
    }
    swa = (False,) * len(layer_types)
    if window is not None:
        # llama.cpp's lfm2 makes every attention layer windowed once the GGUF has a sliding window
        metadata.append(("add_sliding_window", window))
        swa = tuple(not conv for conv in recurrent)
        config = None  # mlx-lm's lfm2 has no sliding window: it would run a different model
    return _Spec("lfm2", metadata, weights, names, config, window, swa, recurrent, to_hf)


def _lfm2_window(rng, vocab: int) -> _Spec:
    return _lfm2(rng, vocab, WINDOW)


# ----------------------------------------------------------------------------- writing


def _write_gguf(path: Path, spec: _Spec, tokenizer, vocab: list[str], kind: str) -> None:
    import gguf

    vocab_map = tokenizer.get_vocab()
    writer = gguf.GGUFWriter(str(path), spec.arch)
    writer.add_name(f"superfluid-memorykind-{kind}")
    for method, value in spec.metadata:
        getattr(writer, method)(value)
    writer.add_vocab_size(len(vocab))
    writer.add_file_type(0)  # all f32
    # the vocabulary exactly as tinymodels writes it, so every tiny model tokenizes alike
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab)
    writer.add_token_types([3 if token in tinymodels.SPECIALS else 1 for token in vocab])
    writer.add_token_merges([" ".join(pair) for pair in tinymodels._merges(tokenizer)])
    writer.add_bos_token_id(vocab_map["<|endoftext|>"])
    writer.add_eos_token_id(vocab_map["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tinymodels.CHATML)
    for name, array in spec.weights.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_mlx(directory: Path, spec: _Spec, tokenizer, vocab_size: int) -> None:
    import mlx.core as mx

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(spec.mlx_config, vocab_size=vocab_size)))
    tensors = {}
    for name, array in spec.weights.items():
        convert = spec.to_hf.get(name)
        tensors[spec.hf_names[name]] = mx.array(np.ascontiguousarray(convert(array) if convert else array))
    mx.save_safetensors(str(directory / "model.safetensors"), tensors)
    tinymodels._save_tokenizer(tokenizer, directory)
