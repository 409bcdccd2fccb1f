"""Memory pressure: the pool's budget holds, watermarks shed cached entries, pins keep theirs."""

import pytest

from superfluid import PinLimit

PROMPT = "The capital of France is Paris. The quick brown fox"


def test_parked_kv_is_shed_past_the_high_watermark_but_pinned_kv_stays(open_host):
    host = open_host(pool_bytes=1 << 20, checkpoint_tokens=8, high_watermark=0.5, low_watermark=0.25)
    keeper = host.session()
    keeper.append_text(PROMPT)
    keeper.complete(max_tokens=4)
    pinned = keeper.pin()
    entry = host._scheduler.sessions.get(keeper.id).entry
    budget = host.pool.stats().budget_bytes
    assert 0 < pinned <= budget
    for i in range(12):
        s = host.session()
        s.append_text(f"{PROMPT} {i} " * 6)
        s.complete(max_tokens=40)
        used = host.pool.stats().bytes_used
        assert used <= budget  # never past the export budget
    stats = host.stats()
    assert stats.evictions > 0 and host.pool.stats().bytes_used <= 0.5 * budget + (64 << 10)
    assert host.pool.info(entry).pins == 1  # the pinned session's KV is still there
    keeper.unpin()
    assert host.pool.info(entry).pins == 0


def test_a_pin_past_the_cap_is_refused_with_the_figures(open_host):
    host = open_host(max_pinned_fraction=0.0)
    s = host.session()
    s.append_text(PROMPT)
    with pytest.raises(Exception, match="no KV to pin yet"):
        s.pin()
    s.complete(max_tokens=2)
    with pytest.raises(PinLimit, match=r"over the cap of 0 \(0% of the pool's budget\); unpin other sessions"):
        s.pin()
    assert host.pool.pinned_bytes() == 0


def test_bad_watermarks_are_refused(open_host):
    with pytest.raises(ValueError, match="watermarks must satisfy"):
        open_host(high_watermark=0.5, low_watermark=0.8)
