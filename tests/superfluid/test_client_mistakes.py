"""Every client mistake is a 4xx naming the field or the rule, never a 500 (which the openai
client retries twice, and which says the server is at fault), and the server goes on.

One server on a tiny model that ships Gemma 2's chat template: a template that refuses
conversations (no system role; roles must alternate), as real models' templates do."""

import json
import socket
import time

import openai
import pytest

from tests import realtemplates, tinymodels
from tests.superfluid.served import Served


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    directory = tmp_path_factory.mktemp("strict")
    model = tinymodels.build(directory, "f32", chat_template=realtemplates.from_llama_cpp()["Gemma 2"])
    server = Served(model.gguf, directory)
    yield server
    assert server.stop() == 0


def send(server, path: str, body: bytes | dict, method: str = "POST") -> tuple[int, dict]:
    status, data = server.raw(method, path, body if isinstance(body, bytes) else json.dumps(body).encode())
    return status, json.loads(data)


def chat_body(server, **fields) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


@pytest.mark.parametrize("fields, named", [
    ({"top_k": 2 ** 70}, "top_k"),  # past any vocabulary, past 64 bits
    ({"repeat_last_n": 2 ** 70}, "repeat_last_n"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),  # not a silent fall back to max_tokens
    ({"max_tokens": 0}, "max_tokens"),
])
def test_a_value_out_of_range_is_a_400_naming_its_field(strict, fields, named):
    status, body = send(strict, "/v1/chat/completions", chat_body(strict, **fields))
    assert status == 400 and body["error"]["param"] == named and f"`{named}`" in body["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"priority": "interactive"}), ("/v1/sessions", {"priority": "interactive"}),
])
def test_a_priority_above_default_is_refused_where_the_server_does_not_allow_it(strict, path, body):
    # any client could send it and preempt every other client's work (serve's --allow-priority)
    status, answer = send(strict, path, chat_body(strict, **body) if "chat" in path else body)
    assert status == 400 and answer["error"]["code"] == "priority_not_allowed" and "--allow-priority" in \
        answer["error"]["message"]
    status, _ = send(strict, path, chat_body(strict, priority="background") if "chat" in path else {"priority": "background"})
    assert status in (200, 201)  # a lower class is anyone's to ask for


@pytest.mark.parametrize("depth", [1000, 10_000])
def test_json_nested_deep_is_a_400(strict, depth):
    # 1,000 deep passes Python 3.12's decoder (then the field's type is wrong) and stops 3.11's;
    # 10,000 stops both: either way a 400, never a 500
    deep = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    status, body = send(strict, "/v1/chat/completions", deep)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    if depth == 10_000:
        assert "too deeply" in body["error"]["message"]
    assert strict.raw("GET", "/health")[0] == 200


@pytest.mark.parametrize("messages, rule", [
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "roles must alternate"),
    ([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}], "System role not supported"),
])
def test_a_conversation_the_template_refuses_is_a_400_in_the_templates_words(strict, messages, rule):
    status, body = send(strict, "/v1/chat/completions", chat_body(strict, messages=messages))
    assert status == 400 and body["error"]["code"] == "chat_template_error" and rule in body["error"]["message"]
    with pytest.raises(openai.BadRequestError, match=rule):  # the client sees it at once, without retrying
        strict.client().chat.completions.create(model=strict.model, messages=messages, max_tokens=2)


def test_session_mistakes_are_400s_and_leave_the_session_as_it_was(strict):
    status, created = send(strict, "/v1/sessions", {})
    assert status == 201 and created["tokens"] == 0
    sid = created["id"]
    status, body = send(strict, f"/v1/sessions/{sid}/generate", {"max_tokens": 2})  # nothing to continue
    assert status == 400 and body["error"]["code"] == "empty_session" and "append" in body["error"]["message"]
    user = {"messages": [{"role": "user", "content": "hi"}]}
    assert send(strict, f"/v1/sessions/{sid}/messages", user)[0] == 200
    status, body = send(strict, f"/v1/sessions/{sid}/messages", user)  # a second user turn in a row
    assert status == 400 and "roles must alternate" in body["error"]["message"]
    long = {"messages": [{"role": "assistant", "content": "word " * 4000}]}  # past the 2,048 one session holds
    status, body = send(strict, f"/v1/sessions/{sid}/messages", long)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and "nothing was appended" in \
        body["error"]["message"]
    status, body = send(strict, f"/v1/sessions/{sid}/generate", {"max_tokens": 2, "top_k": 2 ** 70})
    assert status == 400 and body["error"]["param"] == "top_k"
    status, info = send(strict, f"/v1/sessions/{sid}", b"", method="GET")
    assert status == 200 and info["messages"] == 1  # the refused turn left nothing behind
    status, reply = send(strict, f"/v1/sessions/{sid}/generate", {"max_tokens": 2})
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1


def test_a_stream_whose_client_stops_reading_is_cut_after_the_send_deadline(tmp_path):
    # More than the kernel's socket buffers hold (4 MiB here): a long reply with 20 alternatives
    # a token, from a tiny model that takes 32,768 positions
    model = tinymodels.build(tmp_path, "f32", tinymodels.TinyConfig(context=32768))
    server = Served(model.gguf, tmp_path, "--send-timeout", "1")
    try:
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills fast: the server's sends block
        reader.connect(server.address)
        body = json.dumps({"model": server.model, "prompt": "Go on", "max_tokens": 30000, "stream": True,
                           "ignore_eos": True, "logprobs": 20}).encode()
        reader.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert reader.recv(64).startswith(b"HTTP/1.1 200")  # streaming; then it reads nothing more
        deadline = time.time() + 120
        while server.metric("stalled_clients_total") < 1 and time.time() < deadline:
            time.sleep(0.2)
        assert server.metric("stalled_clients_total") == 1
        while server.metric("generating") and time.time() < deadline:
            time.sleep(0.1)
        assert server.metric("generating") == 0  # its lane is free
        received = b""
        reader.settimeout(30)
        try:
            while chunk := reader.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            pass  # cut, not closed: what was buffered is dropped
        assert b"data: [DONE]" not in received  # the stream was cut, not finished
        assert server.raw("GET", "/health")[0] == 200
        reader.close()
    finally:
        assert server.stop() == 0


def test_the_caps_on_sessions_and_messages_answer_429_and_400_naming_the_flag(tiny_models, tmp_path):
    server = Served(tiny_models["f32"].gguf, tmp_path, "--max-sessions", "1", "--max-messages", "2")
    try:
        assert send(server, "/v1/sessions", {})[0] == 201
        status, body = send(server, "/v1/sessions", {})
        assert status == 429 and body["error"]["code"] == "too_many_sessions" and "--max-sessions" in \
            body["error"]["message"]
        three = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
        status, body = send(server, "/v1/chat/completions", chat_body(server, messages=three))
        assert status == 400 and body["error"]["code"] == "too_many_messages" and "--max-messages" in \
            body["error"]["message"]
        assert send(server, "/v1/chat/completions", chat_body(server, messages=three[1:]))[0] == 200
    finally:
        assert server.stop() == 0
