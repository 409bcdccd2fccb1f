"""A flag that any thread raises to stop llama.cpp's forward in flight.

llama.cpp asks an abort callback, `bool (*)(void *data)`, after each node of the graph it
computes (on the thread that called llama_decode); when the callback says true, llama_decode
returns 2, keeps the KV of the ubatches it finished and removes the positions of the one it
stopped in. A Python callback would take the GIL several hundred times a forward, and wait for
it whenever another thread holds it, with the forward's other threads idle at the graph's
barrier. So the callback is C: libc's `strlen`, given a two-byte buffer whose second byte is
always 0. It returns 0 while the first byte is 0 (go on) and 1 once it is set (stop): the same
register a bool is returned in, and nothing but a byte read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any


class Interrupt:
    """The flag of one llama.cpp context, installed as its abort callback."""

    def __init__(self, api: Any, ctx: Any) -> None:
        """Install the callback on `ctx` (through `api`, llama-cpp-python's bindings)."""
        self._flag = ctypes.create_string_buffer(2)  # [0]: set to stop; [1]: always 0
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        address = ctypes.cast(libc.strlen, ctypes.c_void_p).value
        self._callback = api.ggml_abort_callback(address)  # kept: the context holds the pointer
        api.llama_set_abort_callback(ctx, self._callback, ctypes.cast(self._flag, ctypes.c_void_p))

    def set(self) -> None:
        """Stop the forward in flight at its next node (or the next forward at its first)."""
        self._flag[0] = b"\x01"

    def clear(self) -> None:
        """Let forwards run again."""
        self._flag[0] = b"\x00"

    def is_set(self) -> bool:
        """True while the flag is raised."""
        return self._flag[0] != b"\x00"


def supported(api: Any) -> bool:
    """True where the bindings can install an abort callback."""
    return hasattr(api, "llama_set_abort_callback") and hasattr(api, "ggml_abort_callback")
