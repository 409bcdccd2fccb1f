"""The Host and serve with their disk tier: sessions resumed from disk once memory is gone, deleted
and expired sessions erased from it, a budget held under many parks, and a start-up scan that no
answer waits for. (The tier's own files, crashes and budget: tests/kvpool/test_disk.py; every
memory kind after a reboot: test_memory_kinds_host.py.)"""

from __future__ import annotations

import json
import threading
import time

import pytest

from kvpool import places, segment
from kvpool.disk import DiskTier
from kvpool.tier_folder import remove_tier
from tests.conftest import remove_segment, unique_pool_name
from tests.superfluid.served import Served
from tests.superfluid.test_limits import idle_rounds_until

TEXT = "The capital of France is Paris. The capital of Italy is Rome."


def parked_on_disk(host) -> list:
    """The disk tier's entries once everything the pool queued is written."""
    assert host.pool.wait_spilled(60)
    return host.pool.disk.entries()


def test_sessions_past_the_pools_budget_come_back_from_disk(open_host, runtime):
    host = open_host(pool_bytes=4 << 20, export_budget=160 << 10)  # about four sessions' KV (~37 KB each)
    sessions = []
    for i in range(12):
        session = host.session()
        session.append_text(f"{i}: {TEXT * 4}")
        session.complete(max_tokens=4)
        sessions.append((session, list(session.tokens)))
    host.close()  # every lane parked: the pool keeps what its budget holds, the disk all of them
    again = open_host()
    assert again.pool.disk.wait_scanned(60)
    assert again.pool.stats().entries < 12 <= len(again.pool.disk.entries())
    for session, tokens in sessions:
        resumed = again.session(id=session.id)
        generation = resumed.generate(max_tokens=1)
        generation.collect()
        assert generation.cached_tokens == len(tokens) - 1  # nothing prefilled but the last token
    tiers = again.stats().tiers
    assert tiers["disk"].hits >= 12 - again.pool.stats().entries and tiers["disk"].misses == 0


def test_deleting_or_expiring_a_session_erases_it_from_disk_and_retiring_keeps_it(open_host, clock):
    host = open_host(session_expiry_seconds=100)
    kept, deleted, expired, retired = (host.session() for _ in range(4))
    for session in (kept, deleted, expired, retired):
        session.append_text(TEXT)
        session.complete(max_tokens=2)
    clock.advance(6)  # past idle_park_seconds: the idle lanes are parked, and so queued for the disk
    idle_rounds_until(host, lambda: host.stats().lanes == 0)
    tags = {e.tag for e in parked_on_disk(host)}
    assert {f"session:{s.id}" for s in (kept, deleted, expired, retired)} <= tags
    host.delete(deleted.id)
    host.retire(retired.id)
    clock.advance(50)
    kept.append_text(" More.")  # a change: kept's idle time starts again
    clock.advance(60)
    idle_rounds_until(host, lambda: host.stats().expired_sessions >= 1)
    assert host.stats().expired_sessions == 1
    tags = {e.tag for e in parked_on_disk(host)}
    assert f"session:{deleted.id}" not in tags and f"session:{expired.id}" not in tags
    assert f"session:{kept.id}" in tags and f"session:{retired.id}" in tags  # retired: cached for its prefix
    assert host.pool.disk_stats().erased >= 2


def test_the_disk_budget_holds_under_a_stream_of_parks(open_host, clock):
    host = open_host(disk_budget=1 << 30)
    assert host.pool.disk_stats().budget_bytes == 1 << 30
    budget = host.pool.disk.budget_bytes = 4 * 40 * host.descriptor.cell_price  # four sessions' files, about
    for i in range(16):
        session = host.session()
        session.append_text(f"{i}: {TEXT * 3}")
        session.complete(max_tokens=2)
        clock.advance(6)  # its lane idle past idle_park_seconds: parked, and so queued for the disk
        idle_rounds_until(host, lambda: host.stats().lanes == 0)
        assert host.pool.wait_spilled(60)  # written now (else 2 s after the park)
        assert host.pool.disk_stats().bytes_used <= budget
    disk = host.stats().tiers["disk"]
    assert disk.bytes_used <= budget and disk.budget_bytes == budget and disk.evictions > 0


def test_the_start_up_scan_delays_no_answer(open_host, monkeypatch):
    host = open_host()
    session = host.session()
    session.append_text(TEXT)
    session.complete(max_tokens=2)
    host.close()
    scanning, release = threading.Event(), threading.Event()
    original = DiskTier.scan_now

    def held_scan(self):  # the scan of the next start waits until the test lets it go on
        if threading.current_thread().name == "kvpool-disk-scan":
            scanning.set()
            release.wait(60)
        original(self)

    monkeypatch.setattr(DiskTier, "scan_now", held_scan)
    again = open_host()
    try:
        assert scanning.wait(60) and again.pool.disk_stats().scanning
        other = again.session()
        other.append_text("Hello")
        assert other.complete(max_tokens=2)  # answered while the scan has not indexed a file
        assert again.pool.disk_stats().scanning
    finally:
        release.set()
    assert again.pool.disk.wait_scanned(60) and again.pool.disk.entries()


def test_after_a_reboot_serve_resumes_a_conversation_from_disk(tiny_models, tmp_path):
    pool = unique_pool_name()
    model = tiny_models["f32"].gguf
    server = Served(model, tmp_path, pool=pool)
    server.keeps_tier = True
    try:
        _, created = post(server, "/v1/sessions", {"messages": [{"role": "user", "content": TEXT}]})
        post(server, f"/v1/sessions/{created['id']}/generate", {"max_tokens": 4})
        tokens = post(server, f"/v1/sessions/{created['id']}", method="GET")[1]["tokens"]
        assert server.stop() == 0  # SIGTERM: every lane parked, the tier's queue written; then
        assert pool not in segment.list_pool_names()  # the segment removed, as a reboot does
        again = Served(model, tmp_path, pool=pool)
        try:
            wait_for(lambda: disk_series(again, "kv_tier_entries") >= 1)  # the start-up scan found it
            post(again, f"/v1/sessions/{created['id']}/messages", {"messages": [{"role": "user", "content": "More"}]})
            status, reply = post(again, f"/v1/sessions/{created['id']}/generate", {"max_tokens": 2})
            # parked at the stop: all but the last sampled token and the turn's closing marks (not fed yet)
            assert status == 200 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= tokens - 5
            assert disk_series(again, "kv_tier_hits_total") == 1
            assert disk_series(again, "kv_tier_bytes_read_total") > 0
        finally:
            assert again.stop() == 0
    finally:
        server.stop()
        remove_segment(pool)
        remove_tier(places.disk_folder(pool))


def post(server, path, payload=None, method="POST"):
    status, data = server.raw(method, path, json.dumps(payload or {}).encode())
    return status, json.loads(data)


def disk_series(server, name: str) -> float:
    """The value of superfluid_<name>{tier="disk"} on the server's /metrics."""
    _, text = server.raw("GET", "/metrics")
    prefix = f'superfluid_{name}{{tier="disk"}} '
    for line in text.decode().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"no {prefix.strip()} on /metrics")


def wait_for(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {seconds} s")
        time.sleep(0.05)


def test_deleting_a_parent_keeps_the_kv_its_fork_starts_from(open_host, clock):
    host = open_host()
    parent = host.session()
    parent.append_text(TEXT)
    parent.complete(max_tokens=2)
    clock.advance(6)  # the parent's lane parked: its fork takes its parked KV by reference
    idle_rounds_until(host, lambda: host.stats().lanes == 0)
    child = parent.fork()
    tokens = child.tokens
    host.delete(parent.id)
    assert host.pool.wait_spilled(60)
    assert [e.tag for e in host.pool.disk.entries()] == [f"session:{parent.id}"]  # the fork's until it parks
    generation = child.generate(max_tokens=1)
    generation.collect()
    assert generation.cached_tokens == len(tokens) - 1


def test_a_conversation_keeps_one_entry_in_memory_and_on_disk(open_host, clock):
    host = open_host()
    session = host.session()
    for turn in range(4):
        session.append_text(f" Turn {turn}: {TEXT}")
        session.complete(max_tokens=4)
        clock.advance(6)  # parked after each turn: each park holds the one before and more
        idle_rounds_until(host, lambda: host.stats().lanes == 0)
    entries = [e for e in host.pool.entries() if e.tag == f"session:{session.id}"]
    assert len(entries) == 1 and entries[0].tokens >= len(session.tokens) - 1
    assert [e.tokens for e in parked_on_disk(host)] == [entries[0].tokens]
    assert host.pool.stats().superseded >= 3


def test_a_conversation_of_one_shot_requests_keeps_one_entry_as_it_comes_back(open_host):
    # Each turn of a conversation a client holds is a request of its own: it imports the last
    # turn's entry and parks a longer one, which supersedes it (memory and disk hold one entry
    # per conversation, not one per turn).
    from superfluid.host.request import GenerateRequest, Prompt

    host = open_host()
    prompt = TEXT * 6
    for turn in range(4):
        prompt += f" Turn {turn}."
        _, generation = host.call(host.commands.start_request, host.prepare(Prompt(text=prompt)),
                                  GenerateRequest(max_tokens=2))
        generation.collect()
        if turn:
            assert generation.cached_tokens >= generation.prompt_tokens - 8  # only the new words prefilled
    assert len(parked_on_disk(host)) == 1  # (an entry the writer was reading goes once it is done)
    assert len(host.pool.entries()) == 1 and host.pool.stats().superseded == 3


def test_a_park_its_lane_will_replace_is_deferred_for_the_disk_and_the_last_one_is_not(open_host, monkeypatch):
    # A request parks at the end of its prompt (published for others) and again at its end; the
    # first is replaced within seconds, so the disk tier writes it only if it outlives the
    # deferral (else a long prompt was written twice, a whole entry each time).
    from superfluid.host.kv import PROVISIONAL_SPILL_SECONDS
    from superfluid.host.request import GenerateRequest, Prompt

    host = open_host()
    deferred: list[tuple[int, float]] = []
    defer = host.pool.defer_spill
    monkeypatch.setattr(host.pool, "defer_spill", lambda entry_id, seconds: (
        deferred.append((entry_id, seconds)), defer(entry_id, seconds))[-1])
    prepared = host.prepare(Prompt(text=TEXT * 30))
    assert len(prepared.tokens) >= 256  # past the publishing threshold
    _, generation = host.call(host.commands.start_request, prepared, GenerateRequest(max_tokens=4))
    generation.collect()
    entries = parked_on_disk(host)
    assert len(deferred) == 1 and deferred[0][1] == PROVISIONAL_SPILL_SECONDS
    assert deferred[0][0] not in {e.id for e in host.pool.entries()}  # superseded by the last park
    assert [e.tokens for e in entries] == [len(prepared.tokens) + 3] and host.pool.disk_stats().writes == 1
    # a request that ends at its first token leaves with the end of its prompt: its deferral ends
    deferred.clear()
    prepared = host.prepare(Prompt(text="Again. " + TEXT * 30))  # (none of it cached)
    _, generation = host.call(host.commands.start_request, prepared, GenerateRequest(max_tokens=1))
    generation.collect()
    idle_rounds_until(host, lambda: host.stats().lanes == 0)  # (the lane parked and closed)
    assert [seconds for _, seconds in deferred] == [PROVISIONAL_SPILL_SECONDS, 0]
    assert len({entry_id for entry_id, _ in deferred}) == 1


def test_conversations_returning_from_disk_keep_one_file_each(open_host):
    # More conversations than memory holds: a returning turn loads the last one's entry from disk,
    # memory may evict that copy for room before the turn parks, and its file must still go (else
    # each turn leaves a file, and those crowd out the conversations not yet back).
    from superfluid.host.request import GenerateRequest, Prompt

    # room for three of these conversations on MLX, six on llama.cpp (half the bytes per cell); one
    # more than that and the oldest is always gone from memory when it comes back
    host = open_host(pool_bytes=4 << 20, export_budget=360 << 10)
    prompts = [f"{i}: {TEXT * 6}" for i in range(8)]
    for turn in range(3):
        for i in range(len(prompts)):
            prompts[i] += f" Turn {turn}."
            _, generation = host.call(host.commands.start_request, host.prepare(Prompt(text=prompts[i])),
                                      GenerateRequest(max_tokens=2))
            generation.collect()
            if turn:
                assert generation.cached_tokens >= generation.prompt_tokens - 8  # only the new words prefilled
        assert host.pool.wait_spilled(60)
    assert host.pool.stats().entries < len(prompts) and host.stats().tiers["disk"].hits > 0
    assert len(parked_on_disk(host)) == len(prompts)


def test_a_request_reads_its_kv_from_disk_on_its_own_thread_and_the_scheduler_reads_it_if_memory_let_it_go(
        open_host, monkeypatch):
    # The scheduler thread is every lane's: a request whose cached KV is only on disk has it read
    # back as it is prepared, on its caller's thread; should memory evict it again before the
    # request starts, the scheduler reads it itself. Either way one disk hit, nothing prefilled.
    from superfluid.host.request import GenerateRequest, Prompt

    host = open_host()
    prompt = TEXT * 6
    _, first = host.call(host.commands.start_request, host.prepare(Prompt(text=prompt)), GenerateRequest(max_tokens=2))
    first.collect()
    assert host.pool.wait_spilled(60)
    loads = []
    original = type(host.pool).load

    def counted_load(pool, *args, **kwargs):
        loads.append(threading.current_thread().name)
        return original(pool, *args, **kwargs)

    monkeypatch.setattr(type(host.pool), "load", counted_load)
    for evicted_after_prepare in (False, True):
        assert host.pool.wait_spilled(60)  # (the last turn's file written, the one before it gone)
        host.pool.shed(0)  # memory lets it go: the disk keeps it
        assert host.pool.entries() == [] and host.pool.disk.entries()
        prepared = host.prepare(Prompt(text=prompt + " Again."))
        assert prepared.warmed is not None and loads[-1] == threading.current_thread().name
        if evicted_after_prepare:
            assert host.pool.wait_spilled(60)
            host.pool.shed(0)
        _, generation = host.call(host.commands.start_request, prepared, GenerateRequest(max_tokens=2))
        generation.collect()
        assert generation.cached_tokens >= generation.prompt_tokens - 8  # only the new word prefilled
    me = threading.current_thread().name
    assert loads == [me, me, "superfluid-scheduler"]  # the second time memory had let it go
    tiers = host.stats().tiers
    assert tiers["disk"].hits == 2 and tiers["memory"].misses >= 3  # the first request's miss, and these two


def test_closing_waits_for_a_read_from_disk_on_a_callers_thread(open_host, monkeypatch):
    # a pool does not close while an entry is being read into it: close waits for the read
    from superfluid.host.request import GenerateRequest, Prompt

    host = open_host()
    _, first = host.call(host.commands.start_request, host.prepare(Prompt(text=TEXT * 6)), GenerateRequest(max_tokens=2))
    first.collect()
    assert host.pool.wait_spilled(60)
    host.pool.shed(0)
    reading, go_on = threading.Event(), threading.Event()

    def and_wait(reserve):  # the entry is being written into the pool from there
        def reserve_and_wait(*args, **kwargs):
            writer = reserve(*args, **kwargs)
            reading.set()
            go_on.wait(60)
            return writer
        return reserve_and_wait

    for name in ("reserve", "reserve_blob"):  # (MLX's arrays, llama.cpp's blobs)
        monkeypatch.setattr(host.pool, name, and_wait(getattr(host.pool, name)))
    prepared, closed = [], []
    preparing = threading.Thread(target=lambda: prepared.append(host.prepare(Prompt(text=TEXT * 6 + " Again."))))
    preparing.start()
    assert reading.wait(60)
    closing = threading.Thread(target=lambda: closed.append(host.close()))
    closing.start()
    closing.join(0.2)
    assert closing.is_alive()  # waiting for the read
    go_on.set()
    closing.join(60)
    preparing.join(60)
    assert closed == [None] and len(prepared) == 1 and not host.alive()


def test_a_lane_whose_memory_match_is_evicted_before_its_import_starts_from_the_disk_copy(open_host, monkeypatch):
    # Between the lookup and the import, a park making room (or another thread's read from disk)
    # may evict the entry found in memory: the lane looks once more and finds its file.
    from superfluid.host.kv import KVManager
    from superfluid.host.request import GenerateRequest, Prompt

    host = open_host()
    prompt = TEXT * 6
    _, first = host.call(host.commands.start_request, host.prepare(Prompt(text=prompt)), GenerateRequest(max_tokens=2))
    first.collect()
    assert host.pool.wait_spilled(60)
    imported = KVManager._import
    evicted = []

    def evicted_first(kv, live, entry, keep):
        if not evicted:
            evicted.append(entry)
            kv.pool.shed(0)  # memory lets it go just now: only the file is left
        return imported(kv, live, entry, keep)

    monkeypatch.setattr(KVManager, "_import", evicted_first)
    prepared = host.prepare(Prompt(text=prompt + " Again."))
    assert prepared.warmed is None  # memory held it as the request was prepared
    _, generation = host.call(host.commands.start_request, prepared, GenerateRequest(max_tokens=2))
    generation.collect()
    assert evicted and generation.cached_tokens >= generation.prompt_tokens - 8  # not prefilled
    tiers = host.stats().tiers
    assert tiers["disk"].hits == 1 and tiers["memory"].hits == 0
