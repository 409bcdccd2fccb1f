"""A worker's name, the session ids it mints, and what it answers a router (superfluid/http/worker.py)."""

import msgspec
import pytest

from superfluid.host.stats import HostStats
from superfluid.http import worker


def stats(**fields) -> HostStats:
    zero = {name: 0 for name in HostStats.__struct_fields__}
    return HostStats(**{**zero, **fields})


@pytest.mark.parametrize("name", ["w1", "gpu-box_2", "a" * 64])
def test_a_name_of_letters_digits_dashes_and_underscores_is_taken(name):
    assert worker.check_name(name) == name
    session_id = worker.new_session_id(name)
    assert session_id.startswith(f"{name}.") and worker.owner_of(session_id) == name


@pytest.mark.parametrize("name", ["", "a.b", "a/b", "a b", "a" * 65, "w1\n"])
def test_a_name_a_proxy_could_not_route_by_is_refused_saying_what_a_name_holds(name):
    with pytest.raises(ValueError, match="letters, digits"):
        worker.check_name(name)


def test_without_a_name_the_host_mints_plain_ids_that_name_no_worker():
    assert worker.new_session_id(None) is None
    assert worker.owner_of("0123456789abcdef0123456789abcdef") is None
    assert worker.owner_of("my session.x") is None  # a dot after something that is not a name
    assert worker.new_session_id("w1") != worker.new_session_id("w1")


def test_a_session_of_another_worker_is_a_421_naming_its_worker():
    error = worker.misdirected("w2.abc", "w1")
    assert error.status == 421 and error.code == "misdirected_request"
    assert "`w2`" in error.message and "`w1`" in error.message and "/v1/sessions/w2.*" in error.message
    assert worker.misdirected("w1.abc", "w1") is None  # ours, but gone: a plain 404
    assert worker.misdirected("w2.abc", None) is None  # a worker without a name routes nothing
    assert worker.misdirected("abc", "w1") is None


def test_the_load_and_server_info_are_in_the_shapes_sglang_router_reads():
    held = stats(generating=3, waiting=2, cells_used=1500, cells_total=8192)
    load = worker.load(held)
    assert load == [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 2, "num_tokens": 1500}]
    info = worker.server_info("SmolLM2", "0.1.0", held)
    assert info["served_model_name"] == "SmolLM2" and info["max_total_tokens"] == 8192
    assert "model_path" not in info  # the router would try to load a tokenizer from it
    assert msgspec.json.decode(msgspec.json.encode(worker.model_info("llamacpp")))["is_generation"] is True
