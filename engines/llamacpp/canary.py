"""The first multi-token batch of a model on a llama.cpp build runs in a child process.

A llama.cpp built for the wrong CPU does not fail politely: the native build segfaults on these
machines as soon as a quantized model sees a batch of more than one token. Run in-process, that
would kill the application; run here, in a child, it becomes a RuntimeUnavailable naming the
rebuild command. A passing result is remembered per build and model, so it costs one child
process per model, ever.

    python -m engines.llamacpp.canary MODEL.gguf     # what the child runs
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import xxhash

from engines import identity
from engines.errors import ModelLoadError, RuntimeUnavailable
from engines.llamacpp import library
from engines.models import cache_dir

CHILD_FLAG = "SUPERFLUID_LLAMACPP_CANARY_CHILD"  # set in the child: it runs the batch in-process
BAD_MODEL = 3  # the child's exit status when the file itself does not load


def build_fingerprint() -> str:
    """What identifies the installed llama.cpp build: its shared libraries' sizes and times."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise RuntimeUnavailable(f"llama.cpp runtime not installed: {library.INSTALL}")
    hasher = xxhash.xxh3_64()
    for path in sorted(Path(spec.origin).parent.rglob("*.so*")):
        info = path.stat()
        hasher.update(f"{path.name}:{info.st_size}:{info.st_mtime_ns};".encode())
    return hasher.hexdigest()


def passed_marker(model: Path) -> Path:
    """The file whose presence says this build ran this model's canary without fault."""
    key = xxhash.xxh3_64_hexdigest(f"{build_fingerprint()}:{identity.file_digest(model)}".encode())
    return cache_dir().parent / "canary" / f"llamacpp-{key}.passed"


def ensure(model: Path, command: Sequence[str] | None = None) -> None:
    """Run the canary for `model` in a child process unless it passed before (or we are that
    child). RuntimeUnavailable, with the rebuild command, if the child crashes or fails."""
    if os.environ.get(CHILD_FLAG) == "1":
        return
    marker = passed_marker(model)
    if marker.exists():
        return
    command = list(command or [sys.executable, "-m", "engines.llamacpp.canary", str(model)])
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, CHILD_FLAG: "1"})
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        raise RuntimeUnavailable(f"llama.cpp {library.installed_version()} crashed ({name}) on its first "
                                 f"multi-token batch of {model.name}: this build cannot run here. Rebuild it "
                                 f"portable: {library.INSTALL}")
    last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    if done.returncode == BAD_MODEL:  # the file, not the build: say so as a load error
        raise ModelLoadError(last)
    if done.returncode != 0:
        raise RuntimeUnavailable(f"llama.cpp failed its first multi-token batch of {model.name}: {last}")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def main(argv: Sequence[str]) -> int:
    """The child: load the model (which runs the multi-token batch and checks its logits)."""
    from engines.llamacpp.engine import LlamaCppEngine

    try:
        with LlamaCppEngine(argv[0], n_ctx=256, n_seq_max=1, threads=1, threads_batch=1):
            return 0
    except ModelLoadError as exc:
        print(exc, file=sys.stderr)
        return BAD_MODEL


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
