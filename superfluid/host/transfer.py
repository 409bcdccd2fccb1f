"""Moving one sequence's state between an engine and the pool: the host's half of the boundary.

An engine only describes its state (`Engine.snapshot`) and reads one back from memory it is handed
(`Engine.import_`). Everything that makes a pool entry trustworthy happens here, the same way for
every runtime: the entry is reserved at the size the snapshot names, tagged, written once and
committed with its checksum; on the way back its identity is checked against the engine's and a
blob's bytes against their checksum before the engine reads a byte of it.

Copies: an export is one copy of the state's bytes (llama.cpp serialises straight into the reserved
entry; MLX's arrays are copied into it, hashed on the way); an import is one copy out (llama.cpp
reads the verified blob in place; MLX's arrays are copied out, verified on the way).
"""

from __future__ import annotations

from collections.abc import Sequence

from engines.base import Engine
from engines.errors import IdentityMismatch
from kvpool import EntryInfo, EntryView, Pool
from kvpool.layout import BlobLayout


def export(engine: Engine, pool: Pool, seq: int, tokens: Sequence[int], *, tag: str = "",
           recompute_cost: float | None = None, namespace: str = "") -> EntryInfo | None:
    """Store `seq`'s state (covering `tokens`) as a new pool entry held once by the caller,
    tagged `tag`, found by prefix only from `namespace`; None when the pool has no room for it
    even after compaction and eviction."""
    identity = engine.describe().identity
    snapshot = engine.snapshot(seq, tokens)
    if snapshot.write_blob is None:
        return pool.put(identity, tokens, snapshot.arrays, tag=tag, recompute_cost=recompute_cost,
                        engine_values=snapshot.engine_values, namespace=namespace)
    writer = pool.reserve_blob(identity, tokens, snapshot.blob_bytes, tag=tag, recompute_cost=recompute_cost,
                               namespace=namespace)
    if writer is None:
        return None
    with writer:  # leaving without the commit aborts: nothing half-written becomes visible
        snapshot.write_blob(writer.blob)
        return writer.commit()


def import_(engine: Engine, seq: int, view: EntryView) -> int:
    """Replace `seq`'s state with the entry `view` shows: refused with IdentityMismatch (and `seq`
    untouched) when another model, cache type or setting wrote it, with DataCorrupt when a blob's
    bytes fail their checksum; otherwise the engine reads it. The positions restored."""
    identity = engine.describe().identity
    if view.info.identity != identity:
        raise IdentityMismatch(f"pool entry {view.info.id} was written by {view.info.identity}; this engine is "
                               f"{identity} (other weights, cache types or settings): it cannot read that state")
    if isinstance(view.layout, BlobLayout) and not view.verified:
        view.verify()  # the engine reads a blob in place, so its bytes are checked first
    return engine.import_(seq, view)
