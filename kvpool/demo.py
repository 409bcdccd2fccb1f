"""A tour of the pool on fake KV arrays: store, share, look up a prefix, evict, and the statistics.

Run it with `python -m kvpool demo`. It creates its own pool, prints what happens at each step,
and unlinks the segment at the end, whatever happens in between.
"""

from __future__ import annotations

import os

import numpy as np

from kvpool import pricing
from kvpool.budget import Budget
from kvpool.layout import KVArray
from kvpool.pool import Pool

# A small model: 4 layers, 2 KV heads of width 64, f16 cache.
MODEL = pricing.uniform(layers=4, kv_heads=2, head_dim=64, cache_type="f16")
IDENTITY = "demo-model-f16"


def _kv(tokens: int, seed: int) -> list[KVArray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for layer in range(len(MODEL.layers)):
        for part in ("k", "v"):
            data = rng.standard_normal((2, tokens, 64)).astype(np.float16)  # (heads, tokens, width)
            arrays.append(KVArray(f"{layer}.{part}", data, token_axis=1))
    return arrays


def run(print_line=print) -> dict:
    """Run the tour; returns the final statistics as a dict."""
    name = f"demo-{os.getpid()}"
    price = pricing.bytes_per_token(MODEL)
    budget = Budget(6 << 20, (6 << 20) // price, "demo: 6 MiB")
    pool = Pool.create(name, 16 << 20, budget=budget)
    try:
        print_line(f"pool {name}: {pool.header.arena_size:,} arena bytes, budget {budget.bytes:,} bytes; "
                   f"a cell costs {price:,} bytes ({budget.cells:,} cells fit)")
        system = np.arange(1000, 1512)  # a 512-token shared prompt
        first = pool.put(IDENTITY, system, _kv(512, seed=1), tag="system-prompt")
        print_line(f"put    entry {first.id}: {first.tokens} tokens, {first.stored_bytes:,} bytes stored")
        copied = pool.stats().bytes_copied
        for _ in range(3):
            pool.share(first.id)
        print_line(f"share  entry {first.id} three times: refcount {pool.info(first.id).refcount}, "
                   f"bytes copied by sharing: {pool.stats().bytes_copied - copied}")
        request = np.concatenate([system, np.arange(7, 40)])
        match = pool.lookup(IDENTITY, request)
        print_line(f"lookup a {len(request)}-token request: entry {match.entry_id} covers its first {match.tokens} tokens")
        for seed in range(2, 9):
            info = pool.put(IDENTITY, np.arange(seed * 10_000, seed * 10_000 + 400), _kv(400, seed))
            stats = pool.stats()
            if info is None:
                print_line("put    refused: every entry that could be evicted is still referenced")
                break
            pool.release(info.id)
            print_line(f"put    entry {info.id} (released at once): {stats.entries} entries, "
                       f"{stats.bytes_used:,}/{stats.budget_bytes:,} bytes used, {stats.evictions} evicted")
        with pool.get(first.id) as view:
            print_line(f"get    entry {first.id}: {len(view.arrays)} arrays, checksum verified, "
                       f"layer 0 keys {view.arrays['0.k'].shape}")
        stats = pool.stats()
        print_line("stats  " + ", ".join(f"{k}={v:,}" for k, v in (
            ("entries", stats.entries), ("bytes_used", stats.bytes_used), ("bytes_copied", stats.bytes_copied),
            ("evictions", stats.evictions), ("shares", stats.shares), ("budget_bytes", stats.budget_bytes))))
        for _ in range(4):
            pool.release(first.id)
        return {f: getattr(stats, f) for f in stats.__struct_fields__}
    finally:
        pool.close()
        pool.unlink()
        print_line(f"pool {name} closed and unlinked")
