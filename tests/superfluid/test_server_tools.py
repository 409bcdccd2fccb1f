"""Tool calls over HTTP, with the official `openai` client against a real `superfluid serve` on a tiny
model of random weights (its template takes no tools: they are described in a system message and
calls written in the hermes format): `tool_choice` required and named make the reply calls whose
arguments validate against their tools' parameters, whole and as streamed tool-call deltas; a
conversation that carries the calls and their results is accepted; `auto` reads what the model
wrote; the session routes keep the calls; malformed tools are a 400 naming the problem; a
streamed call preempted by an interactive chat goes on exactly."""

import concurrent.futures
import json
import threading
import time

import jsonschema
import openai
import pytest

from superfluid.http.server import Server
from tests.gate import WAIT_SECONDS, Gate, decode_steps_of
from tests.superfluid.served import Served
from tests.superfluid.test_tools import TOOLS

MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    server = Served(tiny_models["f32"].gguf, tmp_path_factory.mktemp("tools"))
    yield server
    assert server.stop() == 0


def checked(call) -> dict:
    """A call's arguments, validated against its tool's parameters."""
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return arguments


def test_required_tool_choice_answers_with_calls_that_validate(served):
    client = served.client()
    for seed in range(3):
        reply = client.chat.completions.create(model=served.model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                               tool_choice="required", temperature=1.0, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls and all(call.type == "function" for call in choice.message.tool_calls)
        for call in choice.message.tool_calls:
            checked(call)
        assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_a_named_function_is_the_one_called_and_parallel_false_makes_one_call(served):
    reply = served.client().chat.completions.create(
        model=served.model, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=1.0, seed=4,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and len(checked(call)["zone"]) == 3


def test_streamed_tool_calls_arrive_as_deltas_the_client_assembles(served):
    stream = served.client().chat.completions.create(model=served.model, messages=MESSAGES, tools=TOOLS,
                                                     max_tokens=200, tool_choice="required", temperature=1.0, seed=2,
                                                     stream=True)
    calls: dict[int, dict] = {}
    reasons, content = [], ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            if part.function is not None:
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons == ["tool_calls"] and content == "" and calls
    for call in calls.values():
        assert call["id"] and call["name"] in PARAMETERS
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def test_a_conversation_carrying_calls_and_their_results_goes_on(served):
    client = served.client()
    first = client.chat.completions.create(model=served.model, messages=MESSAGES, tools=TOOLS, max_tokens=100,
                                           tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=8)
    message = first.choices[0].message
    (call,) = message.tool_calls
    conversation = [*MESSAGES, message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 4, "sky": "snow"}'}]
    reply = client.chat.completions.create(model=served.model, messages=conversation, tools=TOOLS, max_tokens=8,
                                           tool_choice="none", temperature=0.0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.tool_calls is None
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens


def test_auto_reads_a_call_the_model_wrote_and_leaves_text_as_text(served):
    # a model of random weights writes no call of its own: a regex makes it write one, in the
    # hermes format the tools' description asks for (auto reads whatever the model wrote)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    client = served.client()
    reply = client.chat.completions.create(model=served.model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                           extra_body={"guided_regex": "Checking\\. " + _escaped(call)})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert choice.message.tool_calls[0].function.name == "get_time"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"zone": "UTC"}
    # two calls, streamed: text first, then each call at its index, the ids those of the whole reply's kind
    second = call.replace("UTC", "CET")
    two = {"guided_regex": "Checking\\. " + _escaped(f"{call}\n{second}")}
    stream = client.chat.completions.create(model=served.model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                            stream=True, parallel_tool_calls=True, extra_body=two)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == "Checking."
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    parts = [part for c in chunks for part in c.choices[0].delta.tool_calls or ()]
    assert [part.index for part in parts] == [0, 0, 1, 1]
    assert [json.loads(part.function.arguments) for part in parts if part.function.arguments] == \
        [{"zone": "UTC"}, {"zone": "CET"}]
    assert parts[0].id != parts[2].id and parts[0].id.startswith("call_")
    # one call asked for (parallel_tool_calls unset): the first, whole and streamed
    reply = client.chat.completions.create(model=served.model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                           extra_body=two)
    assert [json.loads(c.function.arguments) for c in reply.choices[0].message.tool_calls] == [{"zone": "UTC"}]
    chunks = list(client.chat.completions.create(model=served.model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                 stream=True, extra_body=two))
    assert [part.index for c in chunks for part in c.choices[0].delta.tool_calls or ()] == [0, 0]
    # a call of a function not offered is text
    unknown = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    reply = client.chat.completions.create(model=served.model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                           extra_body={"guided_regex": _escaped(unknown)})
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content == unknown


def _escaped(text: str) -> str:
    """`text` as a regular expression that matches it alone."""
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\" else ("\\n" if c == "\n" else c) for c in text)


def test_a_session_offering_tools_keeps_the_calls_it_made(served):
    status, made = served.raw("POST", "/v1/sessions", json.dumps({"messages": MESSAGES, "tools": TOOLS}).encode())
    assert status == 201
    session = json.loads(made)["id"]
    status, data = served.raw("POST", f"/v1/sessions/{session}/generate",
                              json.dumps({"max_tokens": 100, "tool_choice": "required", "parallel_tool_calls": False,
                                          "temperature": 1.0}).encode())
    assert status == 200
    reply = json.loads(data)["choices"][0]
    (call,) = reply["message"]["tool_calls"]
    status, _ = served.raw("POST", f"/v1/sessions/{session}/messages", json.dumps({"messages": [
        {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}]}).encode())
    assert status == 200
    status, info = served.raw("GET", f"/v1/sessions/{session}")
    assert status == 200 and json.loads(info)["messages"] == 3
    status, data = served.raw("POST", f"/v1/sessions/{session}/generate",
                              json.dumps({"max_tokens": 4, "tools": TOOLS}).encode())
    assert status == 400 and b"given when it is made" in data


@pytest.mark.parametrize("extra, names", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "letters, digits"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "needs `tools`"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "x"}, "no other constraint"),
    ({"functions": [{"name": "f"}]}, "deprecated function calling"),
])
def test_tools_that_cannot_be_used_are_a_400_before_any_byte_of_a_stream(served, extra, names):
    with pytest.raises(openai.BadRequestError, match=names):
        served.client().chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=5, stream=True,
                                                extra_body=extra)
    assert served.raw("GET", "/health")[0] == 200


@pytest.mark.parametrize("message, names", [
    ({"role": "tool", "content": "x"}, "tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "a"}, "only a tool message"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
     "needs an `id`"),
])
def test_a_malformed_tool_message_is_a_400_naming_it(served, message, names):
    with pytest.raises(openai.BadRequestError, match=names):
        served.client().chat.completions.create(model=served.model, messages=[*MESSAGES, message], max_tokens=5)


def test_tool_fields_that_ask_nothing_without_tools_are_taken(served):
    # clients send these with every request, tools or not: they change nothing then
    reply = served.client().chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=3,
                                                    tool_choice="auto", parallel_tool_calls=False)
    assert reply.choices[0].message.tool_calls is None and reply.usage.completion_tokens >= 1


@pytest.mark.parametrize("runtime", ["llamacpp"])
def test_a_required_call_streamed_over_http_and_preempted_goes_on_exactly(open_host, runtime):
    """A background stream of a required call, swapped out for an interactive chat in the middle
    of its call (one sequence: the engine holds one of them at a time), is answered with the
    calls it makes alone."""
    gate = Gate(decode_steps_of(lanes=1, count=3))  # the call is being written
    host = open_host(gate=gate, llamacpp_n_seq_max=1)
    server = Server(host, ("127.0.0.1", 0), allow_priority=True)
    serving = threading.Event()
    thread = threading.Thread(target=server.run, kwargs={"on_serving": serving.set}, daemon=True)
    thread.start()
    try:
        assert serving.wait(WAIT_SECONDS)
        client = openai.OpenAI(base_url=f"http://{server.address[0]}:{server.address[1]}/v1", api_key="unused",
                               max_retries=0)
        asked = {"model": "superfluid", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                 "max_tokens": 200, "temperature": 1.0, "seed": 9}

        def streamed_calls() -> list[tuple[str, str]]:
            calls: dict[int, list[str]] = {}
            for chunk in client.chat.completions.create(**asked, stream=True, extra_body={"priority": "background"}):
                for part in chunk.choices[0].delta.tool_calls or ():
                    entry = calls.setdefault(part.index, ["", ""])
                    entry[0] += part.function.name or ""
                    entry[1] += part.function.arguments or ""
            return [tuple(entry) for entry in calls.values()]

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            background = pool.submit(streamed_calls)
            gate.wait_reached()
            urgent = pool.submit(client.chat.completions.create, model="superfluid", max_tokens=3,
                                 messages=[{"role": "user", "content": "Hi"}], extra_body={"priority": "interactive"})
            deadline = time.monotonic() + WAIT_SECONDS  # its command is queued behind the held step
            while host._thread._commands.qsize() == 0:
                assert time.monotonic() < deadline, "the interactive request never reached the host"
                time.sleep(0.01)
            gate.open()
            assert urgent.result(WAIT_SECONDS).choices[0].message.content is not None
            calls = background.result(WAIT_SECONDS)
        assert host.stats().preemptions >= 1
        alone = client.chat.completions.create(**asked, extra_body={"priority": "background"}).choices[0].message
        assert calls and calls == [(call.function.name, call.function.arguments) for call in alone.tool_calls]
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    finally:
        server.stop()
        thread.join(WAIT_SECONDS)
        assert not thread.is_alive()


def test_tool_fields_on_routes_without_tools(served):
    client = served.client()
    # a session without tools: auto, none and parallel_tool_calls ask nothing of it
    status, made = served.raw("POST", "/v1/sessions", json.dumps({"messages": MESSAGES}).encode())
    session = json.loads(made)["id"]
    for fields in ({"tool_choice": "auto"}, {"tool_choice": "none"}, {"parallel_tool_calls": True}):
        status, data = served.raw("POST", f"/v1/sessions/{session}/generate",
                                  json.dumps({"max_tokens": 2, **fields}).encode())
        assert status == 200, data
    status, data = served.raw("POST", f"/v1/sessions/{session}/generate",
                              json.dumps({"max_tokens": 2, "tool_choice": "required"}).encode())
    assert status == 400 and b"offers no tools" in data
    # text completions: null tool fields and parallel_tool_calls change nothing; tools are refused by name
    reply = client.completions.create(model=served.model, prompt="Hi", max_tokens=2,
                                      extra_body={"tools": None, "tool_choice": None, "parallel_tool_calls": False})
    assert reply.choices[0].text is not None
    with pytest.raises(openai.BadRequestError, match="taken by chat completions"):
        client.completions.create(model=served.model, prompt="Hi", max_tokens=2, extra_body={"tools": TOOLS})


def test_a_session_made_with_a_system_message_and_tools(served):
    status, made = served.raw("POST", "/v1/sessions", json.dumps(
        {"system": "Be brief.", "messages": MESSAGES, "tools": TOOLS}).encode())
    assert status == 201 and json.loads(made)["messages"] == 2
