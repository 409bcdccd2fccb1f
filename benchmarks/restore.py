"""Restoring and sharing KV state through the pool, against memcpy and the engines' own caches.

For one engine (llama.cpp or MLX, each with the settings a Host gives it, 2 threads) and each
context length, measured side by side in one run:

- restore (import from a pool entry, its checksum verified on the way) and share (a reference
  count on the entry) against numpy memcpy of the same bytes;
- llama.cpp: our export + restore against `Llama.save_state()` + `load_state()` (what
  llama-cpp-python's `LlamaRAMCache` does on an insert and on a hit), and our restore against
  `load_state()` alone;
- MLX: our restore plus the first decode step against `LRUPromptCache.fetch_nearest_cache()` plus
  its first step (mlx-lm's server cache; its fetch copies, lazily, so the step is where it pays);
- restore against prefilling the same tokens again;
- memory: the bytes the pool stores per cached token against the price the pool computed from
  the model's shape and cache types (`kvpool.pricing.state_bytes`); the two must agree.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.harness import Holder, Run
from engines import registry
from engines.base import StepRequest
from kvpool import Budget, Pool, pricing
from superfluid import transfer

TEXT = ("Shared memory lets several processes see the same bytes. A key-value cache holds the attention state "
        "of every token a language model has read, so that the next token costs one step. ")
ENGINE_OPTIONS = {"llamacpp": {"threads": 2, "threads_batch": 2}, "mlx": {}}
NAMES = {"llamacpp": "llama.cpp", "mlx": "MLX"}
# The price and the stored bytes may differ by the engine's own framing of its blob (llama.cpp
# writes a few bytes per layer and per cell beside the KV rows); more than this is a pricing bug.
PRICE_TOLERANCE = 0.02
MEMORY = "memory: pool bytes per cached token against the computed price"


def prompt_of(engine, tokens: int) -> list[int]:
    """`tokens` tokens of plain text."""
    return (engine.tokenize(TEXT) * (tokens // 20 + 2))[:tokens]


def bench_engine(run: Run, runtime: str, model: Path, lengths: list[int], repeat: int,
                 tick: Callable[[str], None], label: str | None = None) -> None:
    """Every figure above for `runtime` at each of `lengths` tokens (figures named by `label`,
    default the runtime's name)."""
    name = label or NAMES[runtime]  # figures are named by it: a second model needs its own
    n_ctx = max(lengths) * 2 + 512
    options = dict(ENGINE_OPTIONS[runtime], **({"n_ctx": n_ctx} if runtime == "llamacpp" else {}))
    engine = registry.adapter(runtime)(model, **options)
    try:
        warmup = engine.new_sequence()  # a first forward's one-time costs stay out of the figures
        engine.step([StepRequest(warmup, prompt_of(engine, 16), "last")])
        engine.free_sequence(warmup)
        size = max(256 << 20, 6 * pricing.state_bytes(engine.describe().model_kv, max(lengths)))
        pool = Pool.create(f"bench-{runtime}-{os.getpid()}", size, budget=Budget(size, None, "benchmark"))
        try:
            own = _OwnCache(runtime, model, n_ctx)
            try:
                for n in lengths:
                    _bench_length(run, name, engine, pool, own, n, repeat)
                    tick(f"{name} restore at {n}")
            finally:
                own.close()
        finally:
            pool.close()
            pool.unlink()
    finally:
        engine.close()


def _bench_length(run: Run, name: str, engine, pool: Pool, own: "_OwnCache", n: int, repeat: int) -> None:
    group = f"restore and share through the pool ({name})"
    prompt = prompt_of(engine, n)
    seq = engine.new_sequence()
    refill = run.measure(f"{name} prefill {n}", lambda: _refill(engine, seq, prompt), repeat=1, warmup=0)
    entry = transfer.export(engine, pool, seq, prompt)
    nbytes = entry.live_bytes

    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    memcpy = run.measure(f"{name} memcpy {n}", lambda: np.copyto(target, source), repeat=repeat, nbytes=nbytes)
    del source, target

    held = Holder(pool)
    export = run.measure(f"{name} export {n}", lambda: held.hold(transfer.export(engine, pool, seq, prompt)),
                         repeat=repeat, setup=held.drop, nbytes=nbytes)
    held.drop()
    restored: list[int] = []

    def free_restored():
        while restored:
            engine.free_sequence(restored.pop())

    def restore():
        other = engine.new_sequence()
        restored.append(other)
        with pool.get(entry.id, verify=False) as view:  # as the Host does: verified by the import
            transfer.import_(engine, other, view)

    restore_figure = run.measure(f"{name} restore {n}", restore, repeat=repeat, setup=free_restored, nbytes=nbytes)
    free_restored()
    share = run.measure(f"{name} share {n}", lambda: pool.release(pool.share(entry.id).id), repeat=repeat)
    # Each label reads as the ratio's value: memcpy's time over ours, i.e. our speed as a share of memcpy's.
    run.ratio(f"{name} restore speed / memcpy speed at {n}", ours=restore_figure.label, baseline=memcpy.label,
              group=group)
    run.ratio(f"{name} share speed / memcpy speed at {n}", ours=share.label, baseline=memcpy.label, group=group)
    run.ratio(f"{name} export speed / memcpy speed at {n}", ours=export.label, baseline=memcpy.label, group=group)
    run.ratio(f"{name} re-prefill time / restore time at {n}", ours=restore_figure.label, baseline=refill.label,
              group=group)

    token = prompt[-1]

    def restore_and_step():
        restore()
        engine.step([StepRequest(restored[-1], [token], "last")])

    ours_step = None
    if own.runtime == "mlx":  # mlx-lm's cache is compared with the step included (see _OwnCache)
        ours_step = run.measure(f"{name} restore + first step {n}", restore_and_step, repeat=repeat,
                                setup=free_restored).label
        free_restored()
    own.compare(run, name, n, prompt, engine, seq, export.label, restore_figure.label, ours_step, repeat)

    priced = pricing.state_bytes(engine.describe().model_kv, n)
    stored = pool.info(entry.id).live_bytes
    run.record(f"{name} pool bytes per cached token at {n}", [stored / n], unit="B/token")
    run.record(f"{name} priced bytes per token at {n}", [priced / n], unit="B/token")
    run.ratio(f"{name} stored / priced bytes per token at {n}", ours=f"{name} pool bytes per cached token at {n}",
              baseline=f"{name} priced bytes per token at {n}", group=MEMORY, kind="agreement")
    engine.free_sequence(seq)
    pool.release(entry.id)
    pool.evict(entry.id)


def price_disagreements(run: Run) -> list[str]:
    """The memory ratios of `run` where stored and priced bytes differ by more than the tolerance."""
    return [f"{label}: {ratio.value:.4f}" for label, ratio in run.ratios.items()
            if ratio.group == MEMORY and abs(ratio.value - 1) > PRICE_TOLERANCE]


def _refill(engine, seq: int, prompt: list[int]) -> None:
    engine.truncate(seq, 0)
    engine.step([StepRequest(seq, prompt, "last")])


class _OwnCache:
    """The engine's own library's cache, on the same model: llama-cpp-python's `Llama` with its
    state save/load (LlamaRAMCache's path), or mlx-lm's `LRUPromptCache`."""

    def __init__(self, runtime: str, model: Path, n_ctx: int) -> None:
        self.runtime = runtime
        self.llama = None
        if runtime == "llamacpp":
            from llama_cpp import Llama

            self.llama = Llama(str(model), n_ctx=n_ctx, n_threads=2, n_threads_batch=2, verbose=False)

    def compare(self, run: Run, name: str, n: int, prompt: list[int], engine, seq: int, export: str, restore: str,
                restore_step: str | None, repeat: int) -> None:
        group = f"restore: ours against the engine's own cache ({name})"
        if self.llama is not None:
            llama = self.llama
            llama.reset()
            llama.eval(prompt)
            saved = []
            save = run.measure(f"{name} Llama.save_state {n}", lambda: saved.append(llama.save_state()), repeat=repeat)
            load = run.measure(f"{name} Llama.load_state {n}", lambda: llama.load_state(saved[-1]), repeat=repeat)
            run.note(f"{name} Llama.save_state bytes at {n}", saved[-1].llama_state_size)
            saved.clear()
            run.ratio(f"{name} LlamaRAMCache hit (load_state) / our restore at {n}", ours=restore, baseline=load.label,
                      group=group)
            ours = run.combine(f"{name} export + restore {n}", export, restore)
            theirs = run.combine(f"{name} save_state + load_state {n}", save.label, load.label)
            run.ratio(f"{name} LlamaRAMCache insert + hit / our export + restore at {n}", ours=ours.label,
                      baseline=theirs.label, group=group)
            return
        import mlx.core as mx
        from mlx_lm.models.cache import LRUPromptCache

        caches = engine._sequences[seq]  # the live cache objects, as mlx-lm's server would hold them
        lru = LRUPromptCache(max_size=4)
        lru.insert_cache("smollm2", prompt, caches)
        token = prompt[-1]

        def fetch_and_step():
            fetched, _ = lru.fetch_nearest_cache("smollm2", prompt)
            mx.eval(engine._model(mx.array([[token]]), cache=fetched))

        theirs = run.measure(f"{name} LRUPromptCache fetch + first step {n}", fetch_and_step, repeat=repeat)
        run.ratio(f"{name} LRUPromptCache fetch + step / our restore + step at {n}", ours=restore_step,
                  baseline=theirs.label, group=group)

    def close(self) -> None:
        if self.llama is not None:
            self.llama.close()
