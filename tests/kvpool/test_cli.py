"""`python -m kvpool ls | gc | rm | demo` and `superfluid pool ...`, run as a user would."""

import os
import re
import signal
import subprocess
import sys

import pytest

from kvpool import segment

OWNER = ("import sys; import numpy as np; from kvpool import Pool, Budget, KVArray;"
         "p = Pool.create(sys.argv[1], 1 << 20, budget=Budget(1 << 20, None, 't'));"
         "[p.put('m', range(4), [KVArray('k', np.zeros((4, 8), np.float32), 0)]) for _ in range(3)];"
         "print('ready', flush=True); sys.stdin.read()")


def kvpool(*args):
    return subprocess.run([sys.executable, "-m", "kvpool", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def owned_pool(pool_name):
    """A pool owned by a live child process (three entries); yields (name, child)."""
    child = subprocess.Popen([sys.executable, "-c", OWNER, pool_name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    yield pool_name, child
    child.kill()
    child.wait()


def _line(output, name):
    return next(line for line in output.splitlines() if line.startswith(name + " "))


def test_ls_shows_owner_size_and_entries(owned_pool):
    name, child = owned_pool
    done = kvpool("ls")
    assert done.returncode == 0
    line = _line(done.stdout, name)
    assert f"alive pid {child.pid}" in line and "1.0 MiB" in line and " 3 " in line


def test_rm_refuses_a_live_pool_then_gc_takes_the_orphan(owned_pool):
    name, child = owned_pool
    refused = kvpool("rm", name)
    assert refused.returncode == 1 and "owned by a live process" in refused.stderr and "--force" in refused.stderr
    assert kvpool("gc").returncode == 0
    assert name in segment.list_pool_names()  # gc spares live pools
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert "orphaned" in _line(kvpool("ls").stdout, name)
    collected = kvpool("gc")
    assert collected.returncode == 0 and f"removed {name}" in collected.stdout
    assert name not in segment.list_pool_names()


def test_rm_removes_an_orphan_and_reports_a_missing_one(owned_pool):
    name, child = owned_pool
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert kvpool("rm", name).returncode == 0
    missing = kvpool("rm", name)
    assert missing.returncode == 1 and "no pool named" in missing.stderr


def test_rm_force_removes_a_live_pools_name(owned_pool):
    name, _ = owned_pool
    assert kvpool("rm", "--force", name).returncode == 0
    assert name not in segment.list_pool_names()


def test_demo_runs_and_cleans_up():
    done = kvpool("demo")
    assert done.returncode == 0, done.stderr
    assert "bytes copied by sharing: 0" in done.stdout and "closed and unlinked" in done.stdout
    assert "evicted" in done.stdout
    # its own pool is gone (only its own: other test runs on this machine make and remove pools meanwhile)
    name = re.search(r"pool (demo-\d+):", done.stdout).group(1)
    assert name not in segment.list_pool_names()


def test_usage_errors_exit_2():
    assert kvpool("frobnicate").returncode == 2
    assert kvpool().returncode == 2


def test_superfluid_pool_command(owned_pool):
    name, child = owned_pool
    done = subprocess.run([sys.executable, "-m", "superfluid.cli.main", "pool", "ls"], capture_output=True, text=True)
    assert done.returncode == 0 and f"alive pid {child.pid}" in _line(done.stdout, name)
    assert os.path.exists(os.path.join(os.path.dirname(sys.executable), "superfluid"))
