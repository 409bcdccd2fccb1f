"""Reading a model's reply for tool calls, in the format its template shows it writing (see
tools.py): the whole reply (`PARSERS`, which ToolUse.parse uses) or the reply as it streams
(`CallStream`), the two telling text from calls alike, so that a client reading the stream gets
what a client reading the whole reply gets.

What a format writes:

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, several in a row
    llama3        {"name": "f", "parameters": {...}}, the whole reply (<|python_tag|> first, maybe)
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "..."}, ...]
    mistral_args  [TOOL_CALLS]f[CALL_ID]id[ARGS]{...}, repeated ([CALL_ID] where written)

Text that does not make a well-formed call of an offered tool stays text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from superfluid.host.messages import ToolCall

if TYPE_CHECKING:
    from superfluid.host.tools import ToolUse

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
LLAMA_PYTHON_TAG = "<|python_tag|>"
# What Qwen 3's template writes before a reply that did not reason (and a constrained call may
# begin with, as the template renders it)
EMPTY_THINK = "<think>\n\n</think>\n\n"
EMPTY_THINKING = re.compile(r"^\s*<think>\s*</think>\s*")
MISTRAL_CALL_ID = re.compile(r"[A-Za-z0-9]{9}")  # what Mistral's templates take as a call's id


def openers(form: str) -> tuple[str, ...]:
    """The text that begins a call in the format `form` (a streamed reply is watched for it: the
    text before it is the reply's text)."""
    if form == "hermes":
        return (HERMES_OPEN,)
    if form == "llama3":
        return (LLAMA_PYTHON_TAG, "{")
    return (MISTRAL_CALLS,)


def _json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value `text` starts with (after whitespace) and where it ends; None if none."""
    start = len(text) - len(text.lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None


# Each reads (the text outside calls, the calls, the text before the first call) out of a reply.

def _parse_hermes(text: str, use: ToolUse) -> tuple[str, list[ToolCall], str]:
    kept, calls, at, before, after_call = [], [], 0, "", False
    while (opened := text.find(HERMES_OPEN, at)) >= 0:
        body_start = opened + len(HERMES_OPEN)
        closing = text.find(HERMES_CLOSE, body_start)
        body = text[body_start:closing if closing >= 0 else len(text)]
        found = _json_prefix(body)
        call = None
        if closing >= 0:
            end = closing + len(HERMES_CLOSE)
            if found is not None and body[found[1]:].strip():
                found = None  # more than a call inside the tags: text
        else:  # an unclosed last call ends with its JSON; what follows it is text
            end = body_start + found[1] if found is not None else len(text)
        if found is not None and isinstance(found[0], dict):
            call = use.call_of(found[0].get("name"), found[0].get("arguments", found[0].get("parameters")))
        if call is None:  # not a call: stays text
            end = len(text) if closing < 0 else end
            kept.append(text[at:end])
            after_call = False
        else:
            if not after_call or text[at:opened].strip():  # (whitespace right after a call says nothing)
                kept.append(text[at:opened])
            if not calls:
                before = "".join(kept)
            calls.append(call)
            after_call = True
        at = end
    kept.append(text[at:])
    return "".join(kept), calls, before


def _parse_llama3(text: str, use: ToolUse) -> tuple[str, list[ToolCall], str]:
    body = text.strip()
    body = body[len(LLAMA_PYTHON_TAG):] if body.startswith(LLAMA_PYTHON_TAG) else body
    if not body.strip():
        return text, [], ""
    calls = []
    for part in _split_top_level(body, ";"):  # a few fine-tunes write several, ";" between them
        found = _json_prefix(part)
        if found is None or part[found[1]:].strip() or not isinstance(found[0], dict):
            return text, [], ""
        call = use.call_of(found[0].get("name"), found[0].get("parameters", found[0].get("arguments")))
        if call is None:
            return text, [], ""
        calls.append(call)
    return "", calls, ""


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at `separator` outside JSON strings and brackets."""
    parts, depth, quoted, escaped, start = [], 0, False, False, 0
    for i, char in enumerate(text):
        if quoted:
            escaped, quoted = (False, quoted) if escaped else (char == "\\", char != '"')
        elif char == '"':
            quoted = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part for part in parts if part.strip()]


def _parse_mistral(text: str, use: ToolUse) -> tuple[str, list[ToolCall], str]:
    opened = text.find(MISTRAL_CALLS)
    if opened < 0:
        return text, [], ""
    found = _json_prefix(text[opened + len(MISTRAL_CALLS):])
    if found is None or not isinstance(found[0], list):
        return text, [], ""
    calls = []
    for entry in found[0]:
        call = use.call_of(entry.get("name"), entry.get("arguments"), entry.get("id")) if isinstance(entry, dict) \
            else None
        if call is None:
            return text, [], ""
        calls.append(call)
    rest = text[opened + len(MISTRAL_CALLS) + found[1]:]
    return text[:opened] + rest, calls, text[:opened]


def _parse_mistral_args(text: str, use: ToolUse) -> tuple[str, list[ToolCall], str]:
    opened = text.find(MISTRAL_CALLS)
    if opened < 0:
        return text, [], ""
    calls, at = [], opened
    while text.startswith(MISTRAL_CALLS, at):
        head_end = text.find(MISTRAL_ARGS, at)
        if head_end < 0:
            return text, [], ""
        head = text[at + len(MISTRAL_CALLS):head_end].split(MISTRAL_ID)
        name, call_id = head[0].strip(), (head[1].strip() if len(head) > 1 else None)
        found = _json_prefix(text[head_end + len(MISTRAL_ARGS):])
        call = None if found is None else use.call_of(name, found[0], call_id)
        if call is None:
            return text, [], ""
        calls.append(call)
        at = head_end + len(MISTRAL_ARGS) + found[1]
        at += len(text[at:]) - len(text[at:].lstrip())
    return text[:opened] + text[at:], calls, text[:opened]


PARSERS: dict[str, Callable[[str, ToolUse], tuple[str, list[ToolCall], str]]] = {
    "hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral, "mistral_args": _parse_mistral_args}


class CallStream:
    """Tells a streamed reply's text from its calls, piece by piece: text goes out as it comes,
    but for what may be the start of a call (held back until it is known); a call goes out once it
    is whole (hermes: at its closing tag; the others: at the end of the reply). What says nothing
    beside a call (whitespace around calls; an empty reasoning block before the first) is held,
    dropped if a call follows it and sent if text does, as `parse` reads the whole. At the end,
    what was held and made no call goes out as text: nothing the model wrote is lost but the
    calls past the first where one is asked for, which `parse` drops too."""

    def __init__(self, use: ToolUse, seed: str) -> None:
        self.use, self.seed = use, seed
        self._held = ""  # text not yet read: a possible opener, or a call being written
        self._in_call = False
        self._started = False  # anything but whitespace was seen (llama3's call is the whole reply)
        self._begun = False  # the reply's start is known not to be an empty reasoning block (or was one)
        self.calls: list[ToolCall] = []  # every call sent so far, in order
        self._quiet = ""  # read, but sent only if text follows it (dropped if a call does)
        self._hush = False  # whitespace is held in `_quiet` (right after a call or an empty reasoning block)

    def feed(self, text: str) -> list[str | ToolCall]:
        """What to send now after the reply's next piece `text`: text and calls, in the order the
        model wrote them."""
        if not self.use.reads_calls:
            return [text] if text else []
        self._held += text
        if not self._begun and not self._lead():
            return []
        out: list[str | ToolCall] = []
        while self._held:
            if self._in_call:
                if self.use.format != "hermes":
                    break  # the rest of the reply is the call(s): read at the end
                closing = self._held.find(HERMES_CLOSE)
                if closing < 0:
                    break
                body, self._held = self._held[:closing + len(HERMES_CLOSE)], self._held[closing + len(HERMES_CLOSE):]
                self._in_call = False
                found = self.use.read(body)[1]
                if found:
                    self._call(found, out)
                else:
                    self._say(body, out)  # not a call: text, as written
                continue
            start = self._opening()
            if start is None:  # no opener here, nor the start of one at the end: all of it is text
                self._say(self._held, out)
                self._held = ""
                break
            at, complete = start
            self._say(self._held[:at], out)
            self._held = self._held[at:]
            if not complete:  # the end may begin an opener: hold it
                break
            self._in_call = True
        return out

    def _call(self, found: list[ToolCall], out: list[str | ToolCall]) -> None:
        """Send the calls `found` (those a single-call reply still takes), dropping what came just
        before them and said nothing."""
        numbered = self.use.numbered(found, self.seed, len(self.calls))
        self.calls += numbered
        out += numbered
        self._quiet, self._hush = "", True

    def _say(self, text: str, out: list[str | ToolCall]) -> None:
        """Send `text`, unless it is whitespace right after a call (or an empty reasoning block):
        that is held until text follows it."""
        if not text:
            return
        if self._hush and not text.strip():
            self._quiet += text
            return
        self._started = self._started or bool(text.strip())
        out.append(self._quiet + text)
        self._quiet, self._hush = "", False

    def _lead(self) -> bool:
        """At the reply's start: an empty reasoning block there is set aside (True: read on), or
        what is held may still become one (False: wait for more)."""
        found = EMPTY_THINKING.match(self._held)
        if found is not None:
            self._quiet, self._held, self._hush = self._held[:found.end()], self._held[found.end():], True
        elif any(block.startswith(self._held.lstrip()) for block in ("<think>\n\n</think>", "<think></think>")) \
                and len(self._held) < 64:
            return False
        self._begun = True
        return True

    def finish(self) -> list[str | ToolCall]:
        """What the end of the reply releases, in order."""
        held, self._held = self._held, ""
        if self._in_call:
            content, found = self.use.read(held)
            if found:
                out: list[str | ToolCall] = []
                self._call(found, out)
                return out + ([content] if content else [])
        if self.calls and not held.strip():
            return []
        text = self._quiet + held if (held or not self.calls) else ""
        return [text] if text else []  # no call after all: as written

    def _opening(self) -> tuple[int, bool] | None:
        """Where in the held text a call opens (and whether the opener is whole), or None."""
        held = self._held
        if self.use.format == "llama3":
            if self._started:
                return None  # llama3's call is a whole reply: text came first, so this is text
            stripped = len(held) - len(held.lstrip())
            rest = held[stripped:]
            if not rest:
                return stripped, False
            for opener in openers(self.use.format):
                if rest.startswith(opener):
                    return stripped, True
                if opener.startswith(rest):
                    return stripped, False
            return None
        best = None
        for opener in openers(self.use.format):
            found = held.find(opener)
            if found >= 0:
                best = (found, True) if best is None or found < best[0] else best
                continue
            for length in range(min(len(opener) - 1, len(held)), 0, -1):  # a tail that may grow into it
                if held.endswith(opener[:length]):
                    at = len(held) - length
                    best = (at, False) if best is None or at < best[0] else best
                    break
        return best
