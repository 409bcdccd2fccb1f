"""/metrics through prometheus-client: parseable by Prometheus' own parser whatever paths clients
send, route labels from the route table only, and histograms whose counts and sums add up."""

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from superfluid.http.app import ROUTES
from superfluid.http.metrics import Metrics
from tests.superfluid.served import Served

ROUTE_LABELS = {route for table in ROUTES.values() for route in table} | {"other"}


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    server = Served(tiny_models["f32"].gguf, tmp_path_factory.mktemp("served-metrics"))
    yield server
    assert server.stop() == 0


def settled(served, ready, seconds: float = 60) -> dict:
    """The metrics once `ready(families)` holds: a request is counted after its answer went out,
    so a client can scrape before the server thread that answered it has counted it."""
    deadline = time.monotonic() + seconds
    while True:
        found = families(served.raw("GET", "/metrics")[1].decode())
        if ready(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def requests_by_label(found: dict) -> dict:
    return {(s.labels["route"], s.labels["status"]): s.value for s in found["superfluid_requests"].samples
            if s.name == "superfluid_requests_total"}


def test_hostile_paths_neither_break_the_exposition_nor_add_series(served):
    hostile = ('/x"y{z}', "/a\\b", "/%0Aevil", "/v1/sessions/a/b/c", "/" + "p" * 2000)
    for path in hostile:
        assert served.raw("GET", path)[0] == 404
    for index in range(20):
        served.raw("GET", f"/bogus/{index}")
    found = settled(served, lambda f: requests_by_label(f).get(("other", "404"), 0) >= 25)
    counted = requests_by_label(found)  # parsed by Prometheus' own parser: the exposition is intact
    assert counted[("other", "404")] >= 25
    assert {route for route, _ in counted} <= ROUTE_LABELS
    assert [key for key in counted if key[0] == "other"] == [("other", "404")]  # one series for them all


def test_request_histograms_count_and_sum_what_was_served(served):
    before = families(served.raw("GET", "/metrics")[1].decode())
    client = served.client()
    for _ in range(3):
        client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       extra_body={"ignore_eos": True})

    def sample(family, suffix):
        return next(s.value for s in family.samples if s.name == family.name + suffix)

    latency = "superfluid_e2e_request_latency_seconds"  # observed once the last byte went out
    after = settled(served, lambda f: sample(f[latency], "_count") - sample(before[latency], "_count") >= 3)

    for name, per_request in (("superfluid_time_to_first_token_seconds", 1),
                              ("superfluid_time_per_output_token_seconds", 3),
                              ("superfluid_e2e_request_latency_seconds", 1)):
        assert after[name].type == "histogram"
        assert sample(after[name], "_count") - sample(before[name], "_count") == 3 * per_request
        if name == "superfluid_time_per_output_token_seconds":
            # tokens the reader takes together (the event loop woke after several steps: a busy
            # machine) are observed 0 s apart; only the count is certain
            assert sample(after[name], "_sum") >= sample(before[name], "_sum")
        else:  # from the request's arrival: always some time
            assert sample(after[name], "_sum") > sample(before[name], "_sum")
    # each reply's four tokens but its last are fed back through decode steps
    assert sample(after["superfluid_decode_tokens"], "_total") - sample(before["superfluid_decode_tokens"], "_total") == 9
    for gauge in ("superfluid_kv_cells", "superfluid_waiting", "superfluid_generating", "superfluid_parked_sessions"):
        assert after[gauge].type == "gauge"


def test_a_route_label_is_a_route_of_the_table_or_other():
    metrics = Metrics(frozenset({"/health"}))
    metrics.count("/health", 200)
    metrics.count('/x"y{z}', 404)
    text = metrics.exposition().decode()
    assert 'route="/health"' in text and 'route="other"' in text and "x\\\"y" not in text and 'x"y' not in text
