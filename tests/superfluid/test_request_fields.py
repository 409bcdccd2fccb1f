"""Every field of an OpenAI-style request is honoured, ignored on purpose, or refused by name:
none is dropped in silence."""

import json

import msgspec
import pytest

from superfluid.http import api

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def decode(kind=api.ChatRequest, **fields):
    return api.decode(json.dumps({**BASE, **fields}).encode(), kind)


def refused(kind=api.ChatRequest, **fields) -> api.ApiError:
    with pytest.raises(api.ApiError) as caught:
        request = decode(kind, **fields)
        api.refuse_unsupported(request)
        api.sampling_of(request)
        api.logprobs_of(request, chat=kind is api.ChatRequest)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]), ("guided_decoding_backend", "xgrammar"),
    ("function_call", "auto"), ("logit_bias", {"1": 5}), ("mirostat", 2), ("typical_p", 0.9), ("n_probs", 3),
    ("suffix", "x"), ("reasoning_effort", "high"),
])
def test_a_field_that_would_change_the_answer_is_refused_by_name(field, value):
    error = refused(**{field: value})
    assert error.param == field and f"`{field}`" in error.message and "not supported" in error.message
    assert error.code == "unsupported_parameter"


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"), ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"echo": True}, "echo"),
])
def test_a_value_that_cannot_be_honoured_is_refused(fields, param):
    assert refused(**fields).param == param


@pytest.mark.parametrize("fields", [{"n": 1}, {"response_format": {"type": "text"}}, {"presence_penalty": 0},
                                    {"echo": False}, {"tools": None}, {"grammar": None}])
def test_values_that_change_nothing_pass(fields):
    request = decode(**fields)
    api.refuse_unsupported(request)
    assert api.sampling_of(request) == {}


def test_an_unknown_field_is_a_400_naming_it_in_every_body():
    assert refused(temprature=0.5).param == "temprature"
    assert "not a field this server knows" in refused(temprature=0.5).message
    for kind in (api.CompletionRequest, api.SessionGenerate, api.SessionCreate):
        with pytest.raises(api.ApiError, match="`wibble`"):
            api.decode(json.dumps({"model": "m", "prompt": "p", "wibble": 1}
                                  if kind is api.CompletionRequest else {"wibble": 1}).encode(), kind)
    with pytest.raises(api.ApiError, match="`wibble`"):
        api.decode(b'{"messages": [], "wibble": 1}', api.SessionMessages)


def test_fields_that_change_nothing_are_dropped_on_purpose():
    request = decode(user="me", metadata={"a": "b"}, store=False, service_tier="auto", cache_prompt=True,
                     prompt_cache_key="k", safety_identifier="s", parallel_tool_calls=False)
    assert api.sampling_of(request) == {}


def test_llama_cpp_and_vllm_sampling_names_reach_the_sampler():
    request = decode(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repeat_penalty=1.1, repeat_last_n=32, seed=7)
    assert api.sampling_of(request) == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
                                        "repetition_penalty": 1.1, "repetition_window": 32, "seed": 7}
    assert api.sampling_of(decode(repetition_penalty=1.2)) == {"repetition_penalty": 1.2}
    assert api.sampling_of(decode(repeat_penalty=1.2, repetition_penalty=1.2)) == {"repetition_penalty": 1.2}


@pytest.mark.parametrize("fields, param", [
    ({"min_p": 1.5}, "min_p"), ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repetition_penalty": -2}, "repetition_penalty"), ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"temperature": -1}, "temperature"), ({"repeat_penalty": 1.1, "repetition_penalty": 1.3}, "repetition_penalty"),
])
def test_a_bad_sampling_value_names_the_field_the_client_sent(fields, param):
    error = refused(**fields)
    assert error.param == param and param in error.message


def test_logprobs_take_openais_shapes():
    assert api.logprobs_of(decode(), chat=True) is None
    assert api.logprobs_of(decode(logprobs=False), chat=True) is None
    assert api.logprobs_of(decode(logprobs=True), chat=True) == 0
    assert api.logprobs_of(decode(logprobs=True, top_logprobs=5), chat=True) == 5
    completion = api.decode(b'{"model": "m", "prompt": "p", "logprobs": 3}', api.CompletionRequest)
    assert api.logprobs_of(completion, chat=False) == 3
    assert refused(logprobs=True, top_logprobs=21).param == "top_logprobs"
    assert refused(top_logprobs=2).param == "top_logprobs"  # without logprobs: true
    assert refused(logprobs=3).param == "logprobs"  # chat counts alternatives in top_logprobs


def test_a_reply_echoed_back_is_taken_with_its_tool_calls_and_a_malformed_call_is_named():
    echoed = {"role": "assistant", "content": "Paris.", "refusal": None, "tool_calls": None}
    request = decode(messages=[{"role": "user", "content": "hi"}, echoed])
    assert [api.message_of(m).content for m in request.messages] == ["hi", "Paris."]
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    calls = decode(messages=[{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert api.message_of(calls.messages[0]).tool_calls[0].name == "f"
    broken = decode(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    with pytest.raises(api.ApiError, match="tool call needs"):
        api.message_of(broken.messages[0])


def test_a_body_that_is_not_an_object_is_a_400():
    for body in (b"[1, 2]", b'"text"', b"{not json"):
        with pytest.raises(api.ApiError) as caught:
            api.decode(body, api.ChatRequest)
        assert caught.value.status == 400


@pytest.mark.parametrize("message, field", [
    ({"role": "user", "content": "hi", "name": "alice"}, "name"),
    ({"role": "assistant", "content": "x", "function_call": {"name": "f"}}, "function_call"),
    ({"role": "user", "content": "hi", "tool_call_id": "7"}, "tool_call_id"),
])
def test_message_fields_that_would_change_the_answer_are_refused(message, field):
    request = decode(messages=[message])
    with pytest.raises(api.ApiError, match=f"`{field}`"):
        api.message_of(request.messages[0])


def test_unknown_fields_inside_a_message_or_the_stream_options_are_named():
    assert refused(messages=[{"role": "user", "content": "hi", "mood": "happy"}]).param == "mood"
    assert refused(stream=True, stream_options={"continuous_usage_stats": True}).param == "continuous_usage_stats"


def test_the_off_values_of_llama_cpp_and_vllm_mean_off():
    assert api.sampling_of(decode(top_k=-1)) == {"top_k": 0}
    assert api.sampling_of(decode(repeat_last_n=-1)) == {"repetition_window": api.WHOLE_CONTEXT}


def test_completions_count_alternatives_and_refuse_true():
    body = b'{"model": "m", "prompt": "p", "logprobs": true}'
    with pytest.raises(api.ApiError, match="number of alternatives"):
        api.logprobs_of(api.decode(body, api.CompletionRequest), chat=False)


# What sglang-router 0.3.2 sends for `{"model": "m", "messages": [...]}`: it re-encodes the request
# with SGLang's own options at their defaults (read off the wire in front of a worker).
ROUTER_CHAT = {"logprobs": False, "stream": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False,
               "include_reasoning": True}  # vllm-router 0.1.17 adds vLLM's include_reasoning to the same
ROUTER_COMPLETION = {"prompt": "p", "max_tokens": 3, "stream": False, "echo": False, "no_stop_trim": False,
                     "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}


def test_what_sglang_router_adds_to_a_request_changes_nothing():
    chat = decode(**ROUTER_CHAT)
    api.refuse_unsupported(chat)
    assert api.sampling_of(chat) == {} and api.logprobs_of(chat, chat=True) is None
    assert msgspec.structs.replace(chat, logprobs=None) == decode()  # false: none, as when absent
    completion = api.decode(json.dumps({"model": "m", **ROUTER_COMPLETION}).encode(), api.CompletionRequest)
    api.refuse_unsupported(completion)
    assert completion.prompt == "p" and completion.max_tokens == 3


@pytest.mark.parametrize("field, value", [("no_stop_trim", True), ("continue_final_message", True),
                                          ("skip_special_tokens", False), ("return_hidden_states", True),
                                          ("separate_reasoning", "yes")])
def test_an_sglang_option_that_would_change_the_answer_is_refused_by_name(field, value):
    error = refused(**{**ROUTER_CHAT, field: value})
    assert error.param == field and error.code == "unsupported_parameter"
    assert f"`{field}: {json.dumps(value)}`" in error.message and "SGLang" in error.message


@pytest.mark.parametrize("kind", [api.ChatRequest, api.CompletionRequest])
def test_a_request_without_stream_is_one_whose_reply_is_read_whole(kind):
    # the planner lets steps beside a reply read whole run past the decode-step target
    chat = kind is api.ChatRequest
    body = BASE if chat else {"model": "m", "prompt": "hi"}
    for stream in (False, True):
        request = api.decode(json.dumps({**body, "stream": stream}).encode(), kind)
        assert api.generate_request(request, chat=chat).streamed is stream


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                 "strict": True}}}, "json_schema"),
    ({"json_schema": {"type": "object"}}, "json_schema"), ({"guided_json": {"type": "object"}}, "json_schema"),
    ({"guided_regex": "[0-9]+"}, "regex"), ({"guided_choice": ["a", "b"]}, "choice"),
    ({"grammar": 'root ::= "yes"'}, "gbnf"), ({"guided_grammar": 'root ::= "yes"'}, "gbnf"),
    ({"response_format": {"type": "text"}}, None),
])
def test_each_constraint_field_names_its_constraint(fields, kind):
    constraint = api.constraint_of(decode(**fields))
    assert (constraint.kind if constraint is not None else None) == kind


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"), ({"json_schema": "{not json"}, "json_schema"),
])
def test_a_constraint_of_the_wrong_shape_or_two_at_once_is_a_400_naming_the_field(fields, param):
    with pytest.raises(api.ApiError) as caught:
        api.constraint_of(decode(**fields))
    assert caught.value.status == 400 and caught.value.param == param
