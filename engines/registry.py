"""The runtimes superfluid can host, by id: an explicit map, no discovery by name.

Asking about a runtime never imports its library unless the adapter is wanted; `available()`
says for each whether its library is installed, which version, and whether that one was tested.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path

import msgspec

from engines.errors import RuntimeUnavailable


class Runtime(msgspec.Struct, frozen=True):
    """A runtime superfluid has an adapter for."""

    id: str
    adapter: str  # "module:Class", imported on demand
    distribution: str  # the PyPI distribution of its library
    tested_versions: tuple[str, ...]
    model_kind: str  # what it loads
    modules: tuple[str, ...] = ()  # what importing its library means


class RuntimeStatus(msgspec.Struct, frozen=True):
    """Whether a runtime can be used here."""

    id: str
    installed_version: str | None
    tested_versions: tuple[str, ...]
    tested: bool


RUNTIMES: dict[str, Runtime] = {
    # Newest first; the first is what scripts/setup installs, the others CI also tests.
    "llamacpp": Runtime("llamacpp", "engines.llamacpp.engine:LlamaCppEngine", "llama-cpp-python",
                        ("0.3.36", "0.3.16"), "a GGUF file", ("llama_cpp",)),
    "mlx": Runtime("mlx", "engines.mlx.engine:MlxEngine", "mlx-lm", ("0.32.2", "0.31.3"),
                   "an mlx-lm model directory (or a llama GGUF file, asked for by name)", ("mlx.core", "mlx_lm")),
}


def get(runtime_id: str) -> Runtime:
    """The runtime of that id; RuntimeUnavailable names the known ones otherwise."""
    try:
        return RUNTIMES[runtime_id]
    except KeyError:
        raise RuntimeUnavailable(f"unknown runtime {runtime_id!r}; superfluid hosts {', '.join(RUNTIMES)}") from None


def adapter(runtime_id: str) -> type:
    """The adapter class of a runtime (its module imported now)."""
    module_name, class_name = get(runtime_id).adapter.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def status(runtime_id: str) -> RuntimeStatus:
    """The installed version of a runtime's library, without importing it."""
    runtime = get(runtime_id)
    try:
        version = importlib.metadata.version(runtime.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return RuntimeStatus(runtime.id, version, runtime.tested_versions, version in runtime.tested_versions)


def runtime_for(model: str | Path) -> str:
    """The runtime a model path calls for: a .gguf file is llama.cpp's, a directory with a
    config.json is mlx-lm's."""
    path = Path(model)
    if path.suffix.lower() == ".gguf":
        return "llamacpp"
    if path.is_dir() and (path / "config.json").is_file():
        return "mlx"
    raise RuntimeUnavailable(f"no runtime loads {path} (superfluid hosts {', '.join(RUNTIMES)}: "
                             + "; ".join(f"{r.id} loads {r.model_kind}" for r in RUNTIMES.values()) + ")")
