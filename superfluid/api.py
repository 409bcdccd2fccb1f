"""The OpenAI-compatible request bodies the server accepts, decoded into msgspec Structs.

Fields clients commonly send that change nothing here (user, metadata, store, ...) are accepted
and ignored. Fields whose meaning the server cannot honour (tools, response_format, logprobs,
n > 1, ...) are refused with a 400 that names them, never answered differently in silence.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from superfluid.sampling import Sampling, SamplingError


class ApiError(Exception):
    """An error the server answers with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        """The JSON body OpenAI's clients expect."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Message(msgspec.Struct):
    """One chat message (text content only)."""

    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[dict[str, Any]]]
    name: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampled(msgspec.Struct, kw_only=True):
    """Sampling settings a request may give."""

    temperature: float | None = None
    top_p: float | None = None
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


class _Generation(_Streamed, kw_only=True):
    """What both completion endpoints share."""

    model: str
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # accepted and ignored: they change nothing here
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # refused: their meaning cannot be honoured
    n: int | None = None
    logprobs: Union[bool, int, None] = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_Generation, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[Message] = []
    max_completion_tokens: int | None = None


class CompletionRequest(_Generation, kw_only=True):
    """POST /v1/completions."""

    prompt: Union[str, list[str]] = ""


def decode(body: bytes, kind: type) -> Any:
    """`body` as a `kind`; ApiError 400 naming the field that is wrong."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise ApiError(400, f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def refuse_unsupported(request: _Generation) -> None:
    """ApiError 400 for each field whose meaning this server cannot honour."""
    unsupported = {
        "tools": request.tools, "tool_choice": request.tool_choice, "functions": request.functions,
        "function_call": request.function_call, "logit_bias": request.logit_bias, "suffix": request.suffix,
        "top_logprobs": request.top_logprobs, "logprobs": request.logprobs or None, "echo": request.echo or None,
    }
    for name, value in unsupported.items():
        if value is not None:
            raise ApiError(400, f"`{name}` is not supported by this server", param=name, code="unsupported_parameter")
    if request.response_format is not None and request.response_format.get("type", "text") != "text":
        raise ApiError(400, "`response_format` other than text is not supported by this server",
                       param="response_format", code="unsupported_parameter")
    for name in ("n", "best_of"):
        value = getattr(request, name)
        if value is not None and value != 1:
            raise ApiError(400, f"`{name}` must be 1: this server returns one choice", param=name,
                           code="unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) not in (None, 0, 0.0):
            raise ApiError(400, f"`{name}` is not supported by this server (the sampler has a repetition penalty "
                           "through the Python API)", param=name, code="unsupported_parameter")


def sampling_of(request: _Sampled) -> dict:
    """The session sampling settings a request asks for (ApiError 400 naming a bad one)."""
    settings = {}
    if request.temperature is not None:
        settings["temperature"] = float(request.temperature)
    if request.top_p is not None:
        settings["top_p"] = float(request.top_p)
    if request.seed is not None:
        settings["seed"] = int(request.seed) % (1 << 64)
    try:
        Sampling(**settings)
    except SamplingError as exc:
        name = str(exc).split("=", 1)[0].removeprefix("sampling ")
        raise ApiError(400, str(exc), param=name) from None
    return settings


def stops_of(request: _Streamed) -> list[str]:
    """The stop strings (at most 4, as OpenAI allows)."""
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stops) > 4:
        raise ApiError(400, "`stop` takes at most 4 strings", param="stop")
    return stops


def text_of(message: Message) -> str:
    """A message's text (content parts of type text joined); ApiError for other parts."""
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
    priority: Literal["interactive", "default", "background"] = "default"


class SessionMessages(msgspec.Struct):
    """POST /v1/sessions/{id}/messages."""

    messages: list[Message]


class SessionGenerate(_Streamed, kw_only=True):
    """POST /v1/sessions/{id}/generate: the assistant's next turn."""
