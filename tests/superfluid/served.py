"""`superfluid serve` as a child process, driven over HTTP (the openai client, or raw requests)."""

import http.client
import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import openai

from kvpool import places
from kvpool.tier_folder import remove_tier
from tests.conftest import remove_segment, unique_pool_name

ROOT = Path(__file__).resolve().parents[2]
# superfluid's variables a server gets from the tests: the cache (models), and the folder of this
# run's disk tiers (tests/conftest.py)
PASSED_ON = ("SUPERFLUID_CACHE", "SUPERFLUID_DISK_TIERS")


class Served:
    """A `superfluid serve` child process; stopped with SIGTERM and its pool removed."""

    def __init__(self, model, tmp_path, *extra: str, pool: str | None = None, exact: bool = True,
                 environment: dict[str, str] | None = None) -> None:
        """`exact` pins llama.cpp's flash attention off (serve's default is on), so that replies
        can be compared token for token across batch shapes and restarts. `environment`: variables
        the server gets besides this process's (those starting SUPERFLUID_ are not passed on)."""
        self.pool = pool or unique_pool_name()  # the log lives beside it: the same pool means a restart
        self.keeps_tier = False  # a test restarting the server on its disk tier sets it
        self.log_dir = tmp_path / f"log-{self.pool}"
        # stderr (a line per request) goes to a file: a pipe nobody reads would fill and stall the server
        self.stderr_path = tmp_path / f"serve-{self.pool}-{os.getpid()}-{id(self)}.err"
        with open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "superfluid", "serve", str(model), "--port", "0", "--pool-name", self.pool,
                 "--pool-bytes", "64M", "--log-dir", str(self.log_dir),
                 *([] if Path(model).is_dir() else ["--llamacpp-threads=2"]),
                 *(["--llamacpp-flash-attn", "false"] if exact and not Path(model).is_dir() else []),
                 *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
                env={**{k: v for k, v in os.environ.items()
                        if not k.startswith("SUPERFLUID_") or k in PASSED_ON}, **(environment or {})})
        try:
            line = self.process.stdout.readline()
            assert " on http://" in line, f"the server did not start: {line!r} {self.stderr()[-2000:]}"
            # the start lines of cells, one session's context and the pool, the pool's last
            self.sizing = [self.process.stdout.readline().removeprefix("superfluid: ").rstrip() for _ in range(3)]
            assert self.sizing[-1].startswith("pool: "), f"the start lines were {self.sizing} {self.stderr()[-2000:]}"
        except BaseException:
            self.stop()  # a server that failed to start leaves no process or segment behind
            raise
        self.url = line.split(" on ")[1].strip()
        self.model = line.split("serving ")[1].split(" ")[0]
        address = urlparse(self.url)
        self.address = (address.hostname, address.port)

    def stderr(self) -> str:
        """What the server wrote to stderr so far."""
        return self.stderr_path.read_text()

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0)

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        connection = http.client.HTTPConnection(*self.address, timeout=60)
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        data = response.read()
        connection.close()
        return response.status, data

    def metric(self, name: str) -> float:
        _, text = self.raw("GET", "/metrics")
        for line in text.decode().splitlines():
            if line.startswith(f"superfluid_{name} "):
                return float(line.split()[1])
        raise AssertionError(f"no metric {name}")

    def stop(self) -> int:
        """SIGTERM, and SIGKILL if it has not stopped within 60 s (a test that then fails on the
        exit code still leaves no process or segment behind); its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        remove_segment(self.pool)
        if not self.keeps_tier:
            remove_tier(places.disk_folder(self.pool))
        return code
