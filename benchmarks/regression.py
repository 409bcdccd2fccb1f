"""Which ratios of a new benchmark run moved against the last committed run of the same name.

    python benchmarks/regression.py NEW.json                      # against benchmarks/results/<name>.json
    python benchmarks/regression.py NEW.json --against OLD.json --tolerance 0.15

A ratio "moved" when its median changed by more than the tolerance (relative), or when it crossed
its goal; an agreement ratio (two sizes that must be equal) moved when it drifted from 1 by more
than half a percent. Noise on these shared machines is ±20 % or so, so the default tolerance is 0.2. Exits 0
when nothing moved the wrong way, 1 when something got worse, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

RESULTS = Path(__file__).resolve().parent / "results"
AGREEMENT_SLACK = 0.005  # how much further from 1 an agreement ratio may drift before it counts


class Movement(NamedTuple):
    """One ratio compared across two runs."""

    label: str
    before: float
    after: float
    change: float  # after / before - 1
    goal: float | None
    verdict: str  # "better", "worse", "steady", "new", "gone"


def compare(new: dict, old: dict, tolerance: float = 0.2) -> list[Movement]:
    """Every ratio of either run, with what happened to it: larger speed ratios are better; an
    agreement ratio (two sizes that must be equal) is better the closer it is to 1."""
    movements = []
    new_ratios, old_ratios = new.get("ratios", {}), old.get("ratios", {})
    for label in sorted(set(new_ratios) | set(old_ratios)):
        if label not in old_ratios:
            movements.append(Movement(label, float("nan"), new_ratios[label]["value"], float("nan"),
                                      new_ratios[label].get("goal"), "new"))
            continue
        if label not in new_ratios:
            movements.append(Movement(label, old_ratios[label]["value"], float("nan"), float("nan"),
                                      old_ratios[label].get("goal"), "gone"))
            continue
        before, after = old_ratios[label]["value"], new_ratios[label]["value"]
        goal = new_ratios[label].get("goal")
        change = after / before - 1 if before else float("inf")
        if new_ratios[label].get("kind") == "agreement":  # two sizes that must be equal: 1 is right
            off_before, off_after = abs(before - 1), abs(after - 1)
            verdict = ("worse" if off_after > off_before + AGREEMENT_SLACK else
                       "better" if off_after < off_before - AGREEMENT_SLACK else "steady")
            movements.append(Movement(label, before, after, change, goal, verdict))
            continue
        lost_goal = goal is not None and before >= goal > after
        won_goal = goal is not None and after >= goal > before
        verdict = ("worse" if lost_goal or change < -tolerance else
                   "better" if won_goal or change > tolerance else "steady")
        movements.append(Movement(label, before, after, change, goal, verdict))
    return movements


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new", type=Path, help="the new run's JSON")
    parser.add_argument("--against", type=Path, help="the run to compare with (default: the committed one)")
    parser.add_argument("--tolerance", type=float, default=0.2, help="relative change that counts (default 0.2)")
    args = parser.parse_args(argv)
    try:
        new = json.loads(args.new.read_text())
        old_path = args.against or RESULTS / f"{new['name']}.json"
        old = json.loads(old_path.read_text())
    except (OSError, ValueError, KeyError) as exc:
        print(f"regression: cannot read the runs: {exc}", file=sys.stderr)
        return 2
    movements = compare(new, old, args.tolerance)
    for m in movements:
        if m.verdict in ("new", "gone"):
            print(f"{m.verdict:>6}  {m.label}")
        else:
            print(f"{m.verdict:>6}  {m.label}: {m.before:.3f} -> {m.after:.3f} ({m.change:+.0%})")
    return 1 if any(m.verdict == "worse" for m in movements) else 0


if __name__ == "__main__":
    sys.exit(main())
