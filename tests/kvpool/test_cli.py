"""`python -m kvpool ls | gc | rm | demo` and `superfluid pool ...`, run as a user would."""

import os
import re
import signal
import subprocess
import sys

import pytest

import msgspec

from kvpool import disk_format, segment

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


def _disk_tier_with(folder, identities):
    """A closed disk tier in `folder` holding one entry per identity, a torn file and a file of
    another format version."""
    from kvpool.disk import DiskTier
    from tests.kvpool import disk_crash_writer as crash

    with DiskTier(folder, 64 << 20, headroom=0, scan=False) as tier:
        for seed, identity in enumerate(identities):
            header = msgspec.structs.replace(crash.header(seed), identity=identity)
            tier.write(header, crash.token_ids(seed), [crash.cells(seed)])
    (folder / "torn.kv.partial").write_bytes(b"half")
    newer = msgspec.structs.replace(crash.header(9), version=99)
    disk_format.write(str(folder / "newer.kv"), newer, [crash.cells(9)], crash.token_ids(9))


def test_disk_ls_gc_and_rm_list_clean_and_remove_a_pools_disk_tier(pool_name, monkeypatch, tmp_path):
    monkeypatch.setenv("SUPERFLUID_DISK_TIERS", str(tmp_path))
    folder = tmp_path / pool_name
    _disk_tier_with(folder, ["model-a", "model-a", "model-b"])
    listed = kvpool("disk", "ls")
    assert listed.returncode == 0, listed.stderr
    row = _line(listed.stdout, pool_name)
    assert "model-a (2), model-b (1), 1 unreadable (another format, or damaged)" in row and " no " in row
    assert (folder / "torn.kv.partial").exists()  # a listing changes nothing
    collected = kvpool("gc")  # the segments, and what no tier can use: torn files, another format
    assert collected.returncode == 0 and f"{pool_name}: 2 file(s) removed; 3 entries" in collected.stdout
    cleaned = kvpool("disk", "gc", "--keep-identity", "model-a")
    assert cleaned.returncode == 0, cleaned.stderr
    assert f"{pool_name}: 1 file(s) removed; 2 entries" in cleaned.stdout  # model-b's
    assert sorted(p.suffix for p in folder.iterdir() if p.name != ".lock") == [".kv", ".kv"]
    removed = kvpool("rm", pool_name)
    assert removed.returncode == 0 and "of its disk tier" in removed.stdout, removed.stderr
    assert not folder.exists()
    again = kvpool("rm", pool_name)
    assert again.returncode == 1 and "no segment and no disk tier" in again.stderr


def test_disk_gc_leaves_a_tier_in_use_to_its_owner(pool_name, monkeypatch, tmp_path):
    from kvpool.disk import DiskTier

    monkeypatch.setenv("SUPERFLUID_DISK_TIERS", str(tmp_path))
    folder = tmp_path / pool_name
    _disk_tier_with(folder, ["model-a"])
    with DiskTier(folder, 64 << 20, headroom=0):
        cleaned = kvpool("disk", "gc", "--keep-identity", "model-b")
        assert "in use: left to its owner" in cleaned.stdout
        assert "yes" in _line(kvpool("disk", "ls").stdout, pool_name)
        busy = kvpool("rm", pool_name)
        assert busy.returncode == 1 and "open in another process" in busy.stderr
    assert len(list(folder.glob("*.kv"))) == 2
