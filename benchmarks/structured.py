"""Structured output on real models: every output of a sweep of JSON schemas (nested objects,
arrays with bounds, enums, numbers with ranges, strings with patterns and formats, anyOf,
optional fields) must parse and validate against its schema, checked by a JSON Schema validator;
an output cut by max_tokens counts as a failure. Run on SmolLM2 and Gemma 3 270M, on each runtime
given; prints each schema's outcome and the pass rate (goal: every one).

    .venv/bin/python benchmarks/structured.py [--runtimes llamacpp mlx] [--models smollm2 gemma3]
    .venv/bin/python benchmarks/structured.py --llama-server   # and the same requests to llama-server

With --llama-server the same schemas go to llama.cpp's llama-server (built as the other
benchmarks build it) as OpenAI's `response_format` with the schema, greedy, the same max_tokens,
checked the same way: where it fails, and how, is printed beside ours.

Tool calls are swept the same way (`--tools`, on by default): each schema becomes a function's
parameters, offered with two others, and the model is asked to call the right one with
`tool_choice: "required"`; every call must be of an offered function and its arguments valid
under that function's parameters, and the reply must not be cut by max_tokens. With
--llama-server the same requests go to llama-server (`--jinja`, its own tool call handling).

tests/superfluid/test_structured_real.py runs a few of these as `real_model` tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jsonschema  # noqa: E402

from engines import models  # noqa: E402
from superfluid import Host  # noqa: E402

MAX_TOKENS = 320
_name = {"type": "string", "minLength": 1, "maxLength": 40}
_short = {"type": "string", "minLength": 1, "maxLength": 24}

# (what to ask for, the schema). Every string, number and array is bounded: a small model decoding
# greedily can repeat a digit or a word until max_tokens (Gemma 3 wrote an id of 120 fives, and a
# longitude of 111.111...; SmolLM2, asked for a call with a time, 300 digits of its fraction of a
# second: `format: time` allows any number; `multipleOf` bounds a number's decimals; a binary fraction, so that the
# validator's float arithmetic agrees), and an output cut by length fails: a schema must fit in
# the tokens given.
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": _name, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 120}},
                  "required": ["name", "age"], "additionalProperties": False}),
    ("the weather in a city", {"type": "object", "properties": {
        "city": _name, "celsius": {"type": "number", "minimum": -60, "maximum": 60},
        "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}}, "required": ["city", "celsius", "sky"]}),
    ("three colours", {"type": "array", "items": _short, "minItems": 3, "maxItems": 3}),
    ("a yes or no answer to: is water wet?", {"type": "object", "properties": {"answer": {"type": "boolean"}},
                                              "required": ["answer"]}),
    ("a book", {"type": "object", "properties": {
        "title": _name, "author": _name, "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        "isbn": {"type": "string", "pattern": "^[0-9]{13}$"}}, "required": ["title", "author", "year", "isbn"]}),
    ("a shopping list", {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 5,
        "items": {"type": "object", "properties": {"name": _short, "quantity": {"type": "integer", "minimum": 1,
                                                                              "maximum": 20}},
                  "required": ["name", "quantity"], "additionalProperties": False}}}, "required": ["items"]}),
    ("a contact", {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 60},
                                                    "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}},
                   "required": ["email", "phone"]}),
    ("a date and a time", {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                                                            "time": {"type": "string", "format": "time",
                                                                     "maxLength": 20}},
                           "required": ["date", "time"]}),
    ("a rating of a film", {"type": "object", "properties": {"film": _name, "stars": {"type": "integer",
                                                                                       "minimum": 1, "maximum": 5},
                                                            "review": {"type": "string", "maxLength": 80}},
                            "required": ["film", "stars"]}),
    ("a point in 3D", {"type": "object", "properties": {axis: {"type": "number", "minimum": -100, "maximum": 100}
                                                        for axis in "xyz"}, "required": ["x", "y", "z"],
                       "additionalProperties": False}),
    ("a task with a priority", {"type": "object", "properties": {"task": _name,
                                                                 "priority": {"enum": ["low", "medium", "high"]},
                                                                 "done": {"type": "boolean"}},
                                "required": ["task", "priority", "done"]}),
    ("a recipe", {"type": "object", "properties": {
        "name": _name, "serves": {"type": "integer", "minimum": 1, "maximum": 12},
        "steps": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "maxLength": 60}}},
        "required": ["name", "serves", "steps"]}),
    ("an address", {"type": "object", "properties": {
        "street": _name, "city": _short, "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"type": "string", "pattern": "^[A-Z]{2}$"}}, "required": ["street", "city", "postcode",
                                                                                "country"]}),
    ("a colour in RGB", {"type": "object", "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255}
                                                          for c in ("r", "g", "b")}, "required": ["r", "g", "b"]}),
    ("a hex colour", {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
                      "required": ["hex"]}),
    ("a user that may have a nickname", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999999}, "nickname": {"anyOf": [_short, {"type": "null"}]}},
        "required": ["id", "nickname"]}),
    ("a measurement", {"type": "object", "properties": {"value": {"type": "number", "minimum": -1e6, "maximum": 1e6},
                                                        "unit": {"enum": ["m", "kg", "s", "K"]}},
                       "required": ["value", "unit"]}),
    ("two teams and a score", {"type": "object", "properties": {
        "home": _short, "away": _short, "score": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 20},
                                                  "minItems": 2, "maxItems": 2}},
        "required": ["home", "away", "score"]}),
    ("an invoice line", {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "price": {"type": "number", "minimum": 0,
                                                                             "maximum": 10000},
        "currency": {"enum": ["EUR", "USD", "GBP"]}}, "required": ["sku", "price", "currency"]}),
    ("a list of numbers from one to five", {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                       "maximum": 5},
                                            "minItems": 5, "maxItems": 5}),
    ("a company and its employees", {"type": "object", "properties": {
        "company": _name, "employees": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"name": _short, "role": _short}, "required": ["name", "role"]}}},
        "required": ["company", "employees"]}),
    ("a geographic location", {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.0625},
        "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.0625}},
        "required": ["lat", "lon"]}),
    ("a sentiment", {"enum": ["positive", "negative", "neutral"]}),
    ("a website", {"type": "object", "properties": {"url": {"type": "string", "format": "uri", "maxLength": 60},
                                                    "title": _name}, "required": ["url", "title"]}),
    ("a flight", {"type": "object", "properties": {
        "number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"}, "from": {"type": "string",
                                                                                 "pattern": "^[A-Z]{3}$"},
        "to": {"type": "string", "pattern": "^[A-Z]{3}$"}, "seats": {"type": "integer", "minimum": 1,
                                                                     "maximum": 9}},
        "required": ["number", "from", "to", "seats"]}),
    ("a tree of two levels", {"type": "object", "properties": {"name": _short, "children": {
        "type": "array", "maxItems": 2, "items": {"type": "object", "properties": {"name": _short},
                                                  "required": ["name"]}}}, "required": ["name", "children"]}),
    ("a poll", {"type": "object", "properties": {"question": _name, "options": {
        "type": "array", "items": _short, "minItems": 2, "maxItems": 4}},
        "required": ["question", "options"]}),
    ("a temperature reading that is either a number or unknown", {"type": "object", "properties": {
        "reading": {"anyOf": [{"type": "number", "minimum": -50, "maximum": 50}, {"const": "unknown"}]}},
        "required": ["reading"]}),
    ("a username", {"type": "object", "properties": {"username": {"type": "string",
                                                                  "pattern": "^[a-z][a-z0-9_]{2,15}$"}},
                    "required": ["username"]}),
    ("settings with optional fields", {"type": "object", "properties": {
        "theme": {"enum": ["light", "dark"]}, "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
        "notifications": {"type": "boolean"}}, "required": ["theme"], "additionalProperties": False}),
    ("an event", {"type": "object", "properties": {
        "title": _name, "start": {"type": "string", "format": "date-time", "maxLength": 32},
        "attendees": {"type": "integer", "minimum": 0, "maximum": 500}}, "required": ["title", "start",
                                                                                     "attendees"]}),
    ("a matrix of two rows", {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}),
]


def run_sweep(host: Host, schemas=SCHEMAS, *, seed: int = 0) -> list[tuple[str, bool, str]]:
    """(what, passed, the output or why not) for each schema on `host`."""
    results = []
    for what, schema in schemas:
        session = host.session(temperature=0.0, seed=seed)
        session.append_system("You answer with JSON only.")
        session.append_user(f"Give me {what} as JSON.")
        generation = session.generate(max_tokens=MAX_TOKENS, json_schema=schema)
        text = generation.collect()
        try:
            if generation.finish_reason != "stop":
                raise ValueError(f"cut: {generation.finish_reason}")
            jsonschema.validate(json.loads(text), schema)
            results.append((what, True, text))
        except (ValueError, jsonschema.ValidationError) as exc:
            results.append((what, False, f"{exc}: {text[:120]!r}"))
        host.delete(session.id)
    return results


def _slug(what: str) -> str:
    return "_".join(word for word in "".join(c if c.isalnum() else " " for c in what).split()[:4]).lower()


def tool_requests(schemas=SCHEMAS) -> list[tuple[str, list[dict]]]:
    """(what to ask for, the tools offered) for each schema: a function `save_<what>` taking it
    (an array or a value of another type is the function's one `value` argument), offered with
    the functions of the next two schemas (of those there are)."""
    tools = []
    for what, schema in schemas:
        parameters = schema if schema.get("type") == "object" else {
            "type": "object", "properties": {"value": schema}, "required": ["value"], "additionalProperties": False}
        tools.append({"type": "function", "function": {"name": f"save_{_slug(what)}",
                                                         "description": f"Save {what}.", "parameters": parameters}})
    return [(what, [tools[(i + k) % len(tools)] for k in range(min(3, len(tools)))])
            for i, (what, _) in enumerate(schemas)]


def check_calls(calls: list[tuple[str, str]], tools: list[dict], finish: str) -> str | None:
    """Why a reply's (name, arguments) calls fail (None: every one is a valid call of an offered tool)."""
    if finish == "length":
        return "cut: length"
    if not calls:
        return "no call"
    offered = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    for name, arguments in calls:
        if name not in offered:
            return f"a call of {name!r}, not offered"
        try:
            jsonschema.validate(json.loads(arguments), offered[name])
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"{name}: {str(exc)[:120]}: {arguments[:120]!r}"
    return None


def run_tool_sweep(host: Host, schemas=SCHEMAS, *, seed: int = 0) -> list[tuple[str, bool, str]]:
    """(what, passed, the calls or why not) for each tool request on `host`."""
    results = []
    for what, tools in tool_requests(schemas):
        session = host.session(temperature=0.0, seed=seed, tools=tools)
        session.append_user(f"Save {what}.")
        generation = session.generate(max_tokens=MAX_TOKENS, tool_choice="required")
        generation.collect()
        calls = [(call.name, call.arguments) for call in generation.reply()[1]]
        failure = check_calls(calls, tools, generation.finish_reason)
        results.append((what, failure is None, failure or repr(calls)[:160]))
        host.delete(session.id)
    return results


def peer_tool_sweep(model_path: Path, schemas=SCHEMAS) -> list[tuple[str, bool, str]]:
    """(what, passed, the calls or why not) for each tool request sent to llama-server."""
    from benchmarks.servers import start_peer
    import openai

    served = start_peer(model_path, 4096, extra=("--jinja",))
    results = []
    try:
        for what, tools in tool_requests(schemas):
            try:
                reply = served.client.chat.completions.create(
                    model=served.model, messages=[{"role": "user", "content": f"Save {what}."}], tools=tools,
                    tool_choice="required", max_tokens=MAX_TOKENS, temperature=0.0)
            except openai.APIError as exc:
                results.append((what, False, f"refused: {exc}"[:200]))
                continue
            message = reply.choices[0].message
            calls = [(call.function.name, call.function.arguments) for call in message.tool_calls or ()]
            failure = check_calls(calls, tools, reply.choices[0].finish_reason)
            results.append((what, failure is None, failure or repr(calls)[:160]))
    finally:
        served.stop()
    return results


def peer_sweep(model_path: Path, schemas=SCHEMAS) -> list[tuple[str, bool, str]]:
    """(what, passed, the output or why not) for each schema sent to llama-server."""
    from benchmarks.servers import start_peer
    import openai

    served = start_peer(model_path, 4096)
    results = []
    try:
        for what, schema in schemas:
            messages = [{"role": "system", "content": "You answer with JSON only."},
                        {"role": "user", "content": f"Give me {what} as JSON."}]
            try:
                reply = served.client.chat.completions.create(
                    model=served.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
                    response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
            except openai.APIError as exc:
                results.append((what, False, f"refused: {exc}"[:200]))
                continue
            text, finish = reply.choices[0].message.content or "", reply.choices[0].finish_reason
            try:
                if finish != "stop":
                    raise ValueError(f"cut: {finish}")
                jsonschema.validate(json.loads(text), schema)
                results.append((what, True, text))
            except (ValueError, jsonschema.ValidationError) as exc:
                results.append((what, False, f"{str(exc)[:120]}: {text[:120]!r}"))
    finally:
        served.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtimes", nargs="+", default=["llamacpp", "mlx"])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--llama-server", action="store_true", help="also send the same requests to llama-server")
    parser.add_argument("--no-tools", dest="tools", action="store_false", help="sweep the schemas only")
    parser.add_argument("--no-schemas", dest="schemas", action="store_false", help="sweep the tool calls only")
    args = parser.parse_args(argv)
    failed = 0
    sweeps = [(name, ours, theirs) for name, ours, theirs, wanted in (
        ("response_format json_schema", run_sweep, peer_sweep, args.schemas),
        ("tool calls, tool_choice required", run_tool_sweep, peer_tool_sweep, args.tools)) if wanted]
    for model_name in args.models:
        path = models.default_model() if model_name == "smollm2" else models.gemma3_model()
        for runtime in args.runtimes:
            with tempfile.TemporaryDirectory() as directory, \
                    Host(path, runtime=runtime, pool_name=f"structured-{Path(directory).name}", log_dir=directory,
                         **({"llamacpp_threads": 2} if runtime == "llamacpp" else {})) as host:
                for name, ours, _ in sweeps:
                    began = time.perf_counter()
                    results = ours(host)
                    failed += _report(f"{model_name} on {runtime} ({name})", results, began)
                host.close(remove_pool=True)
        if args.llama_server:
            for name, _, theirs in sweeps:
                began = time.perf_counter()
                _report(f"{model_name} on llama-server ({name})", theirs(path), began)
    return 1 if failed else 0


def _report(label: str, results: list[tuple[str, bool, str]], began: float) -> int:
    """Print a sweep's pass rate and its failures; the number that failed."""
    passed = sum(ok for _, ok, _ in results)
    print(f"{label}: {passed}/{len(results)} valid ({time.perf_counter() - began:.0f} s)")
    for what, ok, detail in results:
        if not ok:
            print(f"    FAILED {what}: {detail}")
    return len(results) - passed


if __name__ == "__main__":
    raise SystemExit(main())
