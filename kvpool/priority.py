"""CPU priority of the background threads that share the cores with the engine.

On a machine with few cores the engine's threads use every core while anything decodes, so CPU a
background thread takes (building a request, copying an entry to disk) is taken from a forward in
flight: its other thread waits at the graph's barrier. A background thread with a higher nice
value still runs at once when it has used little CPU, and yields the cores to the forward when
it has a lot to do.

Linux keeps a nice value per thread (setpriority on the thread's id); elsewhere the thread keeps
the process's priority.
"""

from __future__ import annotations

import os
import sys
import threading

BACKGROUND_NICENESS = 10  # added to the process's nice value for background threads (Linux)


def lower_this_thread(niceness: int = BACKGROUND_NICENESS) -> None:
    """Raise the calling thread's nice value by `niceness` (capped at 19), on Linux; elsewhere,
    or where a sandbox forbids it, the thread keeps the process's priority."""
    if not sys.platform.startswith("linux"):
        return
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + niceness))
    except OSError:
        pass
