"""MLX on a Linux CPU, and MLX state through the pool against mlx-lm's own ways, in one run.

    python benchmarks/mlx_ratios.py                 # SmolLM2-135M, 512-token prompts
    python benchmarks/mlx_ratios.py --tokens 2000   # the issue's length (the shipped case takes minutes)
    python benchmarks/mlx_ratios.py --quick         # 32 tokens, what the tests run

Figures:
- prefill speed for each combination of weights (as shipped: 4-bit, or dequantized to float32)
  and BLAS (the wheel's reference BLAS, or OpenBLAS loaded before MLX), each in its own process
  (the BLAS is bound when MLX loads), as ratios to the as-shipped case;
- export and import through the pool against numpy memcpy of the same bytes, and against
  mlx-lm's `save_prompt_cache` + `load_prompt_cache` of the same cache;
- a fork plus the first decode step after it, against `LRUPromptCache` fetch plus its first step
  (its fetch deep-copies, which shares buffers until the first write copies them);
- restoring from the pool against prefilling the same tokens again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import Holder, Run  # noqa: E402
from engines import models  # noqa: E402
from superfluid import transfer  # noqa: E402

TEXT = ("Shared memory lets several processes see the same bytes. A key-value cache holds the attention state "
        "of every token a language model has read, so that the next token costs one step. ")
COMBINATIONS = (("shipped", "reference"), ("shipped", "openblas"), ("dequantized", "reference"),
                ("dequantized", "openblas"))


def prefill_child(weights: str, blas: str, tokens: int, model: Path) -> None:
    """Runs in a child: prints the seconds one prefill of `tokens` tokens takes."""
    if blas == "reference":
        import mlx.core  # noqa: F401  (loaded first: the adapter's OpenBLAS preload comes too late)
    from engines.base import StepRequest
    from engines.mlx import blas as blas_status
    from engines.mlx.engine import MlxEngine

    engine = MlxEngine(model, dequantize="on" if weights == "dequantized" else "off")
    assert (blas_status.preload().path is not None) == (blas == "openblas"), blas_status.preload()
    prompt = (engine.tokenize(TEXT) * (tokens // 20 + 2))[:tokens]
    engine.step([StepRequest(engine.new_sequence(), prompt[:16])])  # warm up
    start = time.perf_counter()
    engine.step([StepRequest(engine.new_sequence(), prompt)])
    print(json.dumps({"seconds": time.perf_counter() - start}))


def bench_prefill(run: Run, model: Path, tokens: int, repeat: int) -> None:
    for weights, blas in COMBINATIONS:
        samples = []
        for _ in range(repeat):
            done = subprocess.run([sys.executable, __file__, "--prefill-child", weights, blas, str(tokens),
                                   str(model)], capture_output=True, text=True, check=True)
            samples.append(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])
        run.record(f"prefill {tokens}, {weights} weights, {blas} BLAS", samples)
    shipped = f"prefill {tokens}, shipped weights, reference BLAS"
    for weights, blas in COMBINATIONS[1:]:
        label = f"prefill {tokens}, {weights} weights, {blas} BLAS"
        run.ratio(f"prefill speed: {weights} + {blas} / as shipped", ours=label, baseline=shipped,
                  goal=6 if (weights, blas) == ("dequantized", "openblas") else None)


def bench_state(run: Run, model: Path, tokens: int, repeat: int) -> None:
    from engines.mlx import blas

    blas.preload()  # before MLX loads in this process, as the adapter would
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache, save_prompt_cache

    from engines.base import StepRequest
    from engines.mlx.engine import MlxEngine
    from kvpool import Budget, Pool

    engine = MlxEngine(model)
    prompt = (engine.tokenize(TEXT) * (tokens // 20 + 2))[:tokens]
    seq = engine.new_sequence()
    prefill = run.measure(f"re-prefill {tokens}", lambda: _refill(engine, seq, prompt), repeat=max(2, repeat // 3),
                          warmup=0)
    caches = engine._sequences[seq]
    nbytes = sum(int(c.keys[:, :, :tokens].nbytes + c.values[:, :, :tokens].nbytes) for c in caches)
    run.note(f"live KV bytes at {tokens} tokens", nbytes)
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    run.measure(f"memcpy {tokens}", lambda: np.copyto(target, source), repeat=repeat, nbytes=nbytes)

    size = max(64 << 20, 4 * nbytes)
    pool = Pool.create(f"bench-mlx-{os.getpid()}", size, budget=Budget(size, None, "benchmark"))
    try:
        held = Holder(pool)
        run.measure(f"export {tokens}", lambda: held.hold(transfer.export(engine, pool, seq, prompt)), repeat=repeat,
                    setup=held.drop, nbytes=nbytes)
        held.drop()
        entry = transfer.export(engine, pool, seq, prompt)
        other = engine.new_sequence()

        def restore():
            with pool.get(entry.id, verify=False) as view:  # verified while copying
                transfer.import_(engine, other, view)

        run.measure(f"import {tokens}", restore, repeat=repeat, nbytes=nbytes)
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "cache.safetensors")
            run.measure(f"save_prompt_cache {tokens}", lambda: save_prompt_cache(path, caches), repeat=repeat)
            run.measure(f"load_prompt_cache {tokens}", lambda: mx.eval(load_prompt_cache(path)), repeat=repeat)

        token = prompt[-1]
        children = []

        def fork_and_step():
            child = engine.fork(seq)
            children.append(child)
            engine.step([StepRequest(child, [token])])

        def free_children():
            while children:
                engine.free_sequence(children.pop())

        run.measure(f"fork + first step {tokens}", fork_and_step, repeat=repeat, setup=free_children)
        free_children()
        copied = engine.stats().bytes_copied
        fork_and_step()
        run.note(f"fork + first step: bytes copied / live KV bytes at {tokens}",
                 round((engine.stats().bytes_copied - copied) / nbytes, 3))
        free_children()
        lru = LRUPromptCache(max_size=4)
        lru.insert_cache("smollm2", prompt, caches)  # keyed by a model name

        def fetch_and_step():
            fetched, _ = lru.fetch_nearest_cache("smollm2", prompt)
            mx.eval(engine._model(mx.array([[token]]), cache=fetched))

        run.measure(f"LRUPromptCache fetch + first step {tokens}", fetch_and_step, repeat=repeat)
    finally:
        pool.close()
        pool.unlink()
        engine.close()
    for op in ("export", "import"):
        run.ratio(f"{op} / memcpy at {tokens}", ours=f"{op} {tokens}", baseline=f"memcpy {tokens}", goal=0.5)
    run.combine(f"ours {tokens}", f"export {tokens}", f"import {tokens}")
    run.combine(f"save+load_prompt_cache {tokens}", f"save_prompt_cache {tokens}", f"load_prompt_cache {tokens}")
    run.ratio(f"save+load_prompt_cache / ours at {tokens}", ours=f"ours {tokens}",
              baseline=f"save+load_prompt_cache {tokens}", goal=2)
    run.ratio(f"LRUPromptCache fetch+step / fork+step at {tokens}", ours=f"fork + first step {tokens}",
              baseline=f"LRUPromptCache fetch + first step {tokens}", goal=1)
    run.ratio(f"re-prefill / restore at {tokens}", ours=f"import {tokens}", baseline=prefill.label)


def _refill(engine, seq, prompt) -> None:
    from engines.base import StepRequest

    engine.truncate(seq, 0)
    engine.step([StepRequest(seq, prompt)])


def main(argv: list[str] | None = None) -> Path | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--prefill-child"]:
        prefill_child(argv[1], argv[2], int(argv[3]), Path(argv[4]))
        return None
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 tokens (for tests)")
    parser.add_argument("--tokens", type=int, default=512, help="prompt length (default 512)")
    parser.add_argument("--model", type=Path, help="a llama GGUF or mlx-lm directory (default: SmolLM2)")
    parser.add_argument("--out", type=Path, help="where to write the JSON (default: benchmarks/results/mlx.json)")
    parser.add_argument("--prefill-repeat", type=int, default=1,
                        help="prefill samples per combination (each a process; the shipped case is slow)")
    parser.add_argument("--skip-prefill", action="store_true",
                        help="leave out the prefill combinations (minutes each at 2,000 tokens)")
    args = parser.parse_args(argv)
    tokens = 32 if args.quick else args.tokens
    model = args.model or models.default_model(progress=print)
    run = Run("mlx-quick" if args.quick else "mlx")
    run.note("model", Path(model).name)
    if not args.skip_prefill:
        bench_prefill(run, model, tokens, repeat=args.prefill_repeat)
    bench_state(run, model, tokens, repeat=3 if args.quick else 9)
    return run.finish(args.out)


if __name__ == "__main__":
    main()
