"""Idle sessions cost memory and log space, never scheduler time: a tick looks at the lanes and the
waiting work, not at every session the host keeps."""

from superfluid.host.log import Opened, SessionLog, Tokens
from superfluid.host.sampling import Sampling

PROMPT = "The capital of France is Paris. The quick brown fox"
IDLE = 100_000


class Watched(dict):
    """A dict that counts every walk over its keys, values or items (a lookup is not a walk)."""

    walks = 0

    def __iter__(self):
        Watched.walks += 1
        return super().__iter__()

    def keys(self):
        Watched.walks += 1
        return super().keys()

    def values(self):
        Watched.walks += 1
        return super().values()

    def items(self):
        Watched.walks += 1
        return super().items()


def test_a_tick_never_walks_the_idle_sessions(open_host):
    host = open_host()
    sessions = host.commands.sessions

    def open_idle():  # on the scheduler thread, in one command
        for _ in range(IDLE):
            sessions.open(None, Sampling(), "default")
        host._log.compact()  # the log's housekeeping is behind it: what follows is ticks alone

    host.call(open_idle)
    busy = host.session()
    busy.append_text(PROMPT)

    def watch():
        Watched.walks = 0
        sessions.durable = Watched(sessions.durable)
        host._log.states = Watched(host._log.states)

    host.call(watch)
    generation = busy.generate(max_tokens=24, ignore_eos=True)
    generation.collect()
    walks = host.call(lambda: Watched.walks)
    assert len(generation.tokens) == 24 and host.stats().sessions == IDLE + 1
    assert walks == 0, f"the ticks of a 24-token generation walked the {IDLE} sessions {walks} times"


def test_the_logs_compaction_check_walks_the_sessions_only_when_compaction_may_be_due(tmp_path):
    log = SessionLog(tmp_path)
    try:
        for i in range(5000):  # about 1.3 MB of records for a snapshot estimated larger: no compaction due
            log.append(Opened(f"s{i}", 0.0, Sampling(), "default"), Tokens(f"s{i}", 0, list(range(100)) * 2))
        Watched.walks = 0
        log.states = Watched(log.states)
        assert not any(log.should_compact() for _ in range(1000))  # asked at every tick
        assert Watched.walks == 1
        # not again until the records written could outweigh the snapshot it measured (twice its size)
        log.append(*[Tokens(f"s{i}", 200, list(range(100)) * 2) for i in range(5000)])  # another ~1 MB
        assert not log.should_compact() and Watched.walks == 1
    finally:
        log.close()
