"""`superfluid log check | repair`: what a session log holds, and keeping what is intact of one
damaged in the middle (a host refuses to start on such a log and changes nothing on disk).

    superfluid log check [DIR] [--pool-name NAME] [--json]   what a repair would keep and drop
    superfluid log repair [DIR] [--pool-name NAME] [--json]  do it; the damaged file is kept beside

DIR defaults to the directory serve uses for the pool (sessions/<pool name> under superfluid's
cache). Exit codes: 0 nothing (more) to repair, 1 check found damage a start refuses, or the log
could not be read or repaired.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from superfluid.host.errors import LogBusy, LogCorrupt
from superfluid.host.host import default_log_dir
from superfluid.host.log_repair import examine, repair

EXIT_OK, EXIT_DAMAGED = 0, 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`log check|repair [DIR]`."""
    verbs = parser.add_subparsers(dest="verb", required=True)
    for verb, help_text in (("check", "what a repair would keep and drop (changes nothing)"),
                            ("repair", "keep every intact record; cut each damaged session at its first gap")):
        command = verbs.add_parser(verb, help=help_text)
        command.add_argument("directory", nargs="?", type=Path, help="the log's directory (default: serve's for "
                             "--pool-name)")
        command.add_argument("--pool-name", default="superfluid", help="the pool whose default log directory to use")
        command.add_argument("--json", action="store_true", help="one JSON document instead of text")


def run(args: argparse.Namespace) -> int:
    """Run `log check` or `log repair`; the exit status."""
    directory = args.directory or default_log_dir(args.pool_name)
    try:
        if args.verb == "check":
            report, kept = examine(directory), None
        else:
            report, kept = repair(directory)
    except (LogBusy, LogCorrupt, OSError) as exc:
        print(f"superfluid log {args.verb}: {exc}", file=sys.stderr)
        return EXIT_DAMAGED
    if args.json:
        print(json.dumps({**report.as_dict(), "damaged_file_kept_at": str(kept) if kept else None}))
    else:
        print("\n".join(report.lines()))
        if kept is not None:
            print(f"repaired: {len(report.states)} sessions written to {report.path}; the damaged file is kept at "
                  f"{kept}")
        elif args.verb == "check" and report.needs_repair:
            print(f"a host refuses to start on this log: `superfluid log repair {directory}` keeps what is listed "
                  "as kept")
    return EXIT_DAMAGED if args.verb == "check" and report.needs_repair else EXIT_OK
