"""Choosing a token from a decode step's logits: our sampler against llama.cpp's own sampler chain.

On each model's real logits (one decode step of a short prompt), side by side in one run, the
time per token from logits to token under the same settings:

- ours: the logits copied out of llama.cpp into numpy (as the engine hands them to the Host),
  then `superfluid.host.sampling.sample`;
- llama.cpp's: `llama_sampler_sample` on a chain of the same filters (top-k, top-p, min-p,
  temperature, then a draw), which reads the logits inside the context;
- and a decode step of one token on the same model, for scale: sampling is paid once per token
  beside it.

    .venv/bin/python benchmarks/sampling.py [--quick]   # SmolLM2 and Gemma 3 270M
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import Run  # noqa: E402
from benchmarks.texts import text_of  # noqa: E402
from superfluid.host.sampling import Sampling, sample  # noqa: E402

GROUP = "sampling a token: ours against llama.cpp's sampler chain"
# (name, our settings): greedy; temperature alone (OpenAI's default request); nucleus; and
# llama.cpp's own defaults (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8)
SETTINGS = (("greedy", Sampling()),
            ("temperature 0.8", Sampling(temperature=0.8, seed=1)),
            ("top-p 0.95, temperature 0.8", Sampling(temperature=0.8, top_p=0.95, seed=1)),
            ("llama.cpp's defaults", Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1)))


def their_chain(llama_cpp, settings: Sampling):
    """llama.cpp's sampler chain doing what `settings` ask, in the same order."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if settings.greedy:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        return chain
    if settings.top_k:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(settings.top_k))
    if settings.top_p < 1.0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(settings.top_p, 1))
    if settings.min_p > 0.0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_min_p(settings.min_p, 1))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(settings.temperature))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(settings.seed))
    return chain


def per_call(action: Callable[[], object], calls: int) -> float:
    """Seconds per call of `action`, over `calls` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        action()
    return (time.perf_counter() - start) / calls


def bench_model(run: Run, label: str, model: Path, calls: int, repeat: int, tick: Callable[[str], None]) -> None:
    """Every figure above for one model."""
    import llama_cpp

    llm = llama_cpp.Llama(str(model), n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False)
    try:
        prompt = llm.tokenize(text_of(32).encode())
        llm.eval(prompt)
        vocab = llama_cpp.llama_n_vocab(llama_cpp.llama_model_get_vocab(llm.model))
        row = lambda: llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # noqa: E731
        ours_copy = lambda: np.ctypeslib.as_array(row(), shape=(vocab,)).copy()  # noqa: E731
        step_token = prompt[-1]

        def decode_step() -> None:
            llm.n_tokens -= 1  # the last prompt token again, at its own position: one decode step
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), 0, llm.n_tokens, -1)
            llm.eval([step_token])

        step = [per_call(decode_step, max(1, calls // 10)) for _ in range(repeat)]
        run.record(f"{label}: a decode step of one token", step)
        for name, settings in SETTINGS:
            chain = their_chain(llama_cpp, settings)
            try:
                ours, theirs = [], []
                for r in range(repeat):
                    positions = iter(range(r * calls, (r + 1) * calls))
                    ours.append(per_call(lambda: sample(ours_copy(), settings, next(positions)), calls))
                    theirs.append(per_call(lambda: llama_cpp.llama_sampler_sample(chain, llm.ctx, -1), calls))
            finally:
                llama_cpp.llama_sampler_free(chain)
            run.record(f"{label}: ours, {name}", ours)
            run.record(f"{label}: llama.cpp's chain, {name}", theirs)
            run.ratio(f"{label} ({vocab:,} ids), {name}: llama.cpp's chain / ours", ours=f"{label}: ours, {name}",
                      baseline=f"{label}: llama.cpp's chain, {name}", group=GROUP)
            run.ratio(f"{label}, {name}: a decode step / our sampling", ours=f"{label}: ours, {name}",
                      baseline=f"{label}: a decode step of one token", group=GROUP)
            tick(f"{label}: sampling, {name}")
    finally:
        llm.close()


def bench(run: Run, models: dict[str, Path], calls: int, repeat: int, tick: Callable[[str], None]) -> None:
    """Every figure above for each of `models` (label -> GGUF file)."""
    for label, model in models.items():
        bench_model(run, label, model, calls, repeat, tick)


def main(argv: list[str] | None = None) -> int:
    """The command line: --quick for fewer calls."""
    from engines import models

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls")
    args = parser.parse_args(argv)
    chosen = {"SmolLM2": models.default_model(progress=print), "Gemma 3 270M": models.gemma3_model(progress=print)}
    run = Run("bench-sampling")
    bench(run, chosen, calls=20 if args.quick else 200, repeat=1 if args.quick else 3,
          tick=lambda step: print(step, flush=True))
    print(run.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
