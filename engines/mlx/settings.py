"""MLX's options, declared and validated before a model loads, and the dequantize decision."""

from __future__ import annotations

from typing import Any

from engines.errors import ModelLoadError, OptionError
from engines.options import OptionSpec, validate
from kvpool import describe_bytes, host_memory_available

OPTIONS = (
    OptionSpec("prefill_chunk", "int", 512, "most tokens one forward takes while prefilling", minimum=1,
               maximum=1 << 16),
    OptionSpec("max_sequences", "int", 16, "sequences alive at once", minimum=1, maximum=4096),
    OptionSpec("cache_limit_mb", "int", 1024, "MiB of freed buffers MLX keeps for reuse while the engine "
               "lives (an import into a reused buffer skips the page faults of fresh memory, which cost more "
               "than the copy); emptied after a prefill once more than half full of its temporaries; "
               "0 = MLX's own (32 MiB on a Linux CPU); restored on close", minimum=0),
    OptionSpec("max_kv_size", "int", 0, "keep at most this many tokens of KV per sequence in a rotating "
               "cache (the first 4 always kept); 0 = keep every token", minimum=0),
    OptionSpec("kv_bits", "int", 0, "quantize the KV cache to this many bits (2, 3, 4, 5, 6 or 8); "
               "0 = the model's dtype", minimum=0, maximum=8),
    OptionSpec("kv_group_size", "int", 64, "values per quantization group of the KV cache: 32, 64 or 128 "
               "(the head dimension must be a multiple)", minimum=32, maximum=128),
    OptionSpec("kv_cells", "int", 0, "KV cells (token positions) every sequence together may hold in MLX's "
               "memory; the host admits work within them and parks the rest in the pool. 0 = a quarter of the "
               "memory available at load, by the cell price", minimum=0),
    OptionSpec("dequantize", "choice", "auto", "load a quantized GGUF's weights as float32: MLX's quantized "
               "matmul does not use BLAS, so on a CPU float32 with a fast BLAS is several times faster. "
               "auto = on where MLX runs on the CPU and float32 weights fit the memory available with room "
               "to spare", choices=("auto", "on", "off")),
)

# What changes the meaning of KV bytes (the model's dtype and files are folded in separately).
IDENTITY_OPTIONS: tuple[str, ...] = ("max_kv_size", "kv_bits", "kv_group_size")
KV_BITS = (0, 2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
SPARE_FRACTION = 0.5  # float32 weights may take at most this share of the memory available
KV_MEMORY_FRACTION = 0.25  # the share of available memory MLX's KV caches may grow into by default


def _combinations(values: dict[str, Any]) -> None:
    if values["kv_bits"] not in KV_BITS:
        raise OptionError(f"mlx option kv_bits={values['kv_bits']}: MLX quantizes to "
                          f"{', '.join(map(str, KV_BITS[1:]))} bits (0 = off)")
    if values["kv_bits"] and values["max_kv_size"]:
        raise OptionError("mlx options kv_bits and max_kv_size cannot be combined: mlx-lm has no quantized "
                          "rotating cache; drop one of them")
    if values["kv_group_size"] not in KV_GROUP_SIZES:
        raise OptionError(f"mlx option kv_group_size={values['kv_group_size']}: MLX quantizes in groups of "
                          f"{', '.join(map(str, KV_GROUP_SIZES))}")


def check(values: dict[str, Any]) -> dict[str, Any]:
    """Every option with its typed value; OptionError names the first bad one."""
    return validate("mlx", OPTIONS, values, _combinations)


def dequantize_decision(requested: str, on_cpu: bool, float32_bytes: int, available: int) -> bool:
    """Whether to load quantized weights as float32: `requested` "on" or "off" is obeyed (on
    refused with the figures when the weights would not fit with room to spare); "auto" is on
    exactly where MLX runs on the CPU and they fit."""
    fits = float32_bytes <= available * SPARE_FRACTION
    if requested == "off":
        return False
    if requested == "on":
        if not fits:
            raise ModelLoadError(
                f"dequantizing to float32 needs {float32_bytes / 2**30:.2f} GiB and only "
                f"{available / 2**30:.2f} GiB of memory is available (float32 weights may take at most "
                f"{SPARE_FRACTION:.0%} of it); pass dequantize=off to run the quantized weights, or free memory")
        return True
    return on_cpu and fits


def kv_cells(values: dict[str, Any], cell_price: int, context: int) -> tuple[int, str]:
    """The cells MLX's caches may hold, all sequences together, and why they are that many: the
    kv_cells option, or a quarter of the memory available by the cell price; never more than
    every sequence can use."""
    most = values["max_sequences"] * context if context else 0
    sequences = (f"{values['max_sequences']} sequences at once (max_sequences) at the model's context of "
                 f"{context:,} tokens")
    if values["kv_cells"]:
        given = f"kv_cells={values['kv_cells']}"
        if most and values["kv_cells"] > most:
            return most, f"{sequences}: every cell they can use ({given} is more)"
        return values["kv_cells"], f"{given}, as given"
    available = host_memory_available()
    cells = int(KV_MEMORY_FRACTION * available) // max(cell_price, 1)
    memory = f"a quarter of the {describe_bytes(available)} of memory available"
    if most and cells > most:
        return most, f"{sequences}; {memory} would hold {cells:,} (kv_cells=0)"
    return cells, f"what {memory} holds at {cell_price:,} bytes a cell (kv_cells=0)"


def model_dtype(mx, model):
    """The dtype of the model's first floating-point parameter (float32 where it has none): part
    of the engine's identity, since KV computed at another precision differs."""
    for _, array in _leaves(model.parameters()):
        if array.dtype in (mx.float32, mx.float16, mx.bfloat16):
            return array.dtype
    return mx.float32


def _leaves(tree, prefix=""):
    """(dotted name, array) of every leaf of mlx's nested parameter dicts and lists."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}{index}.")
    else:
        yield prefix, tree
