"""llama.cpp's own `llama-server` (C++), the peer users of local models pick: built once from the
llama.cpp source vendored in the pinned llama-cpp-python release, with the portable flags.

    .venv/bin/python benchmarks/cpp_server.py     # build (once, about 10 minutes on 2 cores) and print its path

The build is kept in superfluid's cache, keyed by the release and the flags like the wheels
(`<cache>/llama-server/<release>-<flags digest>/llama-server`), so later runs and CI take it as
it is. It starts from llama-cpp-python's source archive, which scripts/setup keeps beside the
wheels (downloaded here if it is missing). The binary is linked statically: one file to keep.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines import models  # noqa: E402

# The same portability as the wheel's (the native build uses instructions these CPUs advertise
# but refuse), no network at build or run time (no curl, no OpenSSL, no prebuilt web UI fetched
# from a model hub), only the server, linked statically.
FLAGS = ("-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
         "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
         "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release")
PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


def release() -> str:
    """The llama-cpp-python release installed beside superfluid (its llama.cpp is the one built)."""
    import llama_cpp

    return llama_cpp.__version__


def binary_path(version: str | None = None) -> Path:
    """Where the build of `version` (default: the installed release) is kept."""
    digest = hashlib.sha256(" ".join(FLAGS).encode()).hexdigest()[:12]
    return models.cache_root() / "llama-server" / f"{version or release()}-{digest}" / "llama-server"


def source_archive(version: str, progress: Callable[[str], None]) -> Path:
    """llama-cpp-python's source archive of `version`, from the cache (scripts/setup keeps it) or
    downloaded from PyPI into it."""
    path = models.cache_root() / "sdists" / f"llama_cpp_python-{version}.tar.gz"
    if not path.is_file():
        progress(f"downloading llama-cpp-python {version}'s source")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                            "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={version}", "-d", scratch],
                           check=True)
            os.replace(Path(scratch) / path.name, path)
    return path


def find_or_build(progress: Callable[[str], None] = print, jobs: int | None = None) -> Path:
    """The path of llama-server for the installed release: the kept build, or a new one (its
    cmake progress reported through `progress` as "llama-server: building, N%")."""
    target = binary_path()
    if target.is_file():
        return target
    version = release()
    archive = source_archive(version, progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        source = Path(scratch) / "llama.cpp"
        progress(f"llama-server: unpacking llama.cpp from llama-cpp-python {version}")
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            for member in members:
                member.name = member.name[len(prefix):] or "."
            # only plain files and folders inside the target (Python's "data" filter where it has one)
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(source, members=members, **safe)
        cmake = _cmake()
        log = Path(scratch) / "build.log"
        build = Path(scratch) / "build"
        _run([cmake, "-S", str(source), "-B", str(build), *FLAGS], log, progress, "configuring")
        _run([cmake, "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)],
             log, progress, "building")
        partial = Path(scratch) / "llama-server"  # this build's own: concurrent builds never share it
        shutil.copy2(build / "bin" / "llama-server", partial)
        os.replace(partial, target)  # whole or absent: a build cut short leaves nothing behind
    progress(f"llama-server: built {target}")
    return target


def _cmake() -> str:
    """cmake on the PATH, or beside this Python (PyPI's cmake package); RuntimeError naming both."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError("llama-server: building it needs cmake: `apt-get install cmake`, or `pip install cmake` "
                           "into this environment")
    return found


def _run(command: list[str], log: Path, progress: Callable[[str], None], stage: str) -> None:
    """Run one build step, its output to `log`, reporting cmake's percentages; RuntimeError with
    the log's end when it fails."""
    progress(f"llama-server: {stage}")
    last = None
    with open(log, "a") as sink, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                  text=True) as process:
        for line in process.stdout:
            sink.write(line)
            found = PROGRESS.match(line)
            if found and found.group(1) != last:
                last = found.group(1)
                progress(f"llama-server: {stage}, {last}%")
    if process.returncode != 0:
        raise RuntimeError(f"llama-server: {' '.join(command[:3])} failed ({process.returncode}):\n"
                           f"{log.read_text()[-3000:]}")


if __name__ == "__main__":
    print(find_or_build())
