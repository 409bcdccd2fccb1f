"""The OpenAI-compatible request bodies the server accepts, decoded into msgspec Structs.

Every field a request may carry is accounted for:

- fields the engine honours: OpenAI's, llama.cpp's and vLLM's sampling names (`top_k`, `min_p`,
  `repeat_penalty` / `repetition_penalty`, `repeat_last_n`), `seed`, `logprobs`/`top_logprobs`;
- fields that change nothing here (`user`, `metadata`, `store`, ...: IGNORED), dropped on purpose;
- SGLang's request options, which sglang-router and vllm-router fill in at their defaults on every
  request they forward (ROUTER_FILLED): dropped at a value that changes nothing here, refused at any other;
- constraints on the output: OpenAI's `response_format` (`json_object`, `json_schema`),
  llama-server's `json_schema` and `grammar` (GBNF), vLLM's `guided_json`, `guided_regex`,
  `guided_choice` and `guided_grammar` (`constraint_of`: at most one per request);
- tool calling: `tools`, `tool_choice`, `parallel_tool_calls` (`tool_use_of`), and messages that
  carry an assistant's `tool_calls` or a tool's result (`message_of`);
- fields that would change the answer in a way this server cannot honour (`n` > 1, the legacy
  `functions`, ...: REFUSED and `refuse_unsupported`), a 400 naming the field and why;
- anything else, a 400 naming the unknown field: never an answer that silently ignored it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

import msgspec

from superfluid.host.constraints import Constraint, ConstraintError
from superfluid.host.errors import ChatError
from superfluid.host.messages import ChatMessage, ToolCall
from superfluid.host.request import GenerateRequest, Priority
from superfluid.host.sampling import MAX_TOP_LOGPROBS, Sampling, SamplingError
from superfluid.host.tenants import MAX_SALT
from superfluid.host.tools import FREE_CHOICES, ToolError, Tools, ToolUse

# Sent by common clients, and changing nothing in the answer: accepted and dropped.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "cache_prompt",
                     "prompt_cache_key", "safety_identifier"})
# Taken where a conversation may call tools (chat completions, a session's turn); elsewhere
# dropped when null (as clients send them) and refused naming the routes that take them.
TOOL_FIELDS = frozenset({"tools", "tool_choice"})

# SGLang's own request options. sglang-router (and vllm-router, its fork) re-encodes every chat
# and completion request it forwards with these set to their defaults, so a worker behind it must
# take them: each maps to the values that change nothing here (no reasoning parser runs, so either
# reasoning flag is moot).
ROUTER_FILLED = {
    "no_stop_trim": ((False,), "keeping the stop string in the reply"),
    "continue_final_message": ((False,), "continuing the last assistant message instead of answering it"),
    "skip_special_tokens": ((True,), "special tokens' text in the reply"),
    "separate_reasoning": ((True, False), "separating the reasoning from the reply"),
    "stream_reasoning": ((True, False), "streaming the reasoning apart from the reply"),
    "return_hidden_states": ((False,), "the model's hidden states"),
    "include_reasoning": ((True, False), "the reasoning in the reply"),  # vllm-router adds vLLM's too
}

# Would change the answer, and the engine cannot honour them: a 400 saying what they ask for.
REFUSED = {
    "guided_decoding_backend": "choosing the constrained decoding engine (this server has one)",
    "structured_outputs": "vLLM's structured_outputs (use `response_format` or the guided_* fields)",
    "functions": "OpenAI's deprecated function calling (use `tools`)",
    "function_call": "OpenAI's deprecated function calling (use `tool_choice`)", "logit_bias": "logit biases", "suffix": "fill-in-the-middle",
    "mirostat": "mirostat sampling", "mirostat_tau": "mirostat sampling", "mirostat_eta": "mirostat sampling",
    "typical_p": "locally typical sampling", "tfs_z": "tail-free sampling", "dry_multiplier": "DRY sampling",
    "xtc_probability": "XTC sampling", "dynatemp_range": "dynamic temperature",
    "n_probs": "llama-server's logprobs (use `logprobs` and `top_logprobs`)",
    "reasoning_effort": "a reasoning budget", "modalities": "other output modalities", "audio": "audio output",
    "web_search_options": "web search", "prediction": "predicted outputs",
}


# A request's cache salt (vLLM's field): kept as a digest (superfluid/host/tenants.py).
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SALT)]


class ApiError(Exception):
    """An error the server answers with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        """The JSON body OpenAI's clients expect."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """One chat message (text content only). The fields OpenAI's clients send back with an
    assistant reply are known: refusal and annotations change nothing; tool calls and a tool
    message's call id and name are taken; a participant's name, a function call and audio would
    change the answer and are refused when given (message_of)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None
    refusal: str | None = None
    annotations: list[Any] | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """What a stream adds: the usage chunk at its end."""

    include_usage: bool = False


class _Sampled(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Sampling settings a request may give (OpenAI's names, and llama.cpp's and vLLM's for the
    filters OpenAI lacks)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None  # llama.cpp's name
    repetition_penalty: float | None = None  # vLLM's and transformers' name for the same
    repeat_last_n: int | None = None  # llama.cpp's: how many recent tokens the penalty looks at
    seed: int | None = None


class _Streamed(_Sampled, kw_only=True):
    """What every request that generates takes."""

    max_tokens: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # llama.cpp server's extension: go on past end-of-turn tokens
    # vLLM's and llama-server's scheduling classes: interactive preempts the others
    priority: Literal["interactive", "default", "background"] | None = None
    # chat: a bool, with top_logprobs alternatives; completions: the number of alternatives
    logprobs: Union[bool, int, None] = None
    top_logprobs: int | None = None
    # constraints on the output (constraint_of): OpenAI's, llama-server's, vLLM's
    response_format: dict[str, Any] | None = None
    json_schema: Union[dict[str, Any], bool, None] = None
    grammar: str | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class _Generation(_Streamed, kw_only=True):
    """What both completion endpoints share."""

    model: str
    presence_penalty: float | None = None  # refused unless 0
    frequency_penalty: float | None = None  # refused unless 0
    n: int | None = None  # refused unless 1
    best_of: int | None = None  # refused unless 1
    echo: bool | None = None  # refused unless false
    cache_salt: CacheSalt | None = None  # vLLM's: share cached KV only with requests of the same salt


class ChatRequest(_Generation, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[Message] = []
    max_completion_tokens: int | None = None
    # how the generation may call the conversation's tools (tool_use_of)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Generation, kw_only=True):
    """POST /v1/completions."""

    prompt: Union[str, list[str]] = ""


def decode(body: bytes, kind: type) -> Any:
    """`body` as a `kind`; ApiError 400 naming the field that is wrong, refused or unknown."""
    try:
        fields = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's decoder stops where Python's recursion limit would be passed
        raise ApiError(400, "the request body nests JSON arrays or objects too deeply; a request needs a few "
                       "levels at most") from None
    if not isinstance(fields, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in fields.items():
        if name in ROUTER_FILLED and not any(value is neutral for neutral in ROUTER_FILLED[name][0]):
            raise ApiError(400, f"`{name}: {msgspec.json.encode(value).decode()}` (SGLang's option for "
                           f"{ROUTER_FILLED[name][1]}) is not supported by this server; remove it",
                           param=name, code="unsupported_parameter")
        if name in REFUSED and value is not None:
            raise ApiError(400, f"`{name}` ({REFUSED[name]}) is not supported by this server; remove it",
                           param=name, code="unsupported_parameter")
    for name in TOOL_FIELDS & fields.keys() - set(kind.__struct_fields__):
        if fields[name] is not None:
            raise ApiError(400, f"`{name}` is taken by chat completions and a session's turns, not here; remove it",
                           param=name, code="unsupported_parameter")
    kept = {name: value for name, value in fields.items()
            if not (name in IGNORED and name not in kind.__struct_fields__) and not (name in REFUSED and value is None)
            and name not in ROUTER_FILLED and not (name in TOOL_FIELDS and name not in kind.__struct_fields__)}
    try:
        return msgspec.convert(kept, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if text.startswith("Object contains unknown field `"):
            name = text.split("`")[1]
            raise ApiError(400, f"`{name}` is not a field this server knows; remove it (see docs/server.md for the "
                           "fields it takes)", param=name, code="unknown_parameter") from None
        param = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise ApiError(400, f"invalid request: {text}", param=param) from None


def refuse_unsupported(request: _Generation) -> None:
    """ApiError 400 for each field whose value this server cannot honour."""
    if request.echo:
        raise ApiError(400, "`echo` is not supported by this server", param="echo", code="unsupported_parameter")
    for name in ("n", "best_of"):
        value = getattr(request, name)
        if value is not None and value != 1:
            raise ApiError(400, f"`{name}` must be 1: this server returns one choice", param=name,
                           code="unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) not in (None, 0, 0.0):
            raise ApiError(400, f"`{name}` is not supported by this server; use `repeat_penalty` (llama.cpp's "
                           "multiplicative penalty over the last `repeat_last_n` tokens)", param=name,
                           code="unsupported_parameter")


def logprobs_of(request: _Streamed, *, chat: bool) -> int | None:
    """How many alternatives each token's logprobs list (None: no logprobs). Chat takes
    `logprobs: true` with `top_logprobs` (0 to 20); completions take `logprobs` as the count."""
    if chat:
        if request.logprobs is not None and not isinstance(request.logprobs, bool):
            raise ApiError(400, "`logprobs` is true or false here; the number of alternatives is `top_logprobs`",
                           param="logprobs")
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        count = (request.top_logprobs or 0) if request.logprobs else None
        name = "top_logprobs"
    else:
        if request.top_logprobs is not None:
            raise ApiError(400, "completions take the number of alternatives as `logprobs`", param="top_logprobs")
        if isinstance(request.logprobs, bool) and request.logprobs:
            raise ApiError(400, "completions take `logprobs` as the number of alternatives (0 to 20), not true",
                           param="logprobs")
        count = None if request.logprobs is None or request.logprobs is False else int(request.logprobs)
        name = "logprobs"
    if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"`{name}` must be in [0, {MAX_TOP_LOGPROBS}]", param=name)
    return count


WHOLE_CONTEXT = 1 << 30  # a repetition window longer than any context

# Request names of the session's sampling settings, for errors that name what the client sent.
_SAMPLING_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_window": "repeat_last_n", "seed": "seed"}


def sampling_of(request: _Sampled) -> dict:
    """The session sampling settings a request asks for (ApiError 400 naming a bad one)."""
    settings = {}
    for name in ("temperature", "top_p", "min_p"):
        if getattr(request, name) is not None:
            settings[name] = float(getattr(request, name))
    if request.top_k is not None:
        settings["top_k"] = max(int(request.top_k), 0)  # vLLM's -1 and llama.cpp's 0 both turn it off
    penalties = {name: getattr(request, name) for name in ("repeat_penalty", "repetition_penalty")
                 if getattr(request, name) is not None}
    if len(set(penalties.values())) > 1:
        raise ApiError(400, "`repeat_penalty` and `repetition_penalty` name one setting; give one of them",
                       param="repetition_penalty")
    if penalties:
        settings["repetition_penalty"] = float(next(iter(penalties.values())))
    if request.repeat_last_n is not None:  # llama.cpp's -1: the whole context
        settings["repetition_window"] = WHOLE_CONTEXT if request.repeat_last_n == -1 else int(request.repeat_last_n)
    if request.seed is not None:
        settings["seed"] = int(request.seed) % (1 << 64)
    try:
        Sampling(**settings)
    except SamplingError as exc:
        field = str(exc).split("=", 1)[0].removeprefix("sampling ")
        name = next(iter(penalties), "repeat_penalty") if field == "repetition_penalty" else _SAMPLING_NAMES[field]
        raise ApiError(400, f"`{name}`: {exc}", param=name) from None
    return settings


DEFAULT_MAX_TOKENS = 256


def max_tokens_of(request: _Streamed) -> int:
    """A request's limit on the tokens it generates: `max_completion_tokens` (chat's newer name)
    where given, else `max_tokens`, else the default; ApiError naming the field below 1."""
    name = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) is not None else "max_tokens"
    value = getattr(request, name)
    value = DEFAULT_MAX_TOKENS if value is None else value
    if value < 1:
        raise ApiError(400, f"`{name}` must be at least 1", param=name)
    return value


def generate_request(request: _Streamed, *, chat: bool, compile: Callable[[Constraint], Any] | None = None,
                     tools: ToolUse | None = None) -> GenerateRequest:
    """The host's request for what `request` asks (its sampling as overrides, stops, max_tokens,
    priority, logprobs, whether it is streamed, its constraint compiled by `compile`, how it may
    call `tools`): validated here, once, and carried unchanged into the generation's job.
    ApiError 400 naming the field that is wrong (ConstraintError for a constraint that does not
    compile)."""
    constraint = constraint_of(request)
    if tools is not None and tools.constrains:
        if constraint is not None:
            raise ApiError(400, f"`tool_choice` {tools.choice} makes the reply tool calls; it takes no other "
                           "constraint on the output", param="tool_choice")
        constraint = tools.constraint()
    if constraint is not None and compile is None:
        raise ApiError(400, "this route does not constrain output", param=CONSTRAINT_FIELDS[0])
    return GenerateRequest(max_tokens=max_tokens_of(request), stop=tuple(stops_of(request)),
                           sampling=sampling_of(request),
                           ignore_eos=request.ignore_eos, logprobs=logprobs_of(request, chat=chat),
                           priority=None if request.priority is None else Priority.named(request.priority),
                           streamed=request.stream, constraint=None if constraint is None else compile(constraint),
                           tools=tools)


CONSTRAINT_FIELDS = ("response_format", "json_schema", "grammar", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def constraint_of(request: _Streamed) -> Constraint | None:
    """The constraint a request puts on its output (None: none), from whichever one field gives
    it; ApiError 400 naming the field for two of them, or a value of the wrong shape. (Whether it
    compiles is the host's to say: ConstraintError, also a 400.)"""
    given = [name for name in CONSTRAINT_FIELDS if getattr(request, name) is not None
             and not (name == "response_format" and getattr(request, name).get("type", "text") == "text")]
    if not given:
        return None
    if len(given) > 1:
        raise ApiError(400, f"{' and '.join(f'`{name}`' for name in given)} each constrain the output; give one",
                       param=given[1])
    name = given[0]
    value = getattr(request, name)
    try:
        if name == "response_format":
            return _response_format(value)
        if name in ("json_schema", "guided_json"):  # as llama-server and vLLM take them: what is not implemented is ignored
            return Constraint.json_schema(value, strict=False)
        if name == "guided_regex":
            return Constraint.regex(value)
        if name == "guided_choice":
            return Constraint.choice(value)
        return Constraint.gbnf(value)  # llama-server's grammar, vLLM's guided_grammar: GBNF
    except ConstraintError as exc:
        raise ApiError(400, f"`{name}`: {exc}", param=name, code="invalid_constraint") from None


def _response_format(value: dict[str, Any]) -> Constraint:
    """OpenAI's `response_format`: `json_object`, or `json_schema` with `{"name", "schema",
    "strict"}` (with `strict`, a keyword the engine does not implement is refused; without, it is
    ignored: see docs/server.md)."""
    kind = value.get("type")
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConstraintError("`json_schema` must hold the schema: {\"name\": ..., \"schema\": {...}}")
        return Constraint.json_schema(spec["schema"], strict=spec.get("strict") is True)
    raise ConstraintError(f"type {kind!r}: use text, json_object or json_schema")


def stops_of(request: _Streamed) -> list[str]:
    """The stop strings (at most 4, as OpenAI allows)."""
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stops) > 4:
        raise ApiError(400, "`stop` takes at most 4 strings", param="stop")
    return stops


def message_of(message: Message) -> ChatMessage:
    """The host's message for a request's (a developer message is a system message); ApiError 400
    naming what is wrong or not supported."""
    for field, why in (("function_call", "OpenAI's deprecated function calling (use `tool_calls`)"),
                       ("audio", "audio")):
        if getattr(message, field):
            raise ApiError(400, f"messages with `{field}` are not supported ({why})", param="messages",
                           code="unsupported_parameter")
    if message.name and message.role != "tool":
        raise ApiError(400, "messages with `name` are not supported (participant names: the chat template would not "
                       "see them)", param="messages", code="unsupported_parameter")
    if message.tool_calls and message.role != "assistant":
        raise ApiError(400, f"a {message.role} message cannot make `tool_calls`; only an assistant's does",
                       param="messages")
    if message.role == "tool" and not message.tool_call_id:
        raise ApiError(400, "a tool message needs the `tool_call_id` of the call it answers", param="messages")
    if message.tool_call_id is not None and message.role != "tool":
        raise ApiError(400, f"a {message.role} message has no `tool_call_id`; only a tool message answers a call",
                       param="messages")
    text = "" if message.content is None and message.tool_calls else text_of(message)
    try:
        return ChatMessage("system" if message.role == "developer" else message.role, text,
                           tuple(ToolCall.of(call) for call in message.tool_calls or ()), message.tool_call_id,
                           message.name)
    except ChatError as exc:
        raise ApiError(400, str(exc), param="messages") from None


def tool_use_of(request: ChatRequest | SessionGenerate, tools: Any, make: Callable[..., ToolUse]) -> ToolUse | None:
    """How the request's generation may call `tools` (None: no tools and no choice), made by
    `make` (Host.tool_use: the model's own format); ApiError 400 naming what is wrong."""
    if tools is None:  # (a choice of none or auto, or parallel_tool_calls, asks nothing without tools)
        if request.tool_choice not in FREE_CHOICES:
            raise ApiError(400, "`tool_choice` needs `tools` to choose from", param="tool_choice")
        return None
    try:
        return make(tools, request.tool_choice, request.parallel_tool_calls)
    except ToolError as exc:
        param = "tool_choice" if "tool choice" in str(exc) or "`tool_choice`" in str(exc) else "tools"
        raise ApiError(400, f"`{param}`: {exc}", param=param, code="invalid_tools") from None


def tools_of(value: list[dict[str, Any]] | None) -> Tools | None:
    """A request's `tools` (None: none); ApiError 400 naming what is wrong with them."""
    try:
        return None if value is None else Tools.of(value)
    except ToolError as exc:
        raise ApiError(400, f"`tools`: {exc}", param="tools", code="invalid_tools") from None


def text_of(message: Message) -> str:
    """A message's text (content parts of type text joined); ApiError for other parts."""
    if message.content is None:
        raise ApiError(400, f"a {message.role} message needs `content`", param="messages")
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"message content parts of type {part.get('type')!r} are not supported (text only)",
                           param="messages")
        texts.append(part["text"])
    return "".join(texts)


class SessionCreate(_Sampled, kw_only=True):
    """POST /v1/sessions: a session that lives until deleted (and across restarts)."""

    system: str | None = None
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None  # what its conversation offers the model, kept with it
    priority: Literal["interactive", "default", "background"] = "default"
    cache_salt: CacheSalt | None = None  # its prompts share cached KV only with sessions of the same salt


class SessionMessages(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/sessions/{id}/messages."""

    messages: list[Message]


class SessionGenerate(_Streamed, kw_only=True):
    """POST /v1/sessions/{id}/generate: the assistant's next turn (the tools are the session's)."""

    tools: list[dict[str, Any]] | None = None  # refused: a session's tools are given when it is made
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
