"""Where superfluid keeps its files: the cache root, and each pool's disk tier folder under it.

    $SUPERFLUID_CACHE, else $XDG_CACHE_HOME/superfluid, else ~/.cache/superfluid
        models/  sessions/<pool>/  disk/<pool>/

$SUPERFLUID_DISK_TIERS moves the disk tiers alone (a faster disk, or a test's own folder).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """superfluid's cache: $SUPERFLUID_CACHE, else $XDG_CACHE_HOME/superfluid, else
    ~/.cache/superfluid (models, session logs, disk tiers and wheels all live under it)."""
    base = os.environ.get("SUPERFLUID_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                             os.path.expanduser("~/.cache"), "superfluid")
    return Path(base)


def disk_tiers_root() -> Path:
    """The folder holding one disk tier folder per pool: $SUPERFLUID_DISK_TIERS, else cache_root()/disk."""
    chosen = os.environ.get("SUPERFLUID_DISK_TIERS")
    return Path(chosen) if chosen else cache_root() / "disk"


def disk_folder(pool_name: str) -> Path:
    """The disk tier folder of pool `pool_name`."""
    return disk_tiers_root() / pool_name
