"""The Host on every llama.cpp memory kind (tiny models from tests/memorykinds.py): a trim, a
fork, and a restart each give what a cold run of the same tokens gives, also where the memory
cannot be cut back (a 16-token window, a recurrent state), through checkpoints.
"""

from __future__ import annotations

import pytest

from superfluid import Host
from tests import memorykinds, tinymodels
from tests.conftest import remove_segment, unique_pool_name

KINDS = ("kv", "iswa", "recurrent", "hybrid", "hybrid-iswa")
PROMPT = [1 + (i * 11) % 250 for i in range(100)]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("host-kinds")
    found = {"kv": tinymodels.build(directory / "kv").gguf}
    for kind in KINDS[1:]:
        found[kind] = memorykinds.build(kind.replace("-", "_"), directory / kind).gguf
    return found


@pytest.fixture
def open_host(ggufs, tmp_path):
    """open_host(kind, name) -> a Host on that kind's model; the same name reopens its pool and log.
    Small prefill chunks and checkpoints, so a 100-token prompt holds several checkpoints."""
    opened, pools = [], {}

    def make(kind: str, name: str = "main") -> Host:
        pool = pools.setdefault((kind, name), unique_pool_name())
        host = Host(ggufs[kind], runtime="llamacpp", pool_name=pool, pool_bytes=32 << 20,
                    log_dir=tmp_path / f"{kind}-{name}", idle_park_seconds=None, prefill_budget=32,
                    checkpoint_tokens=16, tick_seconds=None, llamacpp_n_ctx=512, llamacpp_threads=1)
        opened.append(host)
        return host

    yield make
    for host in opened:
        host.close()
    for pool in pools.values():
        remove_segment(pool)


def greedy(session, count: int = 8) -> list[int]:
    generation = session.generate(count, ignore_eos=True, temperature=0.0)
    generation.collect()
    return list(generation.tokens)


def cold(open_host, kind: str, tokens: list[int], count: int = 8) -> list[int]:
    session = open_host(kind, "cold").session()
    session.append_tokens(tokens)
    return greedy(session, count)


@pytest.mark.parametrize("kind", KINDS)
def test_a_trim_equals_a_cold_session(open_host, kind):
    host = open_host(kind)
    session = host.session()
    session.append_tokens(PROMPT)
    greedy(session)
    session.trim(60)
    before = host.stats()
    trimmed = greedy(session)
    prefilled = host.stats().prefill_tokens - before.prefill_tokens
    if host.descriptor.memory.recurrent:  # nothing to cut: the checkpoint at 48 and 12 tokens
        assert host.stats().imports > before.imports and prefilled < 60
    assert trimmed == cold(open_host, kind, PROMPT[:60])


@pytest.mark.parametrize("kind", KINDS)
def test_a_fork_continues_as_its_parent_would(open_host, kind):
    host = open_host(kind)
    parent = host.session()
    parent.append_tokens(PROMPT)
    greedy(parent, 2)
    child = parent.fork()
    assert greedy(child) == greedy(parent)


@pytest.mark.parametrize("kind", KINDS)
def test_a_restart_resumes_where_it_was(open_host, kind):
    host = open_host(kind, "restart")
    session = host.session(id="s", temperature=0.0)
    session.append_tokens(PROMPT)
    first = greedy(session, 4)
    host.close()
    again = open_host(kind, "restart")
    before = again.stats()
    more = greedy(again.session(id="s"), 4)
    assert again.stats().prefill_tokens - before.prefill_tokens <= 4  # restored from the pool
    assert first + more == cold(open_host, kind, PROMPT)
