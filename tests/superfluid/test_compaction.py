"""Compaction runs beside the appends, on a thread of its own: no step waits for it, nothing
appended meanwhile is lost, and a disk that refuses it leaves the log as it was."""

import errno
import time

from superfluid.host.log import Deleted


def test_the_host_compacts_its_log_beside_its_steps(open_host, monkeypatch):
    from superfluid.host import log as log_module

    monkeypatch.setattr(log_module, "COMPACTION_FLOOR", 2048)
    host = open_host()
    log = host._log
    log._next_compaction_check = 2048
    sessions = [host.session() for _ in range(4)]
    for session in sessions:
        session.append_text("The capital of France is")
        session.complete(max_tokens=30, ignore_eos=True)
        session.trim(3)  # what a compaction drops
    compactor = None
    deadline = time.monotonic() + 60
    while compactor is None and time.monotonic() < deadline:
        sessions[0].complete(max_tokens=8, ignore_eos=True)  # steps: the scheduler looks at the log
        compactor = log._compactor
    assert compactor is not None and compactor.name == "superfluid-log-compact"
    log.join_compaction()
    kept = {session.id: session.tokens for session in sessions}
    host.close()
    again = open_host()
    assert {sid: again.session(id=sid).tokens for sid in kept} == kept


def test_a_compaction_the_disk_refuses_leaves_the_log_and_waits(tmp_path, monkeypatch):
    from superfluid.host.log import Opened, SessionLog, Tokens
    from superfluid.host.sampling import Sampling

    log = SessionLog(tmp_path)
    log.append(Opened("a", 1.0, Sampling(), "default"), Tokens("a", 0, [1, 2]))
    data = log.path.read_bytes()

    def refused(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("superfluid.host.log.write_beside", refused)
    log.compact_beside()
    log.join_compaction()
    assert log.path.read_bytes() == data and not log.should_compact()  # as it was; not tried again at once
    log.append(Tokens("a", 2, [3]))
    log.close()
    assert SessionLog(tmp_path).states["a"].tokens == [1, 2, 3]


def test_a_compaction_beside_the_appends_keeps_what_was_appended_meanwhile(tmp_path, monkeypatch):
    from superfluid.host import log as log_module
    from superfluid.host import log_format
    from superfluid.host.log import Opened, SessionLog, Tokens, Trimmed
    from superfluid.host.sampling import Sampling

    log = SessionLog(tmp_path)
    log.append(Opened("a", 1.0, Sampling(), "default"), Tokens("a", 0, list(range(50))), Trimmed("a", 10))
    log.append(Opened("gone", 1.0, Sampling(), "default"), Deleted("gone"))
    write_beside = log_module.write_beside

    def slow_write(path, data):  # the scheduler appends while the snapshot is written
        log.append(Tokens("a", 10, [77, 78]), Opened("b", 1.0, Sampling(), "default"), Tokens("b", 0, [5]))
        return write_beside(path, data)
    monkeypatch.setattr(log_module, "write_beside", slow_write)
    log.compact_beside()
    log.join_compaction()
    kinds = {type(log_module.decode_record(found.payload, "")).__name__
             for found in log_format.scan(log.path.read_bytes(), log_format.VERSION)}
    assert kinds == {"Opened", "Tokens"}  # compacted: no trim, no deletion left
    log.append(Tokens("b", 1, [6]))  # numbered on from the new file's records
    log.close()
    again = SessionLog(tmp_path)
    assert again.states["a"].tokens == list(range(10)) + [77, 78] and again.states["b"].tokens == [5, 6]
    assert "gone" not in again.states
    again.close()
