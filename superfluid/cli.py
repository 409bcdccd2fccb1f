"""The `superfluid` command. For now: `superfluid pool ls | gc | rm` and `superfluid demo`.

`superfluid serve` and the runtime commands arrive with the Host and server issues.
"""

from __future__ import annotations

import argparse
import sys

from kvpool import __main__ as pool_cli


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `superfluid` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="superfluid", description="local LLMs in-process, around a shared KV pool")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pool", help="this user's pool segments: ls | gc | rm NAME", add_help=False)
    commands.add_parser("demo", help="a tour of the shared-memory KV pool")
    args, rest = parser.parse_known_args(argv)
    if args.command == "pool":
        return pool_cli.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return pool_cli.main(["demo"])


if __name__ == "__main__":
    sys.exit(main())
