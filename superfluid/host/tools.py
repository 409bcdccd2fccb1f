"""Tool calls: the tools a conversation offers, how the model's own format writes a call, the
grammar that makes a generation one, and reading calls back out of what the model wrote.

Each model family writes a call its own way, which its chat template shows when it renders an
assistant message that made one (and, for most, tells the model in the tools' description):

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   Qwen 2.5 and 3,
                  several in a row, a newline between                            Hermes 2 and 3
    llama3        {"name": "f", "parameters": {...}}  one call, nothing else      Llama 3.1 to 3.3
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]            Mistral Nemo
    mistral_args  [TOOL_CALLS]f[ARGS]{...}, repeated                              Mistral Small 3.2

`format_shown` reads which one from how the template renders a call. A template that takes no
tools (its source never reads `tools`: ChatML, the one used where a model ships none, as the
Gemma 3 GGUF here; SmolLM2's), or renders calls in none of these formats, gets them described
in a system message that asks for the hermes format, and sees earlier calls and their results
written in it (`as_plain_messages`).

With `tool_choice` "required" or a named function, the output is constrained (`grammar`) to
calls in the model's format of the offered tools, each call's arguments valid under its
`parameters` schema and its JSON laid out as the templates render it (`", "` and `": "`), so the
session mostly keeps the very tokens a re-rendering gives (where a template renders what the
model did not write, Mistral's call ids where it wrote none, the turn is rendered again). With
"auto" the model writes what it will and its calls are read back (`parse`, or `CallStream` while
streaming: tool_replies.py); text that does not make a well-formed call of an offered tool stays
text. Where one call is asked for (`parallel_tool_calls` false, the default; Llama 3's templates
always), the reply is its first call: later ones are dropped, as a constrained reply would have
ended there.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from superfluid.host.constraints import Constraint, closed
from superfluid.host.errors import SuperfluidError
from superfluid.host.messages import ToolCall
from superfluid.host.tool_replies import (EMPTY_THINK, EMPTY_THINKING, HERMES_CLOSE, HERMES_OPEN, MISTRAL_ARGS,
                                         MISTRAL_CALL_ID, MISTRAL_CALLS, MISTRAL_ID, PARSERS, CallStream)

FORMATS = ("hermes", "llama3", "mistral", "mistral_args")
CHOICES = ("none", "auto", "required", "function")
# tool choices that ask nothing where no tools are offered (clients send them with every request)
FREE_CHOICES = (None, "none", "auto")
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for a function's name, and '.' (namespaced names)
MAX_TOOLS = 128  # OpenAI's own limit on the tools of one request
# The JSON of a call as the templates render it (`tojson`: json.dumps' separators), no other whitespace
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(SuperfluidError, ValueError):
    """Tools or a tool choice that cannot be used as given (the message names what to change)."""


class Tool(msgspec.Struct, frozen=True):
    """One function the model may call: its name, what it does, and the JSON schema of its
    arguments (as JSON text: a Tool is hashable)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'

    def as_dict(self) -> dict:
        """OpenAI's shape, as templates read it and sessions keep it."""
        # (a description always: Hermes' templates read it, and fail on a tool without one)
        function: dict[str, Any] = {"name": self.name, "description": self.description,
                                    "parameters": json.loads(self.parameters)}
        return {"type": "function", "function": function}


class Tools(msgspec.Struct, frozen=True):
    """The tools a conversation offers, in the order given."""

    tools: tuple[Tool, ...]

    @classmethod
    def of(cls, value: Any) -> Tools:
        """Tools from OpenAI's shape (`[{"type": "function", "function": {"name", "description",
        "parameters"}}]`) or Tools; ToolError naming what is wrong."""
        if isinstance(value, Tools):
            return value
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
            raise ToolError("`tools` is a non-empty list of {\"type\": \"function\", \"function\": {...}}")
        if len(value) > MAX_TOOLS:
            raise ToolError(f"{len(value)} tools; at most {MAX_TOOLS} are taken")
        tools = []
        for entry in value:
            function = entry.get("function") if isinstance(entry, Mapping) else None
            if not isinstance(function, Mapping) or entry.get("type", "function") != "function":
                raise ToolError(f"a tool is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; got {entry!r}")
            name = function.get("name")
            if not isinstance(name, str) or not NAME.fullmatch(name):
                raise ToolError(f"a function's name is 1 to 64 letters, digits, '_', '-' or '.'; got {name!r}")
            parameters = function.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
                raise ToolError(f"the parameters of {name!r} must be a JSON schema of an object")
            description = function.get("description") or ""
            if not isinstance(description, str):
                raise ToolError(f"the description of {name!r} must be text")
            try:  # (the session log keeps them as msgpack, whose integers end at 64 bits)
                msgspec.msgpack.encode(parameters)
            except (OverflowError, TypeError) as exc:
                raise ToolError(f"the parameters of {name!r} cannot be kept: {exc}") from None
            tools.append(Tool(name, description, json.dumps(parameters, ensure_ascii=False)))
        names = [t.name for t in tools]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ToolError(f"the tools {repeated} are given more than once; each name once")
        return cls(tuple(tools))

    def as_dicts(self) -> list[dict]:
        """OpenAI's shape."""
        return [tool.as_dict() for tool in self.tools]

    def named(self, name: str) -> Tool | None:
        """The tool called `name` (None: not offered)."""
        return next((tool for tool in self.tools if tool.name == name), None)


class ToolUse(msgspec.Struct, frozen=True):
    """How one generation may use the conversation's tools: `choice` none, auto, required or
    function (then `function` names it); `parallel`: several calls in one reply; `format`: the
    model's (FORMATS); `markers`: the ids of the format's marks that are single special tokens of
    the vocabulary ([TOOL_CALLS], [ARGS]), which a constrained call writes as those tokens."""

    tools: Tools
    choice: str = "auto"
    function: str | None = None
    parallel: bool = False
    format: str = "hermes"
    markers: Mapping[str, int] = msgspec.field(default_factory=dict)
    thinks: bool = False  # the template writes an empty reasoning block before a reply (Qwen 3)

    def __post_init__(self) -> None:
        if self.choice not in CHOICES:
            raise ToolError(f"tool choice {self.choice!r}: use none, auto, required, or a function")
        if (self.choice == "function") != (self.function is not None):
            raise ToolError("a named tool choice names its function (and only that choice names one)")
        if self.function is not None and self.tools.named(self.function) is None:
            raise ToolError(f"`tool_choice` names the function {self.function!r}, which is not among the tools "
                            f"({', '.join(t.name for t in self.tools.tools)})")
        if self.format not in FORMATS:
            raise ToolError(f"tool call format {self.format!r}: one of {', '.join(FORMATS)}")

    @classmethod
    def of(cls, tools: Any, choice: Any = None, parallel: bool | None = None, *, format: str = "hermes",
           markers: Mapping[str, int] | None = None, thinks: bool = False) -> ToolUse:
        """From OpenAI's fields: `tools`, `tool_choice` ("none", "auto", "required", or
        {"type": "function", "function": {"name": ...}}; None: auto), `parallel_tool_calls`
        (None: false, as llama-server takes it: a small model allowed several calls in a
        constrained reply repeats them until max_tokens, as SmolLM2 did on 1 of the 32 requests
        of benchmarks/structured.py). ToolError naming what is wrong."""
        function = None
        if choice is None:
            choice = "auto"
        elif isinstance(choice, Mapping):
            named = choice.get("function")
            if choice.get("type", "function") != "function" or not isinstance(named, Mapping) \
                    or not isinstance(named.get("name"), str):
                raise ToolError("a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}")
            choice, function = "function", named["name"]
        elif choice not in ("none", "auto", "required"):
            raise ToolError(f"`tool_choice` {choice!r}: use none, auto, required, or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        return cls(Tools.of(tools), choice, function, parallel is True, format, dict(markers or {}), thinks)

    @property
    def constrains(self) -> bool:
        """The output must be calls (required, or a named function)."""
        return self.choice in ("required", "function")

    @property
    def reads_calls(self) -> bool:
        """What the model writes is read for calls (every choice but none)."""
        return self.choice != "none"

    @property
    def several(self) -> bool:
        """More than one call may come in one reply (Llama 3's templates take one at most)."""
        return self.parallel and self.format != "llama3" and self.function is None

    # ------------------------------------------------------------------------- constraining

    def constraint(self) -> Constraint | None:
        """The constraint that makes the output calls of the tools (None where nothing constrains)."""
        return Constraint.lark(self.grammar()) if self.constrains else None

    def grammar(self) -> str:
        """A Lark grammar (llguidance's dialect) of replies that are only calls, in the format."""
        offered = [self.tools.named(self.function)] if self.function else list(self.tools.tools)
        rules = [f"f{i}: {self._call_rule(tool)}" for i, tool in enumerate(offered)]
        calls = " | ".join(f"f{i}" for i in range(len(offered)))
        if self.format == "hermes":
            top = [f'call: "{HERMES_OPEN}\\n" ({calls}) "\\n{HERMES_CLOSE}"']
            start = 'start: call ("\\n" call)*' if self.several else "start: call"
            if self.thinks:  # a thinking template's empty reasoning first, as it renders a reply without
                start = start.replace("start: ", f"start: {json.dumps(EMPTY_THINK)}? ", 1)
        elif self.format == "llama3":
            top, start = [], f"start: {calls}"
        elif self.format == "mistral":
            top = [f"call: {calls}"]
            start = f'start: {self._mark(MISTRAL_CALLS)} "[" call ' + ('(", " call)* "]"' if self.several else '"]"')
        else:  # mistral_args: the name as text between the marks (and the call's id, where the model
            # writes one: the templates render it), then the arguments' JSON
            call_id = f'({self._mark(MISTRAL_ID)} /[A-Za-z0-9]{{9}}/)?'
            rules = [f"f{i}: {json.dumps(tool.name)} {call_id} {self._mark(MISTRAL_ARGS)} %json "
                     f"{json.dumps(self._arguments_schema(tool), ensure_ascii=False)}" for i, tool in enumerate(offered)]
            top = [f"call: {self._mark(MISTRAL_CALLS)} ({calls})"]
            start = "start: call+" if self.several else "start: call"
        return "\n".join([start, *top, *rules]) + "\n"

    def _mark(self, mark: str) -> str:
        """A format's mark in the grammar: its special token where it is one, else its text."""
        token = self.markers.get(mark)
        return f"<[{token}]>" if token is not None else json.dumps(mark)

    def _arguments_schema(self, tool: Tool) -> dict:
        # closed as constraints close objects (a small model otherwise adds keys until max_tokens);
        # the parameters are the schema's root, so their own `$ref`s (into `$defs`) resolve
        return {"x-guidance": CALL_JSON, **closed(json.loads(tool.parameters))}

    def _call_rule(self, tool: Tool) -> str:
        """A call of `tool` as a JSON object, written as the templates render one: its name, then
        its arguments (the parameters' own schema), then (Mistral Nemo) an optional id."""
        key = "parameters" if self.format == "llama3" else "arguments"
        head = json.dumps(f'{{"name": {json.dumps(tool.name)}, "{key}": ')
        arguments = f"%json {json.dumps(self._arguments_schema(tool), ensure_ascii=False)}"
        call_id = ' (", \\"id\\": \\"" /[A-Za-z0-9]{9}/ "\\"")?' if self.format == "mistral" else ""
        return f'{head} {arguments}{call_id} "}}"'

    # ------------------------------------------------------------------------- reading calls

    def parse(self, text: str, seed: str, first: int = 0) -> tuple[str | None, list[ToolCall]]:
        """(the text outside calls, None if there is none; the calls `text` makes, the `first`th
        of its reply on, their ids made from the reply's `seed`: new_seed). A call that is
        malformed or names a function not offered is left in the text."""
        if not self.reads_calls:
            return (text or None), []
        content, calls = self.read(text)
        return content, self.numbered(calls, seed, first)

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text outside calls, None if none; every call `text` makes, ids only where the
        model wrote them)."""
        content, calls, before = PARSERS[self.format](text, self)
        if calls and EMPTY_THINKING.fullmatch(before):
            # the empty reasoning block a thinking template puts right before calls says nothing
            content = content[len(before):]
        return (content.strip() or None), calls

    def numbered(self, calls: list[ToolCall], seed: str, first: int) -> list[ToolCall]:
        """`calls`, the `first`th of the reply on: only the reply's first call where one is asked
        for (parallel_tool_calls false: what a constrained reply would have ended with; the
        others are dropped, as Llama 3's templates take one call a turn), each with its id (one
        the model wrote where the format has them, Mistral's; else one made from `seed`)."""
        if not self.several:
            calls = calls[:max(0, 1 - first)]
        return [call if call.id else msgspec.structs.replace(call, id=self.call_id(seed, first + i))
                for i, call in enumerate(calls)]

    def stream(self, seed: str) -> CallStream:
        """A reader of the reply (whose calls' ids come from `seed`) as it streams, telling text
        from calls."""
        return CallStream(self, seed)

    def call_id(self, seed: str, index: int) -> str:
        """The id of the `index`th call of the reply whose seed is `seed` (the same wherever the
        reply is read: its stream, its whole text, the session's log). Mistral's templates take
        9 letters and digits."""
        if self.format.startswith("mistral"):
            return f"{seed[:7]:0<7}{index % 100:02d}"
        return f"call_{seed}{index}"

    def call_of(self, name: Any, arguments: Any, call_id: Any = None) -> ToolCall | None:
        """A call of an offered tool, its arguments an object (given as one, or as its JSON text);
        `call_id`: the id the model wrote for it, kept where it is one a template takes."""
        if not isinstance(name, str) or self.tools.named(name) is None:
            return None
        if self.function is not None and name != self.function:
            return None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None
        kept_id = call_id if isinstance(call_id, str) and MISTRAL_CALL_ID.fullmatch(call_id) else ""
        return ToolCall(kept_id, name, json.dumps(arguments, ensure_ascii=False))  # (else its id: parse gives it)


def new_seed() -> str:
    """A reply's seed for its calls' ids: 16 hex digits, random."""
    return secrets.token_hex(8)


def special_marks(tokenize: Callable[[str], list[int]]) -> dict[str, int]:
    """The marks of the formats that are one special token of the vocabulary (mark -> its id),
    given the tokenizer (special tokens parsed): a constrained call writes the token, as the
    model does, not the mark's text spelled out in ordinary tokens."""
    marks = {}
    for mark in (MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_ID):
        ids = tokenize(mark)
        if len(ids) == 1:
            marks[mark] = ids[0]
    return marks


# A call a template is shown making, to see which format it writes calls in (format_shown)
PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_function", "description": "",
                                                   "parameters": {"type": "object", "properties": {"x": {}}}}}]
PROBE_CALL = {"id": "Probe1234", "type": "function", "function": {"name": "probe_function", "arguments": '{"x": 1}'}}
PROBE_CONVERSATION = [{"role": "user", "content": "Probe"},
                      {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]},
                      {"role": "tool", "content": "1", "tool_call_id": "Probe1234", "name": "probe_function"}]
_SHOWN = (  # (format, how its call of the probe reads), checked in order
    ("hermes", '<tool_call>\n{"name": "probe_function", "arguments": {"x": 1}}\n</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "probe_function", "arguments": {"x": 1}'),
    ("mistral_args", '[TOOL_CALLS]probe_function[ARGS]{"x": 1}'),
    ("mistral_args", '[TOOL_CALLS]probe_function[CALL_ID]Probe1234[ARGS]{"x": 1}'),
    ("llama3", '{"name": "probe_function", "parameters": {"x": 1}}'),
)


def format_shown(rendered: str) -> str | None:
    """The format (FORMATS) in which a template rendered PROBE_CONVERSATION's call, as the text
    `rendered`; None where it is none of them (Qwen3-Coder's and GLM's XML inside <tool_call>,
    Command-R's, DeepSeek's, gpt-oss's, ...: their models are described the tools instead)."""
    return next((name for name, written in _SHOWN if written in rendered), None)


# ----------------------------------------------------------------------------- templates without tools

DESCRIBED = ("You may call the functions below, each given with the JSON schema of its arguments:\n<tools>\n{tools}\n"
             "</tools>\nTo call one, answer with a JSON object of its name and arguments between <tool_call> and "
             "</tool_call>, one call per tag:\n<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as "
             "a JSON object>}}\n</tool_call>")


def hermes_calls(calls: Sequence[Mapping]) -> str:
    """Calls (kept-message dicts, arguments as JSON text) written in the hermes format."""
    written = []
    for call in calls:
        arguments = call["function"]["arguments"]
        try:
            arguments = json.loads(arguments)
        except (TypeError, ValueError):
            pass
        body = json.dumps({"name": call["function"]["name"], "arguments": arguments}, ensure_ascii=False)
        written.append(f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}")
    return "\n".join(written)


def as_plain_messages(messages: Sequence[Mapping], tools: Tools | None) -> list[dict]:
    """A conversation as a template that knows no tools can render it: the tools described in
    the system message (one is added first where there is none), an assistant's calls written in
    the hermes format after its text, and a tool's result as a user message inside
    <tool_response> tags."""
    plain = []
    for message in messages:
        if message.get("tool_calls"):
            text = message.get("content") or ""
            calls = hermes_calls(message["tool_calls"])
            plain.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif message["role"] == "tool":
            plain.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            plain.append({"role": message["role"], "content": message["content"]})
    if tools is not None:
        described = DESCRIBED.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools.as_dicts()))
        if plain and plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{described}"}
        else:
            plain.insert(0, {"role": "system", "content": described})
    return plain
