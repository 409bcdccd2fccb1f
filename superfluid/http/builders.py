"""The threads that build requests beside the event loop (decode the body, render the chat
template, tokenize), at a lower CPU priority than the engine's.

On a machine with few cores, llama.cpp's threads use every core while anything decodes, so CPU
given to building a request is taken from a forward in flight (its other thread waits at the
graph's barrier). A short request's prompt is built in a millisecond or two and is not held
back: a thread that has used little CPU is scheduled at once whatever its niceness. A huge one
(a 20,000-message chat, seconds of tokenizing) yields to the forward: on 2 cores the other
stream's longest gap between tokens went from 279-366 ms to 27-187 ms, and the huge request
took 10 s to be answered instead of 6.

Linux keeps a nice value per thread (setpriority on a thread id); elsewhere the threads keep the
process's priority.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

NICENESS = 10  # added to the process's nice value for the builder threads (Linux)

T = TypeVar("T")

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _lower_priority() -> None:
    if sys.platform.startswith("linux"):
        try:
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + NICENESS))
        except OSError:  # a sandbox that forbids it: the thread keeps the process's priority
            pass


def _builders() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:  # as many threads as asyncio.to_thread's default pool
            _pool = concurrent.futures.ThreadPoolExecutor(min(32, (os.cpu_count() or 1) + 4),
                                                          thread_name_prefix="superfluid-build",
                                                          initializer=_lower_priority)
        return _pool


async def build(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` on a builder thread, awaited."""
    return await asyncio.get_running_loop().run_in_executor(_builders(), function, *args)
