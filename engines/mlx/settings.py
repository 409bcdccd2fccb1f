"""MLX's options, declared and validated before a model loads."""

from __future__ import annotations

from typing import Any

from engines.options import OptionSpec, validate

OPTIONS = (
    OptionSpec("prefill_chunk", "int", 512, "most tokens one forward takes while prefilling", minimum=1,
               maximum=1 << 16),
    OptionSpec("max_sequences", "int", 16, "sequences alive at once", minimum=1, maximum=4096),
    OptionSpec("cache_limit_mb", "int", 0, "MLX's buffer cache limit in MiB while the engine lives "
               "(0 = leave MLX's own); restored on close", minimum=0),
    OptionSpec("dequantize", "bool", True, "load a quantized GGUF's weights as float32 (MLX's quantized "
               "matmul does not use BLAS: on a CPU, float32 with a fast BLAS is several times faster)"),
)

# What changes the meaning of KV bytes (the model's dtype and files are folded in separately).
IDENTITY_OPTIONS: tuple[str, ...] = ("dequantize",)


def check(values: dict[str, Any]) -> dict[str, Any]:
    """Every option with its typed value; OptionError names the first bad one."""
    return validate("mlx", OPTIONS, values)
