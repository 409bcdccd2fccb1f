"""Constrained generation in the Host, on both runtimes: a tiny model of random weights, whose every
unconstrained output is noise, writes only what each constraint accepts (each JSON output checked
with a JSON Schema validator); compile errors come before anything is queued; compiled grammars
are cached; a constrained generation swapped out and back in goes on exactly as it would have."""

import json

import jsonschema
import numpy as np
import pytest

from superfluid.host.constraints import Constraint, ConstraintError, constrained
from superfluid.host.request import GenerateRequest
from tests.gate import Gate, decode_steps_of, start_together

# Bounded everywhere (string lengths, array sizes), so that every output fits max_tokens: an
# output cut by length is a failure here, not a pass.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Rome"]},
                                      "temp": {"type": "number", "minimum": -50, "maximum": 60},
                                      "rain": {"type": "boolean"}},
     "required": ["city", "temp", "rain"], "additionalProperties": False},
    {"type": "array", "minItems": 1, "maxItems": 3,
     "items": {"type": "object", "required": ["id", "tags"], "additionalProperties": False, "properties": {
         "id": {"type": "integer", "minimum": 0, "maximum": 99},
         "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}}}}},
    {"type": "object", "required": ["zip", "kind"], "additionalProperties": False, "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "kind": {"anyOf": [{"enum": ["home", "work"]}, {"type": "null"}]},
        "note": {"type": "string", "maxLength": 8}}},
]


def constrained_host(open_host, runtime):
    host = open_host()
    session = host.session(temperature=1.0, seed=7)
    session.append_text("The data:")
    return host, session


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "weather", "items", "address"])
def test_a_random_model_writes_only_json_its_schema_accepts(open_host, runtime, schema):
    host, session = constrained_host(open_host, runtime)
    for seed in range(3):
        probe = session.fork()
        generation = probe.generate(max_tokens=160, json_schema=schema, temperature=1.0, seed=seed)
        text = generation.collect()
        assert generation.finish_reason == "stop", (text, generation.finish_reason)
        jsonschema.validate(json.loads(text), schema)
        assert " " not in text.replace('" "', "").split('"')[0]  # no free whitespace before the first string


def test_choices_regexes_and_grammars_hold_on_a_random_model(open_host, runtime):
    host, session = constrained_host(open_host, runtime)
    cases = [(Constraint.choice(["yes", "no", "maybe so"]), lambda text: text in ("yes", "no", "maybe so")),
             (Constraint.regex(r"[0-9]{3}-[0-9]{4}"), lambda text: len(text) == 8 and text[3] == "-"
              and (text[:3] + text[4:]).isdigit()),
             (Constraint.gbnf('root ::= "(" digit+ ")"\ndigit ::= [0-9]'), lambda text: text.startswith("(")
              and text.endswith(")") and text[1:-1].isdigit() and len(text) > 2),
             (Constraint.lark('start: "a" "b"* "c"'), lambda text: text[0] == "a" and text[-1] == "c"
              and set(text[1:-1]) <= {"b"})]
    for constraint, holds in cases:
        generation = session.fork().generate(max_tokens=40, constraint=constraint, temperature=1.0, seed=3)
        text = generation.collect()
        assert generation.finish_reason == "stop" and holds(text), (constraint, text)


@pytest.mark.parametrize("runtime", ["llamacpp"])  # compiling is the host's, not the engine's
def test_a_constraint_that_does_not_compile_is_refused_before_anything_is_queued(open_host):
    host, session = constrained_host(open_host, "llamacpp")
    before = session.tokens
    for constraint in (Constraint.regex("(unclosed"), Constraint.gbnf("root ::= undefined-rule"),
                       Constraint.lark('start: "a" (')):
        with pytest.raises(ConstraintError, match="does not compile|cannot be read"):
            session.generate(max_tokens=4, constraint=constraint)
    with pytest.raises(ConstraintError, match="not valid JSON"):
        Constraint.json_schema("{nope")
    with pytest.raises(ConstraintError, match="at most"):
        Constraint.regex("a" * (300 * 1024))
    with pytest.raises(ConstraintError, match="non-empty list"):
        Constraint.choice([])
    assert session.tokens == before and host.stats().generations == 0


@pytest.mark.parametrize("runtime", ["llamacpp"])
def test_a_schema_seen_before_is_taken_from_the_cache(open_host):
    host, session = constrained_host(open_host, "llamacpp")
    for _ in range(3):
        session.fork().generate(max_tokens=80, json_schema=SCHEMAS[0]).collect()
    assert (host.grammars.misses, host.grammars.hits) == (1, 2)


def test_a_constrained_generation_swapped_out_and_back_goes_on_exactly(open_host, runtime, tmp_path):
    limits = {"llamacpp": {"llamacpp_n_seq_max": 2}, "mlx": {"mlx_max_sequences": 2}}[runtime]
    digits = Constraint.regex("[0-9]{120}")  # long enough to be swapped out in the middle
    gate = Gate(decode_steps_of(lanes=2, count=3))  # both constrained lanes are mid-output
    host = open_host(gate=gate, **limits)
    urgent = host.session(priority="interactive")
    urgent.append_text("Hello")
    sessions = []
    for seed in (1, 2):
        sessions.append(host.session(priority="background", temperature=1.0, seed=seed))
        sessions[-1].append_text("Numbers:")
    request = GenerateRequest.of(max_tokens=200, constraint=host.grammars.compile(digits))
    background = start_together(host, sessions, request)
    gate.generate_while_held(host, urgent, max_tokens=3).collect()
    texts = [generation.collect() for generation in background]
    assert host.stats().preemptions >= 1
    lone = open_host(pool_name=f"lone-{runtime}", log_dir=tmp_path / "lone-log")
    for seed, text in zip((1, 2), texts):
        session = lone.session(temperature=1.0, seed=seed)
        session.append_text("Numbers:")
        assert session.generate(max_tokens=200, constraint=digits).collect() == text  # token for token
        assert len(text) == 120 and text.isdigit()


@pytest.mark.parametrize("runtime", ["llamacpp"])
def test_masked_logits_keep_the_models_own_and_rows_past_the_vocabulary_are_never_drawn(open_host):
    host, _ = constrained_host(open_host, "llamacpp")
    matching = host.grammars.compile(Constraint.choice(["yes", "no"])).start()
    logits = np.zeros(matching.vocab_size + 2, dtype=np.float32)  # an engine's padded rows
    masked = constrained(logits, matching)
    assert list(np.isfinite(masked)) == list(matching.allowed()) + [False, False]
    assert 0 < np.isfinite(masked).sum() < matching.vocab_size
    assert not np.isinf(logits).any()  # the model's own row is as it was


@pytest.mark.parametrize("runtime", ["llamacpp"])
def test_strict_refuses_a_keyword_the_engine_does_not_implement_and_lenient_ignores_it(open_host):
    host, session = constrained_host(open_host, "llamacpp")
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2, "uniqueItems": True}
    with pytest.raises(ConstraintError, match="uniqueItems"):
        session.generate(max_tokens=20, json_schema=schema)
    text = session.complete(max_tokens=20, constraint=Constraint.json_schema(schema, strict=False))
    assert set(json.loads(text)) <= {"a", "b"}


def test_objects_are_closed_unless_the_schema_opens_them_or_describes_them_in_parts():
    from superfluid.host.constraints import closed
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "additionalProperties": {"type": "integer"}},
              "$defs": {"d": {"properties": {"x": {}}}}}
    done = closed(schema)
    assert done["additionalProperties"] is False and done["properties"]["a"]["additionalProperties"] is False
    assert done["properties"]["additionalProperties"] == {"type": "integer"}  # a property of that name: a schema
    assert done["$defs"]["d"]["additionalProperties"] is False
    opened = {"properties": {"a": {}}, "additionalProperties": True}
    assert closed(opened) == opened and "additionalProperties" not in schema  # the caller's is not changed
    # an object described in parts is left open: closing a part would refuse the others' keys
    parts = {"allOf": [{"properties": {"a": {}}, "required": ["a"]}, {"properties": {"b": {}}, "required": ["b"]}]}
    assert closed(parts) == parts
    union = {"properties": {"kind": {"enum": ["x", "y"]}}, "oneOf": [{"required": ["kind"]}, {"properties": {}}]}
    assert closed(union) == union
    branches = {"anyOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]}  # each branch the whole object
    assert all(branch["additionalProperties"] is False for branch in closed(branches)["anyOf"])
    negated = {"not": {"properties": {"a": {}}}}
    assert closed(negated) == negated


@pytest.mark.parametrize("runtime", ["llamacpp"])
def test_a_grammar_in_error_is_stuck_and_ends_its_generation_with_an_error_not_a_stop(open_host):
    host, _ = constrained_host(open_host, "llamacpp")
    matching = host.grammars.compile(Constraint.choice(["yes"])).start()
    refused = next(t for t in range(matching.vocab_size) if not matching.allowed()[t])
    with pytest.raises(ConstraintError, match="refused token"):
        matching.advance(refused)
    assert matching.stuck  # llguidance would allow an end token alone here: not a finished output
    with pytest.raises(ConstraintError, match="allows no next token"):
        constrained(np.zeros(matching.vocab_size, dtype=np.float32), matching)


@pytest.mark.parametrize("runtime", ["llamacpp"])
def test_with_ignore_eos_a_constrained_generation_still_ends_where_its_grammar_does(open_host):
    host, session = constrained_host(open_host, "llamacpp")
    # after a digit the grammar may end: an end token drawn there ends it, and never shows as text
    for seed in range(6):
        text = session.fork().complete(max_tokens=30, ignore_eos=True, constraint=Constraint.regex("[0-9]{1,12}"),
                                       temperature=1.0, seed=seed)
        assert text.isdigit() and 1 <= len(text) <= 12, text


def test_schema_true_is_any_value_and_false_is_refused():
    assert json.loads(Constraint.json_schema(True).source) == {}
    with pytest.raises(ConstraintError, match="accepts no value"):
        Constraint.json_schema(False)


@pytest.mark.parametrize("runtime", ["llamacpp"])  # (the compiler is the same for both)
def test_a_constraint_that_takes_too_long_to_compile_is_refused_and_remembered(open_host):
    host, session = constrained_host(open_host, "llamacpp")
    grammars = host.grammars
    ticks = iter(range(0, 1000, 3))  # each reading of the clock 3 s after the last: every compile "takes" 3 s
    grammars._clock, grammars.compile_seconds = lambda: next(ticks), 2.0
    slow = Constraint.regex("[a-z]{5}")
    with pytest.raises(ConstraintError, match="took 3.0 s to compile, past the limit of 2 s"):
        session.generate(max_tokens=4, constraint=slow)
    misses = grammars.misses
    with pytest.raises(ConstraintError, match="past the limit"):  # refused again without compiling
        grammars.compile(slow)
    assert grammars.misses == misses and host.stats().generations == 0
