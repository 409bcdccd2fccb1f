"""The bodies the server answers with besides completions: OpenAI-style errors (before a response
began, or as an event inside a stream), usage, and the KV summary /health and the start-up line
report."""

from __future__ import annotations

from typing import NamedTuple

from superfluid.host.constraints import ConstraintError
from superfluid.host.log import LogWriteFailed
from superfluid.host.tools import ToolError
from superfluid.http import api
from superfluid.host.errors import (ChatError, ContextFull, EmptySession, HostClosed, Overloaded, PinLimit,
                                    SessionBusy, SessionNotFound, TooManyMessages, TooManySessions)


class HttpError(NamedTuple):
    """How the HTTP face answers one class of the host's errors."""

    status: int
    kind: str  # OpenAI's error "type"
    code: str


# Every error of the host's a request can meet, and its answer: the one table both a response's
# status and an error event inside a stream read, so the two always agree. A class not here (or
# under one here) is a defect: 500. Looked up along the exception's class hierarchy, nearest first.
HTTP_ERRORS: dict[type[BaseException], HttpError] = {
    SessionNotFound: HttpError(404, "not_found_error", "session_not_found"),
    SessionBusy: HttpError(409, "invalid_request_error", "session_busy"),
    PinLimit: HttpError(409, "invalid_request_error", "pin_limit"),
    ContextFull: HttpError(400, "invalid_request_error", "context_length_exceeded"),
    ChatError: HttpError(400, "invalid_request_error", "chat_template_error"),
    EmptySession: HttpError(400, "invalid_request_error", "empty_session"),
    TooManyMessages: HttpError(400, "invalid_request_error", "too_many_messages"),
    TooManySessions: HttpError(429, "rate_limit_error", "too_many_sessions"),
    ConstraintError: HttpError(400, "invalid_request_error", "invalid_constraint"),
    ToolError: HttpError(400, "invalid_request_error", "invalid_tools"),
    # before any byte of a response: the client may retry (Retry-After says when)
    Overloaded: HttpError(503, "server_error", "overloaded"),
    HostClosed: HttpError(503, "server_error", "shutting_down"),
    # the disk refused the session log's write: the server's fault, retried once it has room
    LogWriteFailed: HttpError(507, "server_error", "log_write_failed"),
}


def api_error(exc: BaseException) -> api.ApiError:
    """`exc` as the server answers it: an ApiError as it is, a host error by HTTP_ERRORS, anything
    else a 500 that names it (a defect: the client hears of it, the server goes on)."""
    if isinstance(exc, api.ApiError):
        return exc
    answer = next((HTTP_ERRORS[cls] for cls in type(exc).__mro__ if cls in HTTP_ERRORS), None)
    if answer is None:
        return api.ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
    return api.ApiError(answer.status, str(exc), kind=answer.kind, code=answer.code)


def error_response(exc: BaseException) -> tuple[int, dict, dict | None]:
    """(status, OpenAI-style body, extra headers) for an error before the response began."""
    error = api_error(exc)
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Overloaded) else None
    return error.status, error.body(), headers


def error_event(exc: BaseException) -> dict:
    """The body of an SSE error event for an error after a stream began (the same as the response
    would have carried)."""
    return api_error(exc).body()


def kv_summary(stats) -> dict:
    """The engine's cells and the pool's budget, as /health and the start-up line report them."""
    price = max(stats.cell_price, 1)
    return {"cells": stats.cells_total, "cells_used": stats.cells_used, "cell_bytes": stats.cell_price,
            "pool_budget_bytes": stats.pool_budget_bytes, "pool_tokens": stats.pool_budget_bytes // price}


def usage(generation) -> dict:
    """A generation's OpenAI `usage`, with the prompt tokens that came from cache."""
    completion = len(generation.tokens)
    return {"prompt_tokens": generation.prompt_tokens, "completion_tokens": completion,
            "total_tokens": generation.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": generation.cached_tokens}}
