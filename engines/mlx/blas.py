"""A fast BLAS for MLX on a Linux CPU, loaded before MLX is.

The mlx-cpu wheel links a reference BLAS (~3 GFLOP/s on a 1024x1024 matmul here); libmlx
resolves `cblas_sgemm` when it loads, so an OpenBLAS loaded first with RTLD_GLOBAL serves it
instead (~120 GFLOP/s measured here, the same as LD_PRELOAD). This only works if it happens
before the first `import mlx.core` in the process: the MLX adapter calls `preload()` before it
imports MLX, and an application that imports MLX itself should call it first, or start Python
with LD_PRELOAD=<the path below>.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from functools import lru_cache

import msgspec

# Debian's libopenblas0-pthread (scripts/setup installs it), then whatever the linker knows.
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)


class BlasStatus(msgspec.Struct, frozen=True):
    """Which BLAS MLX got, and why."""

    path: str | None
    reason: str


def _candidates() -> list[str]:
    found = [path for path in CANDIDATES if os.path.exists(path)]
    named = ctypes.util.find_library("openblas")
    return found + ([named] if named else [])


@lru_cache(maxsize=1)
def preload() -> BlasStatus:
    """Load OpenBLAS globally if MLX is not loaded yet (once per process)."""
    if not sys.platform.startswith("linux"):
        return BlasStatus(None, "not Linux: MLX uses the platform's own BLAS")
    if "LD_PRELOAD" in os.environ and "openblas" in os.environ["LD_PRELOAD"]:
        return BlasStatus(os.environ["LD_PRELOAD"], "preloaded by LD_PRELOAD")
    if "mlx.core" in sys.modules:
        return BlasStatus(None, "MLX was imported before superfluid could load OpenBLAS: call "
                                "engines.mlx.blas.preload() before importing mlx, or set LD_PRELOAD")
    for path in _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return BlasStatus(path, "loaded before MLX")
    return BlasStatus(None, "no OpenBLAS found: install Debian's libopenblas0-pthread (scripts/setup does) "
                            "for matmuls dozens of times faster")


REEXEC_MARK = "SUPERFLUID_BLAS_REEXEC"  # set in a re-executed process, so it never loops


def preload_environment(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment a command should re-execute itself with so that OpenBLAS is preloaded,
    or None when no re-execution would help: MLX is not loaded yet (preload() still works), the
    preload is already there, this process is already the re-executed one, or there is no
    OpenBLAS to load."""
    environ = dict(os.environ if environ is None else environ)
    if not sys.platform.startswith("linux") or "mlx.core" not in sys.modules or REEXEC_MARK in environ:
        return None
    if "openblas" in environ.get("LD_PRELOAD", ""):
        return None
    found = _candidates()
    if not found:
        return None
    environ["LD_PRELOAD"] = ":".join(filter(None, [found[0], environ.get("LD_PRELOAD", "")]))
    environ[REEXEC_MARK] = "1"
    return environ
