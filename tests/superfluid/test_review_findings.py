"""Regression tests for defects a second review of the host found."""

import pytest

from superfluid import ContextFull, HostClosed
from superfluid.host.request import GenerateRequest

PROMPT = "The capital of France is Paris. The quick brown fox"


def test_a_cancelled_generation_frees_the_session_for_the_next_call_at_once(open_host):
    host = open_host()
    s = host.session()
    s.append_text(PROMPT)
    first = s.generate(max_tokens=100_000, ignore_eos=True)
    first.cancel()
    second = s.generate(max_tokens=2)  # no SessionBusy: the cancellation is taken as done
    second.collect()
    assert second.finish_reason == "length" and len(second.tokens) == 2
    first.collect()
    assert first.finish_reason == "cancelled" and len(first.tokens) < 100_000


def test_a_generation_that_never_started_leaves_the_chat_as_it_was(open_host, clock):
    host = open_host()
    s = host.session(system="Be brief.")
    s.append_user("Hi")
    before = s.tokens

    def generate_out_of_time():  # on the scheduler thread: out of time before any tick admits it
        generation = host.commands.generate(s.id, GenerateRequest(max_tokens=100_000, timeout=1.0))
        clock.advance(2.0)
        return generation

    generation = host.call(generate_out_of_time)
    with pytest.raises(TimeoutError):
        generation.collect()
    assert generation.tokens == [] and s.tokens == before  # its assistant opening is taken back
    assert [m["role"] for m in s.messages] == ["system", "user"]
    s.append_user("Again")
    assert s.detokenize(s.tokens).endswith("Hi<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n")


def test_a_chat_turn_is_closed_even_when_its_generation_fails_after_starting(open_host):
    host = open_host()
    s = host.session(system="Be brief.")
    s.append_user("Hi")
    generation = s.generate(max_tokens=100_000, ignore_eos=True)
    next(generation)  # it runs
    generation.cancel()
    generation.collect()
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant"]
    s.append_user("Again")
    assert s.detokenize(s.tokens).endswith("<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n")


def test_a_refused_generation_commits_nothing(open_host, runtime):
    options = {"llamacpp_n_ctx": 64} if runtime == "llamacpp" else {}
    host = open_host(**options)
    s = host.session()
    s.append_user("x " * (host.descriptor.context_length // 2 - 8))
    s.append_tokens([5] * (host.descriptor.context_length - len(s.tokens) - 2))
    before = s.tokens
    with pytest.raises(ContextFull, match="with the assistant's opening"):
        s.generate()
    assert s.tokens == before


def test_calls_after_close_are_refused(open_host):
    host = open_host()
    s = host.session()
    host.close()
    with pytest.raises(HostClosed, match="closed"):
        s.append_text("late")
    host.close()  # idempotent


def test_a_full_pool_is_not_retried_on_every_token(open_host):
    host = open_host(pool_bytes=96 << 10, checkpoint_tokens=8)  # too small for this session's KV
    s = host.session()
    s.append_text(PROMPT * 8)
    s.complete(max_tokens=40)
    stats = host.stats()
    assert stats.export_failures <= 40 // 8 + 2 and stats.exports == 0


def test_a_pool_that_does_not_fit_the_memory_left_is_refused_with_the_figures(open_host, monkeypatch):
    from engines.errors import ModelLoadError
    from superfluid.host import host as host_module

    monkeypatch.setattr(host_module, "host_memory_available", lambda: 32 << 20)  # 32 MiB left after loading
    with pytest.raises(ModelLoadError, match=r"KV pool \(0\.06 GiB\) does not fit in the 0\.03 GiB"):
        open_host()
