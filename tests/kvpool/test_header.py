import msgspec
import numpy as np

from kvpool import header
from kvpool.header import ENTRY_SLOT_BYTES, EntryHeader, EntryState, SlotWriter


def _slot():
    return np.zeros(ENTRY_SLOT_BYTES, dtype=np.uint8)


def _entry(serial=7, live=5):
    return EntryHeader(header.FORMAT_VERSION, EntryState.READY, serial, "id", live, 8)


def test_round_trip_and_newest_generation_wins():
    slot, writer = _slot(), SlotWriter()
    writer.write(slot, _entry(live=1), 1)
    writer.write(slot, _entry(live=2), 2)
    generation, payload = header.read_slot(slot)
    assert generation == 2
    assert header.decode_entry_header(payload).live == 2


def test_torn_write_keeps_previous_version():
    slot, writer = _slot(), SlotWriter()
    writer.write(slot, _entry(live=1), 1)
    writer.write(slot, _entry(live=2), 2)
    slot[0:40] = 0xAB  # generation 2 lives in half 0: tear it
    generation, payload = header.read_slot(slot)
    assert generation == 1 and header.decode_entry_header(payload).live == 1


def test_blank_and_garbage_slots_are_absent():
    assert header.read_slot(_slot()) is None
    rng = np.random.default_rng(0)
    assert header.read_slot(rng.integers(0, 256, ENTRY_SLOT_BYTES, dtype=np.uint8)) is None


def test_a_flipped_payload_bit_fails_the_checksum():
    slot, writer = _slot(), SlotWriter()
    writer.write(slot, _entry(), 1)
    slot[512 + header.FRAME.size + 3] ^= 1
    assert header.read_slot(slot) is None


def test_length_beyond_the_half_is_rejected_without_reading():
    half = np.zeros(512, dtype=np.uint8)
    half[:header.FRAME.size] = np.frombuffer(header.FRAME.pack(header.MAGIC, 10_000, 1, 0), dtype=np.uint8)
    assert header.read_half(half) is None


def test_appended_fields_decode_both_ways():
    fields = [(f.name, f.type) if f.default is msgspec.NODEFAULT else (f.name, f.type, f.default)
              for f in msgspec.structs.fields(EntryHeader)]
    newer_type = msgspec.defstruct("Newer", [*fields, ("added_later", str, "default")], array_like=True)
    newer = msgspec.msgpack.encode(newer_type(2, 2, 9, "x", added_later="new"))
    assert header.decode_entry_header(newer).serial == 9
    assert header.payload_version(newer) == 2
    older = msgspec.msgpack.encode(_entry(serial=3))
    assert msgspec.msgpack.decode(older, type=newer_type).added_later == "default"


def test_non_header_payload_has_no_version():
    assert header.payload_version(b"\xc1") is None
    assert header.decode_pool_header(b"\x90") is None
