"""Finding and binding llama-cpp-python: which release is installed, and its memory functions.

llama.cpp renamed its KV memory functions twice (`llama_kv_cache_*`, then `llama_kv_self_*`,
now `llama_memory_*` on `llama_get_memory(ctx)`); each llama-cpp-python release binds only the
names of the llama.cpp it ships. The names are resolved here, once, at load; a release with none
of them is refused with its version named.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from engines.errors import RuntimeUnavailable
from engines.llamacpp import log
from engines.registry import RUNTIMES

DISTRIBUTION = RUNTIMES["llamacpp"].distribution
TESTED_VERSIONS = RUNTIMES["llamacpp"].tested_versions
# Built from source: the portable build. The native one uses AMX instructions these machines
# advertise but refuse, and crashes on quantized models with multi-token batches.
BUILD_FLAGS = "-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"
INSTALL = (f'CMAKE_ARGS="{BUILD_FLAGS}" pip install --no-cache-dir {DISTRIBUTION}=={TESTED_VERSIONS[0]}'
           " (or: superfluid's scripts/setup, which builds and caches the wheel)")

# (prefix of the memory functions, how to get the handle they take from a context)
_NAMINGS = (("llama_memory_", "llama_get_memory"), ("llama_kv_self_", None))


@dataclass(frozen=True)
class Memory:
    """The KV memory functions of the installed release, taking a context."""

    handle: Callable[[Any], Any]
    seq_rm: Callable[..., bool]
    seq_cp: Callable[..., None]
    seq_keep: Callable[..., None]
    seq_pos_min: Callable[..., int]
    seq_pos_max: Callable[..., int]
    clear: Callable[..., None]
    naming: str


@dataclass(frozen=True)
class Library:
    """The llama_cpp module and what superfluid resolved from it."""

    api: Any  # the llama_cpp.llama_cpp ctypes bindings
    version: str
    memory: Memory
    tested: bool


def installed_version() -> str | None:
    """The installed llama-cpp-python version, or None."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def resolve_memory(api: Any) -> Memory:
    """The memory functions under whichever names `api` binds; RuntimeUnavailable if none."""
    for prefix, handle_name in _NAMINGS:
        names = [prefix + name for name in ("seq_rm", "seq_cp", "seq_keep", "seq_pos_min", "seq_pos_max", "clear")]
        if all(hasattr(api, name) for name in names) and (handle_name is None or hasattr(api, handle_name)):
            handle = getattr(api, handle_name) if handle_name else (lambda ctx: ctx)
            return Memory(handle, *(getattr(api, name) for name in names), naming=prefix + "*")
    raise RuntimeUnavailable(f"{DISTRIBUTION} {installed_version()} binds neither llama_memory_* nor llama_kv_self_* "
                             f"functions; superfluid drives {', '.join(TESTED_VERSIONS)}: {INSTALL}")


@lru_cache(maxsize=1)
def load() -> Library:
    """Import llama-cpp-python and bind it (once per process)."""
    version = installed_version()
    if version is None:
        raise RuntimeUnavailable(f"llama.cpp runtime not installed: {INSTALL}")
    try:
        api = importlib.import_module("llama_cpp.llama_cpp")
    except (ImportError, OSError) as exc:
        raise RuntimeUnavailable(f"{DISTRIBUTION} {version} is installed but does not load ({exc}); "
                                 f"reinstall it: {INSTALL}") from None
    memory = resolve_memory(api)
    log.route(api)  # after the package's import, which installs llama-cpp-python's own callback
    api.llama_backend_init()
    return Library(api, version, memory, version in TESTED_VERSIONS)
