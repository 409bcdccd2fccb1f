"""One-shot requests (OpenAI chat and text completions) run on request lanes: never written to
the session log, never among the sessions, nobody's to fork or delete; only their KV stays, parked
in the pool under its prefix for the next request that starts the same way."""

import http.client
import json

import pytest

from superfluid import ContextFull, SessionNotFound, SuperfluidError
from superfluid.host.request import GenerateRequest, Prompt
from superfluid.host.sampling import Sampling
from tests import tinymodels
from tests.gate import Gate
from tests.conftest import remove_segment, unique_pool_name
from tests.superfluid.served import Served

PROMPT = "The capital of France is Paris. The quick brown fox"


def test_a_one_shot_request_is_no_session_and_writes_nothing_to_the_log(open_host):
    host = open_host()
    kept = host.session()
    kept.append_text(PROMPT)
    written = host._log.path.stat().st_size
    lane, generation = host.call(host.commands.start_request, host.prepare(Prompt(text=PROMPT)),
                                 GenerateRequest(max_tokens=12, ignore_eos=True))
    # until the request ends, its lane exists, and still nobody else can see or touch it
    assert [info.id for info in host.sessions()] == [kept.id]
    for command in (host.commands.info, host.commands.tokens, host.commands.fork, host.commands.delete,
                    host.commands.retire, host.commands.pin):
        with pytest.raises(SessionNotFound):
            host.call(command, lane)
    with pytest.raises(SessionNotFound):
        host.session(id=lane)
    generation.collect()
    assert len(generation.tokens) == 12 and generation.finish_reason == "length"
    # the lane ended with its generation, before its reader heard of the end
    assert host.call(lambda: lane in host.commands.sessions.requests) is False
    assert host._log.path.stat().st_size == written  # not a record: no open, no tokens, no park, no delete
    assert host.stats().sessions == 1 and host.stats().generating == 0 and host.stats().lanes == 0
    host.call(host.commands.end_request, lane)  # after the end: nothing to end


def test_the_next_request_starting_the_same_way_resumes_from_the_parked_prefix(open_host):
    host = open_host()
    prompt = PROMPT * 8
    first, generation = host.call(host.commands.start_request, host.prepare(Prompt(text=prompt)),
                                  GenerateRequest(max_tokens=2))
    generation.collect()  # its lane gone with its generation, its KV parked in the pool
    again, generation = host.call(host.commands.start_request, host.prepare(Prompt(text=prompt + " jumps")),
                                  GenerateRequest(max_tokens=2))
    generation.collect()
    assert generation.cached_tokens >= generation.prompt_tokens - 8  # all but what " jumps" added
    assert host.sessions() == []


def test_a_request_refused_at_the_start_leaves_no_lane(open_host):
    host = open_host()
    with pytest.raises(ContextFull):
        host.call(host.commands.start_request, host.prepare(Prompt(text="word " * 5000)),
                  GenerateRequest(max_tokens=2))
    assert host.call(lambda: len(host.commands.sessions.requests)) == 0 and host.stats().lanes == 0


def test_session_ids_of_the_request_lanes_form_cannot_be_taken(open_host):
    host = open_host()
    with pytest.raises(SuperfluidError, match="the host's own"):
        host.call(host.commands.create, "request-1", None, Sampling(), "default")
    parent = host.session()
    with pytest.raises(SuperfluidError, match="the host's own"):
        host.call(host.commands.fork, parent.id, "request-2")
    assert [info.id for info in host.sessions()] == [parent.id]


def _stream(server, body):
    connection = http.client.HTTPConnection(*server.address, timeout=60)
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                       headers={"Content-Type": "application/json"})
    return connection, connection.getresponse()


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """The tiny model declaring 16,384 positions: a reply to a long question runs for thousands of
    tokens, so the kill below lands in the middle of it."""
    return tinymodels.build(tmp_path_factory.mktemp("tiny-16k"), "f32", tinymodels.TinyConfig(context=16384)).gguf


def test_over_http_a_request_is_invisible_and_after_sigkill_only_its_cached_prefix_remains(long_context_model,
                                                                                           tmp_path):
    pool = unique_pool_name()
    server = Served(long_context_model, tmp_path, pool=pool)
    long_question = " ".join(f"word{i}" for i in range(300))  # past the prefix publishing threshold (256 tokens)
    body = {"model": server.model, "messages": [{"role": "user", "content": long_question}]}
    try:
        connection, response = _stream(server, {**body, "max_tokens": 100_000, "stream": True, "ignore_eos": True})
        events = 0
        while events < 4:  # the role, then tokens: the prompt was prefilled and published
            line = response.readline()
            assert line.startswith(b"data: {") or line == b"\n", line
            events += line.startswith(b"data: ")
        status, listed = server.raw("GET", "/v1/sessions")
        server.process.kill()  # SIGKILL mid-request: nothing parked or synced after this point
        server.process.wait()
        try:
            rest = response.read()
        except http.client.IncompleteRead as cut:  # the connection died with the server, mid-stream
            rest = cut.partial
        connection.close()
        assert b"[DONE]" not in rest, "the reply ended before the kill: it was not killed mid-request"
        assert status == 200 and json.loads(listed)["data"] == []  # not a session while it ran
        again = Served(long_context_model, tmp_path, pool=pool)
        try:
            status, listed = again.raw("GET", "/v1/sessions")
            assert status == 200 and json.loads(listed)["data"] == []  # and none after the restart
            for method, path in (("GET", "/v1/sessions/request-1"), ("DELETE", "/v1/sessions/request-1"),
                                 ("POST", "/v1/sessions/request-1/fork")):
                assert again.raw(method, path, b"{}" if method == "POST" else None)[0] == 404, (method, path)
            reply = again.client().chat.completions.create(**body, max_tokens=2)
            usage = reply.usage
            assert usage.prompt_tokens > 256 and usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1
        finally:
            assert again.stop() == 0
    finally:
        server.stop()
        remove_segment(pool)


def test_a_long_conversation_is_built_on_the_callers_thread_while_the_scheduler_is_busy(open_host):
    # The engine is held in the middle of another generation's step: building the prompt of a
    # 20,000-message conversation needs nothing of the scheduler thread, and renders it once.
    gate = Gate(lambda requests: True)
    host = open_host(gate=gate)
    busy = host.session()
    busy.append_text(PROMPT)
    running = host.submit(host.commands.generate, busy.id, GenerateRequest(max_tokens=4))
    gate.wait_reached()
    try:
        messages = tuple(("user" if i % 2 == 0 else "assistant", "") for i in range(19_999)) + (("user", "Hi"),)
        before = host.prompts.template.messages_rendered
        prompt = host.prepare(Prompt(messages))
        # rendered three times, whatever its length: whole, then without and with the assistant's opening
        assert host.prompts.template.messages_rendered - before == 3 * len(messages)
        assert len(prompt.message_ends) == len(messages) and prompt.tokens and prompt.opening
    finally:
        gate.open()
    running.result().collect()
    with pytest.raises(ContextFull):  # longer than the tiny model's context: refused, before any step
        host.call(host.commands.start_request, prompt, GenerateRequest(max_tokens=2))
    short = host.prepare(Prompt(messages[-3:]))
    lane, generation = host.call(host.commands.start_request, short, GenerateRequest(max_tokens=2))
    generation.collect()
    assert generation.prompt_tokens == len(short.tokens) + len(short.opening)
