"""Hosts on the tiny models, for each runtime: closed and their pools unlinked after each test."""

import pytest

from engines import registry
from kvpool import places
from kvpool.tier_folder import remove_tier
from superfluid import Host
from tests.gate import Gate
from tests.conftest import remove_segment, unique_pool_name

RUNTIMES = ("llamacpp", "mlx")
# Fixed prompt chunks (the prefill budget, not what the measured step time fits): these tests
# compare outputs across runs token for token, and where a model's logits depend on the batch
# shape (sliding-window attention on llama.cpp), a chunk cut elsewhere can flip a near-tie.
# The planner's timing is tested on a simulated clock (tests/superfluid/test_load.py).
FIXED_CHUNKS = {"first_token_target": None, "decode_step_target": None}
DEFAULTS = {
    "llamacpp": {"llamacpp_threads": 2, "llamacpp_threads_batch": 2, "llamacpp_n_ctx": 4096, **FIXED_CHUNKS},
    "mlx": {**FIXED_CHUNKS},
}


@pytest.fixture(params=RUNTIMES)
def runtime(request):
    return request.param


@pytest.fixture
def model_for(tiny_models, tiny_mlx):
    """The tiny f32 model in the form each runtime loads."""
    return lambda runtime: tiny_models["f32"].gguf if runtime == "llamacpp" else tiny_mlx


@pytest.fixture
def open_host(runtime, model_for, tmp_path, clock):
    """Open hosts of this test's runtime (same pool name and log by default, as a restart would).
    The idle timer is on, on the test's clock: a lane is parked by it only where the test moves
    the clock past idle_park_seconds, so statistics read twice never differ by a timer that a
    slow machine let fire in between."""
    opened, names = [], set()
    name = unique_pool_name()

    def make(*, pool_name: str | None = None, log_dir=None, gate: Gate | None = None, **options) -> Host:
        chosen = pool_name or name
        names.add(chosen)
        options = {"pool_bytes": 64 << 20, "clock": clock, **DEFAULTS[runtime], **options}
        if gate is not None:  # the runtime's engine with its step behind the gate (tests/gate.py)
            prefix = f"{runtime}_"
            own = {key[len(prefix):]: options.pop(key) for key in list(options) if key.startswith(prefix)}
            adapter, model = registry.adapter(runtime), model_for(runtime)
            options["engine_factory"] = lambda: gate.wrap(adapter(model, **own))
        host = Host(model_for(runtime), runtime=runtime, pool_name=chosen, log_dir=log_dir or tmp_path / "log",
                    **options)
        opened.append(host)
        return host

    yield make
    for host in opened:
        host.close()
    for chosen in names:
        remove_segment(chosen)
        remove_tier(places.disk_folder(chosen))


@pytest.fixture
def template_host(tmp_path, clock):
    """template_host(template) -> a Host on a tiny model that ships `template`; closed after the test."""
    from tests import tinymodels

    opened = []

    def make(template: str) -> Host:
        model = tinymodels.build(tmp_path / f"model-{len(opened)}", "f32", chat_template=template)
        pool = unique_pool_name()
        opened.append((Host(model.gguf, pool_name=pool, pool_bytes=32 << 20, log_dir=tmp_path / f"log-{len(opened)}",
                            llamacpp_threads=2, llamacpp_n_ctx=2048, clock=clock), pool))
        return opened[-1][0]

    yield make
    for host, pool in opened:
        host.close()
        remove_segment(pool)
