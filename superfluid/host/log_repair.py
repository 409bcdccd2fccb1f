"""Checking a session log, and repairing damage in its middle (`superfluid log check | repair`).

A host refuses to start on a log damaged in the middle, and changes nothing on disk: what to keep
is a person's decision. `examine` reads the log as replay does, but past damage: every intact
record is kept, and each session is cut at its first gap, the first record of it that cannot
apply (one of its records was in the damaged bytes: its number is skipped, or its tokens no
longer continue the session), since none after a gap can be applied safely. A session whose
opening record was lost goes whole. `repair` writes what `examine` kept as a new log (a snapshot
of each session, as a compaction writes it) and keeps the damaged file beside it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from superfluid.host.errors import LogCorrupt
from superfluid.host.log import write_snapshot
from superfluid.host.log_records import Deleted, SessionState, apply, decode_record
from superfluid.host.log_format import FILE_NAME, Damage, lock_directory, open_private, read_private, scan, version_of


@dataclass
class SessionCut:
    """A session cut at its first gap: what it kept and what was dropped after it."""

    session: str
    at_byte: int  # where its first record that could not apply begins
    why: str
    tokens_kept: int  # 0 with `opened` False: the session is gone
    opened: bool
    records_dropped: int = 1


@dataclass
class LogReport:
    """What `examine` found in one log."""

    path: Path
    version: int
    records_kept: int = 0
    damage: list[Damage] = field(default_factory=list)  # spans holding no intact record, in order
    file_bytes: int = 0
    cut: dict[str, SessionCut] = field(default_factory=dict)
    states: dict[str, SessionState] = field(default_factory=dict)

    @property
    def torn_tail(self) -> Damage | None:
        """The damage that ends the file, if any: a torn last write, which a start cuts off by itself."""
        return self.damage[-1] if self.damage and self.damage[-1].end == self.file_bytes else None

    @property
    def needs_repair(self) -> bool:
        """True when a host would refuse to start on this log: damage before its end, or a gap."""
        return bool(self.cut) or any(span is not self.torn_tail for span in self.damage)

    def lines(self) -> list[str]:
        """The report, one finding a line."""
        out = [f"{self.path}: format {self.version}, {self.file_bytes} bytes, {self.records_kept} intact records "
               f"kept, {len(self.states)} sessions"]
        for span in self.damage:
            kind = "a torn last write (a start cuts it off)" if span is self.torn_tail else "damaged"
            out.append(f"  bytes {span.offset}-{span.end} ({span.end - span.offset}): {kind}")
        for cut in self.cut.values():
            kept = (f"kept its first {cut.tokens_kept} tokens" if cut.opened
                    else "dropped whole (its opening record was lost)")
            out.append(f"  session {cut.session}: cut at byte {cut.at_byte}, {kept}; {cut.records_dropped} later "
                       f"records dropped ({cut.why})")
        if not self.needs_repair:
            out.append("  nothing to repair" if not self.damage else "  nothing to repair beyond the torn tail")
        return out

    def as_dict(self) -> dict:
        """The report as JSON-ready data."""
        return {"path": str(self.path), "format": self.version, "bytes": self.file_bytes,
                "records_kept": self.records_kept, "sessions": len(self.states), "needs_repair": self.needs_repair,
                "damage": [{"from": span.offset, "to": span.end, "torn_tail": span is self.torn_tail}
                           for span in self.damage],
                "cut": [{"session": cut.session, "at_byte": cut.at_byte, "why": cut.why, "opened": cut.opened,
                         "tokens_kept": cut.tokens_kept, "records_dropped": cut.records_dropped}
                        for cut in self.cut.values()]}


def examine(directory: str | Path) -> LogReport:
    """Read the log in `directory` past any damage (nothing is written): what a repair keeps and
    drops. LogCorrupt when the file is not a session log this code reads at all."""
    path = Path(directory) / FILE_NAME
    data = read_private(path)
    report = LogReport(path, version_of(data, path), file_bytes=len(data))
    numbers: dict[str, int] = {}
    for found in scan(data, report.version):
        if isinstance(found, Damage):
            report.damage.append(found)
            continue
        where = f" {path} at byte {found.offset}"
        try:
            record = decode_record(found.payload, where)
        except LogCorrupt:
            report.damage.append(Damage(found.offset, found.end))  # intact, but no record this code knows
            continue
        session = record.session
        if session in report.cut:
            report.cut[session].records_dropped += 1
            continue
        expected = numbers.get(session, 0)
        why = None
        if found.number is not None and found.number != expected:
            why = f"its record {expected} is missing; the next found is {found.number}"
        else:
            try:
                apply(report.states, record)
            except LogCorrupt as exc:  # "session log: <what>; <advice for a start>": the what
                why = str(exc).removeprefix("session log: ").split(";")[0]
        if why is not None:
            state = report.states.get(session)
            report.cut[session] = SessionCut(session, found.offset, why, len(state.tokens) if state else 0,
                                             opened=state is not None)
            continue
        if isinstance(record, Deleted):
            numbers.pop(session, None)
        else:
            numbers[session] = expected + 1
        report.records_kept += 1
    return report


def repair(directory: str | Path) -> tuple[LogReport, Path | None]:
    """Rewrite the log in `directory` as what `examine` keeps, the damaged file kept beside it as
    sessions.log.damaged-<time>: (the report, where the damaged file went; None when there was
    nothing to repair). LogBusy while a host uses the directory."""
    directory = Path(directory)
    lock = lock_directory(directory)
    try:
        report = examine(directory)
        if not report.damage and not report.cut:
            return report, None
        kept = directory / f"{FILE_NAME}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
        fd = open_private(kept, os.O_WRONLY | os.O_EXCL)
        with os.fdopen(fd, "wb") as handle:
            handle.write(read_private(report.path))
            handle.flush()
            os.fsync(handle.fileno())
        numbers: dict[str, int] = {}

        def number(record) -> int:
            numbers[record.session] = numbers.get(record.session, -1) + 1
            return numbers[record.session]

        write_snapshot(report.path, report.states.values(), number)
        return report, kept
    finally:
        os.close(lock)
