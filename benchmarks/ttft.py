"""Warm against cold time to first token, by context length, through a Host.

A conversation's first turn is a user message of about N tokens; its second turn adds a 16-token
user message. Warm: the second turn's first token, the first turn's KV still on the session's
lane. Cold: a new session given exactly the tokens of that second turn, on the same host once
everything cached is gone (the lane freed, the pool emptied), so all of them are prefilled.
Each engine runs with the settings a Host gives it by default (MLX: its default CPU settings),
on 2 threads.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import Run
from benchmarks.texts import text_of
from superfluid import Host

NAMES = {"llamacpp": "llama.cpp", "mlx": "MLX"}
GROUP = "time to first token: warm against cold, by context"


def first_token_seconds(session, **generate) -> tuple[float, int]:
    """Seconds from generate() to its first piece (the generation then runs to its end), and the
    prompt tokens it had (with whatever generate added, such as the assistant's opening)."""
    start = time.perf_counter()
    generation = session.generate(**generate)
    next(generation)
    elapsed = time.perf_counter() - start
    generation.collect()
    return elapsed, generation.prompt_tokens


def open_host(runtime: str, model: Path, context: int, scratch: str) -> Host:
    """A host on a pool of its own, sized for one conversation of `context` tokens."""
    name = f"bench-ttft-{runtime}-{os.getpid()}"
    options = {"llamacpp_threads": 2, "llamacpp_threads_batch": 2, "llamacpp_n_ctx": 2 * context + 1024} \
        if runtime == "llamacpp" else {}
    return Host(model, runtime=runtime, pool_name=name, pool_bytes=512 << 20, log_dir=Path(scratch) / name, **options)


def bench_engine(run: Run, runtime: str, model: Path, contexts: list[int], repeat: Callable[[int], int],
                 tick: Callable[[str], None], label: str | None = None) -> None:
    """Warm and cold first-token times at each context length, `repeat(context)` samples each
    (figures named by `label`, default the runtime's name)."""
    name = label or NAMES[runtime]  # figures are named by it: a second model needs its own
    with tempfile.TemporaryDirectory() as scratch:
        host = open_host(runtime, model, max(contexts), scratch)
        try:
            warmup = host.session()  # the first generation of a process pays one-time costs (MLX kernels)
            warmup.append_user(text_of(32, salt=999))
            warmup.generate(max_tokens=2, ignore_eos=True).collect()
            _forget(host, warmup.id)
            for context in contexts:
                warm, cold, prompts = [], [], []
                for i in range(repeat(context)):
                    session = host.session()
                    session.append_user(text_of(context, salt=i))
                    session.generate(max_tokens=4, ignore_eos=True).collect()
                    session.append_user(text_of(16, salt=100 + i))
                    seconds, prompt = first_token_seconds(session, max_tokens=2, ignore_eos=True)
                    warm.append(seconds)
                    tokens = session.tokens[:prompt]  # the second turn's prompt, as generate saw it
                    _forget(host, session.id)
                    lone = host.session()
                    lone.append_tokens(tokens)
                    seconds, lone_prompt = first_token_seconds(lone, max_tokens=2, ignore_eos=True)
                    if lone_prompt != prompt:  # the comparison is only fair on the same tokens
                        raise RuntimeError(f"{name}: the cold prompt has {lone_prompt} tokens, the warm {prompt}")
                    cold.append(seconds)
                    prompts.append(prompt)
                    _forget(host, lone.id)
                    tick(f"{name} first token at {context}")
                label = f"{name} first token at {context}"
                run.record(f"{label}, warm", warm)
                run.record(f"{label}, cold", cold)
                run.note(f"{name} second-turn prompt tokens at {context}", prompts)
                run.ratio(f"{name} cold / warm first token at {context}", ours=f"{label}, warm",
                          baseline=f"{label}, cold", group=GROUP)
        finally:
            host.close(remove_pool=True)


def _forget(host: Host, session_id: str) -> None:
    """Delete a session and evict everything the pool caches, so the next prompt starts cold."""
    host.delete(session_id)
    host.pool.shed(0)
