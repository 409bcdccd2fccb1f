"""benchmarks/suite.py: the one benchmark run, its report, its plot and its regression check."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import cpp_server, report, suite
from benchmarks.regression import compare

ROOT = Path(__file__).resolve().parents[2]


def tokenizer():
    from llama_cpp import Llama

    from engines import models

    return Llama(str(models.default_model()), vocab_only=True, verbose=False)
PNG = b"\x89PNG\r\n\x1a\n"


def _figure(median, unit="s", samples=3):
    return {"median": median, "min": median * 0.9, "max": median * 1.1, "samples": samples, "unit": unit}


def _run(burst_ratio=2.0):
    return {
        "name": "bench-test", "started": 0, "seconds": 120,
        "machine": {"cores": 2, "memory_bytes": 24 << 30, "cpu": "test CPU", "python": "3.11.7",
                    "libraries": {"numpy": "2.0", "mlx": None}},
        "figures": {"warm 256": _figure(0.1), "cold 256": _figure(2.0), "warm 1024": _figure(0.2),
                    "cold 1024": _figure(9.0), "ours burst": _figure(10.0, samples=1),
                    "theirs burst": _figure(10.0 * burst_ratio, samples=1), "ours tok/s": _figure(90.0, "tok/s")},
        "ratios": {
            "llama.cpp cold / warm first token at 256": {"value": 20.0, "low": 15.0, "high": 25.0, "ours": "warm 256",
                                                         "baseline": "cold 256", "goal": None, "met": None,
                                                         "group": suite.ttft.GROUP},
            "llama.cpp cold / warm first token at 1024": {"value": 45.0, "low": 30.0, "high": 50.0,
                                                          "ours": "warm 1024", "baseline": "cold 1024", "goal": 50,
                                                          "met": False, "group": suite.ttft.GROUP},
            "burst: theirs / ours": {"value": burst_ratio, "low": 1.5, "high": 2.5, "ours": "ours burst",
                                     "baseline": "theirs burst", "goal": 1, "met": burst_ratio >= 1,
                                     "group": "shared-prefix burst"},
        },
        "notes": {"model": "test.gguf", "prompt tokens evaluated": [1098]},
    }


def test_the_markdown_has_a_table_per_group_with_both_sides_and_the_goals():
    text = report.markdown(_run(), [], "benchmarks.png")
    assert "2 cores, 24 GiB, test CPU; Python 3.11.7; numpy 2.0" in text and "mlx" not in text.split("\n")[0]
    assert f"### {suite.ttft.GROUP[0].upper()}{suite.ttft.GROUP[1:]}" in text
    assert "### Shared-prefix burst" in text
    assert "| llama.cpp cold / warm first token at 256 | 100.0 ms (90.0 ms – 110.0 ms) | 2.00 s (1.80 s – 2.20 s) | " \
           "20.0× (15.0× – 25.0×) |  |" in text
    assert "≥ 50, **missed**" in text and "≥ 1, met" in text
    assert "| ours burst" not in text and "| burst: theirs / ours | 10.00 s | 20.00 s |" in text  # one sample: no range
    assert "| prompt tokens evaluated | [1098] |" in text
    assert "![" in text and "(benchmarks.png)" in text
    assert "No committed run to compare with." in text


def test_the_markdown_says_which_ratios_moved_since_the_committed_run():
    old, new = _run(burst_ratio=2.0), _run(burst_ratio=1.2)
    text = report.markdown(new, compare(new, old))
    assert "| burst: theirs / ours | 2.00× | 1.20× | -40% | worse |" in text
    assert "first token at 256" not in text.split("### Against the last committed run")[1]  # steady: not listed
    assert "No ratio moved" in report.markdown(old, compare(old, old))


def test_the_page_keeps_what_is_written_around_the_generated_block(tmp_path):
    page = tmp_path / "benchmarks.md"
    report.write_page(page, "first results")
    page.write_text("# Intro by hand\n\n" + page.read_text() + "\nA closing note by hand.\n")
    report.write_page(page, "second results")
    text = page.read_text()
    assert text.startswith("# Intro by hand") and text.rstrip().endswith("A closing note by hand.")
    assert "second results" in text and "first results" not in text
    assert text.count(report.START) == 1 and text.count(report.END) == 1


def test_a_page_without_its_markers_is_refused_and_left_alone(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# Hand-written\n\n{report.START}\nno end marker\n")
    before = page.read_text()
    with pytest.raises(ValueError, match="markers"):
        report.write_page(page, "results")
    assert page.read_text() == before


def test_the_plot_is_a_png_with_the_first_token_curves(tmp_path):
    assert report.first_token_curves(_run(), suite.ttft.GROUP) == {
        "llama.cpp": {"warm": [(256, 0.1), (1024, 0.2)], "cold": [(256, 2.0), (1024, 9.0)]}}
    path = report.plot(_run(), tmp_path / "plot.png", suite.ttft.GROUP)
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def test_unknown_runtimes_are_a_usage_error():
    done = subprocess.run([sys.executable, "benchmarks/suite.py", "--runtimes", "vllm"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "vllm" in done.stderr and "llamacpp, mlx" in done.stderr


def test_a_file_outside_the_checkout_is_read_as_the_last_run(tmp_path):
    path = tmp_path / "benchmarks.json"
    assert suite.last_committed(path) is None
    path.write_text(json.dumps(_run()))
    assert suite.last_committed(path)["name"] == "bench-test"


@pytest.mark.real_model
@pytest.mark.slow
def test_the_quick_run_measures_everything_and_writes_json_table_and_plot(tmp_path):
    # A previous run in the output folder: the new one is compared with it.
    previous = {"name": "bench-quick", "ratios": {"llama.cpp re-prefill time / restore time at 64": {
        "value": 1e9, "low": 1e9, "high": 1e9, "goal": None}}}
    (tmp_path / "benchmarks.json").write_text(json.dumps(previous))
    cpp_server.find_or_build()  # a first build of llama-server (minutes) happens here, not inside the run
    # the timeout only guards against a hang: the run takes 4 minutes alone, 14 beside other work
    done = subprocess.run([sys.executable, "benchmarks/suite.py", "--quick", "--out-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step" in done.stderr and "100%" in done.stderr  # the progress bar
    result = json.loads((tmp_path / "benchmarks.json").read_text())
    assert result["machine"]["cores"] and result["machine"]["libraries"]["llama-cpp-python"]
    grouped = report.groups(result)
    for group in ("restore and share through the pool (llama.cpp)", "restore and share through the pool (MLX)",
                  "restore: ours against the engine's own cache (llama.cpp)",
                  "restore: ours against the engine's own cache (MLX)", suite.ttft.GROUP, suite.servers.BURST,
                  suite.servers.DECODE, suite.INTERACTIVE, suite.restore.MEMORY, suite.load.GROUP,
                  suite.over_http.GROUP, suite.servers.PEER_GROUP, suite.conversations.GROUP, suite.routing.GROUP,
                  suite.sampling.GROUP):
        assert grouped.get(group), f"nothing measured for {group!r}"
    for label, ratio in result["ratios"].items():
        assert ratio["value"] > 0 and ratio["low"] <= ratio["value"] <= ratio["high"], label
    for label, ratio in grouped[suite.restore.MEMORY]:
        assert abs(ratio["value"] - 1) <= suite.restore.PRICE_TOLERANCE, label
    notes = result["notes"]
    burst = "prompt tokens evaluated per burst of 4 on a 128-token prefix"
    one_prompt = 128 + len(tokenizer().tokenize(b" question 0: what comes next?", add_bos=False))
    for server in (suite.servers.OURS, suite.servers.THEIRS, suite.servers.THEIRS_CACHED):
        evaluated = notes[f"{server}: {burst}"][0]
        assert one_prompt <= evaluated < 2 * one_prompt, (server, evaluated)  # the prefix once, not four times
        assert notes[f"{server}: tokens generated per burst (asked: 4 x 16)"] == [64], server
    for peer in suite.servers.PEERS:  # llama-server: its prompt cache and slots decide what it evaluates
        assert notes[f"{peer}: {burst}"][0] >= one_prompt, peer
        assert notes[f"{peer}: tokens generated per burst (asked: 4 x 16)"] == [64], peer
    for server in (suite.servers.OURS, *suite.servers.PEERS):  # the chat was sent behind agents none refused
        agents = notes[f"{server}: agent requests finished / failed while the chats ran"]
        finished, failed = map(int, agents.split(" / "))
        assert finished >= 2 and failed == 0, (server, finished, failed)
        assert notes[f"{server}: chats sent behind the agents (of 1, for at most 60 s)"] == 1, server
    for server in (suite.servers.OURS, *suite.servers.PEERS):  # both report what came from cache
        assert all(cached > 0 for cached in notes[f"{server}: prompt tokens from cache in the last 5 of 10 turns"])
    for server in (suite.servers.OURS, suite.servers.THEIRS, *suite.servers.PEERS):
        assert notes[f"{server}: tokens generated in the decode runs (asked: 8 per request)"] == 8 * (1 + 2), server
    for engine in ("llama.cpp", "MLX"):
        assert len(notes[f"{engine} second-turn prompt tokens at 128"]) == 1
    clients = notes[f"{suite.servers.OURS}: 4 clients at once"]
    assert clients["served"] == 4 and set(clients) <= {"served", "refused", "seconds"}  # nothing else happened
    under_load = dict(grouped[suite.load.GROUP])
    assert under_load["4 clients at once, served: ours / theirs"]["value"] > 0
    against_peer = dict(grouped[suite.servers.PEER_GROUP])
    for peer in suite.servers.PEERS:
        for label in (f"decode tokens/s, 2 at once: ours / {peer}", f"chat first token behind 2 agents: {peer} / ours",
                      f"4 clients at once, served: ours / {peer}",
                      f"shared-prefix burst: {peer} / ours (time for 4 on a 128-token prefix)"):
            assert against_peer[label]["value"] > 0, label
    talks = dict(grouped[suite.conversations.GROUP])
    for other in (suite.servers.THEIRS, *suite.servers.PEERS):
        for label in (f"next turn after a restart: {other} / ours", f"10-turn conversation, late first token: {other} / ours"):
            assert talks[label]["value"] > 0, label
    routed = dict(grouped[suite.routing.GROUP])
    for label in ("prompt tokens prefilled: round-robin / cache-aware", "first token (median): round-robin / cache-aware"):
        assert routed[label]["value"] > 0, label
    for policy in suite.routing.POLICIES:
        assert sum(notes[f"routing, {policy}: requests each worker served"].values()) == 8, policy
    sampled = dict(grouped[suite.sampling.GROUP])
    for name, _ in suite.sampling.SETTINGS:
        assert sampled[f"SmolLM2 (49,152 ids), {name}: llama.cpp's chain / ours"]["value"] > 0, name
    bound = dict(grouped[suite.servers.DECODE])
    assert bound["decode tokens/s, 2 at once: ours / the engine's bound"]["value"] > 0
    assert "decode tokens/s: the engine alone at 2 at once / at 1" in bound
    assert (tmp_path / "benchmarks.png").read_bytes()[:8] == PNG
    page = (tmp_path / "benchmarks.md").read_text()
    assert "| llama.cpp share speed / memcpy speed at 64 |" in page and "![" in page
    assert "| llama.cpp re-prefill time / restore time at 64 | 1,000,000,000× |" in page and "| worse |" in page
