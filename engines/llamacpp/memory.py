"""llama.cpp's memory kinds: which one a model gets, what its sequence state is made of, and
what a sequence of it costs.

llama.cpp gives each architecture a memory: a plain KV cache (`llama_kv_cache`), a sliding-window
pair (`llama_kv_cache_iswa`: a base cache for the full layers and a window cache written after
it), a recurrent state (`llama_memory_recurrent`, Mamba and RWKV), or both side by side
(`llama_memory_hybrid`, attention first then recurrent; `llama_memory_hybrid_iswa` with a
windowed attention pair). A few architectures get memories of their own (DeepSeek's sparse and
compressed caches, MiniMax's); those are refused by name until their state is walked here.
"""

from __future__ import annotations

from engines.base import Memory
from engines.errors import ModelLoadError
from engines.llamacpp import blob
from kvpool import pricing

# The parts of a sequence state, in the order llama.cpp writes them.
PARTS = {
    "kv": (blob.KV,),
    "iswa": (blob.KV, blob.KV),
    "recurrent": (blob.RECURRENT,),
    "hybrid": (blob.KV, blob.RECURRENT),
    "hybrid-iswa": (blob.KV, blob.KV, blob.RECURRENT),
}

# Architectures whose memory is none of the kinds above (llama.cpp 0.3.36's create_memory).
OWN_MEMORY = {
    "minimax-m3": "llama_kv_cache_msa",
    "glm-dsa": "llama_kv_cache_dsa",
    "deepseek32": "llama_kv_cache_dsa",
    "hy_v4": "llama_kv_cache_dsa",
    "dots3note": "llama_kv_cache_dsa_iswa",
    "deepseek4": "llama_kv_cache_dsv4",
    "glm5-next": "llama_memory_hybrid_idx",
}


def kind_of(arch: str, *, recurrent: bool, hybrid: bool, window: int) -> str:
    """The memory kind llama.cpp gives a model of `arch`; ModelLoadError for one this adapter
    cannot walk yet, named."""
    if arch in OWN_MEMORY:
        raise ModelLoadError(f"memory kind {OWN_MEMORY[arch]} (architecture {arch}) is not supported yet; "
                             f"superfluid's llama.cpp adapter handles {', '.join(PARTS)}")
    if recurrent:
        return "recurrent"
    if hybrid:
        return "hybrid-iswa" if window > 0 else "hybrid"
    return "iswa" if window > 0 else "kv"


def memory(kind: str, window: int, swa_full: bool) -> Memory:
    """The engine-neutral description the host plans with."""
    return Memory(kind, window if "iswa" in kind else 0, swa_full if "iswa" in kind else False)


def model_kv(template: blob.Template, window: int) -> pricing.ModelKV:
    """The exact price of a sequence, from the rows this engine writes: a full KV part costs its
    rows per token, a window part its rows per token up to the window, a recurrent part its
    rows once. (Rows are priced as bytes: llama.cpp already rounded them to its blocks.)"""
    layers = []
    for index, (k_rows, v_rows) in enumerate(template.kv_rows):
        windowed = index == 1 and window > 0
        for (_, k_row), (_, v_row) in zip(k_rows, v_rows):
            layers.append(pricing.LayerKV(1, k_row, v_row, "bytes", "bytes",
                                          pricing.Attention.WINDOW if windowed else pricing.Attention.FULL,
                                          window if windowed else 0))
    for _, rows in template.recurrent_rows:
        layers.append(pricing.LayerKV(0, 0, 0, "bytes", "bytes", pricing.Attention.NONE,
                                      fixed_bytes=sum(row for _, row in rows)))
    return pricing.ModelKV(tuple(layers))


def state_overhead(template: blob.Template, tokens: int, window: int) -> int:
    """Bytes of a state blob beyond its priced rows: headers and per-cell metadata."""
    total = 8 if template.header else 0
    for index, (k_rows, v_rows) in enumerate(template.kv_rows):
        cells = min(tokens, window) if index == 1 and window else tokens
        total += 8  # stream count, cell count
        if cells:
            total += cells * blob.CELL_META + 8 + 12 * (len(k_rows) + len(v_rows))  # v_trans, n_layer; each row header
    for _, rows in template.recurrent_rows:
        total += 4 + (blob.RECURRENT_CELL_META if tokens else 0) + 8 + 12 * len(rows)
    return total
