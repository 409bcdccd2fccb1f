"""The scheduler on both engines: lanes decoding together, preemption by priority, stop strings
and cancellation in the middle of a stream."""

import numpy as np
import pytest

from engines import registry
from superfluid.host.churn import Churn
from tests.gate import Gate, decode_steps_of

PROMPT = "The capital of France is Paris. The quick brown fox"
LIMITS = {"llamacpp": {"llamacpp_n_seq_max": 2}, "mlx": {"mlx_max_sequences": 2}}


def reference_tokens(open_host, runtime, prompts, directory, **generate):
    """What each prompt generates alone, on an idle host."""
    lone = open_host(pool_name=f"ref-{runtime}-{len(prompts)}", log_dir=directory / "reference-log")
    out = []
    for text, seed in prompts:
        s = lone.session(temperature=0.8, seed=seed)
        s.append_text(text)
        out.append(s.generate(**generate))
        out[-1].collect()
    return [g.tokens for g in out]


def test_an_interactive_arrival_preempts_and_the_lane_resumes_as_if_uninterrupted(open_host, runtime, tmp_path):
    gate = Gate(decode_steps_of(lanes=2, count=3))  # both lanes are mid-generation
    host = open_host(gate=gate, **LIMITS[runtime])
    prompts = [(PROMPT, 1), (PROMPT + " jumps", 2)]
    urgent = host.session(priority="interactive")
    urgent.append_text("Hello")
    background = []
    for text, seed in prompts:
        s = host.session(priority="background", temperature=0.8, seed=seed)
        s.append_text(text)
        background.append(s.generate(max_tokens=1500, ignore_eos=True))
    quick = gate.generate_while_held(host, urgent, max_tokens=5)
    quick.collect()
    for generation in background:
        generation.collect()
    stats = host.stats()
    assert stats.preemptions >= 1 and stats.exports >= 1 and stats.imports >= 1
    assert quick.finish_reason == "length"
    expected = reference_tokens(open_host, runtime, prompts, tmp_path, max_tokens=1500, ignore_eos=True)
    assert [g.tokens for g in background] == expected  # token for token


def test_an_interactive_arrival_sharing_a_prefix_with_the_running_lane_preempts_it(open_host, runtime, tmp_path):
    # One sequence, held by a background generation whose prompt begins as the arrival's does:
    # the arrival's best source is that running lane (to fork), which must not keep it waiting
    # for the whole background job (it did: a chat behind a tool call on the server).
    one = {"llamacpp": {"llamacpp_n_seq_max": 1}, "mlx": {"mlx_max_sequences": 1}}[runtime]
    gate = Gate(decode_steps_of(lanes=1, count=3))
    host = open_host(gate=gate, **one)
    urgent = host.session(priority="interactive")
    urgent.append_text(PROMPT + " sleeps")
    running = host.session(priority="background", temperature=0.8, seed=1)
    running.append_text(PROMPT)
    background = running.generate(max_tokens=400, ignore_eos=True)
    quick = gate.generate_while_held(host, urgent, max_tokens=3)
    quick.collect()
    assert host.published_stats().generating == 1  # the background job is still running
    background.collect()
    assert host.stats().preemptions == 1 and quick.finish_reason == "length"
    expected = reference_tokens(open_host, runtime, [(PROMPT, 1)], tmp_path, max_tokens=400, ignore_eos=True)
    assert [background.tokens] == expected  # and it went on exactly


def test_a_default_arrival_waits_for_a_lane_instead_of_preempting(open_host, runtime):
    gate = Gate(decode_steps_of(lanes=2, count=2))  # both lanes hold the engine's two sequences
    host = open_host(gate=gate, **LIMITS[runtime])
    waiting = host.session()
    waiting.append_text("Hello")
    running = []
    for seed in (1, 2):
        s = host.session(priority="background", seed=seed)
        s.append_text(PROMPT)
        running.append(s.generate(max_tokens=400, ignore_eos=True))
    late = gate.generate_while_held(host, waiting, max_tokens=3)
    late.collect()
    for generation in running:
        generation.collect()
    assert host.stats().preemptions == 0 and late.finish_reason == "length" and len(late.tokens) == 3
    assert all(len(g.tokens) == 400 for g in running)  # neither was cut short for it


def test_a_stop_string_spanning_tokens_ends_the_generation_before_it(open_host):
    host = open_host()
    s = host.session(temperature=0.8, seed=9)
    s.append_text(PROMPT)
    probe = s.fork()
    pieces = [p.text for p in probe.generate(max_tokens=40, ignore_eos=True) if p.text]
    text = "".join(pieces)
    first = len(pieces[0]) + len(pieces[1])
    stop = text[first - 2:first + 2]  # the end of the second piece and the start of the third
    assert stop and stop not in text[:first - 2]
    generation = s.generate(max_tokens=40, stop=[stop, "never appears \u2603"], ignore_eos=True)
    assert generation.collect() == text[:first - 2] and generation.finish_reason == "stop"


def test_cancelling_mid_stream_frees_the_lane_at_once(open_host, runtime):
    host = open_host(**LIMITS[runtime])
    s = host.session()
    s.append_text(PROMPT)
    generation = s.generate(max_tokens=100_000, ignore_eos=True)
    next(generation)
    generation.cancel()
    list(generation)  # whatever was already streamed, then the end
    assert generation.finish_reason == "cancelled" and len(generation.tokens) < 100_000
    assert host.stats().generating == 0
    others = []
    for seed in (1, 2):  # both lanes are usable again
        other = host.session(seed=seed)
        other.append_text("Hello")
        others.append(other.generate(max_tokens=2))
    for g in others:
        g.collect()
    assert [(g.finish_reason, len(g.tokens)) for g in others] == [("length", 2), ("length", 2)]


def test_a_step_s_tokens_go_to_the_log_in_one_write_before_any_reader_hears_of_them(open_host, monkeypatch):
    from superfluid.host import log as log_module
    from superfluid.host import log_format
    from superfluid.host.request import GenerateRequest
    from superfluid.host.session import Generation

    host = open_host()
    log = host._scheduler.log
    sessions = [host.session() for _ in range(3)]
    for number, session in enumerate(sessions):
        session.append_text(f"{PROMPT} {number}")
    records_per_write, early = [], []
    write, hand = log._write, Generation._hand

    def counting_write(blob):  # the Tokens records in each write
        frames = list(log_format.scan(log_format.FILE_HEADER + blob, log_format.VERSION))
        records = [log_module.decode_record(found.payload, "") for found in frames]
        records_per_write.append(sum(isinstance(record, log_module.Tokens) for record in records))
        write(blob)

    def checked_hand(generation, wakes):  # a reader hears of a token only once its record is written
        if log._batch is not None:
            early.extend(generation._held)
        return hand(generation, wakes)

    log._write = counting_write
    monkeypatch.setattr(Generation, "_hand", checked_hand)
    wanted = GenerateRequest(max_tokens=6, ignore_eos=True)
    generations = host.call(lambda: [host.commands.generate(s.id, wanted) for s in sessions])
    for generation in generations:
        generation.collect()
    assert [len(g.tokens) for g in generations] == [6, 6, 6]
    assert early == []
    assert max(records_per_write) == 3  # the three lanes' tokens of a step, in one write
    assert sum(records_per_write) == 18


def test_a_step_whose_log_write_fails_hands_out_none_of_its_tokens(open_host, tmp_path):
    from superfluid.host.log import SessionLog

    host = open_host()
    session = host.session()
    session.append_text(PROMPT)
    log = host._scheduler.log
    write, writes = log._write, []

    def failing_write(blob):  # the disk fills up at the fourth step's records
        writes.append(len(blob))
        if len(writes) == 4:
            raise OSError(28, "No space left on device")
        write(blob)

    log._write = failing_write
    generation = session.generate(max_tokens=8, ignore_eos=True)
    with pytest.raises(OSError, match="No space left on device"):
        generation.collect()
    received = list(generation.tokens)
    assert host.alive()  # the failed write ended its generation, not the host
    host.close()
    log = SessionLog(tmp_path / "log")
    try:
        logged = log.states[session.id].tokens
    finally:
        log.close()
    written = 3  # steps written before the failure (the fourth write): one write, one token each
    assert received == logged[len(logged) - written:]  # a reader heard of exactly the tokens in the log


@pytest.mark.parametrize("policy", ["tick", "commit", "never"])
def test_every_log_sync_policy_keeps_a_clean_restart_whole(open_host, policy):
    host = open_host(log_sync=policy)
    s = host.session()
    s.append_text(PROMPT)
    s.complete(max_tokens=5)
    tokens = s.tokens
    host.close()
    assert open_host(log_sync=policy).session(id=s.id).tokens == tokens


def test_on_a_quantized_model_a_preempted_lane_keeps_its_rng_aligned_and_its_logits_close(
        runtime, tiny_models, tmp_path):
    """Batch composition moves a quantized model's logits slightly: after a preemption the lane's
    logits agree with the uninterrupted run within 0.05, and while they pick the same tokens the
    seeded draws (a function of seed and position only) pick the same tokens too."""
    from superfluid import Host
    from tests.conftest import remove_segment

    options = {"llamacpp": {"threads": 2, "n_seq_max": 2}, "mlx": {"max_sequences": 2, "dequantize": "off"}}[runtime]
    names, hosts = [f"q8-{runtime}-{i}" for i in range(2)], []
    gate = Gate(decode_steps_of(lanes=2, count=2))  # the busy host's lanes are mid-generation
    adapter, model = registry.adapter(runtime), tiny_models["q8_0"].gguf
    try:
        for index, name in enumerate(names):
            factory = (lambda: gate.wrap(adapter(model, **options))) if index == 0 else (lambda: adapter(model, **options))
            hosts.append(Host(model, pool_name=name, pool_bytes=64 << 20, log_dir=tmp_path / name,
                              engine_factory=factory))
        busy, idle = hosts
        urgent = busy.session(priority="interactive")
        urgent.append_text("Hello")
        runs = {}
        for label, host in (("preempted", busy), ("alone", idle)):
            generations = []
            for seed in (1, 2):
                s = host.session(priority="background", temperature=0.8, seed=seed)
                s.append_text(PROMPT)
                generations.append(s.generate(max_tokens=600, keep_logits=True, ignore_eos=True))
            if host is busy:
                gate.generate_while_held(host, urgent, max_tokens=3).collect()
            for generation in generations:
                generation.collect()
            runs[label] = generations
        assert busy.stats().preemptions >= 1
        for preempted, alone in zip(runs["preempted"], runs["alone"]):
            same = 0
            while same < len(alone.tokens) and preempted.tokens[same] == alone.tokens[same]:
                same += 1
            # every step up to and including the first that picked differently saw the same
            # tokens: its logits must still agree (a divergence comes from tolerance, not from
            # a misaligned draw)
            assert same >= 1
            for a, b in zip(preempted.logits[:same + 1], alone.logits[:same + 1]):
                assert np.abs(a - b).max() <= 0.05
    finally:
        for host in hosts:
            host.close()
        for name in names:
            remove_segment(name)


@pytest.mark.parametrize("churn", [None, Churn(preempt_every=3)], ids=["default", "preempted"])
def test_more_work_than_the_engine_has_cells_finishes_as_it_would_alone(open_host, runtime, tmp_path, churn):
    """Four prompts on an engine whose cells hold two and a half of them: they wait, swap through
    the pool and resume, and each generates what it generates alone (both runtimes: llama.cpp's
    unified cache, MLX's caches by the cell price); also with every running lane preempted every
    third tick (MLX's decode batch then changes members all the time)."""
    prompts = [(f"{i} {PROMPT} {PROMPT} {PROMPT}", i + 1) for i in range(4)]
    expected = reference_tokens(open_host, runtime, prompts, tmp_path, max_tokens=40, ignore_eos=True)
    counter = open_host(pool_name=f"count-{runtime}", log_dir=tmp_path / "count-log")
    longest = 0
    for text, _ in prompts:
        s = counter.session()
        s.append_text(text)
        longest = max(longest, len(s.tokens))
    cells = int(2.5 * (longest + 40 + 64))  # prompt, reply and decode reserve: two and a half fit
    host = open_host(churn=churn, **({"llamacpp_n_ctx": cells} if runtime == "llamacpp" else {"mlx_kv_cells": cells}))
    assert cells <= host.stats().cells_total < cells + 256  # llama.cpp may round its cache up
    generations = []
    for text, seed in prompts:
        s = host.session(temperature=0.8, seed=seed)
        s.append_text(text)
        generations.append(s.generate(max_tokens=40, ignore_eos=True))
    for g in generations:
        g.collect()
    assert [g.tokens for g in generations] == expected
    stats = host.stats()
    assert stats.cells_used <= cells and stats.waiting == 0
    if churn is not None:
        assert stats.preemptions >= 4


def test_a_generation_sharing_a_prefix_with_the_only_sequence_starts_once_it_is_idle(open_host, runtime):
    # The idle lane it would fork holds the engine's only sequence: it was kept for the fork and
    # the generation waited for ever. It is parked instead, and its KV imported.
    host = open_host(**{"llamacpp": {"llamacpp_n_seq_max": 1}, "mlx": {"mlx_max_sequences": 1}}[runtime])
    first = host.session()
    first.append_text(PROMPT)
    first.generate(max_tokens=2).collect()
    second = host.session()
    second.append_text(PROMPT + " jumps")
    generation = second.generate(max_tokens=2)
    generation.collect()
    assert generation.finish_reason == "length" and generation.cached_tokens > 0
