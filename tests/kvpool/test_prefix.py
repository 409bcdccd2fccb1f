import numpy as np

from kvpool.prefix import BLOCK, PrefixIndex, PrefixMatch, common_prefix


def _index(stored):
    return PrefixIndex(lambda entry_id: stored[entry_id])


def test_longest_exact_prefix_wins():
    stored = {1: np.arange(40, dtype=np.int32), 2: np.arange(100, dtype=np.int32),
              3: np.concatenate([np.arange(50), [999] * 10]).astype(np.int32)}
    index = _index(stored)
    for entry_id, tokens in stored.items():
        index.add(entry_id, "m", tokens)
    assert index.longest("m", np.arange(70)) == PrefixMatch(2, 70)
    assert index.longest("m", np.arange(45)) == PrefixMatch(2, 45)
    assert index.longest("m", np.concatenate([np.arange(50), [999] * 5])) == PrefixMatch(3, 55)


def test_namespaced_by_identity():
    stored = {1: np.arange(40, dtype=np.int32)}
    index = _index(stored)
    index.add(1, "model-a", stored[1])
    assert index.longest("model-b", np.arange(40)) is None


def test_short_entries_and_no_match():
    stored = {1: np.array([5, 6, 7], dtype=np.int32)}
    index = _index(stored)
    index.add(1, "m", stored[1])
    assert index.longest("m", [5, 6, 9]) == PrefixMatch(1, 2)
    assert index.longest("m", [1, 2, 3]) is None


def test_forced_collisions_never_return_a_wrong_entry():
    # Every block of every sequence hashes alike: only the token comparison tells them apart.
    stored = {1: np.full(64, 1, dtype=np.int32), 2: np.full(64, 2, dtype=np.int32),
              3: np.concatenate([np.full(32, 2), np.full(32, 3)]).astype(np.int32)}
    index = PrefixIndex(lambda entry_id: stored[entry_id],
                        hasher=lambda identity, tokens: [0] * (len(tokens) // BLOCK))
    for entry_id, tokens in stored.items():
        index.add(entry_id, "m", tokens)
    assert index.longest("m", np.full(64, 2)) == PrefixMatch(2, 64)
    assert index.longest("m", np.concatenate([np.full(32, 2), np.full(8, 3)])) == PrefixMatch(3, 40)
    assert index.longest("m", np.full(64, 4)) is None


def test_remove_and_usable_filter():
    stored = {1: np.arange(32, dtype=np.int32), 2: np.arange(20, dtype=np.int32)}
    index = _index(stored)
    index.add(1, "m", stored[1])
    index.add(2, "m", stored[2])
    assert index.longest("m", np.arange(32), usable=lambda e: e != 1) == PrefixMatch(2, 20)
    index.remove(1)
    index.remove(1)
    assert index.longest("m", np.arange(32)) == PrefixMatch(2, 20)
    assert len(index) == 1


def test_common_prefix():
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 4])) == 2
    assert common_prefix(np.array([], dtype=np.int32), np.array([1])) == 0
