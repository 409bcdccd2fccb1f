"""The export budget: how many bytes of KV the pool may hold beyond what engines hold live.

:func:`export_budget` is pure: the device the model resolved to, the pool's capacity, the host
memory available and the cell price in, a :class:`Budget` out, with the reason for its size.
The pool computes it once at creation, counting its own reserved bytes as available to it, so the
budget does not shrink as the pool fills. The budget is hard: the pool checks it before every
insert and counts every byte it stores (data, side records, header slots).

The disk tier's default budget and headroom (`default_disk_budget`, `default_disk_headroom`)
follow from the file system it is on.
"""

from __future__ import annotations

import os

import msgspec

GiB = 1 << 30
DEFAULT_CAP = 8 * GiB
DEFAULT_HEADROOM = 1 * GiB


class Device(msgspec.Struct, frozen=True):
    """Where a model's weights and live KV resolved to.

    `free_bytes` is what the device reports free; None for the CPU (host memory is the limit).
    """

    kind: str = "cpu"  # "cpu", "cuda", "metal", "vulkan", ...
    name: str = "cpu"
    free_bytes: int | None = None

    @property
    def is_cpu(self) -> bool:
        """True when the model runs on the host CPU and only host memory bounds the pool."""
        return self.kind == "cpu"


class Budget(msgspec.Struct, frozen=True):
    """The export budget in bytes (and cells, when a price was given), and why it is that size."""

    bytes: int
    cells: int | None
    reason: str


def describe_bytes(n: int) -> str:
    """A size as people read it: "2.50 GiB", or "512.0 MiB" below a GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def export_budget(device: Device, pool_capacity: int, host_available: int, *,
                  cell_price: int | None = None, headroom: int = DEFAULT_HEADROOM,
                  cap: int = DEFAULT_CAP) -> Budget:
    """Decide the export budget.

    - CPU: the smallest of the pool's capacity, `cap`, and host memory available beyond
      `headroom`.
    - A device with free memory: additionally bounded by that free memory beyond `headroom`.
    - A device that reports no free memory: nothing, and the reason names the headroom.

    `host_available` must already count the pool's own reserved bytes as available.
    """
    for name, value in (("pool_capacity", pool_capacity), ("host_available", host_available),
                        ("headroom", headroom), ("cap", cap)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if cell_price is not None and cell_price <= 0:
        raise ValueError(f"cell_price must be > 0, got {cell_price}")

    if not device.is_cpu and not device.free_bytes:
        return Budget(0, 0 if cell_price else None,
                      f"device {device.name} ({device.kind}) reports no free memory, and the budget keeps "
                      f"a headroom of {describe_bytes(headroom)} free: nothing granted (free device memory, or lower "
                      f"the headroom)")

    bounds = [
        (pool_capacity, f"the pool's capacity ({describe_bytes(pool_capacity)})"),
        (cap, f"the cap ({describe_bytes(cap)})"),
        (max(0, host_available - headroom),
         f"host memory available ({describe_bytes(host_available)}) less the headroom ({describe_bytes(headroom)})"),
    ]
    if not device.is_cpu:
        bounds.append((max(0, device.free_bytes - headroom),
                       f"{device.name} free memory ({describe_bytes(device.free_bytes)}) less the headroom "
                       f"({describe_bytes(headroom)})"))
    granted, why = min(bounds, key=lambda bound: bound[0])
    cells = granted // cell_price if cell_price else None
    return Budget(granted, cells, f"bounded by {why}")


def host_memory_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (the kernel's estimate of what can be used)."""
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


# The disk tier's budget (kvpool.disk): a hard byte limit on local disk, and room left on it.
BUDGET_DISK_FRACTION = 0.10  # the default budget: at most a tenth of the file system ...
BUDGET_FREE_FRACTION = 0.5  # ... and at most half of what is free on it (with what the tier holds)
HEADROOM_FRACTION = 0.05  # each write leaves this much of the file system free ...
HEADROOM_MIN, HEADROOM_MAX = 64 << 20, 1 << 30  # ... bounded to these bytes


def default_disk_budget(folder: str | os.PathLike, held: int = 0) -> int:
    """The default disk budget for a tier in `folder` holding `held` bytes: the smaller of a tenth
    of its file system and half of the space free on it plus what the tier holds already."""
    fs = os.statvfs(folder)
    total, free = fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize
    return max(0, min(int(BUDGET_DISK_FRACTION * total), int(BUDGET_FREE_FRACTION * (free + held))))


def default_disk_headroom(folder: str | os.PathLike) -> int:
    """Bytes each write leaves free on `folder`'s file system: 5% of it, within 64 MiB .. 1 GiB."""
    fs = os.statvfs(folder)
    return min(HEADROOM_MAX, max(HEADROOM_MIN, int(HEADROOM_FRACTION * fs.f_blocks * fs.f_frsize)))
