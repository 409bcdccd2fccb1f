"""The session log refuses to guess and keeps what is intact: frames that detect their own damage,
records numbered within their session, `superfluid log check | repair`, logs of format 1, and
files no one else can read."""

import os
import stat
import struct
import subprocess
import sys

import msgspec
import pytest
import xxhash

from superfluid.host import log as log_module
from superfluid.host import log_records
from superfluid.host.errors import LogCorrupt
from superfluid.host.log import SessionLog
from superfluid.host.log_records import Opened, Tokens, Turn, counter
from superfluid.host.log_format import FILE_HEADER, Damage, file_header, frame, scan
from superfluid.host.log_repair import examine, repair
from superfluid.host.sampling import Sampling
from tests.conftest import remove_segment, unique_pool_name
from tests.superfluid.served import ROOT

SESSIONS = [f"s{i}" for i in range(5)]


def five_sessions(directory):
    """Five sessions, each opened with two tokens, then each given a message and a third token:
    records in the order s0 Opened, s0 Tokens, s1 Opened, ..., then s0 Turn, s0 Tokens, ..."""
    log = SessionLog(directory)
    for i, session in enumerate(SESSIONS):
        log.append(Opened(session, 1.0, Sampling(seed=i), "default"))
        log.append(Tokens(session, 0, [i, i + 1]))
    for i, session in enumerate(SESSIONS):
        log.append(Turn(session, "user", f"message {i}", 3))
        log.append(Tokens(session, 2, [i + 2]))
    log.close()
    return log.path


def frames_of(path):
    return [found for found in scan(path.read_bytes(), 2)]


def test_a_bit_flipped_in_a_length_refuses_to_start_and_changes_nothing(tmp_path):
    path = five_sessions(tmp_path)
    second = frames_of(path)[1]  # s0's first Tokens record
    data = bytearray(path.read_bytes())
    data[second.offset + 1] ^= 0x04  # its length now points 1,024 bytes further: no longer a torn tail
    path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match=rf"damaged at byte {second.offset} .*`superfluid log repair {tmp_path}`"):
        SessionLog(tmp_path)
    assert path.read_bytes() == bytes(data)  # nothing cut before a person decides


def test_check_says_what_a_repair_keeps_and_repair_keeps_every_intact_record(tmp_path):
    path = five_sessions(tmp_path)
    second = frames_of(path)[1]
    data = bytearray(path.read_bytes())
    data[second.offset + 1] ^= 0x04
    path.write_bytes(bytes(data))
    report = examine(tmp_path)
    assert report.needs_repair and report.damage == [Damage(second.offset, second.end)]
    # s0 lost its first Tokens record: it keeps what came before (its opening, no tokens), and
    # everything of it after the gap goes; the four others are whole
    assert list(report.cut) == ["s0"] and report.cut["s0"].tokens_kept == 0 and report.cut["s0"].opened
    assert report.cut["s0"].records_dropped == 2 and "record 1 is missing" in report.cut["s0"].why
    assert path.read_bytes() == bytes(data)  # check changes nothing
    report, kept = repair(tmp_path)
    assert kept.read_bytes() == bytes(data) and stat.S_IMODE(kept.stat().st_mode) == 0o600
    log = SessionLog(tmp_path)
    assert set(log.states) == set(SESSIONS) and log.states["s0"].tokens == [] and log.states["s0"].messages == []
    for i, session in enumerate(SESSIONS[1:], start=1):
        assert log.states[session].tokens == [i, i + 1, i + 2] and log.states[session].messages[0]["content"] == f"message {i}"
    log.append(Tokens("s0", 0, [7]))  # and the repaired log goes on
    log.close()
    assert not examine(tmp_path).needs_repair


def test_a_record_missing_from_a_session_is_a_gap_even_where_no_byte_is_damaged(tmp_path):
    path = five_sessions(tmp_path)
    frames = frames_of(path)
    turn = frames[10]  # s0's Turn: the tokens of the session still line up without it
    data = path.read_bytes()
    path.write_bytes(data[:turn.offset] + data[turn.end:])
    with pytest.raises(LogCorrupt, match="record 3 of session 's0' where record 2 was due"):
        SessionLog(tmp_path)
    report = examine(tmp_path)
    assert not report.damage and list(report.cut) == ["s0"] and report.cut["s0"].tokens_kept == 2


def test_a_session_whose_opening_was_lost_goes_whole(tmp_path):
    path = five_sessions(tmp_path)
    opening = frames_of(path)[2]  # s1's Opened
    data = bytearray(path.read_bytes())
    data[opening.offset + 30] ^= 0xFF  # in its payload
    path.write_bytes(bytes(data))
    report = examine(tmp_path)
    assert list(report.cut) == ["s1"] and not report.cut["s1"].opened and "s1" not in report.states
    assert len(report.states) == 4


def test_the_command_line_checks_and_repairs(tmp_path):
    path = five_sessions(tmp_path)
    data = bytearray(path.read_bytes())
    data[frames_of(path)[1].offset + 1] ^= 0x04
    path.write_bytes(bytes(data))

    def superfluid(*args):
        return subprocess.run([sys.executable, "-m", "superfluid", "log", *args, str(tmp_path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    checked = superfluid("check")
    assert checked.returncode == 1 and "session s0: cut at byte" in checked.stdout and "log repair" in checked.stdout
    as_json = msgspec.json.decode(superfluid("check", "--json").stdout)
    assert as_json["needs_repair"] and as_json["cut"][0]["session"] == "s0"
    repaired = superfluid("repair")
    assert repaired.returncode == 0 and "the damaged file is kept at" in repaired.stdout
    again = superfluid("check")
    assert again.returncode == 0 and "nothing to repair" in again.stdout


def test_a_torn_tail_is_still_cut_off_at_the_start(tmp_path):
    path = five_sessions(tmp_path)
    size = path.stat().st_size
    with open(path, "ab") as handle:
        handle.write(b"\0" * 300)  # what a file system leaves of a write it never finished
    log = SessionLog(tmp_path)
    assert log.truncated_bytes == 300 and path.stat().st_size == size and len(log.states) == 5
    log.close()


def v1_log(records) -> bytes:
    """A log as superfluid wrote it in format 1: length | xxh3-64 | payload."""
    frames = [file_header(1)]
    for record in records:
        payload = msgspec.msgpack.encode(record)
        frames.append(struct.pack("<IQ", len(payload), xxhash.xxh3_64_intdigest(payload)) + payload)
    return b"".join(frames)


def test_a_log_of_format_2_is_read_and_rewritten_as_format_3_and_holds_tool_calls_after(tmp_path):
    records = [Opened("a", 1.0, Sampling(seed=2), "default", tenant="t"), Turn("a", "user", "hi", 2),
               Tokens("a", 0, [5, 6])]
    numbers: dict = {}
    number = counter(numbers)
    (tmp_path / "sessions.log").write_bytes(
        file_header(2) + b"".join(frame(msgspec.msgpack.encode(r), number(r)) for r in records))
    log = SessionLog(tmp_path)
    assert log.path.read_bytes().startswith(FILE_HEADER) and FILE_HEADER == file_header(3)  # rewritten on open
    assert log.states["a"].tokens == [5, 6] and log.states["a"].tenant == "t" and log.states["a"].tools is None
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    log.append(Turn("a", "assistant", "", 2, tool_calls=[call]), Turn("a", "tool", "42", 2, tool_call_id="c1", name="f"))
    log.close()
    again = SessionLog(tmp_path)
    assert again.states["a"].messages == [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "", "tool_calls": [call]},
                                          {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}]
    again.close()


def test_a_log_of_a_format_this_release_does_not_know_is_refused_naming_it(tmp_path):
    (tmp_path / "sessions.log").write_bytes(file_header(4))
    with pytest.raises(LogCorrupt, match="format 4"):
        SessionLog(tmp_path)
    assert (tmp_path / "sessions.log").read_bytes() == file_header(4)  # left as it was


def test_a_log_of_format_1_is_read_and_rewritten_in_the_current_format(tmp_path):
    (tmp_path / "sessions.log").write_bytes(v1_log([Opened("a", 1.0, Sampling(seed=2), "default"),
                                                    Turn("a", "user", "hi", 2), Tokens("a", 0, [5, 6])]))
    log = SessionLog(tmp_path)
    assert log.states["a"].tokens == [5, 6] and log.states["a"].messages == [{"role": "user", "content": "hi"}]
    log.append(Tokens("a", 2, [7]))
    log.close()
    assert log.path.read_bytes().startswith(FILE_HEADER)
    again = SessionLog(tmp_path)
    assert again.states["a"].tokens == [5, 6, 7]
    again.close()


def test_a_log_of_format_1_damaged_in_the_middle_is_repaired_too(tmp_path):
    records = [Opened("a", 1.0, Sampling(), "default"), Tokens("a", 0, [1]), Opened("b", 1.0, Sampling(), "default"),
               Tokens("a", 1, [2]), Tokens("b", 0, [3])]
    data = bytearray(v1_log(records))
    data[len(FILE_HEADER) + 20] ^= 0xFF  # inside a's opening
    (tmp_path / "sessions.log").write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match="superfluid log repair"):
        SessionLog(tmp_path)
    repair(tmp_path)
    log = SessionLog(tmp_path)
    assert set(log.states) == {"b"} and log.states["b"].tokens == [3]
    log.close()


def test_the_log_is_private_and_never_opened_through_a_link(tmp_path):
    previous = os.umask(0o022)
    try:
        directory = tmp_path / "logs"
        SessionLog(directory).close()
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        for name in ("sessions.log", "sessions.lock"):
            assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600
        (directory / "sessions.log").chmod(0o644)  # as logs were written before
        SessionLog(directory).close()
        assert stat.S_IMODE((directory / "sessions.log").stat().st_mode) == 0o600
    finally:
        os.umask(previous)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"someone's file")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "sessions.log").symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="symbolic link"):
        SessionLog(linked)
    assert elsewhere.read_bytes() == b"someone's file"


def test_compaction_replaces_a_link_left_where_it_writes_and_never_follows_it(tmp_path):
    log = SessionLog(tmp_path)
    log.append(Opened("a", 1.0, Sampling(), "default"), Tokens("a", 0, [1, 2]))
    target = tmp_path / "target"
    target.write_bytes(b"untouched")
    (tmp_path / "sessions.compacting").symlink_to(target)
    log.compact()
    log.close()
    assert target.read_bytes() == b"untouched" and SessionLog(tmp_path).states["a"].tokens == [1, 2]


def test_a_record_over_the_limit_is_refused_before_it_is_written_and_long_sessions_are_split(tmp_path, monkeypatch):
    log = SessionLog(tmp_path)
    log.append(Opened("a", 1.0, Sampling(), "default"))
    size = log.path.stat().st_size
    monkeypatch.setattr(log_module, "MAX_RECORD", 200)
    with pytest.raises(ValueError, match="over the log's 200-byte limit"):
        log.append(Tokens("a", 0, list(range(1000, 1200))))
    assert log.path.stat().st_size == size and log.states["a"].tokens == []
    monkeypatch.setattr(log_records, "TOKENS_PER_RECORD", 30)
    log.append(*[Tokens("a", start, list(range(start, start + 10))) for start in range(0, 100, 10)])
    snapshot = log.states["a"].snapshot()
    assert [len(record.tokens) for record in snapshot if isinstance(record, Tokens)] == [30, 30, 30, 10]
    log.compact()
    log.close()
    assert SessionLog(tmp_path).states["a"].tokens == list(range(100))


def test_serve_refuses_a_log_damaged_in_the_middle_and_names_the_repair(tiny_models, tmp_path):
    path = five_sessions(tmp_path / "log")
    data = bytearray(path.read_bytes())
    data[frames_of(path)[1].offset + 1] ^= 0x04  # the second record's length: it used to keep 1 of 5 sessions
    path.write_bytes(bytes(data))
    pool = unique_pool_name()
    try:
        done = subprocess.run([sys.executable, "-m", "superfluid", "serve", str(tiny_models["f32"].gguf), "--port", "0",
                               "--pool-name", pool, "--pool-bytes", "64M", "--log-dir", str(tmp_path / "log")],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        remove_segment(pool)
    assert done.returncode == 1 and f"superfluid log repair {tmp_path / 'log'}" in done.stderr
    assert path.read_bytes() == bytes(data)
