"""`python -m kvpool ls | gc | rm NAME | demo`: this user's pool segments, and a tour."""

from __future__ import annotations

import argparse
import sys
import time

from kvpool import demo, inventory
from kvpool.budget import describe_bytes
from kvpool.errors import PoolError


def _ls(args: argparse.Namespace) -> int:
    rows = inventory.list_segments()
    if not rows:
        print("no pool segments for this user")
        return 0
    print(f"{'NAME':<24} {'OWNER':<16} {'SIZE':>10} {'ENTRIES':>8}  CREATED")
    for info in rows:
        owner = f"alive pid {info.owner_pid}" if info.owner_alive else "none (orphaned)"
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.created_at)) if info.created_at else "-"
        entries = "-" if info.entries is None else str(info.entries)
        print(f"{info.name:<24} {owner:<16} {describe_bytes(info.size):>10} {entries:>8}  {created}"
              + (f"  ({info.problem})" if info.problem else ""))
    return 0


def _gc(args: argparse.Namespace) -> int:
    removed = inventory.collect_garbage()
    for info in removed:
        print(f"removed {info.name} ({describe_bytes(info.size)})")
    print(f"{len(removed)} orphaned segment(s) removed")
    return 0


def _rm(args: argparse.Namespace) -> int:
    inventory.remove(args.name, force=args.force)
    print(f"removed {args.name}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    demo.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m kvpool`; returns the exit status (2 for usage, 1 for a pool error)."""
    parser = argparse.ArgumentParser(prog="python -m kvpool", description="superfluid's shared-memory KV pools")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("ls", help="list this user's pool segments: owner, size, entries").set_defaults(run=_ls)
    commands.add_parser("gc", help="remove segments no live process owns (their entries are lost)").set_defaults(run=_gc)
    rm = commands.add_parser("rm", help="remove one segment by pool name")
    rm.add_argument("name")
    rm.add_argument("--force", action="store_true", help="remove it even if a live process owns it")
    rm.set_defaults(run=_rm)
    commands.add_parser("demo", help="create a pool, store, share, evict, print statistics, unlink").set_defaults(run=_demo)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except PoolError as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
