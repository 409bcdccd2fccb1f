"""llama.cpp's log, routed into Python's `logging` (logger "llama.cpp") at its real levels.

llama-cpp-python's own callback (llama_cpp._logger) maps ggml's log levels by an enum that
ggml has since renumbered (now NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5): with it
quieted, every warning was printed as an error and every error hidden as debug. Here each line
goes to the "llama.cpp" logger at its own level; that logger passes warnings and errors by
default (an application lowers its level to see llama.cpp's load chatter).

A warning the caller knows to be wrong for its configuration is dropped while the call that
causes it runs (`expecting`), never wholesale: llama.cpp warns "n_ctx_seq > n_ctx_train" for a
unified cache sized for many sessions, although the host caps each session at the trained
context.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any

LOGGER = logging.getLogger("llama.cpp")
LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
CONTINUE = 5  # ggml's GGML_LOG_LEVEL_CONT: more of the line before

_state: dict[str, Any] = {"callback": None, "line": "", "level": logging.INFO, "expected": []}


def route(api: Any) -> None:
    """Send llama.cpp's log to the "llama.cpp" logger (once per process; the callback is kept
    alive here, since llama.cpp holds only its address)."""
    if _state["callback"] is not None:
        return
    if LOGGER.level == logging.NOTSET:
        LOGGER.setLevel(logging.WARNING)
    _state["callback"] = api.llama_log_callback(_receive)
    api.llama_log_set(_state["callback"], None)


@contextlib.contextmanager
def expecting(pattern: str) -> Iterator[None]:
    """Drop the log lines matching `pattern` (a regular expression) while the block runs: a
    warning the caller knows does not apply."""
    compiled = re.compile(pattern)
    _state["expected"].append(compiled)
    try:
        yield
    finally:
        _state["expected"].remove(compiled)


def _receive(level: int, text: bytes, _user_data) -> None:
    """llama.cpp's callback: gather pieces into lines, and log each whole line at its level."""
    if level != CONTINUE:
        _state["level"] = LEVELS.get(level, logging.INFO)
    _state["line"] += text.decode("utf-8", errors="replace")
    *lines, _state["line"] = _state["line"].split("\n")
    for line in lines:
        if line and not any(pattern.search(line) for pattern in _state["expected"]):
            LOGGER.log(_state["level"], "%s", line)
