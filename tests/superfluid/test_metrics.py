"""/metrics through prometheus-client: parseable by Prometheus' own parser whatever paths clients
send, route labels from the route table only, and histograms whose counts and sums add up."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from superfluid.metrics import Metrics
from superfluid.server import ROUTES
from tests.superfluid.served import Served

ROUTE_LABELS = {route for table in ROUTES.values() for route in table} | {"other"}


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    server = Served(tiny_models["f32"].gguf, tmp_path_factory.mktemp("served-metrics"))
    yield server
    assert server.stop() == 0


def test_hostile_paths_neither_break_the_exposition_nor_add_series(served):
    for path in ('/x"y{z}', "/a\\b", "/%0Aevil", "/v1/sessions/a/b/c", "/" + "p" * 2000):
        assert served.raw("GET", path)[0] in (404, 401)
    served.raw("GET", "/metrics")  # its own series exists from now on
    first = families(served.raw("GET", "/metrics")[1].decode())
    labels = {sample.labels["route"] for sample in first["superfluid_requests"].samples}
    assert labels <= ROUTE_LABELS and "other" in labels
    for index in range(20):
        served.raw("GET", f"/bogus/{index}")
    again = families(served.raw("GET", "/metrics")[1].decode())
    assert len(again["superfluid_requests"].samples) == len(first["superfluid_requests"].samples)
    other = [s for s in again["superfluid_requests"].samples if s.labels == {"route": "other", "status": "404"}
             and s.name == "superfluid_requests_total"]
    assert other and other[0].value >= 25


def test_request_histograms_count_and_sum_what_was_served(served):
    before = families(served.raw("GET", "/metrics")[1].decode())
    client = served.client()
    for _ in range(3):
        client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       extra_body={"ignore_eos": True})
    after = families(served.raw("GET", "/metrics")[1].decode())

    def sample(family, suffix):
        return next(s.value for s in family.samples if s.name == family.name + suffix)

    for name, per_request in (("superfluid_time_to_first_token_seconds", 1),
                              ("superfluid_time_per_output_token_seconds", 3),
                              ("superfluid_e2e_request_latency_seconds", 1)):
        assert after[name].type == "histogram"
        assert sample(after[name], "_count") - sample(before[name], "_count") == 3 * per_request
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
