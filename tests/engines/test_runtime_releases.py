"""The adapters against the older runtime releases they support, each in its own environment.

scripts/setup builds `.venv-llamacpp-<version>` for each older llama-cpp-python release (its wheel
built once and cached) and `.venv-mlx-lm-<version>` for each older mlx-lm (the earlier cache
generation: `state` holds the live arrays, settings in `meta_state`). The adapters' tests run
there in a child pytest; none may skip.
"""

import subprocess
from pathlib import Path

import pytest

from engines import registry

ROOT = Path(__file__).resolve().parents[2]
SUITES = {
    "llamacpp": ["tests/engines/test_llamacpp.py", "tests/engines/test_llamacpp_support.py",
                 "tests/engines/test_llamacpp_real.py"],
    "mlx": ["tests/engines/test_mlx.py", "tests/engines/test_mlx_caches.py", "tests/engines/test_mlx_real.py"],
}
ENVIRONMENTS = {"llamacpp": ".venv-llamacpp-{}", "mlx": ".venv-mlx-lm-{}"}
OLDER = [(runtime, version) for runtime in SUITES for version in registry.get(runtime).tested_versions[1:]]


@pytest.mark.slow
@pytest.mark.parametrize("runtime, version", OLDER, ids=[f"{r}-{v}" for r, v in OLDER])
def test_the_adapter_suite_passes_under_an_older_release(runtime, version):
    python = ROOT / ENVIRONMENTS[runtime].format(version) / "bin" / "python"
    assert python.exists(), f"no environment for {registry.get(runtime).distribution} {version}: run scripts/setup"
    distribution = registry.get(runtime).distribution
    probe = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({distribution!r}))"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == version
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITES[runtime]], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, f"under {distribution} {version}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert " passed" in summary and "failed" not in summary and "error" not in summary
