"""A child process for the disk tier's crash tests: writes whole entries, then one that it kills
itself at a named point inside the write (a real SIGKILL: no handler, no cleanup runs).

    python disk_crash_writer.py FOLDER STAGE   # STAGE: data | tokens | header | synced | renamed

Entry `seed` holds tokens token_ids(seed) and cells(seed): the parent checks every byte.
"""

import os
import signal
import sys

import numpy as np

from kvpool import checksum, disk_format
from kvpool.disk import DiskTier
from kvpool.layout import ArrayTemplate, plan

WHOLE_ENTRIES = 3
TOKENS = 64


def token_ids(seed: int) -> np.ndarray:
    """The tokens of entry `seed`."""
    return ((np.arange(TOKENS) * 7 + seed * 1000) % 30000).astype(np.int32)


def cells(seed: int) -> np.ndarray:
    """The (2, TOKENS, 16) float32 cells of entry `seed`."""
    return (np.arange(2 * TOKENS * 16, dtype=np.float32).reshape(2, TOKENS, 16) + seed * 1e5)


def header(seed: int) -> disk_format.DiskHeader:
    """Entry `seed`'s disk header."""
    data = cells(seed)
    layout, _ = plan([ArrayTemplate("k", data.dtype, data.shape, 1)], TOKENS)
    return disk_format.header_for("crash-model", "", f"s{seed}", TOKENS, layout, data.nbytes,
                                  checksum.digest([data]), token_ids(seed), float(TOKENS), 0.0)


def main(folder: str, stage: str) -> None:
    def kill_at(name: str) -> None:
        if name == stage and armed:
            os.kill(os.getpid(), signal.SIGKILL)

    armed = False
    tier = DiskTier(folder, 64 << 20, headroom=0, scan=False, stage=kill_at)
    for seed in range(WHOLE_ENTRIES):
        assert tier.write(header(seed), token_ids(seed), [cells(seed)]) is not None
    armed = True
    tier.write(header(WHOLE_ENTRIES), token_ids(WHOLE_ENTRIES), [cells(WHOLE_ENTRIES)])
    sys.exit(3)  # not killed: the stage was never reached


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
