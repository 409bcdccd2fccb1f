"""The benchmark harness every superfluid benchmark uses.

A `Run` measures figures side by side in one process, reports each as median / min / max of its
samples, computes ratios against a comparison measured in the same run (never against a number
from another day or machine), records the machine, prints a table, and writes JSON:

    run = Run("pool")
    run.measure("memcpy 16 MiB", lambda: np.copyto(dst, src), nbytes=16 << 20)
    run.measure("put 16 MiB", put_once, setup=evict_last, nbytes=16 << 20)
    run.ratio("put / memcpy 16 MiB", ours="put 16 MiB", baseline="memcpy 16 MiB", goal=0.8)
    run.finish()   # prints the table, writes benchmarks/results/pool.json

A ratio is baseline time / our time: above 1 we are faster, 0.8 means 80% of the baseline's speed.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
LIBRARIES = ("numpy", "msgspec", "xxhash", "posix-ipc", "sortedcontainers", "llama-cpp-python", "mlx", "mlx-lm")


@dataclass
class Figure:
    """The samples of one measured operation, in seconds."""

    label: str
    samples: list[float]
    nbytes: int | None = None
    unit: str = "s"

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def as_dict(self) -> dict:
        result = {"median": self.median, "min": min(self.samples), "max": max(self.samples),
                  "samples": len(self.samples), "unit": self.unit}
        if self.nbytes:
            result["nbytes"] = self.nbytes
            result["gb_per_s_median"] = self.nbytes / self.median / 1e9 if self.median else None
        return result


@dataclass
class Ratio:
    """baseline / ours, from medians and from the spread (worst and best pairing of samples)."""

    label: str
    ours: str
    baseline: str
    value: float
    low: float
    high: float
    goal: float | None = None
    group: str | None = None  # the section of a report it belongs to
    kind: str = "speed"  # "speed": larger is better; "agreement": two sizes that must be equal (1 is right)

    @property
    def met(self) -> bool | None:
        return None if self.goal is None else self.value >= self.goal

    def as_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high, "ours": self.ours,
                "baseline": self.baseline, "goal": self.goal, "met": self.met, "group": self.group,
                "kind": self.kind}


def machine() -> dict:
    """Cores, memory, CPU, Python and the versions of the libraries that matter here."""
    info = {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            info["memory_bytes"] = int(meminfo.readline().split()[1]) * 1024
        with open("/proc/cpuinfo", encoding="ascii") as cpuinfo:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    except OSError:
        pass
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    info["libraries"] = versions
    return info


COST_UNITS = frozenset({"s", "tokens"})  # figures where less is better: time taken, tokens a server evaluated


@dataclass
class Run:
    """One benchmark run: figures, ratios, notes, the machine; printed and written as JSON."""

    name: str
    out_dir: Path = RESULTS_DIR
    figures: dict[str, Figure] = field(default_factory=dict)
    ratios: dict[str, Ratio] = field(default_factory=dict)
    notes: dict[str, object] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def measure(self, label: str, operation: Callable[[], object], *, repeat: int = 7, warmup: int = 1,
                setup: Callable[[], object] | None = None, nbytes: int | None = None) -> Figure:
        """Time `operation` `repeat` times after `warmup` untimed calls; `setup` runs untimed
        before every call. The garbage collector is off while timing."""
        for _ in range(warmup):
            if setup:
                setup()
            operation()
        samples = []
        for _ in range(repeat):
            if setup:
                setup()
            gc.disable()
            try:
                start = time.perf_counter()
                operation()
                samples.append(time.perf_counter() - start)
            finally:
                gc.enable()
        figure = Figure(label, samples, nbytes)
        self.figures[label] = figure
        return figure

    def record(self, label: str, samples: list[float], *, unit: str = "s", nbytes: int | None = None) -> Figure:
        """Add a figure measured elsewhere (e.g. operations per second)."""
        figure = Figure(label, list(samples), nbytes, unit)
        self.figures[label] = figure
        return figure

    def combine(self, label: str, first: str, second: str) -> Figure:
        """A figure whose samples are the sums of two figures' samples, paired in sorted order
        (e.g. export + import, measured apart)."""
        a, b = sorted(self.figures[first].samples), sorted(self.figures[second].samples)
        return self.record(label, [x + y for x, y in zip(a, b)])

    def ratio(self, label: str, *, ours: str, baseline: str, goal: float | None = None,
              group: str | None = None, kind: str = "speed") -> Ratio:
        """A speed ratio (kind "speed"): baseline / ours over the medians for costs (figures in
        COST_UNITS: seconds, tokens evaluated), ours / baseline for rates and counts of what got
        done (tok/s, requests served), so above 1 we are ahead; or an
        agreement (kind "agreement"): ours / baseline of two sizes that must be equal. The spread
        comes from the extremes of both."""
        a, b = self.figures[ours], self.figures[baseline]
        if a.unit != b.unit:
            raise ValueError(f"ratio {label!r}: {ours!r} is in {a.unit} but {baseline!r} in {b.unit}")
        if kind not in ("speed", "agreement"):
            raise ValueError(f"ratio {label!r}: kind {kind!r}; use speed or agreement")
        if a.unit not in COST_UNITS or kind == "agreement":
            a, b = b, a
        ratio = Ratio(label, ours, baseline, b.median / a.median, min(b.samples) / max(a.samples),
                      max(b.samples) / min(a.samples), goal, group, kind)
        self.ratios[label] = ratio
        return ratio

    def note(self, key: str, value: object) -> None:
        """Record a fact about the run (a count, a setting) beside the figures."""
        self.notes[key] = value

    def as_dict(self) -> dict:
        return {"name": self.name, "started": self.started, "seconds": time.time() - self.started,
                "machine": machine(), "figures": {k: f.as_dict() for k, f in self.figures.items()},
                "ratios": {k: r.as_dict() for k, r in self.ratios.items()}, "notes": self.notes}

    def table(self) -> str:
        """The figures and ratios as a plain-text table."""
        lines = [f"{'figure':<44} {'median':>12} {'min':>12} {'max':>12} {'GB/s':>7}"]
        for figure in self.figures.values():
            scale, unit = (1e3, "ms") if figure.unit == "s" else (1, figure.unit)
            rate = f"{figure.nbytes / figure.median / 1e9:7.2f}" if figure.nbytes and figure.median else ""
            lines.append(f"{figure.label:<44} {figure.median * scale:>9.3f} {unit:<2} {min(figure.samples) * scale:>9.3f}"
                         f" {unit:<2} {max(figure.samples) * scale:>9.3f} {unit:<2} {rate}")
        if self.ratios:
            lines.append("")
            lines.append(f"{'ratio (times: theirs / ours; rates: ours / theirs)':<44} {'median':>8} {'spread':>17} "
                         f"{'goal':>8}")
            for r in self.ratios.values():
                goal = "" if r.goal is None else f">= {r.goal:g} {'met' if r.met else 'MISSED'}"
                lines.append(f"{r.label:<44} {r.value:>8.3f} {r.low:>8.3f}..{r.high:<8.3f} {goal}")
        for key, value in self.notes.items():
            lines.append(f"note: {key} = {value}")
        return "\n".join(lines)

    def finish(self, path: Path | None = None) -> Path:
        """Print the table and write the JSON (default: results/<name>.json); the path written."""
        path = path or self.out_dir / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
        print(self.table())
        print(f"\nwritten to {path}")
        return path


class Holder:
    """Pool entries a benchmark puts, given back between samples (as a harness `setup`), so every
    sample starts from the same pool."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.ids: list[int] = []

    def hold(self, info) -> None:
        """Keep an entry put by the measured operation."""
        self.ids.append(info.id)

    def drop(self) -> None:
        """Release and evict every entry held."""
        while self.ids:
            entry_id = self.ids.pop()
            self.pool.release(entry_id)
            self.pool.evict(entry_id)
