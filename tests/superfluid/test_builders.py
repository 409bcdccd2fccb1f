"""Requests are built on threads of a lower CPU priority than the engine's (Linux)."""

import asyncio
import os
import sys
import threading

import pytest

from superfluid.http import builders


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_a_builder_thread_runs_below_the_process_priority_and_the_caller_keeps_its_own():
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def niceness() -> tuple[int, str]:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), threading.current_thread().name

    nice, name = asyncio.run(builders.build(niceness))
    assert nice == min(19, own + builders.NICENESS) and name.startswith("superfluid-build")
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller's thread is untouched
