"""The bodies the server answers with besides completions: OpenAI-style errors (before a response
began, or as an event inside a stream), usage, and the KV summary /health and the start-up line
report."""

from __future__ import annotations

from superfluid import api
from superfluid.errors import ContextFull, HostClosed, Overloaded, SessionBusy, SessionNotFound


def error_response(exc: BaseException) -> tuple[int, dict, dict | None]:
    """(status, OpenAI-style body, extra headers) for an error before the response began."""
    if isinstance(exc, api.ApiError):
        return exc.status, exc.body(), None
    if isinstance(exc, (SessionBusy, SessionNotFound, ContextFull)):
        status = 409 if isinstance(exc, SessionBusy) else 404 if isinstance(exc, SessionNotFound) else 400
        return status, api.ApiError(status, str(exc)).body(), None
    if isinstance(exc, Overloaded):  # before any byte of a response: the client may retry
        return 503, api.ApiError(503, str(exc), kind="server_error", code="overloaded").body(), \
            {"Retry-After": str(exc.retry_after)}
    if isinstance(exc, HostClosed):
        return 503, api.ApiError(503, str(exc), kind="server_error").body(), None
    # a defect: the client hears of it, the server goes on
    return 500, api.ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body(), None


def error_event(exc: BaseException) -> dict:
    """The body of an SSE error event for an error after a stream began."""
    if isinstance(exc, api.ApiError):
        return exc.body()
    if isinstance(exc, ContextFull):
        return api.ApiError(400, str(exc), code="context_length_exceeded").body()
    return api.ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error").body()


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
