import os
import stat
import subprocess
import sys

import msgspec
import numpy as np
import posix_ipc
import pytest

from kvpool import (Budget, KVArray, Pool, PoolBusy, PoolCorrupt, PoolExists, PoolFormatError, PoolNotFound,
                    ReservationError, segment)
from kvpool.header import POOL_HEADER_HALF, EntryHeader, PoolHeader, SlotWriter
from tests.conftest import remove_segment


def test_segment_is_mode_0600_and_named_for_the_user(make_pool):
    pool = make_pool(1 << 20)
    path = f"/dev/shm/sf-{os.getuid()}-{pool.name}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert pool.name in segment.list_pool_names()


def test_memory_is_reserved_up_front(make_pool):
    pool = make_pool(4 << 20)
    assert os.stat(f"/dev/shm/sf-{os.getuid()}-{pool.name}").st_blocks * 512 >= 4 << 20


def test_a_pool_larger_than_shm_is_an_error_naming_the_size(pool_name):
    free = os.statvfs("/dev/shm")
    too_big = (free.f_bavail * free.f_frsize + (64 << 30)) // 4096 * 4096
    with pytest.raises(ReservationError, match="cannot reserve .* GiB .* smaller pool size"):
        Pool.create(pool_name, too_big, budget=Budget(1, None, "t"))
    assert pool_name not in segment.list_pool_names()  # nothing left behind


def test_create_twice_and_attach_missing(make_pool, pool_name):
    pool = make_pool(1 << 20)
    with pytest.raises(PoolExists, match="already exists"):
        Pool.create(pool.name, 1 << 20)
    with pytest.raises(PoolNotFound, match="no pool named"):
        Pool.attach(pool_name)


@pytest.mark.parametrize("name", ["", "a/b", "-x", "x" * 65, "sp ace"])
def test_bad_pool_names(name):
    with pytest.raises(Exception, match="invalid pool name"):
        Pool.create(name, 1 << 20)


def test_attach_refused_while_the_owner_is_alive_in_this_process(make_pool):
    pool = make_pool(1 << 20)
    with pytest.raises(PoolBusy, match="live process"):
        Pool.attach(pool.name)
    assert segment.owner_alive(pool.name)


def test_attach_refused_while_another_process_owns_it(pool_name):
    script = ("import sys, time; from kvpool import Pool, Budget;"
              f"p = Pool.create({pool_name!r}, 1 << 20, budget=Budget(1 << 20, None, 't'));"
              "print('ready', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(PoolBusy):
            Pool.attach(pool_name)
    finally:
        child.kill()
        child.wait()
    pool = Pool.attach(pool_name)  # the owner died: the kernel dropped its lock
    assert not pool.entries()
    pool.close()


def _raw_segment(name, size=1 << 20):
    shm = posix_ipc.SharedMemory(segment.segment_name(name), posix_ipc.O_CREX, mode=0o600, size=size)
    return shm


def _write_pool_header(name, header):
    shm = posix_ipc.SharedMemory(segment.segment_name(name))
    import mmap

    with mmap.mmap(shm.fd, 2 * POOL_HEADER_HALF) as mapped:
        SlotWriter().write(np.frombuffer(mapped, dtype=np.uint8), header, 1)
    shm.close_fd()


def test_another_format_version_is_refused(make_pool):
    pool = make_pool(1 << 20)
    name, header = pool.name, pool.header
    pool.close()
    _write_pool_header(name, PoolHeader(**{**{f: getattr(header, f) for f in header.__struct_fields__},
                                           "version": 99}))
    with pytest.raises(PoolFormatError, match="format version 99; this kvpool reads versions 1, 2"):
        Pool.attach(name)


def test_a_version_1_pool_is_read_its_entries_in_the_empty_namespace_and_it_becomes_version_2(make_pool):
    # what a release before namespaces left in /dev/shm: headers without the namespace field
    pool = make_pool(1 << 20)
    info = pool.put("m", range(20), [KVArray("0.k", np.ones((2, 20, 8), np.float32), 1)])
    name, header = pool.name, pool.header
    record = pool._entries[info.id]
    fields = [(f.name, f.type, f.default) if f.default is not msgspec.NODEFAULT else (f.name, f.type)
              for f in msgspec.structs.fields(EntryHeader) if f.name != "namespace"]
    version_1 = msgspec.defstruct("EntryHeaderV1", fields, array_like=True)
    old = version_1(**{**{f: getattr(record.header, f) for f in version_1.__struct_fields__}, "version": 1})
    pool._store.write_header(record.slot, old)  # (any struct: it is framed as it encodes)
    pool.close()
    _write_pool_header(name, PoolHeader(**{**{f: getattr(header, f) for f in header.__struct_fields__},
                                           "version": 1}))
    again = Pool.attach(name)
    try:
        assert again.recovery.entries == 1
        assert again.info(info.id).namespace == ""
        assert again.lookup("m", range(20)).entry_id == info.id
        assert again.header.version == 2  # a release that reads only version 1 now refuses it whole
    finally:
        again.close()


def test_another_users_segment_is_refused(pool_name):
    _raw_segment(pool_name).close_fd()
    os.chown(f"/dev/shm/sf-{os.getuid()}-{pool_name}", 12345, -1)
    with pytest.raises(PoolFormatError, match="uid 12345"):
        Pool.attach(pool_name)


def test_a_segment_that_is_no_pool(pool_name):
    _raw_segment(pool_name).close_fd()
    with pytest.raises(PoolCorrupt, match="unreadable"):
        Pool.attach(pool_name)
    remove_segment(pool_name)
    _raw_segment(pool_name, size=100).close_fd()
    with pytest.raises(PoolFormatError, match="too small"):
        Pool.attach(pool_name)


def test_geometry_that_does_not_match_the_segment(make_pool):
    pool = make_pool(1 << 20)
    name, header = pool.name, pool.header
    pool.close()
    fields = {f: getattr(header, f) for f in header.__struct_fields__}
    _write_pool_header(name, PoolHeader(**{**fields, "arena_size": header.arena_size * 4}))
    with pytest.raises(PoolCorrupt, match="geometry"):
        Pool.attach(name)
