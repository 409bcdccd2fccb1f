"""`python -m kvpool ls | gc | rm NAME | disk ls | disk gc | demo`: this user's pool segments and
disk tiers, and a tour."""

from __future__ import annotations

import argparse
import sys
import time

from kvpool import demo, inventory, places, segment, tier_inventory
from kvpool.budget import describe_bytes
from kvpool.tier_folder import remove_tier
from kvpool.errors import PoolBusy, PoolError


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
    return _disk_gc(args)  # (the disk tiers' files kept as they are: only what is torn or unreadable goes)


def _rm(args: argparse.Namespace) -> int:
    folder = places.disk_folder(args.name)
    segment_found = args.name in segment.list_pool_names()
    if segment_found:
        inventory.remove(args.name, force=args.force)
    try:
        freed = remove_tier(folder)
    except PoolBusy as exc:
        if not segment_found:
            raise
        print(f"removed {args.name}'s segment; its disk tier stays: {exc}", file=sys.stderr)
        return 1
    if not segment_found and not freed and not folder.exists():
        raise PoolError(f"no pool named {args.name!r}: no segment and no disk tier of that name (`ls` and `disk ls` "
                        "list them)")
    print(f"removed {args.name}" + (f" and {describe_bytes(freed)} of its disk tier ({folder})" if freed else ""))
    return 0


def _disk_ls(args: argparse.Namespace) -> int:
    tiers = tier_inventory.list_tiers()
    if not tiers:
        print(f"no disk tiers under {places.disk_tiers_root()}")
        return 0
    print(f"{'POOL':<24} {'IN USE':<7} {'ENTRIES':>8} {'SIZE':>10}  MODELS")
    for tier in tiers:
        models = ", ".join(f"{identity} ({count})" for identity, count in sorted(tier.identities.items()))
        if tier.unreadable:
            models += f"{', ' if models else ''}{tier.unreadable} unreadable (another format, or damaged)"
        print(f"{tier.name:<24} {'yes' if tier.in_use else 'no':<7} {tier.files:>8} {describe_bytes(tier.bytes):>10}  "
              + (models or ("-" if not tier.in_use else "(its owner's)")))
    return 0


def _disk_gc(args: argparse.Namespace) -> int:
    for tier in tier_inventory.collect_garbage(keep_identity=args.keep_identity):
        state = "in use: left to its owner" if tier.in_use else f"{tier.removed} file(s) removed"
        print(f"{tier.name}: {state}; {tier.files} entries, {describe_bytes(tier.bytes)} kept")
    return 0


def _demo(args: argparse.Namespace) -> int:
    demo.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m kvpool`; returns the exit status (2 for usage, 1 for a pool error)."""
    parser = argparse.ArgumentParser(prog="python -m kvpool", description="superfluid's shared-memory KV pools")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("ls", help="list this user's pool segments: owner, size, entries").set_defaults(run=_ls)
    commands.add_parser("gc", help="remove segments no live process owns (their entries are lost from memory), and "
                        "clean the disk tiers not in use (as `disk gc`)").set_defaults(run=_gc, keep_identity=None)
    rm = commands.add_parser("rm", help="remove one pool by name: its segment and its disk tier")
    rm.add_argument("name")
    rm.add_argument("--force", action="store_true", help="remove it even if a live process owns it")
    rm.set_defaults(run=_rm)
    disk = commands.add_parser("disk", help="this user's disk tiers: ls | gc").add_subparsers(dest="disk_command",
                                                                                         required=True)
    disk.add_parser("ls", help="each pool's disk tier: in use, entries, bytes, the models that wrote them"
                    ).set_defaults(run=_disk_ls)
    gc = disk.add_parser("gc", help="in tiers not in use, remove torn and damaged files and files of another format")
    gc.add_argument("--keep-identity", metavar="IDENTITY", help="also remove every entry another model wrote "
                    "(identities as `disk ls` shows them)")
    gc.set_defaults(run=_disk_gc)
    commands.add_parser("demo", help="create a pool, store, share, evict, print statistics, unlink").set_defaults(run=_demo)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except PoolError as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
