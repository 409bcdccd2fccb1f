"""Answering with a generation: OpenAI's chat and text completion bodies, or their server-sent
events, read from the generation without a thread.

The status goes out with the first piece, so a generation refused while it waited (Overloaded,
ContextFull) is answered with its own status, not inside a 200. A client that goes away at any
point cancels its generation, which frees its lane at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec

from superfluid.host.errors import GenerationTimeout
from superfluid.host.prompts import PreparedPrompt
from superfluid.host.interruption import Arrival
from superfluid.host.request import GenerateRequest, Priority
from superfluid.http import api, logprobs, responses

if TYPE_CHECKING:
    from superfluid.http.app import App, Exchange
    from superfluid.host.session import Generation, Piece

_json = msgspec.json.Encoder()
FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "timeout": "length", "closed": "stop"}


async def one_shot(app: App, exchange: Exchange, request, prompt: PreparedPrompt, wanted: GenerateRequest, *,
                   chat: bool) -> None:
    """A request on a lane of its own (never logged, never listed), its prompt built already:
    opened, filled and started in one scheduler command (a busy engine answers commands between
    steps, so one wait), then answered. The lane ends with its generation, on the scheduler
    thread, before the reply's last bytes: its KV parked in the pool for later requests with the
    same prefix (of its tenant and cache salt only). A reply cut short (the client left, an error)
    cancels the generation."""
    priority = Priority.DEFAULT if wanted.priority is None else wanted.priority
    _, generation = await app.call(app.host.commands.start_request, prompt, wanted,
                                   arrival=Arrival(priority, len(prompt.tokens)), tenant=exchange.tenant,
                                   cache_salt=request.cache_salt)
    try:
        await answer(app, exchange, generation, request, chat)
    finally:
        generation.cancel()  # nothing once it has ended; else it ends at the next tick


async def answer(app: App, exchange: Exchange, generation: Generation, request, chat: bool) -> None:
    """Answer with `generation`: one JSON body, or server-sent events."""
    watcher = asyncio.create_task(exchange.watch_disconnect(generation.cancel))
    try:
        batches = _timed(app, generation, exchange.arrived)
        try:
            first = await anext(batches, None)
        except GenerationTimeout:
            first = None  # nothing produced in time: answered with finish_reason "length"
        except BaseException:
            generation.cancel()
            raise
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": app.model_name}
        try:
            if request.stream:
                await _events(exchange, _chunks(generation, first or [], batches, base, chat, request))
            else:
                await _whole(exchange, generation, first or [], batches, base, chat, request)
        finally:
            if first is not None:
                app.metrics.latency(time.perf_counter() - exchange.arrived)
            app.metrics.tokens(exchange.tenant, generation.prompt_tokens, generation.cached_tokens,
                               len(generation.tokens))
    finally:
        watcher.cancel()


async def _timed(app: App, generation: Generation, started: float) -> AsyncIterator[list[Piece]]:
    """The generation's pieces in batches: each the piece waited for and those already queued
    behind it (a reader that fell behind catches up in one write, not one per token); observing
    the time to the first token and between output tokens."""
    last = None
    async for piece in generation:
        batch = [piece, *generation.pieces_ready()]
        now = time.perf_counter()
        tokens = sum(1 for piece in batch if piece.token >= 0)  # new tokens (-1: held-back text at the end)
        if tokens and last is None:
            app.metrics.first_token(now - started)
            tokens, last = tokens - 1, now
        if tokens:
            # tokens handed over together (superfluid/host/handoff.py) share the time since the
            # last: each is counted with its part of it, not the first with all and the others 0
            for _ in range(tokens):
                app.metrics.output_token((now - last) / tokens)
            last = now
        yield batch


async def _whole(exchange: Exchange, generation: Generation, first: list[Piece], batches: AsyncIterator[list[Piece]],
                 base: dict, chat: bool, request) -> None:
    scored = [piece.logprobs for piece in first if piece.logprobs is not None]
    try:
        async for batch in batches:
            scored.extend(piece.logprobs for piece in batch if piece.logprobs is not None)
    except GenerationTimeout:
        pass  # what it produced is answered (its logprobs too), with finish_reason "length"
    text = generation.text
    reason = FINISH.get(generation.finish_reason or "stop", "stop")
    wanted = api.logprobs_of(request, chat=chat) is not None
    shown = (logprobs.chat(scored) if chat else logprobs.completion(scored)) if wanted else None
    message = {"role": "assistant", "content": text}
    if chat and generation.tools is not None:
        content, calls = generation.reply()
        if calls:  # OpenAI's shape: the text outside the calls (null where there is none), and the calls
            message = {"role": "assistant", "content": content, "tool_calls": [call.as_dict() for call in calls]}
            reason = "tool_calls" if reason == "stop" else reason
    choice = ({"index": 0, "message": message, "finish_reason": reason, "logprobs": shown} if chat else
              {"index": 0, "text": text, "finish_reason": reason, "logprobs": shown})
    await exchange.json(200, {**base, "choices": [choice], "usage": responses.usage(generation)})


def _event(chunk: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + _json.encode(chunk) + b"\n\n"


class _TextEvents:
    """A stream's text events, the same every time but for the text: encoded once around a
    marker, so each token's event is its text's JSON between two constant byte strings."""

    MARKER = "\x00text\x00"

    def __init__(self, base: dict, kind: str, chat: bool) -> None:
        delta = {"delta": {"content": self.MARKER}} if chat else {"text": self.MARKER}
        event = _event({**base, "object": kind, "choices": [{"index": 0, **delta, "finish_reason": None}]})
        self._before, self._after = event.split(_json.encode(self.MARKER))

    def of(self, text: str) -> bytes:
        """The event that carries `text`."""
        return self._before + _json.encode(text) + self._after


async def _chunks(generation: Generation, first: list[Piece], batches: AsyncIterator[list[Piece]], base: dict,
                  chat: bool, request) -> AsyncIterator[bytes]:
    """The stream's events, a batch of pieces at a time: the role (chat), one per piece with
    text, the finish, the usage."""
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    kind = "chat.completion.chunk" if chat else "text_completion"
    wanted = api.logprobs_of(request, chat=chat) is not None
    text_events = _TextEvents(base, kind, chat)
    sent = 0  # characters streamed so far (completions' text offsets)
    # a reply that may make tool calls: its text and its calls told apart as they stream
    calls = generation.tools.stream(generation.call_seed) if chat and generation.tools is not None else None
    made = 0  # calls streamed so far

    def call_events(call) -> list[bytes]:
        # a call as OpenAI streams one: its index, id, type and name, then its arguments
        nonlocal made
        head = {"index": made, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        made += 1
        return [_event({**base, "object": kind, "choices": [{"index": 0, "delta": {"tool_calls": [delta]},
                                                              "finish_reason": None}]})
                for delta in (head, {"index": made - 1, "function": {"arguments": call.arguments}})]

    def shown(scored: list) -> dict:
        # a token's logprobs go out with the first chunk that carries its text (or the last)
        return {"logprobs": logprobs.chat(scored) if chat else logprobs.completion(scored, sent)}

    if chat:
        yield _event({**base, "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                            "finish_reason": None}]})
    pending = []
    async for batch in _every_batch(first, batches):
        events = []
        for piece in batch:
            if wanted and piece.logprobs is not None:
                pending.append(piece.logprobs)
            # (a reply that may call tools: its text and its calls in the order written)
            for item in (calls.feed(piece.text) if calls is not None else (piece.text,)):
                if not isinstance(item, str):
                    events += call_events(item)
                elif item and wanted:
                    delta = {"delta": {"content": item}} if chat else {"text": item}
                    events.append(_event({**base, "object": kind,
                                          "choices": [{"index": 0, **delta, **shown(pending), "finish_reason": None}]}))
                    sent, pending = sent + len(item), []
                elif item:
                    events.append(text_events.of(item))
                    sent += len(item)
        if events:
            yield b"".join(events)
    reason = FINISH.get(generation.finish_reason or "stop", "stop")
    if calls is not None:
        events = [event for item in calls.finish()
                  for event in (call_events(item) if not isinstance(item, str) else [text_events.of(item)])]
        if events:
            yield b"".join(events)
        if made and reason == "stop":
            reason = "tool_calls"
    last = {"delta": {}} if chat else {"text": ""}
    yield _event({**base, "object": kind, "choices": [{"index": 0, **last, **(shown(pending) if pending else {}),
                                                        "finish_reason": reason}]})
    if include_usage:
        yield _event({**base, "object": kind, "choices": [], "usage": responses.usage(generation)})


async def _every_batch(first: list[Piece], batches: AsyncIterator[list[Piece]]) -> AsyncIterator[list[Piece]]:
    if first:
        yield first
    try:
        async for batch in batches:
            yield batch
    except GenerationTimeout:
        pass  # what it produced was streamed; it ends with finish_reason "length"


async def _events(exchange: Exchange, events: AsyncIterator[bytes]) -> None:
    """Server-sent events, one JSON chunk each, then [DONE]. An error after the stream began goes
    out as an error event (OpenAI's clients raise it as an API error), then [DONE]: never as a
    second response inside the first."""
    await exchange.start(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        async for data in events:
            await exchange.write(data, more=True)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the client must hear of it in the stream
        await exchange.write(_event(responses.error_event(exc)), more=True)
    await exchange.write(b"data: [DONE]\n\n", more=False)
