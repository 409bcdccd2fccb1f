"""`superfluid serve` on a tiny model, driven with the official openai client (and raw HTTP
where a client would not send what is tested)."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

from tests.conftest import in_threads, remove_segment, unique_pool_name
from tests.superfluid.served import ROOT, Served

@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    server = Served(tiny_models["f32"].gguf, tmp_path_factory.mktemp("served"))
    yield server
    assert server.stop() == 0


def chat(client, model, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "What is the capital of France?"}])
    kwargs.setdefault("max_tokens", 6)
    return client.chat.completions.create(model=model, **kwargs)


def test_models_and_health(served):
    assert [m.id for m in served.client().models.list().data] == [served.model] == ["tiny-f32"]
    status, body = served.raw("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_the_start_says_what_was_sized_and_why_and_warns_of_nothing_that_does_not_apply(served):
    # serve sizes the cells from memory, past the tiny model's trained 2,048 positions: one
    # session is still capped there, so llama.cpp's "training context overflow" is not shown
    cells, session, pool = served.sizing
    count = int(cells.split()[2].replace(",", ""))
    assert count > 2048 and cells.startswith("KV cells: ") and ", shared by every session: " in cells
    assert ("at the model's training context of 2,048 tokens" in cells or "of memory available holds" in cells) \
        and "(n_ctx=-1); --llamacpp-n-ctx sets them" in cells
    assert session == "one session holds up to 2,048 tokens: the model's trained context; the other cells are for " \
                      "other sessions"
    # the fixture's pool is 64 MiB, less than every other bound on a test machine
    assert pool.startswith("pool: 64 MiB (set by --pool-bytes), up to 64 MiB of KV kept beyond the cells (") \
        and "bounded by the pool's capacity (64.0 MiB); --pool-bytes and --export-budget set it" in pool
    assert "training context overflow" not in served.stderr()


def test_chat_reports_usage_and_the_cached_prompt_tokens_of_a_repeat(served):
    client = served.client()
    first = chat(client, served.model, seed=1)
    assert first.choices[0].finish_reason in ("stop", "length") and first.usage.completion_tokens >= 1
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    again = chat(client, served.model, seed=1)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_a_streamed_chat_matches_the_whole_one_and_ends_with_usage(served):
    client = served.client()
    whole = chat(client, served.model, max_tokens=8)
    chunks = list(chat(client, served.model, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def test_completions_streamed_and_not(served):
    client = served.client()
    whole = client.completions.create(model=served.model, prompt="The capital of France is", max_tokens=6)
    streamed = client.completions.create(model=served.model, prompt="The capital of France is", max_tokens=6,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"


def test_a_stop_string_ends_the_reply_before_it(served):
    client = served.client()
    text = client.completions.create(model=served.model, prompt="Once", max_tokens=30, seed=3, temperature=0.8,
                                     extra_body={"ignore_eos": True}).choices[0].text
    at = next(k for k in range(3, len(text) - 3) if text.find(text[k:k + 3]) == k and "\ufffd" not in text[k:k + 3])
    cut = client.completions.create(model=served.model, prompt="Once", max_tokens=30, seed=3, temperature=0.8,
                                    stop=[text[at:at + 3]], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:at] and cut.choices[0].finish_reason == "stop"


def test_several_clients_at_once(served):
    client = served.client()
    results = in_threads(lambda i: chat(client, served.model, messages=[{"role": "user", "content": f"Question {i}?"}]),
                         6)
    assert len(results) == 6 and all(r.choices[0].finish_reason in ("stop", "length") for r in results)


def test_a_client_that_disconnects_mid_stream_frees_its_lane(served):
    body = json.dumps({"model": served.model, "prompt": "Go on", "max_tokens": 100_000, "stream": True,
                       "ignore_eos": True}).encode()
    connection = http.client.HTTPConnection(*served.address, timeout=60)
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.fp.readline()  # streaming now
    assert served.metric("generating") == 1
    connection.sock.close()
    connection.close()
    deadline = time.time() + 20
    while served.metric("generating") and time.time() < deadline:
        time.sleep(0.1)
    assert served.metric("generating") == 0


@pytest.mark.parametrize("body, status, names", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "M", "messages": "hello"}', 400, "messages"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"model": "M", "messages": [{"role": "wizard", "content": "x"}]}', 400, "role"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": -1}', 400, "temperature"),
    (b'{"model": "M", "messages": []}', 400, "messages"),
    (b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}', 404, "does not exist"),
])
def test_bad_requests_get_an_openai_style_error_naming_the_problem(served, body, status, names):
    got, data = served.raw("POST", "/v1/chat/completions", body.replace(b'"M"', f'"{served.model}"'.encode()))
    error = json.loads(data)["error"]
    assert got == status and names in (error["message"] + str(error["param"]))


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f"}]), ("n", 2),
                                          ("invented_field", 1)])
def test_fields_that_cannot_be_honoured_are_refused(served, field, value):
    with pytest.raises(openai.BadRequestError, match=f"`{field}`"):
        chat(served.client(), served.model, extra_body={field: value})
    assert served.raw("GET", "/health")[0] == 200


def test_fields_that_change_nothing_are_accepted(served):
    reply = chat(served.client(), served.model, user="me", metadata={"a": "b"}, store=False, max_tokens=2)
    assert reply.usage.completion_tokens >= 1


def test_llama_cpp_sampling_fields_change_the_answer(served):
    """top_k 1 is greedy whatever the temperature: the same reply as temperature 0."""
    client = served.client()
    greedy = chat(client, served.model, temperature=0, max_tokens=8)
    top_one = chat(client, served.model, temperature=1.5, seed=11, max_tokens=8, extra_body={"top_k": 1})
    assert top_one.choices[0].message.content == greedy.choices[0].message.content
    loose = [chat(client, served.model, temperature=1.5, seed=s, max_tokens=8).choices[0].message.content
             for s in range(4)]
    assert any(text != greedy.choices[0].message.content for text in loose)  # without top_k it wanders
    with pytest.raises(openai.BadRequestError, match="repeat_penalty"):
        chat(client, served.model, extra_body={"repeat_penalty": 0})


def test_a_body_over_the_limit_is_refused(served):
    status, data = served.raw("POST", "/v1/chat/completions", b"x" * ((1 << 20) + 1))
    assert status == 413 and "over the limit" in json.loads(data)["error"]["message"]
    assert served.raw("GET", "/health")[0] == 200  # and the server goes on


def test_with_an_api_key_every_route_but_health_needs_it(tiny_models, tmp_path):
    server = Served(tiny_models["f32"].gguf, tmp_path, "--api-key", "s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").models.list()
        assert server.raw("GET", "/metrics")[0] == 401
        assert server.raw("GET", "/health")[0] == 200
        assert [m.id for m in server.client("s3cret").models.list().data] == [server.model]
        assert "visible to every user of this machine" in server.stderr()  # a key in argv is seen in ps
    finally:
        assert server.stop() == 0


def serve_exit(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "superfluid", "serve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_exit_codes(tiny_models, tmp_path):
    model = str(tiny_models["f32"].gguf)
    done = serve_exit(model, "--port", "nope")
    assert done.returncode == 2 and "invalid int value" in done.stderr
    done = serve_exit(model, "--mlx-prefill-chunk", "8")
    assert done.returncode == 2 and "is an option of the mlx runtime" in done.stderr
    done = serve_exit(model, "--api-key", " ")
    assert done.returncode == 2 and "turn authentication off" in done.stderr
    done = serve_exit(model, "--llamacpp-n-ctx", "many")
    assert done.returncode == 2 and "n_ctx" in done.stderr
    for flag in ("--max-connections", "--timeout-keep-alive", "--header-timeout", "--body-timeout"):
        done = serve_exit(model, flag, "0")
        assert done.returncode == 2 and f"{flag} 0" in done.stderr and "above 0" in done.stderr
    done = serve_exit(str(tmp_path / "missing.gguf"))
    assert done.returncode == 3 and "no model at" in done.stderr
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    done = serve_exit(str(broken), "--pool-name", unique_pool_name(), "--log-dir", str(tmp_path / "log"))
    assert done.returncode == 3 and "failed to load" in done.stderr
    done = serve_exit(model, "--pool-bytes", str(1 << 50))
    assert done.returncode == 3 and "GiB of memory available" in done.stderr
    busy_pool = unique_pool_name()
    with socket.socket() as taken:  # a port another process holds: the server cannot listen (exit 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        try:
            done = serve_exit(model, "--port", str(taken.getsockname()[1]), "--pool-name", busy_pool,
                              "--log-dir", str(tmp_path / "log-busy"))
        finally:
            remove_segment(busy_pool)  # in case it created one: the port is checked first, so it should not
        assert done.returncode == 1 and "cannot listen" in done.stderr
    (tmp_path / "not-a-model").mkdir()
    done = serve_exit(str(tmp_path / "not-a-model"))
    assert done.returncode == 4 and "no runtime loads" in done.stderr


def post(server, path, payload=None, method="POST"):
    status, data = server.raw(method, path, json.dumps(payload or {}).encode())
    return status, json.loads(data)


def test_session_routes_create_append_generate_fork_delete(served):
    status, created = post(served, "/v1/sessions", {"system": "Be brief.", "seed": 4})
    assert status == 201 and created["messages"] == 1
    sid = created["id"]
    status, after = post(served, f"/v1/sessions/{sid}/messages",
                         {"messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert status == 200 and after["messages"] == 2 and after["tokens"] > created["tokens"]
    status, reply = post(served, f"/v1/sessions/{sid}/generate", {"max_tokens": 5})
    assert status == 200 and reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] >= 1
    status, child = post(served, f"/v1/sessions/{sid}/fork")
    assert status == 201 and child["parent"] == sid and child["tokens"] == post(served, f"/v1/sessions/{sid}",
                                                                                 method="GET")[1]["tokens"]
    status, second = post(served, f"/v1/sessions/{child['id']}/generate", {"max_tokens": 3})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the fork started from the parent's KV
    listed = {s["id"] for s in post(served, "/v1/sessions", method="GET")[1]["data"]}
    assert {sid, child["id"]} <= listed
    assert post(served, f"/v1/sessions/{child['id']}", method="DELETE") == (200, {"id": child["id"], "object": "session",
                                                                                 "deleted": True})
    status, missing = post(served, f"/v1/sessions/{child['id']}/generate", {"max_tokens": 3})
    assert status == 404 and "no session" in missing["error"]["message"]


def test_a_streamed_session_turn(served):
    _, created = post(served, "/v1/sessions", {"messages": [{"role": "user", "content": "Hello"}]})
    connection = http.client.HTTPConnection(*served.address, timeout=60)
    connection.request("POST", f"/v1/sessions/{created['id']}/generate",
                       body=json.dumps({"max_tokens": 4, "stream": True}).encode(),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    events = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
    connection.close()
    assert response.status == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_conversation_resumes_after_the_server_is_killed_and_restarted(tiny_models, tmp_path):
    pool = unique_pool_name()
    server = Served(tiny_models["f32"].gguf, tmp_path, pool=pool)
    try:
        _, created = post(server, "/v1/sessions", {"messages": [{"role": "user", "content": "Hello there"}]})
        post(server, f"/v1/sessions/{created['id']}/generate", {"max_tokens": 4})
        tokens = post(server, f"/v1/sessions/{created['id']}", method="GET")[1]["tokens"]
        server.process.kill()  # SIGKILL: no chance to park or sync anything more
        server.process.wait()
        again = Served(tiny_models["f32"].gguf, tmp_path, pool=pool)
        try:
            info = post(again, f"/v1/sessions/{created['id']}", method="GET")[1]
            assert info["tokens"] == tokens and info["messages"] == 2
            post(again, f"/v1/sessions/{created['id']}/messages", {"messages": [{"role": "user", "content": "More"}]})
            status, reply = post(again, f"/v1/sessions/{created['id']}/generate", {"max_tokens": 3})
            assert status == 200 and reply["usage"]["prompt_tokens"] > tokens
        finally:
            assert again.stop() == 0
    finally:
        server.stop()  # ended in the test; if it failed before, the server must not outlive it
        remove_segment(pool)


def test_offline_with_no_cached_default_model_says_what_to_do(tmp_path):
    environment = {**os.environ, "SUPERFLUID_CACHE": str(tmp_path / "empty-cache"),
                   "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "", "PIP_FIND_LINKS": "",
                   "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    done = subprocess.run([sys.executable, "-m", "superfluid", "serve"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=environment)
    assert done.returncode == 3 and "could not fetch the default model" in done.stderr


def test_sigterm_mid_stream_parks_the_lane_and_a_restart_resumes_it_warm(tiny_models, tmp_path):
    pool = unique_pool_name()
    server = Served(tiny_models["f32"].gguf, tmp_path, pool=pool)
    try:
        _, created = post(server, "/v1/sessions", {"messages": [{"role": "user", "content": "Tell me more"}]})
        connection = http.client.HTTPConnection(*server.address, timeout=60)
        connection.request("POST", f"/v1/sessions/{created['id']}/generate",
                           body=json.dumps({"max_tokens": 100_000, "stream": True, "ignore_eos": True}).encode(),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        for _ in range(6):
            response.readline()  # tokens are flowing
        server.process.send_signal(signal.SIGTERM)
        rest = response.read().decode()  # the stream ends (the generation is closed), not cut
        connection.close()
        assert server.process.wait(timeout=60) == 0 and rest.rstrip().endswith("data: [DONE]")
        again = Served(tiny_models["f32"].gguf, tmp_path, pool=pool)
        try:
            info = post(again, f"/v1/sessions/{created['id']}", method="GET")[1]
            assert info["tokens"] > created["tokens"] + 2  # what it generated before the stop was kept
            post(again, f"/v1/sessions/{created['id']}/messages", {"messages": [{"role": "user", "content": "Go"}]})
            _, reply = post(again, f"/v1/sessions/{created['id']}/generate", {"max_tokens": 2})
            # parked at the stop: all but the last sampled token and the turn's closing marks (not fed yet)
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= info["tokens"] - 5
        finally:
            assert again.stop() == 0
    finally:
        server.stop()  # ended in the test; if it failed before, the server must not outlive it
        remove_segment(pool)


def test_an_mlx_model_directory_is_served_by_mlx(tiny_mlx, tmp_path):
    server = Served(tiny_mlx, tmp_path, "--mlx-prefill-chunk", "64")
    try:
        status, health = server.raw("GET", "/health")
        assert json.loads(health)["runtime"] == "mlx"
        reply = chat(server.client(), server.model, max_tokens=3)
        assert reply.usage.completion_tokens >= 1
    finally:
        assert server.stop() == 0


def test_a_reply_that_reaches_the_context_ends_with_length(tiny_models, tmp_path):
    server = Served(tiny_models["f32"].gguf, tmp_path, "--llamacpp-n-ctx", "64", "--llamacpp-n-seq-max", "1")
    try:
        reply = server.client().completions.create(model=server.model, prompt="x " * 20, max_tokens=10_000,
                                                   extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length" and reply.usage.total_tokens <= 256
        streamed = list(server.client().completions.create(model=server.model, prompt="x " * 20, max_tokens=10_000,
                                                           stream=True, extra_body={"ignore_eos": True}))
        assert streamed[-1].choices[0].finish_reason == "length"
    finally:
        assert server.stop() == 0


def test_a_host_driving_mlx_from_its_scheduler_thread_exits_cleanly(tiny_mlx, tmp_path):
    """MLX used from a thread other than the main one aborts at exit now and then unless that
    thread clears its streams; the Host's scheduler does. Several runs, each must exit 0."""
    script = (f"from superfluid import Host\n"
              f"host = Host({str(tiny_mlx)!r}, pool_name='exit-' + __import__('sys').argv[1], pool_bytes=64 << 20, "
              f"log_dir={str(tmp_path)!r} + '/log-' + __import__('sys').argv[1])\n"
              f"s = host.session(); s.append_text('hello'); s.complete(max_tokens=3)\n"
              f"host.close(remove_pool=True)\n")
    codes = [subprocess.run([sys.executable, "-c", script, f"{os.getpid()}-{i}"], cwd=ROOT, capture_output=True,
                            timeout=120).returncode for i in range(6)]
    assert codes == [0] * 6
