"""How a step's requests are grouped into llama_decode calls (engines/llamacpp/forwards.py)."""

from engines.llamacpp.forwards import QUERY_TILE, group


def test_without_tiled_attention_one_forward_carries_everything():
    assert group([1, 1, 300, 5], tiled_attention=False) == [[0, 1, 2, 3]]
    assert group([], tiled_attention=False) == []


def test_a_request_of_a_tile_or_more_runs_alone():
    assert group([1, QUERY_TILE, 1, 200], tiled_attention=True) == [[1], [3], [0, 2]]


def test_small_requests_share_forwards_of_fewer_than_a_tile():
    sizes = [1] * 8 + [40, 30] + [1] * 3
    groups = group(sizes, tiled_attention=True)
    assert sorted(index for g in groups for index in g) == list(range(len(sizes)))  # each once
    assert all(sum(sizes[index] for index in g) < QUERY_TILE for g in groups)
    assert groups == [[0, 1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]  # in order, packed
    assert group([], tiled_attention=True) == []
