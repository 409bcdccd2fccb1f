"""Random sequences of pool operations against a model of what the pool must hold.

After every step: extents tile the arena with no overlap, free space is coalesced, used + free
equals the arena, the budget is never exceeded, byte totals add up, reference counts match the
model and never go negative, and an entry the pool evicted on its own was neither referenced nor
pinned. Reads check every byte against the model.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool import Budget, EntryBusy, EntryTooLarge, KVArray, Pool
from tests.conftest import remove_segment, unique_pool_name

WIDTH = 8


def cells(seed, start, stop):
    return (np.arange(start, stop, dtype=np.float32)[None, :, None] * 3 + seed
            + np.zeros((2, stop - start, WIDTH), np.float32))


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.name = unique_pool_name()
        self.pool = Pool.create(self.name, 96 << 10, budget=Budget(40_000, None, "property test"), max_entries=16)
        self.model: dict[int, dict] = {}  # id -> {seed, live, refs, pins, blob}
        self.seed = 0

    def teardown(self):
        try:
            self.pool.close()
        finally:
            remove_segment(self.name)

    def _reconcile(self):
        present = {e.id for e in self.pool.entries()}
        for entry_id in list(self.model):
            if entry_id not in present:
                gone = self.model.pop(entry_id)
                assert gone["refs"] == 0 and gone["pins"] == 0, f"pool evicted a held entry {entry_id}"

    @rule(tokens=st.integers(0, 200), extra=st.integers(0, 300), blob=st.booleans())
    def put(self, tokens, extra, blob):
        self.seed += 1
        try:
            info = self._put(tokens, extra, blob)
        except EntryTooLarge as exc:
            assert "exceeds the pool's export budget" in str(exc)
            return
        self._reconcile()
        if info is not None:
            self.model[info.id] = dict(seed=self.seed, live=tokens, refs=1, pins=0, blob=blob)

    def _put(self, tokens, extra, blob):
        if blob:
            data = np.full(tokens * 16 + 1, self.seed % 251, np.uint8)
            return self.pool.put_blob("m", np.arange(tokens) + self.seed, data)
        arrays = [KVArray("k", cells(self.seed, 0, tokens), 1), KVArray("v", -cells(self.seed, 0, tokens), 1)]
        return self.pool.put("m", np.arange(tokens) + self.seed, arrays, capacity=tokens + extra)

    def _pick(self, data, condition):
        choices = sorted(k for k, v in self.model.items() if condition(v))
        return data.draw(st.sampled_from(choices)) if choices else None

    @rule(data=st.data())
    def share(self, data):
        entry_id = self._pick(data, lambda v: True)
        if entry_id is not None:
            assert self.pool.share(entry_id).refcount == self.model[entry_id]["refs"] + 1
            self.model[entry_id]["refs"] += 1

    @rule(data=st.data())
    def release(self, data):
        entry_id = self._pick(data, lambda v: v["refs"] > 0)
        if entry_id is not None:
            self.pool.release(entry_id)
            self.model[entry_id]["refs"] -= 1

    @rule(data=st.data())
    def pin_or_unpin(self, data):
        entry_id = self._pick(data, lambda v: True)
        if entry_id is None:
            return
        if self.model[entry_id]["pins"] and data.draw(st.booleans()):
            self.pool.unpin(entry_id)
            self.model[entry_id]["pins"] -= 1
        else:
            self.pool.pin(entry_id)
            self.model[entry_id]["pins"] += 1

    @rule(data=st.data())
    def evict(self, data):
        entry_id = self._pick(data, lambda v: True)
        if entry_id is None:
            return
        entry = self.model[entry_id]
        if entry["refs"] or entry["pins"]:
            with pytest.raises(EntryBusy):
                self.pool.evict(entry_id)
        else:
            self.pool.evict(entry_id)
            del self.model[entry_id]

    @rule(data=st.data(), more=st.integers(1, 40))
    def extend(self, data, more):
        entry_id = self._pick(data, lambda v: not v["blob"] and v["refs"] <= 1)
        if entry_id is None:
            return
        entry, info = self.model[entry_id], self.pool.info(entry_id)
        more = min(more, info.capacity - info.tokens)
        if more == 0:
            return
        live = entry["live"]
        with self.pool.extend(entry_id, np.arange(live, live + more) + entry["seed"]) as writer:
            writer.arrays["k"][...] = cells(entry["seed"], live, live + more)
            writer.arrays["v"][...] = -cells(entry["seed"], live, live + more)
            writer.commit()
        entry["live"] += more

    @rule()
    def compact(self):
        self.pool.compact(min_bytes=0)

    @rule(data=st.data())
    def read(self, data):
        entry_id = self._pick(data, lambda v: True)
        if entry_id is None:
            return
        entry = self.model[entry_id]
        with self.pool.get(entry_id) as view:
            assert np.array_equal(view.tokens, np.arange(entry["live"]) + entry["seed"])
            if entry["blob"]:
                assert (view.blob == entry["seed"] % 251).all() and view.blob.nbytes == entry["live"] * 16 + 1
            else:
                assert np.array_equal(view.arrays["k"], cells(entry["seed"], 0, entry["live"]))
                assert np.array_equal(view.arrays["v"], -cells(entry["seed"], 0, entry["live"]))

    @invariant()
    def accounting_holds(self):
        stats = self.pool.stats()
        extents = self.pool.arena_map()
        cursor = 0
        for offset, length, _ in extents:
            assert offset == cursor, "extents overlap or leave a gap"
            cursor += length
        assert cursor == stats.capacity
        free = [(o, n) for o, n, owner in extents if owner == "free"]
        assert all(o1 + n1 < o2 for (o1, n1), (o2, _) in zip(free, free[1:])), "free space not coalesced"
        assert stats.bytes_free == sum(n for _, n in free)
        assert stats.bytes_used <= stats.budget_bytes
        infos = self.pool.entries()
        assert stats.bytes_used == sum(e.stored_bytes for e in infos)
        assert {e.id: e.refcount for e in infos} == {k: v["refs"] for k, v in self.model.items()}
        assert {e.id: e.pins for e in infos} == {k: v["pins"] for k, v in self.model.items()}
        assert all(e.refcount >= 0 and e.pins >= 0 for e in infos)


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestPoolProperties = PoolMachine.TestCase
