"""An engine's plain values beside its arrays: stored in the layout record, checked on the way
in, kept through re-attach and through moves."""

import numpy as np
import pytest

from kvpool import KVArray, LayoutError, Pool

VALUES = {"0.class": "KVCache", "0.offset": 3, "1.bits": -(1 << 63)}


def arrays(tokens=3):
    return [KVArray("k", np.arange(tokens * 4, dtype=np.float32).reshape(1, tokens, 4), 1)]


def test_values_come_back_with_the_entry_after_reattach_and_a_move(make_pool):
    pool = make_pool(4 << 20)
    info = pool.put("engine:1", [1, 2, 3], arrays(), capacity=64, engine_values=VALUES)
    with pool.get(info.id) as view:
        assert dict(view.layout.engine_values) == VALUES
    pool.close()
    again = Pool.attach(pool.name)
    try:
        with again.get(info.id) as view:
            assert dict(view.layout.engine_values) == VALUES
        again.compact(ratio=0, min_bytes=0)  # gives the slack back: the entry moves to a smaller extent
        with again.get(info.id) as view:
            assert view.info.capacity == 3 and dict(view.layout.engine_values) == VALUES
            np.testing.assert_array_equal(view.arrays["k"], arrays()[0].data)
    finally:
        again.close()


@pytest.mark.parametrize("values, problem", [
    ({"x": 1.5}, "engine value 'x' is 1.5"),
    ({"x": True}, "engine value 'x' is True"),
    ({"x": 1 << 63}, "use an int64"),
    ({"": 1}, "name must be a string of 1-96"),
    ({"x": "y" * 97}, "engine value 'x' must be a string of 0-96"),
    ({f"v{i}": i for i in range(4097)}, "at most 4096"),
    ([("x", 1)], "must be a dict"),
])
def test_bad_values_are_refused_before_anything_is_written(make_pool, values, problem):
    pool = make_pool(4 << 20)
    with pytest.raises(LayoutError, match=problem):
        pool.put("engine:1", [1, 2, 3], arrays(), engine_values=values)
    assert pool.entries() == [] and pool.stats().bytes_used == 0
