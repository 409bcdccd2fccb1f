"""`superfluid serve [MODEL]`: load a model and answer OpenAI-style HTTP requests until SIGTERM.

Exit codes (documented in docs/server.md): 0 a clean stop, 1 a runtime failure, 2 a usage error
(a bad flag or value), 3 the model failed to load or does not fit in memory, 4 the runtime for
the model is not installed or cannot run here.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import resource
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from engines import models, registry
from engines.llamacpp.log import LOGGER as LLAMA_LOG
from engines.errors import ModelLoadError, OptionError, RuntimeUnavailable
from engines.options import validate
from kvpool import PoolBusy, PoolExists, ReservationError, host_memory_available
from superfluid.host.errors import LogBusy, LogCorrupt
from superfluid.host.host import DEFAULT_POOL_BYTES, Host
from superfluid.http import worker
from superfluid.http.connections import REFUSING_ROOM
from superfluid.http.keys import ApiKeys, KeysError
from superfluid.http.responses import kv_summary
from superfluid.http.server import (BACKLOG, BODY_TIMEOUT, HEADER_TIMEOUT, KEEP_ALIVE_TIMEOUT, MAX_CONNECTIONS,
                                     SEND_TIMEOUT,
                                    Server, model_name_of)

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_MODEL, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130  # Ctrl-C before serving began, as shells report SIGINT
LOG_LEVELS = ("debug", "info", "warning", "error")
# Open files the process needs besides the connections it serves: connections the kernel queued
# and the event loop accepts at once (the listen backlog), those beyond the cap being refused, and
# the model, the log, the pool and the libraries.
FILES_BESIDE_CONNECTIONS = BACKLOG + REFUSING_ROOM + 256


# What serve changes of the runtimes' own defaults (the library's Host keeps them for exactness):
# llama.cpp's cells sized from the model's cell price and the memory available, and flash
# attention on. Without it every forward multiplies over every used cell of the unified cache,
# other sessions' included: a one-line chat's prefill beside two 1,800-token prompts took 0.10 s
# instead of 0.06 on SmolLM2 here. Its price: logits differ in the last bits between batch shapes.
SERVE_DEFAULTS = {"llamacpp": {"n_ctx": "-1", "flash_attn": "true"}}


class OriginFormatter(logging.Formatter):
    """A log line headed by who said it: "llama.cpp: " for the lines llama.cpp logs (routed
    through the `llama.cpp` logger), "superfluid: " for everything else."""

    def format(self, record: logging.LogRecord) -> str:
        origin = "llama.cpp" if record.name == LLAMA_LOG.name else "superfluid"
        return f"{origin}: {super().format(record)}"


class UsageError(Exception):
    """A bad flag or value (exit 2)."""


ENVIRONMENT_PREFIX = "SUPERFLUID_"
KEYS_VARIABLE = f"{ENVIRONMENT_PREFIX}API_KEYS"  # tenants' keys as name=key pairs (there is no flag: argv is public)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def size(text: str) -> int:
    """Bytes from a count or a size with a binary unit: "536870912", "512M", "512MiB", "2G",
    "1.5GB" (K, M, G and T are powers of 1,024, as memory is sized)."""
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = cleaned[-1:] if cleaned[-1:] in ("K", "M", "G", "T") else ""
    number = cleaned[:len(cleaned) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes or a number with K, M, G or T "
                                         "(512M, 2G)") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: it must be a finite number >= 0")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag, each also read from $SUPERFLUID_<FLAG> (the flag wins); the runtimes' options
    as --<runtime>-<name> VALUE, listed from their declarations."""

    def flag(*names, **options) -> None:
        if "choices" in options:  # argparse checks choices on the command line only, not on a
            options["type"] = _one_of(options["choices"])  # default taken from the environment
        action = parser.add_argument(*names, **options)
        _from_environment(action)

    flag("model", nargs="?", help="a GGUF file or an mlx-lm directory (default: SmolLM2-135M-Instruct)")
    flag("--runtime", choices=sorted(registry.RUNTIMES), help="default: the one the model calls for")
    flag("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    flag("--port", type=int, default=8000, help="port (0: a free one, printed)")
    flag("--api-key", help="require Authorization: Bearer KEY on every route but /health")
    flag("--api-keys-file", type=Path, help="several tenants' keys, from a TOML file only its owner may read: "
         "[tenants.NAME] keys = [\"...\"]; each tenant's sessions and cached prompts are its own (docs/operating.md; "
         f"or name=key pairs in ${KEYS_VARIABLE})")
    flag("--allow-priority", type=_yes_no, nargs="?", const=True, default=False, help="honour `priority: "
         "interactive` in requests (it preempts the other clients' work; without this flag it is refused with a 400, "
         "as any client could send it)")
    flag("--pool-name", default="superfluid", help="the shared-memory KV pool's name")
    flag("--pool-bytes", type=size, help="its size, taken up front, in bytes or with a unit: 512M, 2G (default: an "
         f"eighth of the memory available once the weights are loaded, within {DEFAULT_POOL_BYTES >> 20}M and "
         f"{MAX_AUTO_POOL_BYTES >> 30}G)")
    flag("--export-budget", type=size, help="bytes of KV the pool may hold (default: computed from the pool's size "
         "and the memory available)")
    flag("--disk-tier", type=_yes_no, nargs="?", const=True, default=True, help="keep parked KV on disk too, "
         "so it outlives the pool's budget, a restart and a reboot (default: yes; --disk-tier no turns it off)")
    flag("--disk-budget", type=size, help="bytes the disk tier may hold, a hard limit (default: a tenth of its file "
         "system, at most half of the space free on it)")
    flag("--disk-dir", type=Path, help="the disk tier's folder (default: disk/<pool name> under $XDG_CACHE_HOME/"
         "superfluid; one folder per pool)")
    flag("--log-dir", type=Path, help="the session log's directory (default: sessions/<pool name> under "
         "$XDG_CACHE_HOME/superfluid)")
    flag("--log-level", default="info", choices=LOG_LEVELS, help="what goes to stderr: info logs a line per "
         "request (default: info)")
    flag("--model-name", help="the id /v1/models shows (default: the file's name)")
    flag("--worker-name", help="this server's name among workers behind a router: it heads the ids of the sessions "
         "it creates, so a proxy can route each session to its worker, and goes out on every response as "
         "X-Superfluid-Worker (docs/scaling.md)")
    flag("--max-connections", type=int, default=MAX_CONNECTIONS, help="open connections; beyond them a request is "
         f"answered 503 with Retry-After and its connection closed (default: {MAX_CONNECTIONS})")
    flag("--timeout-keep-alive", type=float, default=KEEP_ALIVE_TIMEOUT, help="seconds an idle kept-alive "
         f"connection stays open (default: {KEEP_ALIVE_TIMEOUT:g})")
    flag("--header-timeout", type=float, default=HEADER_TIMEOUT, help="seconds a connection has to send a whole "
         f"request head (default: {HEADER_TIMEOUT:g})")
    flag("--body-timeout", type=float, default=BODY_TIMEOUT, help="seconds a request body has to arrive once its "
         f"head did; a 408 after that (default: {BODY_TIMEOUT:g})")
    flag("--send-timeout", type=float, default=SEND_TIMEOUT, help="seconds a response may wait for its client to "
         "read what was sent; then its stream ends, its lane is freed and its connection is cut (default: "
         f"{SEND_TIMEOUT:g})")
    flag("--max-sessions", type=int, default=1_000_000, help="sessions kept; creating one more is answered 429 "
         "(default: 1000000)")
    flag("--max-messages", type=int, default=100_000, help="messages in one request; more is answered 400 (default: "
         "100000)")
    flag("--session-expiry-seconds", type=float, help="delete a session idle this long (never a pinned one; idle "
         "since its last change or this start; default: never, as sessions are promised to survive)")
    flag("--max-waiting", type=int, default=64, help="generations that may wait for the engine at once; beyond them "
         "a request is answered 503 with Retry-After (default: 64)")
    flag("--max-wait-seconds", type=float, default=300.0, help="a request that waited this long without starting is "
         "answered 503 (default: 300)")
    flag("--idle-park-seconds", type=float, default=5.0, help="an idle session's KV leaves the engine for the pool "
         "after this long (default: 5)")
    flag("--on-context-full", choices=("stop", "error"), default="stop", help="a reply that reaches the context: stop "
         "(finish_reason length; the default) or error (a context_length_exceeded error, as an SSE error event in a "
         "stream)")
    flag("--decode-reserve", type=int, default=64, help="KV cells a generation must find free beyond its prompt to "
         "be admitted (default: 64)")
    flag("--first-token-target", type=float, default=1.0, help="seconds a step may last at most: what a request "
         "arriving during it waits before its prompt goes first; steps carry as many prompt tokens as the measured "
         "step costs fit (default: 1)")
    flag("--decode-step-target", type=float, default=0.5, help="seconds a step may last at most while a reply is "
         "being streamed: the longest wait between its tokens while prompts are fed; a reply sent whole (no "
         "`stream`) waits for its end only, so steps beside it are bounded by --first-token-target (default: 0.5)")
    flag("--arrival-wait", type=float, default=None, help="seconds a short request that goes before the prompts "
         "being fed may wait for the step in flight: a step with more left is stopped part-way for it, throwing away "
         "what it did (sooner first tokens beside long prompts, at the cost of their prefill; llama.cpp on plain KV "
         "only). Default: none; only a step or piece in its first quarter is stopped, and such a request otherwise "
         "waits for the piece in flight (about a quarter of --first-token-target)")
    flag("--stream-interval", type=float, default=0.02, help="seconds between the writes of a streamed reply: its "
         "first text and its end go at once, the tokens between together at most this often (each write costs the "
         "step in flight a little; 0: every token as it comes; default: 0.02)")
    for runtime in registry.RUNTIMES:
        group = parser.add_argument_group(f"{runtime} options", f"for models on the {runtime} runtime")
        for spec in registry.adapter(runtime).options():
            default = SERVE_DEFAULTS.get(runtime, {}).get(spec.name, spec.default)
            shown = f"one of {', '.join(spec.choices)}; " if spec.choices else ""
            action = group.add_argument(f"--{runtime}-{spec.name.replace('_', '-')}", dest=f"{runtime}__{spec.name}",
                                        metavar=spec.shape.upper(),
                                        help=f"{spec.help} ({shown}default: {default})")
            _from_environment(action)


def _yes_no(value: str) -> bool:
    """An argparse type for a switch that may also come from the environment: true or false."""
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r}: give true or false")


def _one_of(choices) -> Callable[[str], str]:
    """An argparse type that accepts only `choices` (whether the value came from the command line
    or from the environment)."""
    def check(value: str) -> str:
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(map(str, choices))}")
        return value
    return check


def _from_environment(action: argparse.Action) -> None:
    """Take the flag's default from $SUPERFLUID_<NAME> (parsed as the flag would be) and say so."""
    variable = ENVIRONMENT_PREFIX + action.dest.replace("__", "_").upper()
    if variable in os.environ:
        action.default = os.environ[variable]  # argparse converts a string default with the flag's type
    action.help = f"{action.help} [${variable}]"


def runtime_options(runtime: str, args: argparse.Namespace) -> dict:
    """The --<runtime>-<name> values given (over serve's defaults), checked against the runtime's
    declared options; a value for another runtime's option is a usage error."""
    options = dict(SERVE_DEFAULTS.get(runtime, {}))
    for key, value in vars(args).items():
        if "__" not in key or value is None:
            continue
        owner, name = key.split("__", 1)
        if owner != runtime:
            if os.environ.get(f"{ENVIRONMENT_PREFIX}{owner}_{name}".upper()) == value:
                continue  # set in the environment for models on the other runtime: not this one's
            raise UsageError(f"--{owner}-{name.replace('_', '-')} is an option of the {owner} runtime; this model runs "
                             f"on {runtime}")
        options[name] = value
    try:
        return validate(runtime, registry.adapter(runtime).options(), options)
    except OptionError as exc:
        raise UsageError(str(exc)) from None


# serve sizes its pool from the memory it finds when no --pool-bytes is given. The library's
# default (512 MiB, about 23,000 tokens of SmolLM2-135M) is too small for a server: 24 returning
# conversations of ~750-token documents were prefilled again every round, where a 2 GiB pool kept
# them all (19,737 cached tokens, as llama-server's 8 GiB prompt cache did). An eighth of what is
# available leaves the rest to the weights, the engine's cells and the application; 4 GiB at most,
# since the pool is reserved up front (llama-server's --cache-ram, 8 GiB by default, is a limit).
AUTO_POOL_FRACTION = 8
MAX_AUTO_POOL_BYTES = 4 << 30


def pool_size(model: Path, asked: int | None) -> tuple[int, str]:
    """The pool's size and why: `asked` (--pool-bytes), else an eighth of the memory available
    beside the weights, within DEFAULT_POOL_BYTES and MAX_AUTO_POOL_BYTES."""
    if asked is not None:
        return asked, "set by --pool-bytes"
    left = max(0, host_memory_available() - weights_bytes(model))
    chosen = min(MAX_AUTO_POOL_BYTES, max(DEFAULT_POOL_BYTES, left // AUTO_POOL_FRACTION >> 20 << 20))  # whole MiB
    reason = (f"an eighth of the {left / 2**30:.1f} GiB available beside the weights, within "
              f"{DEFAULT_POOL_BYTES >> 20} MiB and {MAX_AUTO_POOL_BYTES >> 30} GiB")
    shm = shared_memory_free()
    if shm is not None and chosen > max(DEFAULT_POOL_BYTES, shm // 2):  # a container's small /dev/shm
        chosen = max(DEFAULT_POOL_BYTES, shm // 2 >> 20 << 20)
        reason = f"half of the {shm / 2**30:.1f} GiB free in /dev/shm"
    return chosen, reason


def shared_memory_free() -> int | None:
    """Bytes free in /dev/shm, where the pool's segment lives (None where it cannot be read)."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def weights_bytes(model: Path) -> int:
    """The bytes of the model's file, or of its directory's files."""
    return model.stat().st_size if model.is_file() else sum(p.stat().st_size for p in model.rglob("*") if p.is_file())


def check_memory(model: Path, pool_bytes: int) -> None:
    """ModelLoadError (exit 3) with the figures when the weights and the pool cannot fit."""
    weights = weights_bytes(model)
    available = host_memory_available()
    if weights + pool_bytes > available:
        raise ModelLoadError(f"the weights ({weights / 2**30:.2f} GiB) and the KV pool ({pool_bytes / 2**30:.2f} GiB) "
                             f"need more than the {available / 2**30:.2f} GiB of memory available; pass a smaller "
                             "--pool-bytes or free memory")


def run(args: argparse.Namespace, rest: list[str]) -> int:
    """Serve until SIGTERM or SIGINT; the exit code. Every expected failure is one line on stderr
    with its exit code, never a traceback; the port is taken before the model loads."""
    server = None
    try:
        logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
        logging.getLogger().handlers[0].setFormatter(OriginFormatter())
        # uvicorn's own lines (started, shutting down, waiting for connections) say nothing serve
        # does not; nor its warnings about each malformed request (a 400 it answered). Its errors show.
        logging.getLogger("uvicorn").setLevel(logging.DEBUG if args.log_level == "debug" else logging.ERROR)
        if rest:
            raise UsageError(f"unrecognized arguments: {' '.join(rest)}")
        model = Path(args.model) if args.model else models.default_model(progress=lambda m: print(m, flush=True))
        if not model.exists():
            raise ModelLoadError(f"no model at {model}: give a GGUF file or an mlx-lm directory")
        runtime = args.runtime or registry.runtime_for(model)
        if registry.status(runtime).installed_version is None:
            raise RuntimeUnavailable(f"the {runtime} runtime is not installed here: `superfluid runtime install "
                                     f"{runtime}`")
        options = runtime_options(runtime, args)
        server = _listen(args, model)
        pool_bytes, pool_reason = pool_size(model, args.pool_bytes)
        check_memory(model, pool_bytes)
        server.host = Host(model, runtime=runtime, pool_name=args.pool_name, pool_bytes=pool_bytes,
                           log_dir=args.log_dir, export_budget=args.export_budget, max_waiting=args.max_waiting,
                           max_wait_seconds=args.max_wait_seconds, idle_park_seconds=args.idle_park_seconds,
                           decode_reserve=args.decode_reserve, on_context_full=args.on_context_full,
                           first_token_target=args.first_token_target, decode_step_target=args.decode_step_target,
                           arrival_wait=args.arrival_wait,
                           stream_interval=args.stream_interval,
                           max_sessions=args.max_sessions, max_messages=args.max_messages,
                           session_expiry_seconds=args.session_expiry_seconds, disk_tier=args.disk_tier,
                           disk_budget=args.disk_budget, disk_dir=args.disk_dir,
                           **{f"{runtime}_{k}": v for k, v in options.items()})
    except BaseException as exc:  # noqa: BLE001 - each failure is answered with its line and code
        if server is not None:
            server.close()
        return _failed(exc)
    return _serve(server, runtime, pool_bytes, pool_reason)


def api_keys(args: argparse.Namespace) -> ApiKeys | None:
    """The keys requests must carry, and their tenants: --api-key, --api-keys-file or
    $SUPERFLUID_API_KEYS (one of them; none: no key needed)."""
    given = [name for name, value in (("--api-key", args.api_key), ("--api-keys-file", args.api_keys_file),
                                      (f"${KEYS_VARIABLE}", os.environ.get(KEYS_VARIABLE))) if value is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} are both given; use one (a tenant `default` in a keys file takes "
                         "the place of a single key)")
    try:
        if args.api_keys_file is not None:
            return ApiKeys.from_file(args.api_keys_file)
        if KEYS_VARIABLE in os.environ:
            return ApiKeys.from_environment(os.environ[KEYS_VARIABLE], KEYS_VARIABLE)
        _check_api_key(args.api_key)
        return None if args.api_key is None else ApiKeys.single(args.api_key)
    except KeysError as exc:
        raise UsageError(str(exc)) from None


def _check_api_key(key: str | None) -> None:
    """An empty key is a usage error (it would turn authentication off in silence); a key given on
    the command line is warned of (every user of the machine sees it in `ps`)."""
    if key is None:
        return
    if not key.strip():
        raise UsageError("--api-key (or SUPERFLUID_API_KEY) is empty: that would turn authentication off; give a "
                         "key, or leave both out to serve without one")
    if os.environ.get(f"{ENVIRONMENT_PREFIX}API_KEY") != key:
        logging.getLogger(__name__).warning("--api-key on the command line is visible to every user of this machine "
                                            "(ps, /proc); set SUPERFLUID_API_KEY in the environment instead")


def _listen(args: argparse.Namespace, model: Path) -> Server:
    """The HTTP server bound to its port (before the model loads: a taken port costs no load)."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: a port is 0 to 65535 (0: any free one)")
    keys = api_keys(args)
    if args.worker_name is not None:
        try:
            worker.check_name(args.worker_name)
        except ValueError as exc:
            raise UsageError(f"--worker-name: {exc}") from None
    for name, value in (("--max-connections", args.max_connections), ("--timeout-keep-alive", args.timeout_keep_alive),
                        ("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout),
                        ("--send-timeout", args.send_timeout)):
        if not value > 0:
            raise UsageError(f"{name} {value}: it must be above 0")
    allowed = open_file_limit(args.max_connections)
    if allowed < args.max_connections:
        logging.getLogger(__name__).warning("--max-connections %d: this process may open only %d files (ulimit -n); "
                                            "serving at most %d connections", args.max_connections, files_allowed(),
                                            allowed)
    try:
        reload = None if args.api_keys_file is None else lambda: ApiKeys.from_file(args.api_keys_file)
        return Server(None, (args.host, args.port), keys=keys, reload_keys=reload,
                      allow_priority=args.allow_priority, model_name=args.model_name or model_name_of(model),
                      max_connections=allowed,
                      header_timeout=args.header_timeout, keep_alive_timeout=args.timeout_keep_alive,
                      body_timeout=args.body_timeout, send_timeout=args.send_timeout, worker_name=args.worker_name)
    except socket.gaierror as exc:
        raise UsageError(f"--host {args.host}: not an address this machine can listen on ({exc.strerror})") from None
    except OSError as exc:
        raise PortUnavailable(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; pick another "
                              "--port (0: any free one)") from None


class PortUnavailable(Exception):
    """The address to listen on is taken or not ours (exit 1)."""


def _failed(exc: BaseException) -> int:
    """One line on stderr for a failure before serving began, and its exit code."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, (UsageError, ValueError)):  # a flag's value the host refuses (it names the setting)
        code, text = EXIT_USAGE, str(exc)
    elif isinstance(exc, (LogBusy, PoolBusy, PoolExists, ReservationError)):
        # a log directory or pool another process holds, no room for the pool in /dev/shm: each
        # is changed by a flag
        flags = "--pool-bytes" if isinstance(exc, ReservationError) else "--pool-name and --log-dir"
        code, text = EXIT_USAGE, f"{exc} (serve's flags: {flags})"
    elif isinstance(exc, LogCorrupt):  # its message names the byte and the commands that check and repair
        code, text = EXIT_RUNTIME, str(exc)
    elif isinstance(exc, ModelLoadError):
        code, text = EXIT_MODEL, f"the model failed to load: {exc}"
    elif isinstance(exc, RuntimeUnavailable):
        code, text = EXIT_UNAVAILABLE, str(exc)
    elif isinstance(exc, PortUnavailable):
        code, text = EXIT_RUNTIME, str(exc)
    else:  # not expected: the traceback is there with --log-level debug
        code, text = EXIT_RUNTIME, f"{type(exc).__name__}: {exc}"
        logging.getLogger(__name__).debug("the failure in full", exc_info=exc)
    print(f"superfluid serve: {text}", file=sys.stderr)
    return code


def _serve(server: Server, runtime: str, pool_bytes: int, pool_reason: str) -> int:
    """Answer requests until SIGTERM or SIGINT, then stop gracefully (superfluid.http.server)."""
    host = server.host

    sized = start_lines(host, runtime, pool_bytes, pool_reason)

    def serving() -> None:  # once requests are answered and SIGTERM stops it gracefully
        print(f"superfluid: serving {server.model_name} ({runtime}) on {server.url}", flush=True)
        for line in sized:
            print(f"superfluid: {line}", flush=True)

    try:
        server.run(on_serving=serving)
    finally:
        host.close()  # run() closed it on the way out; this covers a server that failed to start
    print("superfluid: stopped", flush=True)
    return EXIT_OK


# The option that sizes each runtime's KV cells (its --<runtime>-<option> flag is named at start).
CELLS_OPTION = {"llamacpp": "n_ctx", "mlx": "kv_cells"}


def start_lines(host: Host, runtime: str, pool_bytes: int, pool_reason: str) -> list[str]:
    """What serve sized and why, said once at start: the engine's cells (how many, their price,
    what decided their number and the flag that changes it), the context one session may use, and
    the pool (its size and what chose it; its export budget, in tokens, and what bounds it)."""
    descriptor = host.descriptor
    kv = kv_summary(host.stats())
    flag = f"--{runtime}-{CELLS_OPTION[runtime].replace('_', '-')}" if runtime in CELLS_OPTION else None
    cells = (f"KV cells: {kv['cells']:,} at {kv['cell_bytes']:,} bytes each "
             f"({kv['cells'] * kv['cell_bytes'] / 2**30:.2f} GiB), shared by every session")
    if descriptor.kv_cells_reason:
        cells += f": {descriptor.kv_cells_reason}"
    if flag:
        cells += f"; {flag} sets them"
    context = descriptor.context_length
    session = (f"one session holds up to {context:,} tokens: "
               + ("every cell" if context >= kv["cells"] else "the model's trained context; the other cells are for "
                  "other sessions"))
    size = host.pool.header.size
    if abs(size - pool_bytes) >= mmap.PAGESIZE:  # (rounded up to a page) the segment outlived an earlier start
        pool_reason = "the pool of that name kept from an earlier start; `superfluid pool rm` it to size it anew"
    budget = (f"pool: {size / 2**20:,.0f} MiB ({pool_reason}), up to "
              f"{kv['pool_budget_bytes'] / 2**20:,.0f} MiB of KV kept beyond the cells ({kv['pool_tokens']:,} tokens), "
              f"{host.pool.header.budget_reason}; --pool-bytes and --export-budget set it")
    disk = host.pool.disk_stats()
    if disk is None:
        return [cells, session, budget, "disk tier: off (--disk-tier no); parked KV lives only in the pool's memory"]
    tier = (f"disk tier: {disk.folder}, up to {disk.budget_bytes / 2**30:,.1f} GiB "
            f"({disk.budget_bytes // max(1, kv['cell_bytes']):,} tokens), {disk.bytes_used / 2**20:,.0f} MiB held; "
            "--disk-budget and --disk-dir set it")
    return [cells, session, budget, tier]


def open_file_limit(connections: int) -> int:
    """Raise this process's limit on open files toward what `connections` sockets need (each is
    a file; the backlog of connections not yet accepted, the model, the log and the pool take
    more); the connections that limit allows."""
    needed = connections + FILES_BESIDE_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass  # a kernel ceiling below the hard limit (macOS): keep what we have
    if soft == resource.RLIM_INFINITY:
        return connections
    return max(min(connections, soft - FILES_BESIDE_CONNECTIONS), 1)


def files_allowed() -> int:
    """This process's limit on open files (its soft limit)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
