"""`superfluid serve` as people drive it: --version, --flag=value, sizes with units, flags from the
environment, runtime options in --help, one-line failures with their exit codes (checked before
the model loads where they can be), and a log line per request."""

import argparse
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from kvpool import segment
from superfluid.cli import serve as serve_cli
from superfluid.cli.serve import size
from tests.conftest import remove_segment, unique_pool_name
from tests.superfluid.served import ROOT, Served


def serve(*args: str, env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SUPERFLUID_") or k == "SUPERFLUID_CACHE"}
    return subprocess.run([sys.executable, "-m", "superfluid", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**environment, **(env or {})})


def one_line(done: subprocess.CompletedProcess) -> str:
    """The failure's message: one line of ours on stderr (llama.cpp may log its own), no traceback."""
    lines = [line for line in done.stderr.splitlines() if line.startswith("superfluid")]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    server = Served(tiny_models["f32"].gguf, tmp_path_factory.mktemp("served-cli"))
    yield server
    assert server.stop() == 0


def test_sizes_take_binary_units():
    assert size("536870912") == 512 << 20
    assert size("512M") == size("512MiB") == size("512mb") == 512 << 20
    assert size("2G") == 2 << 30 and size("1.5GiB") == 3 << 29 and size("64K") == 64 << 10 and size("10B") == 10
    for bad in ("12Q", "", "M", "-1G", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            size(bad)


def test_version_and_help_list_every_runtime_option():
    version = serve("--version")
    assert version.returncode == 0 and re.match(r"superfluid \d+\.\d+\.\d+ \(llama-cpp-python ", version.stdout)
    helped = serve("serve", "--help")
    assert helped.returncode == 0
    for flag in ("--llamacpp-n-ctx", "--llamacpp-cache-type-k", "--mlx-kv-bits", "--mlx-dequantize", "--log-level"):
        assert flag in helped.stdout
    assert "KV cells shared by all sequences" in helped.stdout  # the declaration's own help
    assert "$SUPERFLUID_POOL_BYTES" in helped.stdout and "$SUPERFLUID_LLAMACPP_THREADS" in helped.stdout


def test_flag_values_from_the_environment_are_parsed_as_flags_are(tiny_models):
    model = str(tiny_models["f32"].gguf)
    done = serve("serve", model, env={"SUPERFLUID_PORT": "nope"})
    assert done.returncode == 2 and "--port" in done.stderr and "'nope'" in done.stderr
    done = serve("serve", model, env={"SUPERFLUID_LLAMACPP_N_CTX": "many"})
    assert done.returncode == 2 and "n_ctx" in one_line(done)
    done = serve("serve", model, "--pool-bytes", "lots")
    assert done.returncode == 2 and "'lots' is not a size" in done.stderr


def test_a_taken_port_is_found_before_the_model_loads(tiny_models, tmp_path):
    pool = unique_pool_name()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        try:
            done = serve("serve", str(tiny_models["f32"].gguf), "--port", str(taken.getsockname()[1]),
                         "--pool-name", pool, "--log-dir", str(tmp_path / "log"))
            assert pool not in segment.list_pool_names()  # nothing was loaded or created: the port came first
        finally:
            remove_segment(pool)
    assert done.returncode == 1 and "cannot listen" in one_line(done) and "--port" in one_line(done)


def test_a_second_server_on_a_busy_log_or_pool_says_so_in_one_line(served, tiny_models, tmp_path):
    model = str(tiny_models["f32"].gguf)
    same_log = serve("serve", model, "--port", "0", "--pool-name", unique_pool_name(), "--log-dir", str(served.log_dir))
    assert same_log.returncode == 2 and "log" in one_line(same_log).lower()
    same_pool = serve("serve", model, "--port", "0", "--pool-name", served.pool, "--log-dir", str(tmp_path / "other"))
    assert same_pool.returncode == 2 and served.pool in one_line(same_pool)
    assert served.raw("GET", "/health")[0] == 200  # the running server is untouched


def test_each_request_is_logged_in_one_line(served):
    served.raw("GET", "/health")
    served.raw("GET", '/x"y{z}')

    def logged() -> tuple[bool, bool]:
        lines = served.stderr().splitlines()
        return (any(re.search(r"GET '/health' 200 \d+ ms$", line) for line in lines),
                any("GET '/x\"y{z}' 404 " in line for line in lines))

    # a line is written once its answer went out, so the client may read the file first: wait
    deadline = time.monotonic() + 60
    while not all(logged()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert logged() == (True, True)


def test_values_from_the_environment_meet_the_flags_checks(tiny_models, monkeypatch):
    done = serve("serve", str(tiny_models["f32"].gguf), env={"SUPERFLUID_LOG_LEVEL": "verbose"})
    assert done.returncode == 2 and "'verbose' is not one of" in done.stderr and "Traceback" not in done.stderr
    done = serve("serve", str(tiny_models["f32"].gguf), "--port", "70000")
    assert done.returncode == 2 and "0 to 65535" in one_line(done)
    # an option set in the environment for the other runtime is not this model's business
    from superfluid.cli.serve import add_arguments, runtime_options

    monkeypatch.setenv("SUPERFLUID_MLX_KV_BITS", "4")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert runtime_options("llamacpp", parser.parse_args([]))["n_ctx"] == -1
    with pytest.raises(Exception, match="is an option of the mlx runtime"):
        runtime_options("llamacpp", parser.parse_args(["--mlx-kv-bits", "8"]))


def test_each_log_line_is_headed_by_who_said_it():
    import logging

    from superfluid.cli.serve import OriginFormatter

    def line(logger: str, text: str) -> str:
        return OriginFormatter().format(logging.LogRecord(logger, logging.WARNING, __file__, 1, text, None, None))

    loaded = line("llama.cpp", "llama_model_load: error loading model")
    assert loaded == "llama.cpp: llama_model_load: error loading model"
    assert line("superfluid.cli.serve", "serving at most 10 connections") == "superfluid: serving at most 10 connections"
    assert line("llama.cpp.other", "x") == "superfluid: x"  # only llama.cpp's own logger


def test_without_pool_bytes_the_pool_is_an_eighth_of_the_memory_beside_the_weights_within_bounds(tmp_path, monkeypatch):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"\0" * 1024)
    monkeypatch.setattr(serve_cli, "shared_memory_free", lambda: 64 << 30)
    for available, expected in ((20 << 30, 2560 << 20), (2 << 30, 512 << 20), (100 << 30, 4 << 30)):
        monkeypatch.setattr(serve_cli, "host_memory_available", lambda available=available: available + 1024)
        chosen, reason = serve_cli.pool_size(weights, None)
        assert chosen == expected and reason.startswith("an eighth of the ")
    assert serve_cli.pool_size(weights, 3 << 20) == (3 << 20, "set by --pool-bytes")
    # a container's small /dev/shm: half of what it has free (never below the library's 512 MiB)
    monkeypatch.setattr(serve_cli, "host_memory_available", lambda: 40 << 30)
    monkeypatch.setattr(serve_cli, "shared_memory_free", lambda: 2 << 30)
    assert serve_cli.pool_size(weights, None) == (1 << 30, "half of the 2.0 GiB free in /dev/shm")
