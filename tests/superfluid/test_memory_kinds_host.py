"""The Host on every memory kind (tiny models from tests/memorykinds.py), on llama.cpp and on MLX
where mlx-lm has the architecture: a trim, a fork, a next turn and a restart each give what a
cold run of the same tokens gives, also where the memory cannot be cut back (a 16-token window,
a recurrent state), through checkpoints.

Each story runs three ways: as the host runs by default; with every idle lane parked at every
tick (each fork, trim and next turn then starts from the pool); and with running lanes also
preempted every other tick (swapped out inside prompts and between tokens, and resumed by
import). The host checks its KV bookkeeping after every tick in the last two (superfluid.host.churn),
so what a slow machine's timers would do at some point is done at every point.
"""

from __future__ import annotations

import pytest

from kvpool import places
from kvpool.tier_folder import remove_tier
from superfluid import Host
from superfluid.host.churn import Churn
from tests import memorykinds, tinymodels
from tests.conftest import remove_segment, unique_pool_name
from tests.superfluid.conftest import FIXED_CHUNKS

KINDS = ("kv", "iswa", "recurrent", "hybrid", "hybrid-iswa")
MLX_KINDS = ("kv", "iswa", "recurrent", "hybrid")  # mlx-lm has no windowed LFM2
CASES = [("llamacpp", kind) for kind in KINDS] + [("mlx", kind) for kind in MLX_KINDS]
MODES = {"default": None, "parked": Churn(), "preempted": Churn(preempt_every=2)}
PROMPT = [1 + (i * 11) % 250 for i in range(100)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (its GGUF, its mlx-lm directory or None)."""
    directory = tmp_path_factory.mktemp("host-kinds")
    kv = tinymodels.build(directory / "kv")
    found = {"kv": (kv.gguf, tinymodels.build_mlx(directory / "kv-mlx"))}
    for kind in KINDS[1:]:
        model = memorykinds.build(kind.replace("-", "_"), directory / kind)
        found[kind] = (model.gguf, model.mlx)
    return found


@pytest.fixture(params=CASES, ids=[f"{runtime}-{kind}" for runtime, kind in CASES])
def case(request):
    return request.param


@pytest.fixture(params=list(MODES))
def mode(request):
    return request.param


@pytest.fixture
def open_host(models, case, mode, tmp_path):
    """open_host(name) -> a Host on this case's model in this mode; the same name reopens its pool
    and log. Small prefill chunks and checkpoints, so a 100-token prompt holds several checkpoints
    (where they fall follows the tick, 8 to 32 tokens a step by the machine's speed: every
    assertion here holds wherever they fall); the idle timer stays on."""
    runtime, kind = case
    opened, pools = [], {}

    def make(name: str = "main", churn: Churn | None = MODES[mode]) -> Host:
        pool = pools.setdefault(name, unique_pool_name())
        model = models[kind][0] if runtime == "llamacpp" else models[kind][1]
        options = {"llamacpp_n_ctx": 512, "llamacpp_threads": 1} if runtime == "llamacpp" else {}
        host = Host(model, runtime=runtime, pool_name=pool, pool_bytes=32 << 20, log_dir=tmp_path / name,
                    prefill_budget=32, checkpoint_tokens=16, churn=churn, **FIXED_CHUNKS, **options)
        opened.append(host)
        return host

    yield make
    for host in opened:
        host.close()
    for pool in pools.values():
        remove_segment(pool)
        remove_tier(places.disk_folder(pool))


def greedy(session, count: int = 8) -> list[int]:
    generation = session.generate(count, ignore_eos=True, temperature=0.0)
    generation.collect()
    return list(generation.tokens)


_cold: dict = {}


@pytest.fixture
def cold(open_host, case):
    """cold(tokens, count) -> what a fresh session of this case's model generates after exactly
    `tokens` (greedy, so remembered across the modes)."""
    hosts = []

    def run(tokens: list[int], count: int = 8) -> list[int]:
        key = (case, tuple(tokens), count)
        if key not in _cold:
            hosts[:] = hosts or [open_host("cold", churn=None)]
            session = hosts[0].session()
            session.append_tokens(tokens)
            _cold[key] = greedy(session, count)
        return _cold[key]

    return run


def test_a_trim_equals_a_cold_session(open_host, cold):
    host = open_host()
    session = host.session()
    session.append_tokens(PROMPT)
    greedy(session)
    session.trim(60)
    before = host.stats()
    trimmed = greedy(session)
    prefilled = host.stats().prefill_tokens - before.prefill_tokens
    if host.descriptor.memory.recurrent:  # nothing to cut: the checkpoint at 48 and 12 tokens
        assert host.stats().imports > before.imports and prefilled < 60
    assert trimmed == cold(PROMPT[:60])


def test_a_trim_to_a_parked_state_equals_a_cold_session(open_host, cold):
    # The end of the prompt was parked with all 100 tokens. After a trim back to them the last
    # one is fed again, so that state serves only where it can be cut back by one: on MLX a
    # window layer that has wrapped cannot be cut at all, and an earlier checkpoint serves.
    host = open_host()
    session = host.session()
    session.append_tokens(PROMPT)
    greedy(session)
    session.trim(len(PROMPT))
    assert greedy(session) == cold(PROMPT)


def test_a_fork_continues_as_its_parent_would(open_host):
    host = open_host()
    parent = host.session()
    parent.append_tokens(PROMPT)
    greedy(parent, 2)
    child = parent.fork()
    assert greedy(child) == greedy(parent)


def test_turns_forks_and_restarts_continue_as_cold_sessions(open_host, cold, mode):
    # A long prompt, a next turn, a fork with its own turn, then a restart and a trim back past
    # the window: each generation equals a cold run of the same tokens.
    host = open_host("story")
    session = host.session(id="s", temperature=0.0)
    session.append_tokens(PROMPT)
    first = greedy(session)
    session.append_tokens(PROMPT[:10])
    second = greedy(session)
    child = session.fork()
    child.append_tokens(PROMPT[20:27])
    forked = greedy(child)
    expected = [PROMPT, first, PROMPT[:10], second]
    assert [first, second] == [cold(PROMPT), cold(sum(expected[:3], []))]
    assert forked == cold(sum(expected, []) + PROMPT[20:27])
    stats = host.stats()  # the mode did what it says (llama.cpp parks idle lanes while others run anyway)
    assert (stats.preemptions > 0) == (mode == "preempted")
    if mode != "default":
        assert stats.idle_parks > 0
    host.close()

    again = open_host("story")
    session = again.session(id="s")
    third = greedy(session)
    assert third == cold(sum(expected, []))
    session.trim(70)
    assert greedy(session) == cold(PROMPT[:70])


def test_a_restart_resumes_where_it_was(open_host, cold):
    host = open_host("restart")
    session = host.session(id="s", temperature=0.0)
    session.append_tokens(PROMPT)
    first = greedy(session, 4)
    host.close()
    again = open_host("restart")
    before = again.stats()
    more = greedy(again.session(id="s"), 4)
    assert again.stats().prefill_tokens - before.prefill_tokens <= 4  # restored from the pool
    assert first + more == cold(PROMPT)


def test_after_a_reboot_a_session_resumes_from_the_disk_tier_where_it_was(models, case, tmp_path, cold):
    # The segment is removed between the two hosts, as a reboot removes shared memory: the KV
    # comes back from the disk tier (checkpoints of windowed and recurrent memory included), and
    # what follows equals a cold run.
    runtime, kind = case
    model = models[kind][0] if runtime == "llamacpp" else models[kind][1]
    options = {"llamacpp_n_ctx": 512, "llamacpp_threads": 1} if runtime == "llamacpp" else {}
    pool = unique_pool_name()
    opened = []

    def open_host() -> Host:
        opened.append(Host(model, runtime=runtime, pool_name=pool, pool_bytes=32 << 20, log_dir=tmp_path / "log",
                           prefill_budget=32, checkpoint_tokens=16, **FIXED_CHUNKS, **options))
        return opened[-1]

    try:
        session = open_host().session(id="s", temperature=0.0)
        session.append_tokens(PROMPT)
        first = greedy(session, 4)
        opened[0].close()
        remove_segment(pool)
        again = open_host()
        assert again.pool.disk.wait_scanned(60)
        more = greedy(again.session(id="s"), 4)
        stats = again.stats()
        assert stats.tiers["disk"].hits == 1 and stats.prefill_tokens <= 4  # from disk, not prefilled
        assert first + more == cold(PROMPT)
    finally:
        for host in opened:
            host.close()
        remove_segment(pool)
        remove_tier(places.disk_folder(pool))
