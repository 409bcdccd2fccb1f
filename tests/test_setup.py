"""scripts/setup as a new user and CI run it: a run with everything in place installs and builds
nothing, and a flag it does not know is refused by name (the first run on a clean machine is
measured by benchmarks/first_answer.py: it takes minutes and the network)."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def setup(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["./scripts/setup", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def stamps() -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in ROOT.glob(".venv*/.superfluid-installed")}


def said(done: subprocess.CompletedProcess) -> list[str]:
    """What a run printed, but the note a machine without Python 3.12 gets at every run."""
    return [line for line in (done.stdout + done.stderr).splitlines() if "no Python 3.12 here" not in line]


def test_setup_run_again_installs_and_builds_nothing():
    # scripts/test ran `scripts/setup --tests` before pytest: serving's setup asks for no more
    before = stamps()
    done = setup()
    assert done.returncode == 0 and said(done) == []
    again = setup("--tests")
    assert again.returncode == 0 and said(again) == []
    assert stamps() == before and str(ROOT / ".venv" / ".superfluid-installed") in before


def test_an_unknown_flag_is_refused_with_the_usage():
    done = setup("--serve")
    assert done.returncode == 2 and done.stderr.startswith("usage: scripts/setup [--tests]")
