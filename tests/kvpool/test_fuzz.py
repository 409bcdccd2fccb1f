"""Garbage over the header slots: attach raises only the pool's own errors or drops the bad
entries, never reads outside the arena, and keeps every entry whose slot was left alone."""

import mmap

import msgspec
import numpy as np
import posix_ipc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvpool import Budget, KVArray, Pool, PoolError, segment
from kvpool.header import ENTRY_SLOT_BYTES, FORMAT_VERSION, EntryHeader, EntryState, SlotWriter
from tests.conftest import remove_segment, unique_pool_name

ENTRIES = 8
SLOTS = 16


def _arrays(seed, tokens):
    data = (np.arange(tokens * 4 * 8, dtype=np.float32).reshape(4, tokens, 8) + seed * 1000)
    return [KVArray("k", data, 1), KVArray("v", -data, 1)]


class Fixture:
    """A pool of 8 entries (arrays and blobs), its pristine bytes, and a raw mapping to corrupt."""

    def __init__(self):
        self.name = unique_pool_name()
        pool = Pool.create(self.name, 1 << 20, budget=Budget(1 << 20, None, "fuzz"), max_entries=SLOTS)
        self.expected = {}
        for seed in range(ENTRIES):
            if seed % 3 == 2:
                info = pool.put_blob("m", range(seed, seed + 10), np.full(777, seed, np.uint8), tag=f"b{seed}")
            else:
                info = pool.put("m", range(seed, seed + 20 + seed), _arrays(seed, 20 + seed), capacity=64,
                                tag=f"a{seed}")
            self.expected[info.id] = seed
        self.header = pool.header
        self.slot_of = {e.id: slot for slot, e in enumerate(pool.entries())}
        pool.close()
        shm = posix_ipc.SharedMemory(segment.segment_name(self.name))
        self.map = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)
        self.pristine = self.bytes.copy()

    def slot(self, index):
        start = self.header.slot_table_offset + index * ENTRY_SLOT_BYTES
        return self.bytes[start:start + ENTRY_SLOT_BYTES]

    def restore(self):
        self.bytes[:] = self.pristine

    def attach_and_check(self, untouched_slots):
        try:
            pool = Pool.attach(self.name)
        except PoolError:
            return None
        try:
            kept = {e.id: e for e in pool.entries()}
            for entry_id, seed in self.expected.items():
                if self.slot_of[entry_id] in untouched_slots:
                    assert entry_id in kept, f"good entry {entry_id} was dropped"
            for entry_id, info in kept.items():
                seed = self.expected[entry_id]  # nothing that was never written appears
                with pool.get(entry_id) as view:  # data verified against its checksum
                    if info.tag.startswith("b"):
                        assert (view.blob == seed).all() and view.blob.size == 777
                    else:
                        assert np.array_equal(view.arrays["k"], _arrays(seed, 20 + seed)[0].data)
            return pool.recovery
        finally:
            pool.close()

    def close(self):
        del self.bytes
        self.map.close()
        remove_segment(self.name)


@pytest.fixture(scope="module")
def fixture():
    made = Fixture()
    yield made
    made.close()


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(hits=st.lists(st.tuples(st.integers(0, SLOTS - 1), st.integers(0, ENTRY_SLOT_BYTES - 1),
                               st.binary(min_size=1, max_size=64)), min_size=1, max_size=12))
def test_random_bytes_over_entry_slots(fixture, hits):
    fixture.restore()
    for slot, offset, junk in hits:
        raw = np.frombuffer(junk, dtype=np.uint8)[:ENTRY_SLOT_BYTES - offset]
        fixture.slot(slot)[offset:offset + raw.size] = raw
    touched = {slot for slot, _, _ in hits}
    report = fixture.attach_and_check(set(range(SLOTS)) - touched)
    assert report is not None  # the pool header was not hit, so the attach must succeed


@FUZZ
@given(offset=st.integers(0, 4095), junk=st.binary(min_size=1, max_size=256))
def test_random_bytes_over_the_pool_header(fixture, offset, junk):
    fixture.restore()
    raw = np.frombuffer(junk, dtype=np.uint8)[:4096 - offset]
    fixture.bytes[offset:offset + raw.size] = raw
    fixture.attach_and_check(set(range(SLOTS)))  # either the other copy serves, or a PoolError


_big = st.integers(-(2 ** 63), 2 ** 64 - 1)


@FUZZ
@given(fields=st.fixed_dictionaries({
    "serial": st.integers(100, 10 ** 6), "live": _big, "capacity": _big, "data_offset": _big,
    "data_length": _big, "meta_offset": _big, "meta_length": _big, "layout_length": _big,
}), slot=st.integers(ENTRIES, SLOTS - 1), borrow=st.booleans())
def test_forged_headers_with_valid_frames_are_dropped(fixture, fields, slot, borrow):
    """Well-framed headers (valid checksum) naming wild offsets and lengths: bounds checks drop
    them before anything is read. With `borrow`, the forgery copies a good entry's side record
    so its layout checksum holds and only the bounds or overlap checks can stop it."""
    fixture.restore()
    base = dict(version=FORMAT_VERSION, state=EntryState.READY, identity="m", **fields)
    if borrow:
        with Pool.attach(fixture.name) as pool:
            good = pool._entries[1].header
        base.update(meta_offset=good.meta_offset, meta_length=good.meta_length, layout_length=good.layout_length,
                    layout_checksum=good.layout_checksum, tokens_checksum=good.tokens_checksum)
        fixture.restore()
    try:
        forged = EntryHeader(**base)
        SlotWriter().write(fixture.slot(slot), forged, 5)
    except (OverflowError, ValueError, msgspec.EncodeError):
        return  # a value msgpack cannot even carry
    report = fixture.attach_and_check(set(range(SLOTS)) - {slot})
    assert report is not None and report.entries == ENTRIES and report.dropped == 1
