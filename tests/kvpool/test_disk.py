"""The disk tier behind a pool: spilled in the background, found again after a restart or a crash,
within a hard budget, verified before anything reads it, and private.

Each test has its own tier folder (pytest's tmp_path, removed with it) and its own pool segment.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvpool import DataCorrupt, EntryBusy, EntryNotFound, KVArray, PoolError, disk_format
from kvpool.budget import default_disk_budget
from kvpool.disk import DiskTier
from tests.kvpool import disk_crash_writer as crash

MODEL = "model-a"
ENOUGH = 64 << 20


def cells(seed: int, tokens: int, heads: int = 2, width: int = 8) -> np.ndarray:
    """(heads, tokens, width) float32 cells that follow from `seed`."""
    return (np.arange(heads * tokens * width, dtype=np.float32).reshape(heads, tokens, width) + seed * 1e6)


def token_ids(seed: int, count: int) -> list[int]:
    """Token ids that follow from `seed` (two seeds share no first token)."""
    return [seed * 1000 + i for i in range(count)]


def put(pool, seed: int, tokens: int = 32, *, tag: str = "", cost: float | None = None, capacity: int | None = None):
    """Put entry `seed` and release the caller's reference: it stays cached, evictable."""
    info = pool.put(MODEL, token_ids(seed, tokens), [KVArray("k", cells(seed, tokens), 1)], tag=tag,
                    recompute_cost=cost, capacity=capacity)
    pool.release(info.id)
    return info


def tiered(make_pool, folder: Path, *, disk_budget: int = ENOUGH, size: int = 4 << 20, delay: float = 0.0,
           **options):
    """A pool with a disk tier in `folder`, its entries written `delay` seconds after their commit
    (none here: the tests that are about the delay say so)."""
    pool = make_pool(size)
    pool.attach_disk(DiskTier(folder, disk_budget, headroom=0, **options), delay=delay)
    return pool


def hold_the_writer(pool) -> tuple[threading.Event, threading.Event]:
    """(gate, reading): the tier's writer stops before the data of each file it writes until
    `gate` is set; `reading` is set once it stopped there."""
    gate, reading = threading.Event(), threading.Event()

    def hold(stage: str) -> None:
        if stage == "data" and not gate.is_set():
            reading.set()
            gate.wait(10)

    pool.disk._stage = hold
    return gate, reading


def written(pool, count: int) -> bool:
    """Wait until the tier's writer has written `count` files on its own (nobody waiting for
    everything); whether it wrote exactly that many."""
    for _ in range(400):
        if pool.disk_stats().writes >= count:
            return pool.disk_stats().writes == count
        time.sleep(0.05)
    return False


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock")


def test_an_entry_evicted_from_memory_is_loaded_back_from_disk_byte_for_byte(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    info = put(pool, 1, 40, capacity=64)  # slack is not written: the file holds 40 cells
    assert pool.wait_spilled(10)
    disk = pool.disk_stats()
    assert disk.writes == 1 and disk.entries == 1 and disk.bytes_written == disk.bytes_used
    assert disk.bytes_written < info.live_bytes + 1024
    pool.evict(info.id)
    match = pool.lookup(MODEL, token_ids(1, 50))
    assert match.on_disk and match.tokens == 40
    loaded = pool.load(match.entry_id, MODEL)
    with pool.get(loaded.id) as view:
        assert np.array_equal(view.arrays["k"], cells(1, 40))
        assert list(view.tokens) == token_ids(1, 40)
    assert pool.disk_stats().bytes_read == cells(1, 40).nbytes and pool.disk_stats().loads == 1
    pool.release(loaded.id)
    # once loaded it is in memory again, and found there first; it is not written twice
    assert not pool.lookup(MODEL, token_ids(1, 50)).on_disk
    assert pool.wait_spilled(10) and pool.disk_stats().writes == 1


def test_an_entry_is_written_once_its_delay_is_over_and_one_superseded_before_never(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path, delay=3600)  # nothing is due within the test
    old = put(pool, 1, 20, tag="session:a")
    new = put(pool, 1, 30, tag="session:a")  # its owner parked again within the delay
    assert pool.supersede(old.id, new.id)
    assert pool.disk_stats().writes == 0
    assert pool.wait_spilled(10)  # writes what is queued now, delay or not
    assert [e.tokens for e in pool.disk.entries()] == [30] and pool.disk_stats().writes == 1
    soon = tiered(make_pool, tmp_path / "soon", delay=0.05)
    put(soon, 2, 20)
    assert written(soon, 1)  # by the writer on its own once due


def test_a_delay_the_writer_cannot_keep_is_refused(make_pool, tmp_path):
    pool = make_pool(1 << 20)
    with DiskTier(tmp_path, ENOUGH, headroom=0, scan=False) as tier:
        for delay in (-1, float("nan"), float("inf"), 7200):
            with pytest.raises(ValueError, match="seconds from 0 to 3600"):
                pool.attach_disk(tier, delay=delay)
    assert pool.disk is None


def test_an_entry_its_owner_will_replace_is_written_only_once_its_deferral_is_over(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path, delay=0.5)  # (long enough that each deferral below comes first)

    provisional = put(pool, 1, 20, tag="session:a")
    pool.defer_spill(provisional.id, 3600)  # its lane goes on and parks again at its end
    put(pool, 2, 24)
    assert written(pool, 1)  # the plain entry, once its own delay is over; the other waits
    time.sleep(0.6)  # (the writer has taken the deferred entry off the queue and put it back by now)
    assert [e.tokens for e in pool.disk.entries()] == [24] and pool.disk_stats().writes == 1
    final = put(pool, 1, 30, tag="session:a")  # the lane's next park supersedes it: never written
    assert pool.supersede(provisional.id, final.id)
    assert written(pool, 2) and sorted(e.tokens for e in pool.disk.entries()) == [24, 30]
    # a deferral that runs out is written by the writer on its own; one ended (its owner will
    # not replace it after all) is written at once
    short = put(pool, 3, 28)
    pool.defer_spill(short.id, 1.0)
    assert written(pool, 3) and 28 in [e.tokens for e in pool.disk.entries()]
    ended = put(pool, 4, 32)
    pool.defer_spill(ended.id, 3600)
    pool.defer_spill(ended.id, 0)
    assert written(pool, 4) and 32 in [e.tokens for e in pool.disk.entries()]
    # one still deferred is written at once by whoever waits for everything, and on eviction
    waited = put(pool, 5, 20)
    pool.defer_spill(waited.id, 3600)
    assert pool.wait_spilled(10) and pool.disk_stats().writes == 5
    evicted = put(pool, 6, 20)
    pool.defer_spill(evicted.id, 3600)
    pool.shed(0)  # memory makes room: everything else is on disk already
    assert pool.stats().evicted_unspilled == 1 and pool.wait_spilled(10)
    assert pool.lookup(MODEL, token_ids(6, 20)).on_disk
    with pytest.raises(ValueError, match="from 0 to 3600"):
        pool.defer_spill(evicted.id, float("nan"))


def test_an_entry_evicted_within_its_delay_is_written_as_it_goes(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path, size=1 << 20, delay=3600)
    info = put(pool, 1, 32)
    pool.shed(0)
    assert pool.stats().evicted_unspilled == 1 and pool.wait_spilled(10)
    loaded = pool.load(pool.lookup(MODEL, token_ids(1, 32)).entry_id, MODEL)
    with pool.get(loaded.id) as view:
        assert np.array_equal(view.arrays["k"], cells(1, 32)) and loaded.id != info.id
    pool.release(loaded.id)


def test_a_blob_entry_goes_to_disk_and_back(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    blob = np.frombuffer(os.urandom(10_000), np.uint8)
    info = pool.put_blob(MODEL, token_ids(2, 20), blob, tag="request")
    pool.release(info.id)
    assert pool.wait_spilled(10)
    pool.evict(info.id)
    loaded = pool.load(pool.lookup(MODEL, token_ids(2, 20)).entry_id, MODEL)
    with pool.get(loaded.id) as view:
        assert bytes(view.blob) == blob.tobytes() and view.info.tag == "request"
    pool.release(loaded.id)


def test_memory_keeps_a_longer_match_and_disk_answers_only_beyond_it(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    short = put(pool, 3, 20)
    long = put(pool, 3, 48)
    assert pool.wait_spilled(10)
    assert pool.lookup(MODEL, token_ids(3, 60)).entry_id == long.id  # memory, on a tie
    pool.evict(long.id)
    found = pool.lookup(MODEL, token_ids(3, 60))
    assert found.on_disk and found.tokens == 48  # the disk holds more than memory's 20
    assert pool.lookup(MODEL, token_ids(3, 20)).entry_id == short.id


def test_a_new_pool_on_the_same_folder_finds_every_entry_after_a_restart(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    for seed in range(4):
        put(pool, seed, 24 + seed, tag=f"session:{seed}")
    assert pool.wait_spilled(10)
    pool.close()
    again = tiered(make_pool, tmp_path)  # a new segment: memory is empty, as after a reboot
    assert again.disk.wait_scanned(10)
    for seed in range(4):
        match = again.lookup(MODEL, token_ids(seed, 40))
        assert match.on_disk and match.tokens == 24 + seed
        loaded = again.load(match.entry_id, MODEL)
        with again.get(loaded.id) as view:
            assert np.array_equal(view.arrays["k"], cells(seed, 24 + seed)) and view.info.tag == f"session:{seed}"
        again.release(loaded.id)
    # entries still in a re-attached memory pool are matched to their files, not written again
    assert again.wait_spilled(10) and again.disk_stats().writes == 0


def test_an_entry_of_another_identity_is_never_found_or_loaded(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    put(pool, 4, 32)
    assert pool.wait_spilled(10)
    pool.evict(pool.entries()[0].id)
    assert pool.lookup("model-b", token_ids(4, 32)) is None
    disk_id = pool.lookup(MODEL, token_ids(4, 32)).entry_id
    with pytest.raises(PoolError, match="another model's state is never loaded"):
        pool.load(disk_id, "model-b")
    assert pool.stats().entries == 0  # nothing was reserved for it
    assert pool.lookup(MODEL, token_ids(4, 32)).on_disk  # and the entry is still there for its model


def test_a_damaged_file_is_refused_before_anything_reads_it_and_removed(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    put(pool, 5, 32)
    assert pool.wait_spilled(10)
    pool.evict(pool.entries()[0].id)
    (path,) = [tmp_path / name for name in files(tmp_path)]
    with open(path, "r+b") as f:  # one bit of the data flipped
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    disk_id = pool.lookup(MODEL, token_ids(5, 32)).entry_id
    with pytest.raises(DataCorrupt, match="fails its checksum"):
        pool.load(disk_id, MODEL)
    assert pool.stats().entries == 0 and pool.stats().writing == 0  # the reserved entry was given back
    assert files(tmp_path) == [] and pool.lookup(MODEL, token_ids(5, 32)) is None
    assert pool.disk_stats().corrupt_found == 1


@pytest.mark.parametrize("stage", ["data", "tokens", "header", "synced", "renamed"])
def test_killed_inside_a_write_the_next_open_finds_every_whole_entry_and_no_torn_one(tmp_path, stage):
    folder = tmp_path / "tier"
    child = subprocess.run([sys.executable, crash.__file__, str(folder), stage], capture_output=True,
                           timeout=120, cwd=Path(__file__).parents[2])
    assert child.returncode == -9, child.stderr.decode()[-2000:]
    left = files(folder)
    assert sum(name.endswith(disk_format.PARTIAL) for name in left) == (0 if stage == "renamed" else 1)
    tier = DiskTier(folder, 64 << 20, headroom=0, scan=False)
    try:
        tier.scan_now()
        expected = crash.WHOLE_ENTRIES + (1 if stage == "renamed" else 0)
        assert sorted(e.tag for e in tier.entries()) == [f"s{i}" for i in range(expected)]
        assert tier.stats().torn_removed == (0 if stage == "renamed" else 1)
        assert not any(name.endswith(disk_format.PARTIAL) for name in files(folder))
        for entry in tier.entries():
            seed = int(entry.tag[1:])
            out = np.empty_like(crash.cells(seed))
            with tier.reading(entry.id) as (header, tokens, read_into):
                read_into([out])
            assert np.array_equal(out, crash.cells(seed)) and np.array_equal(tokens, crash.token_ids(seed))
    finally:
        tier.close()


def test_a_truncated_or_foreign_file_is_removed_at_the_scan_and_another_format_is_kept(tmp_path):
    with DiskTier(tmp_path, ENOUGH, headroom=0, scan=False) as tier:
        tier.write(crash.header(0), crash.token_ids(0), [crash.cells(0)])
    (whole,) = files(tmp_path)
    data = (tmp_path / whole).read_bytes()
    (tmp_path / "cut.kv").write_bytes(data[:-5])  # a file cut short
    (tmp_path / "junk.kv").write_bytes(b"not an entry at all" * 10)
    newer = crash.header(1).__class__(**{**{f: getattr(crash.header(1), f) for f in crash.header(1).__struct_fields__},
                                         "version": 99})
    disk_format.write(str(tmp_path / "newer.kv"), newer, [crash.cells(1)], crash.token_ids(1))
    with DiskTier(tmp_path, ENOUGH, headroom=0, scan=False) as tier:
        tier.scan_now()
        stats = tier.stats()
        assert [e.name for e in tier.entries()] == [whole[:-3]]
        assert stats.corrupt_found == 2 and stats.unreadable == 1
        assert sorted(files(tmp_path)) == sorted([whole, "newer.kv"])
        assert stats.bytes_used == len(data) + (tmp_path / "newer.kv").stat().st_size


def test_the_budget_holds_under_a_stream_of_parks_evicting_cheapest_per_byte(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    put(pool, 100, 32, cost=1e6)
    assert pool.wait_spilled(10)
    pool.disk.budget_bytes = int(4.5 * pool.disk_stats().bytes_used)  # room for four files of this size
    for seed in range(20):
        put(pool, seed, 32, cost=32 + seed)  # each worth more than the one before
        assert pool.wait_spilled(10)
        stats = pool.disk_stats()
        assert stats.bytes_used <= stats.budget_bytes
        assert sum((tmp_path / name).stat().st_size for name in files(tmp_path)) == stats.bytes_used
    on_disk = sorted(int(e.recompute_cost) for e in pool.disk.entries())
    assert on_disk == [49, 50, 51, 1_000_000]  # the dearest per byte stayed
    assert pool.disk_stats().evictions == 17


def test_an_entry_worth_less_than_everything_on_a_full_tier_is_refused(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    put(pool, 1, 32, cost=1000.0)
    assert pool.wait_spilled(10)
    pool.disk.budget_bytes = int(2.5 * pool.disk_stats().bytes_used)  # room for two
    put(pool, 2, 32, cost=1000.0)
    assert pool.wait_spilled(10)
    put(pool, 3, 32, cost=1.0)
    assert pool.wait_spilled(10)
    stats = pool.disk_stats()
    assert stats.refused == 1 and stats.evictions == 0 and stats.entries == 2


def test_memory_evicts_an_entry_with_a_disk_copy_before_a_dearer_one_without(make_pool, tmp_path):
    gate = threading.Event()
    pool = tiered(make_pool, tmp_path, size=1 << 20)
    kept = put(pool, 1, 32, cost=1.0)  # cheap, but on disk
    assert pool.wait_spilled(10)
    pool.disk._stage = lambda name: gate.wait(10) if name == "data" else None  # the next spill waits
    dear = put(pool, 2, 32, cost=1e6)
    assert pool._spill_busy or not pool.wait_spilled(0.2)
    try:
        pool.shed(pool.stats().bytes_used - 1)  # room for one entry less
        assert [e.id for e in pool.entries()] == [dear.id]
        assert kept.id not in [e.id for e in pool.entries()]
        with pytest.raises(EntryBusy):  # held by the writer while it reads it: not evicted
            pool.evict(dear.id)
    finally:
        gate.set()
    assert pool.wait_spilled(10) and pool.disk_stats().entries == 2


def test_the_writer_keeps_its_entry_in_place_while_compaction_moves_others(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path, size=1 << 20)
    gate, reading = hold_the_writer(pool)
    held = put(pool, 1, 16, capacity=2048)  # mostly slack: compaction would move both
    queued = put(pool, 2, 16, capacity=2048)
    assert reading.wait(10)

    def extents(entry):
        return [extent for extent in pool.arena_map() if extent[2].startswith(f"{entry.id}.")]

    before, other = extents(held), extents(queued)
    assert pool.compact() > 0
    assert extents(held) == before and extents(queued) != other  # only the one not being read moved
    assert pool.info(held.id).slack_bytes > 0 and pool.info(queued.id).slack_bytes == 0
    gate.set()
    assert pool.wait_spilled(10)
    for entry in pool.entries():
        pool.evict(entry.id)
    for seed, tokens in ((1, 16), (2, 16)):
        loaded = pool.load(pool.lookup(MODEL, token_ids(seed, tokens)).entry_id, MODEL)
        with pool.get(loaded.id) as view:
            assert np.array_equal(view.arrays["k"], cells(seed, tokens))
        pool.release(loaded.id)


def test_erasing_a_tag_removes_its_files_and_keeps_its_held_memory_entries_off_disk(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    erased = put(pool, 1, 20, tag="session:a", capacity=24)
    put(pool, 2, 20, tag="session:b")
    assert pool.wait_spilled(10)
    pool.share(erased.id)  # held: it stays in memory
    assert pool.erase(tag="session:a") == 1
    assert [e.tag for e in pool.disk.entries()] == ["session:b"] and len(files(tmp_path)) == 1
    assert pool.disk_stats().erased == 1
    # an extension would queue the entry again: an erased one is never written back
    with pool.extend(erased.id, [9, 9]) as writer:
        writer.arrays["k"][...] = 0
        writer.commit()
    pool.release(erased.id)
    assert pool.wait_spilled(10) and [e.tag for e in pool.disk.entries()] == ["session:b"]


def test_a_failed_write_leaves_no_file_and_costs_only_that_entry(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)

    def no_space(name):
        if name == "tokens":
            raise OSError(28, "No space left on device")

    pool.disk._stage = no_space
    info = put(pool, 1, 20)
    assert pool.wait_spilled(10)
    assert files(tmp_path) == [] and pool.disk_stats().write_failures == 1
    assert pool.info(info.id).tokens == 20  # the entry is still in memory
    pool.disk._stage = disk_format.NO_STAGE
    put(pool, 2, 20)
    assert pool.wait_spilled(10) and pool.disk_stats().writes == 1


def test_a_write_that_would_leave_less_than_the_headroom_free_is_refused(make_pool, tmp_path):
    pool = make_pool(4 << 20)
    fs = os.statvfs(tmp_path)
    pool.attach_disk(DiskTier(tmp_path, ENOUGH, headroom=fs.f_bavail * fs.f_frsize))
    put(pool, 1, 20)
    assert pool.wait_spilled(10)
    assert pool.disk_stats().refused == 1 and files(tmp_path) == []


def test_the_folder_and_files_are_private_and_one_process_writes_them(make_pool, tmp_path):
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    pool = tiered(make_pool, folder)
    put(pool, 1, 20)
    assert pool.wait_spilled(10)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert [stat.S_IMODE((folder / name).stat().st_mode) for name in files(folder)] == [0o600]
    other = subprocess.run([sys.executable, "-c", "import sys; from kvpool.disk import DiskTier; "
                            "DiskTier(sys.argv[1], 1 << 20)", str(folder)],
                           capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=60)
    assert other.returncode != 0 and "open in another process" in other.stderr


def test_the_scan_runs_beside_lookups_and_finds_entries_as_it_goes(tmp_path):
    with DiskTier(tmp_path, ENOUGH, headroom=0, scan=False) as tier:
        for seed in range(3):
            tier.write(crash.header(seed), crash.token_ids(seed), [crash.cells(seed)])
    tier = DiskTier(tmp_path, ENOUGH, headroom=0, scan=False)
    try:
        assert tier.stats().scanning and tier.lookup("crash-model", crash.token_ids(1)) is None
        assert tier.stats().bytes_used > 0  # unscanned files count against the budget already
        tier.scan_now()
        assert not tier.stats().scanning and tier.lookup("crash-model", crash.token_ids(1)).tokens == crash.TOKENS
    finally:
        tier.close()


def test_the_default_budget_follows_the_disk(tmp_path):
    fs = os.statvfs(tmp_path)
    total, free = fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize
    assert default_disk_budget(tmp_path) == min(total // 10, free // 2) or abs(default_disk_budget(tmp_path)
                                                                        - min(total // 10, free // 2)) < 1 << 24
    assert default_disk_budget(tmp_path, held=10 << 30) >= default_disk_budget(tmp_path)


def test_an_erase_reaches_files_the_scan_has_not_and_writes_in_flight(tmp_path):
    with DiskTier(tmp_path, ENOUGH, headroom=0, scan=False) as tier:
        for seed, tag in ((0, "session:a"), (1, "session:b")):
            tier.write(msgspec.structs.replace(crash.header(seed), tag=tag), crash.token_ids(seed), [crash.cells(seed)])
    with DiskTier(tmp_path, ENOUGH, headroom=0, scan=False) as tier:
        assert tier.erase(tag="session:a") == 0  # nothing indexed yet: nothing waits for the scan
        pending = tier.begin(msgspec.structs.replace(crash.header(2), tag="session:a"), crash.token_ids(2),
                             [crash.cells(2)])
        tier.scan_now()
        assert [e.tag for e in tier.entries()] == ["session:b"]
        assert tier.finish(pending) is None  # erased while it was written: removed, never indexed
        assert len(files(tmp_path)) == 1 and tier.stats().erased == 2
        tier.write(msgspec.structs.replace(crash.header(3), tag="session:a"), crash.token_ids(3), [crash.cells(3)])
        assert sorted(e.tag for e in tier.entries()) == ["session:a", "session:b"]  # a new one after is kept


def test_a_tier_over_a_smaller_budget_is_trimmed_once_scanned(tmp_path):
    with DiskTier(tmp_path, ENOUGH, headroom=0, scan=False) as tier:
        for seed in range(3):
            tier.write(msgspec.structs.replace(crash.header(seed), recompute_cost=10.0 + seed), crash.token_ids(seed),
                       [crash.cells(seed)])
        one = tier.stats().bytes_used // 3
    with DiskTier(tmp_path, int(1.5 * one), headroom=0, scan=False) as tier:
        tier.scan_now()
        stats = tier.stats()
        assert stats.bytes_used <= stats.budget_bytes and stats.evictions == 2
        assert [e.recompute_cost for e in tier.entries()] == [12.0]  # the dearest stayed


def test_a_file_that_cannot_be_read_is_not_found_and_nothing_is_reserved(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    put(pool, 1, 20)
    assert pool.wait_spilled(10)
    pool.evict(pool.entries()[0].id)
    disk_id = pool.lookup(MODEL, token_ids(1, 20)).entry_id
    for name in files(tmp_path):
        os.unlink(tmp_path / name)  # removed by hand
    with pytest.raises(EntryNotFound, match="cannot be read"):
        pool.load(disk_id, MODEL)
    assert pool.stats().entries == 0 and pool.lookup(MODEL, token_ids(1, 20)) is None


def test_an_entry_evicted_before_the_writer_reached_it_is_written_as_it_goes(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path, size=1 << 20)
    gate, reading = hold_the_writer(pool)
    first = put(pool, 1, 32)  # the writer holds this one
    assert reading.wait(10)
    second = put(pool, 2, 32)  # queued behind it
    try:
        pool.shed(pool.stats().bytes_used - 1)  # the only entry that can go is the second
        assert [e.id for e in pool.entries()] == [first.id]
        assert pool.stats().evicted_unspilled == 1
    finally:
        gate.set()
    assert pool.wait_spilled(10) and pool.disk_stats().entries == 2
    loaded = pool.load(pool.lookup(MODEL, token_ids(2, 32)).entry_id, MODEL)
    with pool.get(loaded.id) as view:
        assert np.array_equal(view.arrays["k"], cells(2, 32)) and loaded.id != second.id
    pool.release(loaded.id)


def test_the_writer_survives_a_failure_of_its_own_and_releases_the_entry(make_pool, tmp_path, monkeypatch):
    from kvpool import tiering

    real = tiering._disk_header
    calls = []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return real(*args)

    monkeypatch.setattr(tiering, "_disk_header", failing_once)
    pool = tiered(make_pool, tmp_path)
    first = put(pool, 1, 20)
    assert pool.wait_spilled(10) and pool.disk_stats().entries == 0
    assert pool.info(first.id).pins == 0  # the writer's view was given back
    put(pool, 2, 20)
    assert pool.wait_spilled(10) and pool.disk_stats().entries == 1


def test_erasing_evicts_the_memory_entries_nobody_holds_except_those_kept(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    put(pool, 1, 20, tag="session:a")  # nobody holds it: evicted
    kept = put(pool, 2, 20, tag="session:a")
    held = put(pool, 3, 20, tag="session:a")
    pool.share(held.id)
    assert pool.wait_spilled(10)
    pool.erase(tag="session:a", keep={kept.id})
    assert sorted(e.id for e in pool.entries()) == [kept.id, held.id]
    assert [e.tokens for e in pool.disk.entries()] == [20] and pool.lookup(MODEL, token_ids(2, 20)) is not None
    assert pool.lookup(MODEL, token_ids(1, 20)) is None and not pool.lookup(MODEL, token_ids(3, 20)).on_disk


def test_a_superseded_entry_leaves_memory_and_its_disk_copy_goes_once_the_new_one_is_written(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    old = put(pool, 1, 20, tag="session:a")
    assert pool.wait_spilled(10) and len(pool.disk.entries()) == 1
    gate, reading = hold_the_writer(pool)
    new = put(pool, 1, 30, tag="session:a")  # the same tokens and ten more
    assert reading.wait(10)
    other = put(pool, 2, 30)
    assert not pool.supersede(other.id, new.id)  # not a prefix of it: kept
    assert pool.supersede(old.id, new.id) and pool.stats().superseded == 1
    assert [e.id for e in pool.entries()] == [new.id, other.id]
    assert len(pool.disk.entries()) == 1  # the old copy stays while the new one is not on disk yet
    gate.set()
    assert pool.wait_spilled(10)
    assert sorted(e.tokens for e in pool.disk.entries()) == [30, 30]  # the new one and the other
    assert pool.stats().evictions == 0


def test_an_entry_memory_evicted_for_room_is_superseded_on_disk_unless_memory_names_its_copy_again(make_pool,
                                                                                                    tmp_path):
    # a returning conversation: the turn it resumed from left memory before the next turn parked;
    # its file must still go, or each turn's file crowds out conversations not yet back
    pool = tiered(make_pool, tmp_path, size=1 << 20)
    old = put(pool, 1, 20, tag="session:a")
    assert pool.wait_spilled(10)
    pool.shed(0)
    assert pool.entries() == [] and len(pool.disk.entries()) == 1
    loaded = pool.load(pool.lookup(MODEL, token_ids(1, 20)).entry_id, MODEL)
    pool.release(loaded.id)
    new = put(pool, 1, 30, tag="session:a")  # the same tokens and ten more
    other = put(pool, 2, 30)
    assert not pool.supersede(old.id, new.id)  # the loaded entry names that file: it stays with it
    assert not pool.supersede(old.id, other.id)  # not a prefix of that one
    pool.evict(loaded.id)
    assert pool.supersede(old.id, new.id) and pool.stats().superseded == 1
    assert not pool.supersede(old.id, new.id)  # once
    assert pool.wait_spilled(10)
    assert sorted(e.tokens for e in pool.disk.entries()) == [30, 30]  # the new one and the other
    assert pool.stats().evictions == 2 and not pool.supersede(10 ** 6, new.id)


def test_an_entry_evicted_before_its_file_was_flushed_is_superseded_once_it_is(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path, size=1 << 20)
    gate, reading = hold_the_writer(pool)
    first = put(pool, 1, 32)  # the writer holds this one
    assert reading.wait(10)
    old = put(pool, 2, 20, tag="session:a")  # queued behind it, then evicted: written into the page cache
    try:
        pool.shed(pool.stats().bytes_used - 1)
        assert pool.stats().evicted_unspilled == 1
        new = put(pool, 2, 30, tag="session:a")
        assert pool.supersede(old.id, new.id) and pool.stats().superseded == 1
    finally:
        gate.set()
    assert pool.wait_spilled(10)
    assert sorted(e.tokens for e in pool.disk.entries()) == [30, 32]  # the old file went once the new was written
    assert first.id in [e.id for e in pool.entries()]


def test_an_entry_of_another_tag_is_not_superseded(make_pool, tmp_path):
    # a fork's park must not take its parent's entry along: deleting the fork would erase both
    pool = tiered(make_pool, tmp_path, size=1 << 20)
    parent = put(pool, 1, 20, tag="session:parent")
    child = put(pool, 1, 30, tag="session:child")
    assert not pool.supersede(parent.id, child.id)
    assert pool.wait_spilled(10)
    pool.evict(parent.id)
    assert not pool.supersede(parent.id, child.id)  # (and not as a file either)
    pool.shed(0)
    assert not pool.supersede(parent.id, child.id)
    assert sorted(e.tokens for e in pool.disk.entries()) == [20, 30]


def test_an_entry_parked_again_with_nothing_new_keeps_its_file(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    old = put(pool, 1, 20, tag="session:a")
    assert pool.wait_spilled(10)
    again = put(pool, 1, 20, tag="session:a")  # the same tokens and cells: the writer adopts the file
    assert pool.supersede(old.id, again.id) and pool.wait_spilled(10)
    assert [e.tokens for e in pool.disk.entries()] == [20] and pool.disk_stats().writes == 1
    pool.evict(again.id)
    assert pool.lookup(MODEL, token_ids(1, 20)).on_disk


def test_an_entry_erased_or_removed_from_disk_while_it_is_loaded(make_pool, tmp_path, monkeypatch):
    # a load on a request's thread can meet its owner's deletion, or the file's removal
    pool = tiered(make_pool, tmp_path)
    put(pool, 1, 20, tag="session:a")
    assert pool.wait_spilled(10)
    pool.shed(0)
    disk_id = pool.lookup(MODEL, token_ids(1, 20)).entry_id
    reserve = pool.reserve
    meanwhile = [lambda: pool.erase(tag="session:a")]

    def reserve_then(*args, **kwargs):
        writer = reserve(*args, **kwargs)
        if meanwhile:  # (the test's own puts reserve too)
            meanwhile.pop()()
        return writer

    monkeypatch.setattr(pool, "reserve", reserve_then)
    with pytest.raises(EntryNotFound, match="erased"):
        pool.load(disk_id, MODEL)
    assert pool.entries() == [] and pool.disk.entries() == []  # nothing of it came back
    put(pool, 2, 20, tag="session:b")
    assert pool.wait_spilled(10)
    pool.shed(0)
    disk_id = pool.lookup(MODEL, token_ids(2, 20)).entry_id
    meanwhile.append(lambda: pool.disk.remove(disk_id))
    loaded = pool.load(disk_id, MODEL)  # read whole before the file went: written anew
    pool.release(loaded.id)
    assert pool.wait_spilled(10)
    assert [(e.tokens, e.tag) for e in pool.disk.entries()] == [(20, "session:b")]
    pool.evict(loaded.id)
    assert pool.lookup(MODEL, token_ids(2, 20)).on_disk


def test_a_pool_without_a_tier_supersedes_only_what_memory_holds(make_pool):
    pool = make_pool(1 << 20)
    old = put(pool, 1, 20)
    pool.shed(0)  # evicted for room, and no tier keeps it
    new = put(pool, 1, 30)
    assert not pool.supersede(old.id, new.id) and pool.stats().superseded == 0


def test_an_entry_held_or_of_another_namespace_is_not_superseded(make_pool, tmp_path):
    pool = tiered(make_pool, tmp_path)
    held = put(pool, 1, 20)
    pool.share(held.id)
    new = put(pool, 1, 30)
    assert not pool.supersede(held.id, new.id)
    elsewhere = pool.put(MODEL, token_ids(1, 20), [KVArray("k", cells(1, 20), 1)], namespace="tenant-b")
    pool.release(elsewhere.id)
    assert not pool.supersede(elsewhere.id, new.id)
    assert len(pool.entries()) == 3


def test_an_entry_superseded_while_the_writer_reads_it_goes_when_it_is_done_and_a_tail_is_allowed(make_pool,
                                                                                                 tmp_path):
    pool = tiered(make_pool, tmp_path)
    gate, reading = hold_the_writer(pool)
    old = pool.put(MODEL, token_ids(1, 20) + [7, 7], [KVArray("k", cells(1, 22), 1)])  # two tokens the next lacks
    pool.release(old.id)
    assert reading.wait(10)
    new = put(pool, 1, 30)
    assert not pool.supersede(old.id, new.id)  # its last two tokens are not the new one's
    assert pool.supersede(old.id, new.id, tail=2)
    assert old.id in [e.id for e in pool.entries()]  # the writer still reads it
    gate.set()
    assert pool.wait_spilled(10)
    assert [e.id for e in pool.entries()] == [new.id] and [e.tokens for e in pool.disk.entries()] == [30]
