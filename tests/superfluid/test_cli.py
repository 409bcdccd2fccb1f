"""The `superfluid` command, run as a user runs it: a child process of this interpreter."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def superfluid(*args: str, prelude: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    code = f"{prelude}import sys; from superfluid.cli.main import main; sys.exit(main({list(args)!r}))"
    environment = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SUPERFLUID_BLAS_REEXEC")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**environment, **(env or {})})


def test_runtimes_reports_each_runtime_its_version_and_options():
    done = superfluid("runtimes", "--json")
    assert done.returncode == 0, done.stderr
    report = {entry["id"]: entry for entry in json.loads(done.stdout)}
    assert set(report) == {"llamacpp", "mlx"}
    assert report["llamacpp"]["installed_version"] == importlib.metadata.version("llama-cpp-python")
    assert report["mlx"]["installed_version"] == importlib.metadata.version("mlx-lm")
    assert all(entry["imports"] and entry["tested"] for entry in report.values())
    assert {"prefill_chunk", "kv_bits", "max_kv_size", "dequantize"} <= {o["name"] for o in report["mlx"]["options"]}
    assert report["mlx"]["blas"]["reason"] == "loaded before MLX" and "openblas" in report["mlx"]["blas"]["path"]
    text = superfluid("runtimes")
    assert text.returncode == 0 and "llamacpp: " in text.stdout and "BLAS: " in text.stdout


def test_the_command_reexecutes_itself_with_openblas_when_mlx_was_imported_first():
    done = superfluid("runtimes", "--json", prelude="import mlx.core; ")
    assert done.returncode == 0, done.stderr
    mlx = next(entry for entry in json.loads(done.stdout) if entry["id"] == "mlx")
    assert mlx["blas"]["reason"] == "preloaded by LD_PRELOAD" and "openblas" in mlx["blas"]["path"]
    # marked as re-executed already, it does not loop: it reports the slow BLAS instead
    marked = superfluid("runtimes", "--json", prelude="import mlx.core; ", env={"SUPERFLUID_BLAS_REEXEC": "1"})
    mlx = next(entry for entry in json.loads(marked.stdout) if entry["id"] == "mlx")
    assert mlx["blas"]["path"] is None and "MLX was imported before superfluid" in mlx["blas"]["reason"]


def test_usage_errors_exit_2():
    done = superfluid("runtimes", "--bogus")
    assert done.returncode == 2 and "unrecognized arguments: --bogus" in done.stderr


def test_runtime_options_versions_and_compat():
    done = superfluid("runtime", "options", "llamacpp", "--json")
    options = {o["name"]: o for o in json.loads(done.stdout)}
    assert done.returncode == 0 and options["n_ctx"]["default"] == 4096 and "cache_type_k" in options
    text = superfluid("runtime", "options", "mlx").stdout
    assert "--mlx-prefill-chunk (int, default 512)" in text
    versions = json.loads(superfluid("runtime", "versions", "mlx", "--json").stdout)
    assert versions["tested"] == ["0.32.2", "0.31.3"] and versions["installed"] == importlib.metadata.version("mlx-lm")
    report = json.loads(superfluid("compat", "--json").stdout)
    assert report["runtimes"]["llamacpp"]["build"]["CMAKE_ARGS"] == "-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"
    assert report["runtimes"]["llamacpp"]["installed"] == importlib.metadata.version("llama-cpp-python")


def test_runtime_install_takes_tested_versions_with_portable_flags_and_refuses_others():
    refused = superfluid("runtime", "install", "llamacpp", "--version", "0.3.2")
    assert refused.returncode == 2 and "was not tested by this release" in refused.stderr and "--untested" in refused.stderr
    planned = superfluid("runtime", "install", "llamacpp", "--dry-run")
    assert planned.returncode == 0
    assert "CMAKE_ARGS='-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF'" in planned.stdout and "llama-cpp-python==0.3.36" in planned.stdout
    untested = superfluid("runtime", "install", "llamacpp", "--version", "0.3.2", "--untested", "--dry-run")
    assert untested.returncode == 0 and "llama-cpp-python==0.3.2" in untested.stdout
    installed = superfluid("runtime", "install", "llamacpp")  # already there: pip has nothing to build
    assert installed.returncode == 0, installed.stderr
    unknown = superfluid("runtime", "versions", "nope")
    assert unknown.returncode == 2 and "unknown runtime 'nope'" in unknown.stderr
