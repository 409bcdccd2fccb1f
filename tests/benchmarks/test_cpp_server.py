"""benchmarks/cpp_server.py: llama.cpp's llama-server, built once from the vendored source and kept."""

import subprocess

import pytest

from benchmarks import cpp_server


def test_the_build_is_kept_by_release_and_flags():
    path = cpp_server.binary_path("0.3.36")
    assert path.name == "llama-server" and path.parent.name.startswith("0.3.36-")
    assert cpp_server.binary_path("0.3.35") != path  # another release is another build
    assert cpp_server.binary_path().parent.name.startswith(cpp_server.release())


@pytest.mark.slow
def test_llama_server_is_built_or_found_and_runs():
    """Builds it on first use (about 10 minutes on 2 cores; CI keeps the cache), else finds it."""
    steps = []
    path = cpp_server.find_or_build(progress=steps.append)
    assert path == cpp_server.binary_path() and path.is_file()
    assert not steps or steps[-1].startswith("llama-server: built")  # a build says where it put it
    done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "version" in (done.stdout + done.stderr).lower()
