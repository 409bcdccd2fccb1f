"""The session log: replay, torn tails, damage in the middle, compaction, sync policies."""

import os

import pytest

from superfluid.host.errors import LogCorrupt
from superfluid.host.log import FILE_HEADER, SessionLog
from superfluid.host.log_records import Deleted, Opened, Parked, Tokens, Trimmed, Turn
from superfluid.host.sampling import Sampling


def opened(session="a"):
    return Opened(session, 1.0, Sampling(seed=3), "default")


def write_some(directory, sync="tick"):
    log = SessionLog(directory, sync)
    log.append(opened("a"), Turn("a", "user", "hi", 3), Tokens("a", 0, [1, 2, 3]))
    log.append(Tokens("a", 3, [4]))
    log.append(Parked("a", 7, 4))
    log.append(opened("b"), Tokens("b", 0, [9]))
    log.close()
    return log.path


def test_replay_gives_every_session_back(tmp_path):
    write_some(tmp_path)
    log = SessionLog(tmp_path)
    a = log.states["a"]
    assert a.tokens == [1, 2, 3, 4] and a.messages == [{"role": "user", "content": "hi"}] and a.parked == (7, 4)
    assert a.sampling.seed == 3 and log.states["b"].tokens == [9] and log.records_replayed == 7
    log.close()


@pytest.mark.parametrize("cut", [1, 5, 11, 12, 13])
def test_a_torn_last_record_is_cut_off_and_the_rest_kept(tmp_path, cut):
    path = write_some(tmp_path)
    size = path.stat().st_size
    with open(path, "ab") as handle:  # a record torn at `cut` bytes
        handle.write(b"\x20\x00\x00\x00" + b"\x11" * 8 + b"\x92" * 32)
    os.truncate(path, size + cut)
    log = SessionLog(tmp_path)
    assert log.truncated_bytes == cut and path.stat().st_size == size
    assert log.states["a"].tokens == [1, 2, 3, 4]
    log.append(Tokens("b", 1, [10]))  # and it goes on
    log.close()
    assert SessionLog(tmp_path).states["b"].tokens == [9, 10]


def test_a_damaged_record_in_the_middle_refuses_to_start(tmp_path):
    path = write_some(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(FILE_HEADER) + 14] ^= 0xFF  # inside the first record's payload
    path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match=r"damaged at byte 8 \(to byte \d+\), with intact records after it.*superfluid log repair"):
        SessionLog(tmp_path)
    assert path.read_bytes() == bytes(data)  # nothing was cut


def test_a_file_that_is_not_a_log_is_refused(tmp_path):
    (tmp_path / "sessions.log").write_bytes(b"hello world")
    with pytest.raises(LogCorrupt, match="not a superfluid session log"):
        SessionLog(tmp_path)


def test_records_that_contradict_the_log_are_refused(tmp_path):
    log = SessionLog(tmp_path)
    log.append(opened("a"), Tokens("a", 0, [1]))
    with pytest.raises(LogCorrupt, match="has 1 tokens but a record continues it at 5"):
        log.append(Tokens("a", 5, [2]))
    with pytest.raises(LogCorrupt, match="never opened"):
        log.append(Tokens("zz", 0, [2]))


def test_trims_and_deletes_are_compacted_away(tmp_path):
    log = SessionLog(tmp_path)
    log.append(opened("a"), Turn("a", "user", "one", 2), Tokens("a", 0, [1, 2]), Turn("a", "user", "two", 4),
               Tokens("a", 2, [3, 4]), Parked("a", 5, 4))
    log.append(opened("gone"), Tokens("gone", 0, [1] * 1000), Deleted("gone"))
    log.append(Trimmed("a", 3))
    assert log.states["a"].messages == [{"role": "user", "content": "one"}] and log.states["a"].parked is None
    before = log.path.stat().st_size
    log.close()
    again = SessionLog(tmp_path)  # a deleted session in the log: compacted on open
    assert "gone" not in again.states and again.path.stat().st_size < before
    assert again.states["a"].tokens == [1, 2, 3] and again.states["a"].message_ends == [2]
    again.close()


@pytest.mark.parametrize("policy, synced", [("tick", True), ("commit", False), ("never", False)])
def test_sync_policies(tmp_path, policy, synced):
    log = SessionLog(tmp_path, policy)
    log.append(opened("a"))
    assert log.sync() is synced  # "commit" synced already; "never" leaves it to the kernel
    assert log.sync() is False
    log.close()


def test_a_batch_is_written_once_at_its_end_and_other_threads_are_not_held(tmp_path):
    import threading

    log = SessionLog(tmp_path)
    log.append(opened("a"), opened("b"))
    writes = []
    write = log._write
    log._write = lambda blob: (writes.append(len(blob)), write(blob))
    size = log.path.stat().st_size
    with log.batch():
        log.append(Tokens("a", 0, [1, 2]))
        log.append(Tokens("b", 0, [7]))
        assert log.states["a"].tokens == [1, 2] and log.path.stat().st_size == size  # applied, not yet written
        other = threading.Thread(target=log.append, args=(opened("c"),))
        other.start()
        other.join()
        assert len(writes) == 1  # another thread's append is written at once
    assert len(writes) == 2 and log.path.stat().st_size == size + sum(writes)
    log.close()
    again = SessionLog(tmp_path)
    assert again.states["a"].tokens == [1, 2] and again.states["b"].tokens == [7] and "c" in again.states
    again.close()


def test_the_tick_policy_syncs_on_its_own_thread_without_holding_the_writer(tmp_path, monkeypatch):
    import threading

    from superfluid.host import log as log_module

    started, release, threads = threading.Event(), threading.Event(), []
    real_fsync = os.fsync

    def slow_fsync(fd):  # a disk that takes its time
        threads.append(threading.current_thread().name)
        started.set()
        release.wait(timeout=60)
        real_fsync(fd)

    monkeypatch.setattr(log_module.os, "fsync", slow_fsync)
    log = SessionLog(tmp_path, "tick")
    log.append(opened("a"))
    log.sync_soon()
    assert started.wait(timeout=60)
    log.append(Tokens("a", 0, [1]))  # written while the fsync runs: neither waits for the other
    log.sync_soon()
    release.set()
    log.close()  # the syncer ends; close syncs what is left
    assert threads[0] == "superfluid-log-sync"
    again = SessionLog(tmp_path)
    assert again.states["a"].tokens == [1]
    again.close()


def test_a_failed_background_fsync_is_raised_by_the_next_sync(tmp_path, monkeypatch):
    import threading

    from superfluid.host import log as log_module

    failed = threading.Event()

    def broken_fsync(fd):
        failed.set()
        raise OSError(5, "Input/output error")

    log = SessionLog(tmp_path, "tick")
    log.append(opened("a"))
    monkeypatch.setattr(log_module.os, "fsync", broken_fsync)
    log.sync_soon()
    assert failed.wait(timeout=60)
    log._syncer.stop()  # the failure is recorded before the thread ends
    with pytest.raises(OSError, match="Input/output error"):
        log.sync_soon()
    monkeypatch.undo()
    assert log.sync() is True  # still owed to the disk
    log.close()


def test_an_unknown_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="log sync policy 'sometimes'"):
        SessionLog(tmp_path, "sometimes")


def test_a_contradicting_append_writes_nothing(tmp_path):
    log = SessionLog(tmp_path)
    log.append(opened("a"))
    size = log.path.stat().st_size
    with pytest.raises(LogCorrupt, match="continues it at 2"):
        log.append(Tokens("a", 0, [1]), Tokens("a", 2, [2]))  # the second does not follow the first
    assert log.path.stat().st_size == size and log.states["a"].tokens == []
    log.close()


def test_one_log_directory_serves_one_host_at_a_time(tmp_path):
    from superfluid.host.errors import LogBusy

    log = SessionLog(tmp_path)
    with pytest.raises(LogBusy, match="another Host is using the session log"):
        SessionLog(tmp_path)
    log.close()
    SessionLog(tmp_path).close()  # free again


def test_a_turn_a_generation_opened_stays_marked_open_through_compaction_until_a_message_closes_it(
        tmp_path, monkeypatch):
    from superfluid.host import log_records

    monkeypatch.setattr(log_records, "TOKENS_PER_RECORD", 4)  # the opening falls inside a split
    log = SessionLog(tmp_path)
    log.append(Opened("s", 1.0, Sampling(), "default"), Turn("s", "user", "hi", 3), Tokens("s", 0, [1, 2, 3]))
    log.append(Tokens("s", 3, [4, 5, 6], opens_turn=True), Tokens("s", 6, [7, 8, 9, 10, 11]))
    assert log.states["s"].open_turn == (3, 6)  # across the split at 4
    log.compact()
    log.close()
    again = SessionLog(tmp_path)
    state = again.states["s"]
    assert state.open_turn == (3, 6) and state.tokens == list(range(1, 12))
    again.append(Trimmed("s", 9))
    assert again.states["s"].open_turn == (3, 6)  # a cut into the reply leaves the turn open
    again.append(Turn("s", "assistant", "ok", 9))
    assert again.states["s"].open_turn is None
    again.append(Tokens("s", 9, [12, 13], opens_turn=True), Trimmed("s", 10))
    assert again.states["s"].open_turn is None  # a cut into the opening: no turn is open
    again.close()
