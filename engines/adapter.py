"""What every runtime adapter shares: its declared options, one owning thread, and the
per-sequence lengths it keeps."""

from __future__ import annotations

import threading

from engines.errors import EngineError, WrongThread
from engines.options import OptionSpec


LOGITS = ("last", "all", "none")


class Adapter:
    """Base of the runtime adapters. Subclasses set OPTIONS and call `_claim_thread()` first."""

    OPTIONS: tuple[OptionSpec, ...] = ()
    runtime = ""

    @classmethod
    def options(cls) -> tuple[OptionSpec, ...]:
        """The options this runtime takes, with shapes, defaults and help."""
        return cls.OPTIONS

    def _claim_thread(self) -> None:
        self._owner = threading.get_ident()
        self._lengths: dict[int, int] = {}

    def _check_thread(self) -> None:
        if threading.get_ident() != self._owner:
            raise WrongThread(f"a {self.runtime} engine is called only from the thread that created it (the "
                              "scheduler thread that owns it); hand the work to that thread")

    def _check_requests(self, requests) -> None:
        """Refuse a step request asking for logits other than "last", "all" or "none" (a typo
        would otherwise return nothing, silently)."""
        for request in requests:
            if request.logits not in LOGITS:
                raise EngineError(f"step request for sequence {request.seq} asks for logits={request.logits!r}; "
                                  f"use one of {', '.join(LOGITS)}")

    def length(self, seq: int) -> int:
        """Positions held by `seq`."""
        return self._length(seq)

    def sequences(self) -> list[int]:
        """The ids of the sequences alive, in ascending order."""
        self._check_thread()
        return sorted(self._lengths)

    def _length(self, seq: int) -> int:
        self._check_thread()
        try:
            return self._lengths[seq]
        except KeyError:
            raise EngineError(f"no sequence {seq} in this {self.runtime} engine") from None

    def close(self) -> None:
        """Free what the engine holds (each adapter says what)."""

    def release_thread(self) -> None:
        """Free what the runtime keeps for the calling thread; a host calls it last on the thread
        that owned the engine, after close(), when that thread ends."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
