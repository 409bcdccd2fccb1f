"""`superfluid serve [MODEL]`: load a model and answer OpenAI-style HTTP requests until SIGTERM.

Exit codes (documented in docs/server.md): 0 a clean stop, 1 a runtime failure, 2 a usage error
(a bad flag or value), 3 the model failed to load or does not fit in memory, 4 the runtime for
the model is not installed or cannot run here.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from engines import models, registry
from engines.errors import ModelLoadError, OptionError, RuntimeUnavailable
from engines.options import validate
from kvpool import host_memory_available
from superfluid.host import DEFAULT_POOL_BYTES, Host
from superfluid.server import Server, kv_summary, model_name_of

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_MODEL, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4


# What serve changes of the runtimes' own defaults (the library's Host keeps them for exactness):
# llama.cpp's cells sized from the model's cell price and the memory available, and flash
# attention on. Without it every forward multiplies over every used cell of the unified cache,
# other sessions' included: a one-line chat's prefill beside two 1,800-token prompts took 0.10 s
# instead of 0.06 on SmolLM2 here. Its price: logits differ in the last bits between batch shapes.
SERVE_DEFAULTS = {"llamacpp": {"n_ctx": "-1", "flash_attn": "true"}}


class UsageError(Exception):
    """A bad flag or value (exit 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every runtime shares; runtime options come as --<runtime>-<name> VALUE."""
    parser.add_argument("model", nargs="?", help="a GGUF file or an mlx-lm directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--runtime", choices=sorted(registry.RUNTIMES), help="default: the one the model calls for")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed)")
    parser.add_argument("--api-key", default=os.environ.get("SUPERFLUID_API_KEY"),
                        help="require Authorization: Bearer KEY on every route but /health (or $SUPERFLUID_API_KEY)")
    parser.add_argument("--pool-name", default="superfluid", help="the shared-memory KV pool's name")
    parser.add_argument("--pool-bytes", type=int, default=DEFAULT_POOL_BYTES, help="its size, taken up front")
    parser.add_argument("--export-budget", type=int, help="bytes of KV the pool may hold (default: computed from "
                        "the pool's size and the memory available)")
    parser.add_argument("--log-dir", type=Path, help="the session log's directory")
    parser.add_argument("--model-name", help="the id /v1/models shows (default: the file's name)")
    parser.add_argument("--max-waiting", type=int, default=64, help="generations that may wait for the engine at "
                        "once; beyond them a request is answered 503 with Retry-After (default: 64)")
    parser.add_argument("--max-wait-seconds", type=float, default=300.0, help="a request that waited this long "
                        "without starting is answered 503 (default: 300)")
    parser.add_argument("--idle-park-seconds", type=float, default=5.0, help="an idle session's KV leaves the "
                        "engine for the pool after this long (default: 5)")
    parser.add_argument("--on-context-full", choices=("stop", "error"), default="stop", help="a reply that reaches "
                        "the context: stop (finish_reason length; the default) or error (a context_length_exceeded "
                        "error, as an SSE error event in a stream)")
    parser.add_argument("--decode-reserve", type=int, default=64, help="KV cells a generation must find free "
                        "beyond its prompt to be admitted (default: 64)")


def runtime_options(runtime: str, rest: list[str]) -> dict:
    """`--<runtime>-<name> VALUE` pairs, checked against the runtime's declared options."""
    options, prefix = dict(SERVE_DEFAULTS.get(runtime, {})), f"--{runtime}-"
    items = list(rest)
    while items:
        flag = items.pop(0)
        other = next((r for r in registry.RUNTIMES if flag.startswith(f"--{r}-")), None)
        if other is None:
            raise UsageError(f"unrecognized argument {flag}")
        if other != runtime:
            raise UsageError(f"{flag} is an option of the {other} runtime; this model runs on {runtime}")
        if not items:
            raise UsageError(f"{flag} needs a value")
        options[flag[len(prefix):].replace("-", "_")] = items.pop(0)
    try:
        return validate(runtime, registry.adapter(runtime).options(), options)
    except OptionError as exc:
        raise UsageError(str(exc)) from None


def check_memory(model: Path, pool_bytes: int) -> None:
    """ModelLoadError (exit 3) with the figures when the weights and the pool cannot fit."""
    weights = model.stat().st_size if model.is_file() else sum(p.stat().st_size for p in model.rglob("*") if p.is_file())
    available = host_memory_available()
    if weights + pool_bytes > available:
        raise ModelLoadError(f"the weights ({weights / 2**30:.2f} GiB) and the KV pool ({pool_bytes / 2**30:.2f} GiB) "
                             f"need more than the {available / 2**30:.2f} GiB of memory available; pass a smaller "
                             "--pool-bytes or free memory")


def run(args: argparse.Namespace, rest: list[str]) -> int:
    """Serve until SIGTERM or SIGINT; the exit code."""
    try:
        model = Path(args.model) if args.model else models.default_model(progress=lambda m: print(m, flush=True))
        if not model.exists():
            raise ModelLoadError(f"no model at {model}: give a GGUF file or an mlx-lm directory")
        runtime = args.runtime or registry.runtime_for(model)
        status = registry.status(runtime)
        if status.installed_version is None:
            raise RuntimeUnavailable(f"the {runtime} runtime is not installed here: `superfluid runtime install "
                                     f"{runtime}`")
        options = runtime_options(runtime, rest)
        check_memory(model, args.pool_bytes)
        host = Host(model, runtime=runtime, pool_name=args.pool_name, pool_bytes=args.pool_bytes,
                    log_dir=args.log_dir, export_budget=args.export_budget, max_waiting=args.max_waiting,
                    max_wait_seconds=args.max_wait_seconds, idle_park_seconds=args.idle_park_seconds,
                    decode_reserve=args.decode_reserve,
                    on_context_full=args.on_context_full,
                    **{f"{runtime}_{k}": v for k, v in options.items()})
    except (UsageError, ValueError) as exc:  # a flag's value the host refuses (it names the setting)
        print(f"superfluid serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModelLoadError as exc:
        print(f"superfluid serve: the model failed to load: {exc}", file=sys.stderr)
        return EXIT_MODEL
    except RuntimeUnavailable as exc:
        print(f"superfluid serve: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        server = Server(host, (args.host, args.port), api_key=args.api_key,
                        model_name=args.model_name or model_name_of(model))
    except OSError as exc:
        host.close()
        print(f"superfluid serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    stopping = threading.Event()

    def stop(signum, frame) -> None:  # SIGTERM/SIGINT: no new requests, lanes parked, log synced
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    kv = kv_summary(host.stats())
    print(f"superfluid: serving {server.model_name} ({runtime}) on {server.url}", flush=True)
    print(f"superfluid: {kv['cells']:,} KV cells at {kv['cell_bytes']:,} bytes each; pool export budget "
          f"{kv['pool_budget_bytes'] / 2**20:,.0f} MiB: up to {kv['pool_tokens']:,} tokens kept in the pool", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        host.close()  # ends running generations (their streams finish), parks lanes, syncs the log
        server.server_close()  # joins the request threads
    print("superfluid: stopped", flush=True)
    return EXIT_OK
