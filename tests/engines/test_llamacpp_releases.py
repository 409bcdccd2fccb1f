"""The llama.cpp adapter against the older llama-cpp-python releases it supports.

scripts/setup builds each older tested release's wheel (cached like the current one) into its
own environment, `.venv-llamacpp-<version>`; the adapter's tests run there in a child pytest.
"""

import subprocess
from pathlib import Path

import pytest

from engines.llamacpp import library

ROOT = Path(__file__).resolve().parents[2]
SUITE = ["tests/engines/test_llamacpp.py", "tests/engines/test_llamacpp_support.py",
         "tests/engines/test_llamacpp_real.py"]


@pytest.mark.slow
@pytest.mark.parametrize("version", library.TESTED_VERSIONS[1:])
def test_the_adapter_suite_passes_under_an_older_release(version):
    python = ROOT / f".venv-llamacpp-{version}" / "bin" / "python"
    assert python.exists(), f"no environment for llama-cpp-python {version}: run scripts/setup"
    probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('llama-cpp-python'))"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == version
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITE], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, f"under llama-cpp-python {version}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert " passed" in summary and "failed" not in summary and "error" not in summary
