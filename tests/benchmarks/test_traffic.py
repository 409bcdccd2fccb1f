"""benchmarks/traffic.py: how the passes of a run become its figures."""

from benchmarks import traffic
from benchmarks.harness import Run


def test_the_passes_samples_are_joined_in_order_and_notes_that_differ_keep_each_passs_value():
    first, second = Run("traffic"), Run("traffic")
    first.record("ours: one stream decoding, tokens/s", [100.0, 102.0], unit="tok/s")
    second.record("ours: one stream decoding, tokens/s", [90.0, 91.0], unit="tok/s")
    first.record("llama-server: conversations", [70.0])
    second.record("llama-server: conversations", [74.0])
    first.record("ours: agents", [22.0])
    second.note("ours: agents FAILED", "APIConnectionError: Connection error.")  # the second pass only
    for this, evaluated in ((first, 100), (second, 120)):
        this.note("cells: ours", 65536)
        this.note("ours: conversations: prompt tokens evaluated", evaluated)
    merged = Run("traffic")

    traffic.merge_passes(merged, [first, second])

    decode = merged.figures["ours: one stream decoding, tokens/s"]
    assert decode.samples == [100.0, 102.0, 90.0, 91.0] and decode.unit == "tok/s"
    assert merged.figures["llama-server: conversations"].samples == [70.0, 74.0]
    assert merged.figures["llama-server: conversations"].unit == "s"
    assert merged.figures["ours: agents"].samples == [22.0]
    assert merged.notes == {"cells: ours": 65536,
                            "ours: conversations: prompt tokens evaluated": "pass 1: 100 | pass 2: 120",
                            "ours: agents FAILED": "pass 2: APIConnectionError: Connection error."}
