"""A GGUF file as an mlx-lm model: superfluid reads, renames and rebuilds.

Architectures (`general.architecture`, see ARCHITECTURES): llama onto mlx-lm's llama, gemma3
onto mlx-lm's gemma3_text; any other is refused by name. Each maps the GGUF tensor names to the
Hugging Face names its mlx-lm model expects and builds that model's config from the metadata:

- llama: `rope_traditional: true` (GGUF stores llama's Q and K permuted for interleaved RoPE).
- gemma3: NEOX RoPE in Hugging Face order (no permutation; mlx-lm's gemma3_text already uses
  traditional=False), sliding-window layers as llama.cpp sets them (window and pattern from the
  metadata, pattern 6 when absent), local RoPE base `rope.freq_base_swa` (10,000 when absent),
  query scale 1/sqrt(head_dim) (1/sqrt(n_embd/n_head) for the 62-layer 27B, as llama.cpp).
  The converter stores every RMS norm weight with Gemma's +1 already added; mlx-lm's Gemma norm
  adds it itself, so 1 is taken off at load. llama.cpp scales the embeddings by sqrt(n_embd) in
  float32; mlx-lm rounds that factor to bfloat16 (25.25 for 640 against 25.298), so the model is
  given its embeddings scaled by the ratio (GemmaFromGguf).

Weights: MLX reads F32, F16 and the Q4_0, Q4_1 and Q8_0 blocks natively (`mx.load`, quantized
ones in MLX's affine form: weight, scales, biases, groups of 32). A file with any other tensor
type (the K-quants of a Q4_K_M file) is read by this module: metadata and tensor table parsed
here, each tensor dequantized by the `gguf` package's own `gguf.quants.dequantize`, row block by
row block, into float32. Quantized weights are dequantized to float32 when the `dequantize`
option says so: MLX's quantized matmul does not use BLAS and is slow on a CPU (measured: a
2,000-token SmolLM2 prefill, 134 s 4-bit against 22 s float32). Kept quantized, a tensor MLX
cannot read is quantized again by MLX at 8 bits (affine, groups of 32; REQUANT_BITS): close to
the file's values, not identical to them.

The tokenizer is rebuilt from the GGUF vocabulary by engines.mlx.vocab.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from engines.errors import ModelLoadError
from engines.mlx import settings
from engines.mlx import vocab as vocabs
from kvpool import host_memory_available

GROUP = 32  # GGUF's block size, which MLX keeps as its group size
CONTROL = vocabs.CONTROL  # token type of special tokens in a GGUF vocabulary

# GGUF tensor name (per layer, after "blk.N.") -> Hugging Face name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GEMMA3_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# GGML types MLX's GGUF loader reads (ggml_type numbers): F32, F16, Q4_0, Q4_1, Q8_0
MLX_READS = frozenset({0, 1, 2, 3, 8})
F32, F16, BF16 = 0, 1, 30
# MLX's width for a tensor it cannot read, kept quantized: its affine groups do not fall on a
# K-quant's (or Q5_0's) grid, so at the file's own width a second rounding adds about 2/3 of the
# file's quantization error (measured on Q5_0); at 8 bits about 1/10, in 8.5 bits a weight
REQUANT_BITS = 8
ROWS_AT_ONCE = 4096  # rows dequantized per numpy call: bounds the temporaries of a 262,144-row embedding


# ----------------------------------------------------------------------------- reading GGUF

class NotGguf(ValueError):
    """The file is not a GGUF this reader understands."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGML order: dims[0] varies fastest
    kind: int  # ggml_type
    offset: int  # from the start of the data section

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))

    @property
    def size(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64))


@dataclass
class GgufFile:
    """A GGUF file's metadata (plain Python values) and tensor table, its data mapped."""

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int
    _map: Any = field(default=None, repr=False)

    @property
    def mlx_reads_all(self) -> bool:
        return all(info.kind in MLX_READS for info in self.tensors.values())

    def array(self, info: TensorInfo) -> np.ndarray:
        """The tensor as float32 (numpy), dequantized by the gguf package where it is quantized."""
        import gguf

        if self._map is None:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        start = self.data_start + info.offset
        if info.kind in (F32, F16, BF16):
            dtype = {F32: np.float32, F16: np.float16, BF16: np.uint16}[info.kind]
            raw = np.frombuffer(self._map, dtype, info.size, start).reshape(info.shape)
            if info.kind == BF16:
                return (raw.astype(np.uint32) << 16).view(np.float32)
            return raw.astype(np.float32)
        try:
            qtype = gguf.GGMLQuantizationType(info.kind)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelLoadError(f"GGUF tensor {info.name} has GGML type {info.kind}, which the gguf package does "
                                 "not know (use runtime llamacpp)") from None
        row_bytes = info.dims[0] // block * type_size
        rows = info.size // info.dims[0]
        raw = np.frombuffer(self._map, np.uint8, rows * row_bytes, start).reshape(rows, row_bytes)
        out = np.empty((rows, info.dims[0]), np.float32)
        try:
            for first in range(0, rows, ROWS_AT_ONCE):
                out[first:first + ROWS_AT_ONCE] = gguf.quants.dequantize(raw[first:first + ROWS_AT_ONCE], qtype)
        except NotImplementedError as exc:
            raise ModelLoadError(f"GGUF tensor {info.name} is {qtype.name}: {exc} (use runtime llamacpp)") from None
        return out.reshape(info.shape)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a numpy view still alive (an exception's frames): the collector unmaps it
                pass
            self._map = None


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


def read_gguf(path: Path) -> GgufFile:
    """Parse a little-endian GGUF (version 2 or 3): metadata and tensor table; NotGguf otherwise."""
    with open(path, "rb") as handle:
        try:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise NotGguf("empty file") from None
    try:
        return _parse(path, data)
    except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
        raise NotGguf(str(exc)) from None
    finally:
        data.close()


def _parse(path: Path, data) -> GgufFile:
    if data[:4] != b"GGUF":
        raise NotGguf("no GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise NotGguf(f"GGUF version {version}")
    pos = 24

    def string() -> str:
        nonlocal pos
        (length,) = struct.unpack_from("<Q", data, pos)
        text = bytes(data[pos + 8:pos + 8 + length]).decode("utf-8", errors="replace")
        pos += 8 + length
        return text

    def value(kind: int) -> Any:
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            (item, count) = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if item == 8:
                return [string() for _ in range(count)]
            if item in _NUMPY:
                array = np.frombuffer(data, _NUMPY[item], count, pos).copy()
                pos += array.nbytes
                return array.tolist()
            return [value(item) for _ in range(count)]
        (result,) = struct.unpack_from(_SCALARS[kind], data, pos)
        pos += struct.calcsize(_SCALARS[kind])
        return result

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", data, pos)
        pos += 4
        meta[key] = value(kind)
    tensors = {}
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
        kind, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors[name] = TensorInfo(name, tuple(dims), kind, offset)
    alignment = int(meta.get("general.alignment", 32))
    return GgufFile(path, meta, tensors, (pos + alignment - 1) // alignment * alignment)


# ----------------------------------------------------------------------------- architectures

def _number(meta: dict, key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata has no {key}")
    return value.item() if hasattr(value, "item") else value


def _llama_config(meta: dict, tensor_names) -> dict:
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
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }


def sliding_pattern(value: Any, layers: int) -> int:
    """mlx-lm's sliding_window_pattern n (layer i slides unless i % n == n - 1) from GGUF's
    attention.sliding_window_pattern: a number, or llama.cpp's per-layer flags when they follow
    that rule; anything else is refused."""
    value = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(value, list):
        return int(value)
    flags = [bool(v) for v in value][:layers]
    n = flags.index(False) + 1 if False in flags else 1
    if n == 1 and all(flags):
        raise ModelLoadError("GGUF marks every layer sliding-window; mlx-lm's gemma3_text needs global layers")
    if flags != [i % n != n - 1 for i in range(len(flags))]:
        raise ModelLoadError(f"GGUF sliding-window layers {flags} do not follow one every-n pattern, which is all "
                             "mlx-lm's gemma3_text can run (use runtime llamacpp)")
    return n


def _gemma3_config(meta: dict, tensor_names) -> dict:
    p = "gemma3."
    hidden = int(_number(meta, p + "embedding_length"))
    layers = int(_number(meta, p + "block_count"))
    heads = int(_number(meta, p + "attention.head_count"))
    head_dim = int(_number(meta, p + "attention.key_length", hidden // heads))
    if int(_number(meta, p + "attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError("GGUF gemma3 with keys and values of different widths: mlx-lm's gemma3_text has one")
    if int(_number(meta, p + "rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError("GGUF gemma3 with partial RoPE: mlx-lm's gemma3_text rotates whole heads")
    if float(_number(meta, p + "final_logit_softcapping", 0.0)):
        raise ModelLoadError("GGUF gemma3 with final logit soft-capping: mlx-lm's gemma3_text has none "
                             "(use runtime llamacpp)")
    window = int(_number(meta, p + "attention.sliding_window", 0))
    pattern = sliding_pattern(meta.get(p + "attention.sliding_window_pattern", 6), layers) if window > 0 else 1
    config = {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(_number(meta, p + "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_number(meta, p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_number(meta, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "rope_theta": float(_number(meta, p + "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": float(_number(meta, p + "rope.freq_base_swa", 10_000.0)),
        # llama.cpp: 1/sqrt(head_dim), but 1/sqrt(n_embd/n_head) for the 27B (62 layers)
        "query_pre_attn_scalar": float(hidden // heads if layers == 62 else head_dim),
        "sliding_window": window or int(_number(meta, p + "context_length", 32768)),
        "sliding_window_pattern": pattern,
        "max_position_embeddings": int(_number(meta, p + "context_length", 32768)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ModelLoadError(f"GGUF gemma3 RoPE scaling {scaling!r}: the MLX adapter maps linear only")
        config["rope_scaling"] = {"type": "linear", "factor": float(_number(meta, p + "rope.scaling.factor"))}
    return config


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture becomes an mlx-lm model."""

    layer_names: dict[str, str]
    config: Callable[[dict, Any], dict]
    norm_shift: float = 0.0  # taken off every "*norm.weight" (Gemma's converter adds 1)


ARCHITECTURES = {
    "llama": Architecture(LAYER_NAMES, _llama_config),
    "gemma3": Architecture(GEMMA3_LAYER_NAMES, _gemma3_config, norm_shift=1.0),
}


def architecture(meta: dict) -> tuple[str, Architecture]:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported by the MLX adapter yet; supported: "
                             f"{', '.join(ARCHITECTURES)} (use runtime llamacpp)")
    return arch, ARCHITECTURES[arch]


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor ("blk.3.attn_q.scales" -> "model.layers.3.self_attn.q_proj.scales")."""
    layer_names = ARCHITECTURES[arch].layer_names
    base, _, part = gguf_name.rpartition(".")
    if base in MODEL_NAMES:
        return f"{MODEL_NAMES[base]}.{part}"
    prefix, layer, name = (base.split(".", 2) + ["", ""])[:3]
    if prefix != "blk" or name not in layer_names:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not part of a {arch} model superfluid can map")
    return f"model.layers.{layer}.{layer_names[name]}.{part}"


def config_from(meta: dict, weights) -> dict:
    """An mlx-lm config from GGUF metadata (`weights`: the tensor names)."""
    _, arch = architecture(meta)
    return arch.config(meta, weights)


# ----------------------------------------------------------------------------- weights

def weights_from(mx, tensors: dict, dequantize: bool, arch: str = "llama") -> tuple[dict, dict[str, int]]:
    """HF-named weights from MLX-read tensors, and the bits of each module kept quantized (none
    when `dequantize`: then quantized weights come back as float32)."""
    out, bits_by_module = {}, {}
    for name, array in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.scales" in tensors:
            scales, biases = tensors[f"{base}.scales"], tensors[f"{base}.biases"]
            bits = array.shape[-1] * 32 // (scales.shape[-1] * GROUP)
            if dequantize:
                out[hf_name(name, arch)] = mx.dequantize(array, scales, biases, group_size=GROUP, bits=bits).astype(
                    mx.float32)
            else:
                module = hf_name(name, arch)[: -len(".weight")]
                bits_by_module[module] = bits
                out[f"{module}.weight"], out[f"{module}.scales"], out[f"{module}.biases"] = array, scales, biases
        else:
            out[hf_name(name, arch)] = array.astype(mx.float32) if array.dtype != mx.float32 else array
    return out, bits_by_module


def weights_read(mx, source: GgufFile, dequantize: bool, arch: str = "llama") -> tuple[dict, dict[str, int]]:
    """HF-named weights from a file MLX cannot read itself: each tensor dequantized to float32 by
    the gguf package; kept quantized (not `dequantize`), a quantized matrix is quantized again
    by MLX at its type's width."""
    out, bits_by_module = {}, {}
    for name, info in source.tensors.items():
        target = hf_name(name, arch)
        array = mx.array(source.array(info))
        quantized = info.kind not in (F32, F16, BF16)
        if not dequantize and quantized and len(info.dims) == 2 and info.dims[0] % GROUP == 0:
            module = target[: -len(".weight")]
            out[f"{module}.weight"], out[f"{module}.scales"], out[f"{module}.biases"] = mx.quantize(
                array, group_size=GROUP, bits=REQUANT_BITS)
            bits_by_module[module] = REQUANT_BITS
        else:
            out[target] = array
        mx.eval(list(out.values())[-3:])  # one tensor at a time: the numpy copy goes before the next
    return out, bits_by_module


def float32_bytes(tensors: dict) -> int:
    """Bytes the model's weights take once every quantized tensor is float32 (MLX-read tensors
    or a GgufFile's table)."""
    total = 0
    for name, array in tensors.items():
        if isinstance(array, TensorInfo):
            total += array.size * 4
            continue
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.scales" in tensors:
            bits = array.shape[-1] * 32 // (tensors[f"{base}.scales"].shape[-1] * GROUP)
            total += array.size * 32 // bits * 4
        else:
            total += array.size * 4
    return total


def _shift_norms(mx, weights: dict, shift: float) -> None:
    if shift:
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = weights[name].astype(mx.float32) - shift


@lru_cache(maxsize=1)
def _gemma3_class():
    import mlx.core as mx
    from mlx_lm.models import gemma3_text

    class GemmaFromGguf(gemma3_text.Model):
        """mlx-lm's gemma3_text with llama.cpp's embedding scale: mlx-lm multiplies by
        sqrt(hidden) rounded to bfloat16; this hands it embeddings pre-scaled by the ratio, so
        the product is sqrt(hidden) as llama.cpp (and Hugging Face in float32) computes it."""

        def __call__(self, inputs, cache=None, input_embeddings=None):
            if input_embeddings is None:
                exact = self.args.hidden_size ** 0.5
                rounded = mx.array(exact, mx.bfloat16).astype(mx.float32).item()
                embeddings = self.model.embed_tokens(inputs)
                input_embeddings = embeddings * mx.array(exact / rounded, embeddings.dtype)
            return super().__call__(inputs, cache, input_embeddings)

    return GemmaFromGguf


def _model(config: dict):
    if config["model_type"] == "gemma3_text":
        from mlx_lm.models import gemma3_text

        return _gemma3_class()(gemma3_text.ModelArgs.from_dict(config))
    from mlx_lm.models import llama

    return llama.Model(llama.ModelArgs.from_dict(config))


def tokenizer_from(meta: dict):
    """A Hugging Face fast tokenizer rebuilt from the GGUF vocabulary (engines.mlx.vocab)."""
    return vocabs.tokenizer_from(meta)


def load(path: Path, dequantize: str):
    """(model, config, HF tokenizer) from a GGUF file; `dequantize` is the option's value
    ("auto", "on" or "off", see settings.dequantize_decision)."""
    import mlx.core as mx
    import mlx.nn as nn

    try:
        source = read_gguf(path)
    except (NotGguf, OSError):
        source = None  # MLX's own reader has the last word (and the error message)
    read_here = source is not None and not source.mlx_reads_all
    if not read_here:
        try:
            tensors, meta = mx.load(str(path), return_metadata=True)
        except Exception as exc:  # MLX raises RuntimeError or ValueError for unreadable files
            raise ModelLoadError(f"MLX could not read {path} as GGUF: {exc}") from None
    else:
        tensors, meta = source.tensors, source.meta
    arch_name, arch = architecture(meta)
    config = arch.config(meta, tensors)
    tokenizer = tokenizer_from(meta)
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    as_float32 = settings.dequantize_decision(dequantize, on_cpu, float32_bytes(tensors), host_memory_available())
    if read_here:
        try:
            weights, bits = weights_read(mx, source, as_float32, arch_name)
        finally:
            source.close()
    else:
        weights, bits = weights_from(mx, tensors, as_float32, arch_name)
    _shift_norms(mx, weights, arch.norm_shift)
    model = _model(config)
    weights = model.sanitize(weights) if config["model_type"] == "gemma3_text" else weights
    if bits:  # each quantized module at its own width (a Q4_1 file keeps some tensors in Q8_0)
        nn.quantize(model, group_size=GROUP,
                    class_predicate=lambda name, module: {"group_size": GROUP, "bits": bits[name]} if name in bits
                    else False)
        config["quantization"] = {"group_size": GROUP, "bits": sorted(set(bits.values()))}
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model, config, tokenizer
