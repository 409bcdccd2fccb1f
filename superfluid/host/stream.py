"""Token bytes to text pieces a user can be shown: whole characters, and nothing of a stop string.

A token may end in the middle of a UTF-8 character (byte-level BPE splits emoji and CJK across
tokens): those bytes wait for the rest. A stop string may span several tokens: text that could
still be the start of one is held back until the next tokens show it is not, and when one is
found the text before it is released and the stream ends.

    tokens:  "Hel" "lo" " ST" "OP" "..."    stop=["STOP"]
    emitted: "Hel" "lo" " "   (stop)         " ST" held: "ST" could begin "STOP"
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    """Turns a generation's token bytes into text pieces, watching for stop strings."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        """`stop`: strings that end the stream (not part of the text emitted)."""
        if isinstance(stop, str):
            stop = [stop]
        self._stops = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self.stopped: str | None = None  # the stop string found, once found
        self.text = ""  # everything emitted so far

    def feed(self, data: bytes) -> str:
        """The text that can be shown after `data` (possibly empty); after a stop, nothing."""
        if self.stopped is not None:
            return ""
        self._held += self._decoder.decode(data)
        found = [(self._held.find(s), s) for s in self._stops]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, self.stopped = min(found)
            return self._emit(self._held[:at], rest="")
        keep = self._partial_stop_length(self._held)
        return self._emit(self._held[:len(self._held) - keep], rest=self._held[len(self._held) - keep:])

    def finish(self) -> str:
        """The text still held when the generation ends for another reason (bytes of an
        unfinished character become U+FFFD)."""
        if self.stopped is not None:
            return ""
        self._held += self._decoder.decode(b"", final=True)
        return self._emit(self._held, rest="")

    def _emit(self, piece: str, rest: str) -> str:
        self._held = rest
        self.text += piece
        return piece

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest end of `text` that is the beginning of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
