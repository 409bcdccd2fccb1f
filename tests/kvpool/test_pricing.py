import pytest

from kvpool import pricing
from kvpool.pricing import Attention, LayerKV, ModelKV


def test_issue_vectors():
    assert pricing.bytes_per_token(pricing.uniform(28, 8, 128, "f16")) == 114_688
    assert pricing.bytes_per_token(pricing.uniform(28, 8, 128, "q8_0")) == 60_928
    assert pricing.bytes_per_token(pricing.uniform(28, 8, 128, "q4_0")) == 32_256


def test_every_fourth_layer_attends():
    attending = LayerKV(2, 256, 256, "f16", "f16")
    none = LayerKV(2, 256, 256, attention=Attention.NONE)
    model = ModelKV(tuple(attending if i % 4 == 3 else none for i in range(24)))
    assert pricing.bytes_per_token(model) == 12_288
    assert pricing.state_bytes(model, 10) == 122_880


@pytest.mark.parametrize("cache_type, expected", [
    ("f32", 4096), ("f16", 2048), ("bf16", 2048), ("q8_0", 1088), ("q4_0", 576),
    ("q4_1", 640), ("q5_0", 704), ("q5_1", 768), ("iq4_nl", 576),
])
def test_row_bytes_by_ggml_blocks(cache_type, expected):
    assert pricing.row_bytes(cache_type, 1024) == expected


def test_partial_block_rounds_up():
    assert pricing.row_bytes("q8_0", 33) == 68


def test_mixed_key_and_value_types():
    model = pricing.uniform(2, 4, 64, "q8_0", value_type="f16")
    assert pricing.bytes_per_token(model) == 2 * (pricing.row_bytes("q8_0", 256) + 512)


def test_sliding_window_charged_up_to_window():
    full = LayerKV(1, 8, 8, "f32", "f32")
    window = LayerKV(1, 8, 8, "f32", "f32", Attention.WINDOW, window=4)
    model = ModelKV((full, window), fixed_bytes=100)
    assert pricing.bytes_per_token(model) == 128
    assert pricing.full_bytes_per_token(model) == 64
    assert pricing.state_bytes(model, 0) == 100
    assert pricing.state_bytes(model, 3) == 100 + 3 * 128
    assert pricing.state_bytes(model, 10) == 100 + 10 * 64 + 4 * 64


def test_recurrent_fixed_state():
    recurrent = LayerKV(0, 0, 0, attention=Attention.NONE, fixed_bytes=5000)
    model = ModelKV((recurrent, LayerKV(1, 4, 4, "f16", "f16")))
    assert pricing.fixed_bytes(model) == 5000
    assert pricing.state_bytes(model, 2) == 5000 + 2 * 16


def test_tokens_for_bytes_inverts_state_bytes():
    model = ModelKV((LayerKV(1, 8, 8, "f32", "f32"),
                     LayerKV(1, 8, 8, "f32", "f32", Attention.WINDOW, window=4)), fixed_bytes=10)
    for budget in (0, 9, 10, 137, 138, 1000, 10_000):
        n = pricing.tokens_for_bytes(model, budget)
        if budget < 10:
            assert n == 0
            continue
        assert pricing.state_bytes(model, n) <= budget < pricing.state_bytes(model, n + 1)


def test_tokens_for_bytes_unbounded_without_full_layers():
    model = ModelKV((LayerKV(1, 8, 8, "f32", "f32", Attention.WINDOW, window=4),))
    assert pricing.tokens_for_bytes(model, 4 * 64) is None
    assert pricing.tokens_for_bytes(model, 3 * 64) == 3


@pytest.mark.parametrize("bad", [
    dict(kv_heads=-1, key_width=1, value_width=1),
    dict(kv_heads=1, key_width=1, value_width=1, key_type="q3_k"),
    dict(kv_heads=1, key_width=1, value_width=1, attention=Attention.WINDOW, window=0),
])
def test_bad_layer_is_refused(bad):
    with pytest.raises(ValueError):
        LayerKV(**bad)


def test_unknown_type_names_the_choices():
    with pytest.raises(ValueError, match="q8_0"):
        pricing.row_bytes("q2", 32)
    with pytest.raises(ValueError):
        pricing.state_bytes(pricing.uniform(1, 1, 1), -1)
