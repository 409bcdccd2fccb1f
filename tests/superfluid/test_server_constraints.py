"""Constrained output over HTTP, with the official `openai` client against a real `superfluid serve`
on a tiny model of random weights: OpenAI's `response_format`, llama-server's `json_schema` and
`grammar`, vLLM's `guided_*` fields, whole and streamed, on chat, completions and the session
routes; a constraint that does not compile is a 400 before any byte of a stream."""

import json

import jsonschema
import openai
import pytest

from tests.superfluid.served import Served

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
MESSAGES = [{"role": "user", "content": "Plan a trip."}]


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    server = Served(tiny_models["f32"].gguf, tmp_path_factory.mktemp("constrained"))
    yield server
    assert server.stop() == 0


def test_response_format_json_schema_whole_and_streamed(served):
    client = served.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        reply = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=60,
                                               temperature=1.0, seed=seed, response_format=response_format)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=60, temperature=1.0,
                                            seed=5, response_format=response_format, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # compiled once, found in the cache three times (the module's other tests may add to both)
    assert served.metric("grammar_cache_hits_total") >= 3 and served.metric("grammar_cache_misses_total") >= 1


def test_response_format_json_object_writes_an_object(served):
    # any object: a random model's may run past max_tokens (its content is unbounded), so only
    # what was written is checked: an object's start, and a whole object when it stopped
    reply = served.client().chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=120,
                                                    temperature=1.0, seed=1,
                                                    response_format={"type": "json_object"})
    text = reply.choices[0].message.content
    assert text.startswith("{") and " " not in text[:2]
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra, holds", [
    ({"json_schema": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ({"guided_json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"guided_regex": "[A-Z][0-9]{3}"}, lambda text: len(text) == 4 and text[0].isupper() and text[1:].isdigit()),
    ({"grammar": 'root ::= "yes" | "no"'}, lambda text: text in ("yes", "no")),
])
def test_every_constraint_field_on_chat_and_on_completions(served, extra, holds):
    client = served.client()
    chat = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=80, temperature=1.0,
                                          seed=2, extra_body=extra)
    assert chat.choices[0].finish_reason == "stop" and holds(chat.choices[0].message.content)
    text = client.completions.create(model=served.model, prompt="Answer:", max_tokens=80, temperature=1.0, seed=2,
                                     extra_body=extra)
    assert text.choices[0].finish_reason == "stop" and holds(text.choices[0].text)


def test_a_session_generates_under_a_constraint(served):
    status, made = served.raw("POST", "/v1/sessions", json.dumps({"messages": MESSAGES}).encode())
    assert status == 201
    status, data = served.raw("POST", f"/v1/sessions/{json.loads(made)['id']}/generate",
                              json.dumps({"max_tokens": 60, "json_schema": SCHEMA, "temperature": 1.0}).encode())
    assert status == 200
    jsonschema.validate(json.loads(json.loads(data)["choices"][0]["message"]["content"]), SCHEMA)


@pytest.mark.parametrize("extra, names", [
    ({"guided_regex": "(unclosed"}, "does not compile"),
    ({"grammar": "root ::= missing"}, "cannot be read"),
    ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "give one"),
])
def test_a_constraint_that_cannot_be_used_is_a_400_before_any_byte_of_a_stream(served, extra, names):
    client = served.client()
    with pytest.raises(openai.BadRequestError, match=names):
        client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=5, stream=True,
                                       extra_body=extra)
    assert served.raw("GET", "/health")[0] == 200
