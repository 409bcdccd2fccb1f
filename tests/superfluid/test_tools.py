"""Tool calls in the Host, on both runtimes: a session offering tools, a reply constrained to calls
of them (each call's arguments checked with a JSON Schema validator against its tool's
parameters), the calls kept in the session log and rendered back by the template, a tool's result
appended, and all of it as it was after a restart; a required call swapped out and back in under
load goes on exactly as it would have alone."""

import json

import jsonschema
import pytest

from superfluid.host.errors import ChatError
from superfluid.host.request import GenerateRequest, Prompt
from superfluid.host.tools import ToolError, Tools
from tests import realtemplates
from tests.gate import Gate, decode_steps_of, start_together

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]


def valid_call(call, tools=TOOLS) -> dict:
    """The call's arguments, checked against its tool's parameters."""
    tool = next(t for t in tools if t["function"]["name"] == call.name)
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_a_required_tool_choice_makes_the_reply_calls_of_the_offered_tools(open_host):
    host = open_host()
    session = host.session(tools=TOOLS, temperature=1.0, seed=3)
    session.append_user("What is the weather in Paris?")
    generation = session.generate(max_tokens=120, tool_choice="required", parallel_tool_calls=False)
    generation.collect()
    content, calls = generation.reply()
    assert generation.finish_reason == "stop" and len(calls) == 1 and content is None
    valid_call(calls[0])
    kept = session.messages[-1]
    assert kept["role"] == "assistant" and kept["tool_calls"][0]["function"]["name"] == calls[0].name
    assert json.loads(kept["tool_calls"][0]["function"]["arguments"]) == json.loads(calls[0].arguments)


def test_a_named_tool_choice_calls_that_tool(open_host):
    host = open_host()
    session = host.session(tools=TOOLS, temperature=1.0, seed=5)
    session.append_user("Time in Tokyo?")
    generation = session.generate(max_tokens=80, tool_choice={"type": "function", "function": {"name": "get_time"}})
    generation.collect()
    _, calls = generation.reply()
    assert [call.name for call in calls] == ["get_time"]
    assert len(valid_call(calls[0])["zone"]) == 3


def test_calls_and_results_are_kept_in_the_log_and_render_alike_after_a_restart(open_host, tmp_path):
    host = open_host()
    session = host.session(tools=TOOLS, temperature=1.0, seed=11)
    session.append_user("Weather in Rome?")
    generation = session.generate(max_tokens=120, tool_choice="required", parallel_tool_calls=False)
    generation.collect()
    (call,) = generation.reply()[1]
    session.append_tool_result(call.id, '{"temp": 21}', name=call.name)
    session.append_user("Thanks")
    before_tokens, before_messages = session.tokens, session.messages
    assert [m["role"] for m in before_messages] == ["user", "assistant", "tool", "user"]
    session_id = session.id
    host.close()
    again = open_host()
    resumed = again.session(id=session_id)
    assert resumed.messages == before_messages and resumed.tokens == before_tokens
    # the whole conversation rendered at once holds what was appended turn by turn
    template = again.prompts.template
    rendered = template.render(before_messages, tools=again.call(again.commands.tools, session_id))
    assert again.prompts.tokenize(rendered) == before_tokens


def test_a_tool_choice_on_a_session_without_tools_is_refused_naming_the_fix(open_host):
    host = open_host()
    session = host.session()
    session.append_user("Hi")
    with pytest.raises(ToolError, match="offers no tools"):
        session.generate(tool_choice="required")
    with pytest.raises(ToolError, match="not among the tools"):
        host.session(tools=TOOLS).generate(tool_choice={"type": "function", "function": {"name": "nope"}})


@pytest.mark.parametrize("tools, problem", [
    ([], "non-empty list"),
    ([{"type": "function", "function": {"name": "has space"}}], "letters, digits"),
    ([WEATHER, WEATHER], "more than once"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "schema of an object"),
])
def test_malformed_tools_are_refused_naming_the_problem_and_make_no_session(open_host, tools, problem):
    host = open_host()
    with pytest.raises(ToolError, match=problem):
        host.session(tools=tools)
    assert host.sessions() == []


def test_a_malformed_tool_message_is_refused_and_appends_nothing(open_host):
    host = open_host()
    session = host.session(tools=TOOLS)
    session.append_user("Hi")
    tokens = session.tokens
    with pytest.raises(ChatError, match="needs an `id`"):
        session.append_messages({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}]})
    with pytest.raises(ChatError, match="only a tool message"):
        session.append_messages({"role": "user", "content": "x", "tool_call_id": "a"})
    assert session.tokens == tokens and len(session.messages) == 1


def test_a_required_call_swapped_out_and_back_goes_on_exactly(open_host, runtime, tmp_path):
    limits = {"llamacpp": {"llamacpp_n_seq_max": 2}, "mlx": {"mlx_max_sequences": 2}}[runtime]
    gate = Gate(decode_steps_of(lanes=2, count=3))  # both calls are being written
    host = open_host(gate=gate, **limits)
    urgent = host.session(priority="interactive")
    urgent.append_text("Hello")
    sessions = []
    for seed in (1, 2):
        sessions.append(host.session(priority="background", temperature=1.0, seed=seed, tools=TOOLS))
        sessions[-1].append_user("Weather and time, please.")
    use = host.tool_use(TOOLS, "required")
    request = GenerateRequest.of(max_tokens=200, constraint=host.grammars.compile(use.constraint()), tools=use)
    background = start_together(host, sessions, request)
    gate.generate_while_held(host, urgent, max_tokens=3).collect()
    replies = []
    for generation in background:
        generation.collect()
        replies.append(generation.reply())
    assert host.stats().preemptions >= 1
    lone = open_host(pool_name=f"lone-{runtime}", log_dir=tmp_path / "lone-log")
    for seed, (content, calls) in zip((1, 2), replies):
        session = lone.session(temperature=1.0, seed=seed, tools=TOOLS)
        session.append_user("Weather and time, please.")
        alone = session.generate(max_tokens=200, tool_choice="required")
        alone.collect()
        assert content is None and calls
        for call in calls:
            valid_call(call)  # (raises where its arguments do not validate)
        assert [(c.name, c.arguments) for c in alone.reply()[1]] == [(c.name, c.arguments) for c in calls]


def test_llama3_with_tools_renders_a_system_message_with_the_user_message_that_carries_them(template_host):
    # Llama 3's templates put the tools in the first user message and refuse a conversation of a
    # system message alone while tools are offered: rendered with the message after it instead
    host = template_host(realtemplates.from_llama_cpp()["Llama 3.1"])
    opening = [("system", "Be brief."), ("user", "Weather in Oslo?")]
    whole = host.prompts.tokenize(host.prompts.template.render(
        [{"role": role, "content": text} for role, text in opening], tools=Tools.of(TOOLS)))
    assert host.prepare(Prompt(tuple(opening), tools=Tools.of(TOOLS))).tokens == whole
    with pytest.raises(ChatError, match="first user message"):
        host.session(system="Be brief.", tools=TOOLS)
    assert host.sessions() == []  # nothing left behind
    session = host.session(tools=TOOLS)
    session.append_messages(*opening)
    assert session.tokens == whole


def test_a_call_the_template_refuses_to_render_is_kept_as_the_text_the_model_wrote(open_host, monkeypatch):
    host = open_host()
    session = host.session(tools=TOOLS, temperature=1.0, seed=2)
    session.append_user("Time?")
    template = host.call(host.commands.sessions.template)
    closing = template.closing

    def refusing(messages, reply, tools=None, message=None):
        if message is not None and message.get("tool_calls"):
            raise ChatError("the chat template refused the conversation: no calls here")
        return closing(messages, reply, tools, message)

    monkeypatch.setattr(template, "closing", refusing)
    generation = session.generate(max_tokens=120, tool_choice="required")
    text = generation.collect()
    assert generation.finish_reason == "stop" and generation.reply()[1]  # answered, with its call
    assert session.messages[-1] == {"role": "assistant", "content": text}  # kept as written
