"""llama.cpp's options: declared, validated, and turned into the library's parameter structs.

Every option that changes what the KV cache means or how a state blob is laid out (RoPE and
YaRN, cache types, flash attention, n_seq_max, swa_full) is folded into the engine's identity,
so state written under one setting is refused under another before llama.cpp sees it.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from engines.errors import OptionError, RuntimeUnavailable
from engines.llamacpp.library import INSTALL
from engines.options import OptionSpec, validate
from kvpool import describe_bytes

CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
ROPE_SCALING = {"unspecified": -1, "none": 0, "linear": 1, "yarn": 2, "longrope": 3}
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}

OPTIONS = (
    OptionSpec("threads", "int", min(4, os.cpu_count() or 1), "threads for decode steps", minimum=1, maximum=512),
    OptionSpec("threads_batch", "int", min(4, os.cpu_count() or 1), "threads for prefill", minimum=1, maximum=512),
    OptionSpec("batch_size", "int", 512, "most tokens one step submits (n_batch)", minimum=1, maximum=1 << 20),
    OptionSpec("ubatch_size", "int", 512, "most tokens one physical batch computes (n_ubatch)", minimum=1,
               maximum=1 << 20),
    OptionSpec("n_ctx", "int", 4096, "KV cells shared by all sequences; 0 = the model's training context; "
               "-1 = as many as an eighth of the memory available holds at the model's cell price, at most "
               "n_seq_max times the training context", minimum=-1, maximum=1 << 24),
    OptionSpec("n_seq_max", "int", 8, "sequences alive at once", minimum=1, maximum=256),
    OptionSpec("n_gpu_layers", "int", 0, "layers offloaded to a GPU (0 = CPU only, -1 = all)", minimum=-1),
    OptionSpec("main_gpu", "int", 0, "the GPU that holds the model when split_mode is none", minimum=0),
    OptionSpec("split_mode", "choice", "layer", "how layers spread over GPUs", choices=tuple(SPLIT_MODES)),
    OptionSpec("tensor_split", "floats", None, "share of the model per GPU, comma-separated"),
    OptionSpec("flash_attn", "bool", False, "flash attention (needed for a quantized V cache)"),
    OptionSpec("cache_type_k", "choice", "f16", "storage type of the K cache", choices=tuple(CACHE_TYPES)),
    OptionSpec("cache_type_v", "choice", "f16", "storage type of the V cache", choices=tuple(CACHE_TYPES)),
    OptionSpec("kv_offload", "bool", True, "keep the KV cache on the GPU when layers are offloaded"),
    OptionSpec("op_offload", "bool", True, "offload host tensor operations to the device"),
    OptionSpec("swa_full", "bool", False, "full-size cache for sliding-window layers"),
    OptionSpec("rope_scaling_type", "choice", "unspecified", "RoPE scaling", choices=tuple(ROPE_SCALING)),
    OptionSpec("rope_freq_base", "float", 0.0, "RoPE base frequency (0 = the model's)", minimum=0),
    OptionSpec("rope_freq_scale", "float", 0.0, "RoPE frequency scale (0 = the model's)", minimum=0),
    OptionSpec("yarn_ext_factor", "float", -1.0, "YaRN extrapolation mix (negative = the model's)"),
    OptionSpec("yarn_attn_factor", "float", 1.0, "YaRN magnitude scale", minimum=0),
    OptionSpec("yarn_beta_fast", "float", 32.0, "YaRN low correction dimension", minimum=0),
    OptionSpec("yarn_beta_slow", "float", 1.0, "YaRN high correction dimension", minimum=0),
    OptionSpec("yarn_orig_ctx", "int", 0, "YaRN original context (0 = the model's)", minimum=0),
)

# What changes the meaning of KV bytes or the layout of a state blob.
IDENTITY_OPTIONS = ("cache_type_k", "cache_type_v", "flash_attn", "n_seq_max", "swa_full", "rope_scaling_type",
                    "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast",
                    "yarn_beta_slow", "yarn_orig_ctx")


def _combinations(values: dict[str, Any]) -> None:
    quantized_v = values["cache_type_v"] not in ("f32", "f16", "bf16")
    if quantized_v and not values["flash_attn"]:
        raise OptionError(f"llamacpp: a quantized V cache (cache_type_v={values['cache_type_v']}) needs flash "
                          "attention; set flash_attn=true, or cache_type_v=f16")
    if values["ubatch_size"] > values["batch_size"]:
        raise OptionError(f"llamacpp: ubatch_size {values['ubatch_size']} exceeds batch_size {values['batch_size']}; "
                          "lower ubatch_size")
    if values["tensor_split"] is not None and (not values["tensor_split"] or min(values["tensor_split"]) < 0):
        raise OptionError("llamacpp: tensor_split takes non-negative shares, one per GPU, e.g. 3,1")


def check(values: dict[str, Any]) -> dict[str, Any]:
    """Every option with its typed value; OptionError names the first bad one."""
    return validate("llamacpp", OPTIONS, values, _combinations)


def model_params(api: Any, values: dict[str, Any]) -> tuple[Any, Any]:
    """llama_model_params for `values`, and what must stay alive with it (the split array)."""
    params = api.llama_model_default_params()
    params.n_gpu_layers = values["n_gpu_layers"]
    params.main_gpu = values["main_gpu"]
    params.split_mode = SPLIT_MODES[values["split_mode"]]
    keep = None
    if values["tensor_split"] is not None:
        keep = (ctypes.c_float * len(values["tensor_split"]))(*values["tensor_split"])
        params.tensor_split = keep
    return params, keep


# llama_context_params field -> the option that sets it as it is
_CONTEXT_FIELDS = {
    "n_batch": "batch_size", "n_ubatch": "ubatch_size", "n_seq_max": "n_seq_max", "n_threads": "threads",
    "n_threads_batch": "threads_batch", "offload_kqv": "kv_offload", "rope_freq_base": "rope_freq_base",
    "rope_freq_scale": "rope_freq_scale", "yarn_ext_factor": "yarn_ext_factor", "yarn_attn_factor": "yarn_attn_factor",
    "yarn_beta_fast": "yarn_beta_fast", "yarn_beta_slow": "yarn_beta_slow", "yarn_orig_ctx": "yarn_orig_ctx",
}
_OPTIONAL_CONTEXT_FIELDS = {"op_offload": "op_offload", "swa_full": "swa_full"}  # not in every release


def _fields(params: Any) -> set[str]:
    return {field[0] for field in type(params)._fields_}


def context_params(api: Any, values: dict[str, Any], n_ctx: int, version: str) -> Any:
    """llama_context_params for `values`: several sequences in one unified KV cache. Fields
    differ between releases; a missing one the engine needs is refused with the version."""
    params = api.llama_context_default_params()
    fields = _fields(params)
    if "kv_unified" not in fields:
        raise RuntimeUnavailable(f"llama-cpp-python {version} cannot hold several sequences in one unified KV cache "
                                 f"(no kv_unified), which superfluid needs for forks; {INSTALL}")
    if values["swa_full"] and "swa_full" not in fields:
        raise OptionError(f"llamacpp: llama-cpp-python {version} has no swa_full; leave it false")
    params.n_ctx = n_ctx
    for field, option in _CONTEXT_FIELDS.items():
        setattr(params, field, values[option])
    for field, option in _OPTIONAL_CONTEXT_FIELDS.items():
        if field in fields:
            setattr(params, field, values[option])
    # One cache for every sequence: a fork tags cells instead of copying a stream, and n_ctx is
    # one budget. Without it a partial cross-stream seq_cp aborts the process (a GGML_ASSERT).
    params.kv_unified = True
    if "flash_attn_type" in fields:  # newer releases: an enum with "auto"; never auto here
        params.flash_attn_type = 1 if values["flash_attn"] else 0
    else:
        params.flash_attn = values["flash_attn"]
    params.type_k = CACHE_TYPES[values["cache_type_k"]]
    params.type_v = CACHE_TYPES[values["cache_type_v"]]
    params.rope_scaling_type = ROPE_SCALING[values["rope_scaling_type"]]
    params.no_perf = True
    return params


AUTO_MEMORY_FRACTION = 8  # n_ctx = -1 gives the KV cache at most 1/8 of the memory available


def context_cells(n_ctx: int, trained: int, n_seq_max: int, cell_price: int, available: int) -> tuple[int, str]:
    """The cells of the unified KV cache and why they are that many: `n_ctx` as given, the
    training context for 0, and for -1 what an eighth of the `available` memory holds at
    `cell_price` bytes per cell, at most `n_seq_max` sessions of the training context (cells
    nobody uses cost memory, not time: each forward reads only up to the highest cell in use)."""
    if n_ctx > 0:
        return n_ctx, f"n_ctx={n_ctx}, as given"
    if n_ctx == 0:
        return trained, "the model's training context (n_ctx=0)"
    by_memory = available // AUTO_MEMORY_FRACTION // max(cell_price, 1)
    memory = f"an eighth of the {describe_bytes(available)} of memory available"
    if by_memory < 256:
        return 256, f"the fewest cells a context is given: {memory} holds only {by_memory:,} (n_ctx=-1)"
    if trained <= 0 or by_memory < n_seq_max * trained:  # (a model that names no training context: memory alone)
        return by_memory // 256 * 256, f"what {memory} holds at {cell_price:,} bytes a cell (n_ctx=-1)"
    cells = n_seq_max * trained // 256 * 256
    return max(cells, 256), (f"{n_seq_max} sequences at once (n_seq_max) at the model's training context of "
                             f"{trained:,} tokens; {memory} would hold {by_memory:,} (n_ctx=-1)")
