"""The engine's thread: the one thread that touches an engine, and the commands that reach it.

Every public Host and Session call becomes a command (a callable and its arguments) queued here
from any thread and answered through a `concurrent.futures.Future`. The thread runs the commands
that arrived, then a scheduler tick while any generation is active (superfluid/host/scheduler.py);
with nothing active it waits up to IDLE_WAIT for the next command. Callers are answered after
the statistics their commands changed are published, so a caller that reads them next sees its
command's effect.

A command that starts a request may bring its `Arrival` (class and prompt length): the queueing
thread then asks the scheduler whether to stop the step in flight for it (`Scheduler.hurry`),
without waiting for the thread.

If the engine or the pool fails, every generation and every queued caller hears of it, and later
calls are refused with HostClosed naming the failure.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from superfluid.host.errors import HostClosed
from superfluid.host.interruption import Arrival
from superfluid.host.scheduler import Scheduler

IDLE_WAIT = 0.05  # seconds a thread with nothing to do waits for a command
T = TypeVar("T")


class EngineThread:
    """Runs `scheduler` on a thread of its own, and queues commands for it from any thread."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._commands: queue.Queue = queue.Queue()
        # when the command running now was submitted: a generation waits from there, the step in
        # flight as it came included (its first-token target and timeout count from it)
        self.arrived = scheduler.clock()
        self._stopping = False
        self.error: BaseException | None = None  # what ended the thread, if anything failed
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="superfluid-scheduler", daemon=True)

    def start(self) -> None:
        """Start the thread and wait until the engine and the pool are open (re-raising their error)."""
        self.thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def alive(self) -> bool:
        """True while the thread runs."""
        return self.thread.is_alive()

    def join(self) -> None:
        """Wait for the thread to end (after `stop`, or a failure)."""
        self.thread.join()

    def submit(self, command: Callable[..., T], *args: Any,
               arrival: Arrival | None = None) -> concurrent.futures.Future:
        """Queue `command(*args)` to run on the thread; its future. `arrival`: the command starts
        this request, which may stop the step in flight."""
        if self.error is not None or self._stopping or not self.thread.is_alive():
            raise HostClosed("the host is closed" + (f" (its scheduler failed: {self.error})" if self.error else ""))
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((future, command, args, self.scheduler.clock()))
        if arrival is not None:
            self.scheduler.hurry(arrival)
        return future

    def call(self, command: Callable[..., T], *args: Any, arrival: Arrival | None = None) -> T:
        """Run `command(*args)` on the thread and return its result (or raise its error)."""
        future = self.submit(command, *args, arrival=arrival)
        while not concurrent.futures.wait([future], timeout=0.5).done:
            if not self.thread.is_alive() and not future.done():  # it ended (failed) as this call came in
                raise HostClosed("the host's scheduler stopped before answering"
                                 + (f" (it failed: {self.error!r})" if self.error is not None else ""))
        return future.result()

    def stop(self) -> None:
        """Ask the thread to end after the command running now (call it from a command, or after
        the last one); commands queued behind it are refused."""
        self._stopping = True

    def _run(self) -> None:
        scheduler = self.scheduler
        try:
            scheduler.open()
        except BaseException as exc:  # handed to start(), which re-raises it in the caller
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stopping:
                self._drain(block=not scheduler.active)
                if scheduler.active:
                    scheduler.tick()
                elif not self._stopping:
                    scheduler.idle()
                scheduler.end_round(closing=self._stopping)
        except BaseException as exc:  # the engine or the pool failed: every waiter hears of it
            self.error = exc
            scheduler.fail_all(exc)
        finally:
            scheduler.publisher.tell_ended()
            self._drain(block=False, refuse=True)
            scheduler.release_engine()

    def _drain(self, block: bool, refuse: bool = False) -> None:
        """Run the commands that arrived (waiting up to IDLE_WAIT for one if `block`); their
        callers are answered after the statistics are published."""
        answers = []
        while True:
            try:
                future, command, args, self.arrived = (self._commands.get(timeout=IDLE_WAIT) if block
                                                       else self._commands.get_nowait())
            except queue.Empty:
                break
            block = False
            if not future.set_running_or_notify_cancel():
                continue
            if refuse or self._stopping:  # after close: the engine, log and pool are gone
                future.set_exception(HostClosed("the host closed before this call ran"))
                continue
            try:
                answers.append((future, command(*args), None))
            except Exception as exc:  # handed back to the caller's thread
                answers.append((future, None, exc))
        try:
            if answers:
                self.scheduler.announce(force=True, publish=not self._stopping)
        finally:  # the callers are answered even if publishing failed (the loop then fails everything)
            for future, result, error in answers:
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
