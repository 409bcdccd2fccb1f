"""The `superfluid` command: `serve`, `runtimes`, `runtime options|versions|install`, `compat`,
`pool ls | gc | rm | disk ls | disk gc`, `log check | repair` and `demo`. Exit codes: 0 normal, 1 runtime failure, 2 usage error, 3 the
model failed to load, 4 the runtime cannot run here.

MLX on a Linux CPU needs OpenBLAS loaded before MLX is (engines/mlx/blas.py). The adapter does
that itself when it is first; when something imported MLX before this command ran (a
sitecustomize, an embedding script), the command re-executes itself once with LD_PRELOAD set.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import sys

from engines import registry
from engines.mlx import blas
from kvpool import __main__ as pool_cli
from superfluid.cli import log as log_commands
from superfluid.cli import runtimes as runtime_commands
from superfluid.cli import serve


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `superfluid` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _reexec_with_openblas(argv)
    parser = argparse.ArgumentParser(prog="superfluid", description="local LLMs in-process, around a shared KV pool")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="an OpenAI-compatible server on loopback (default model: SmolLM2)")
    serve.add_arguments(serve_parser)
    runtimes = commands.add_parser("runtimes", help="the runtimes superfluid hosts and whether they work here")
    runtimes.add_argument("--json", action="store_true", help="one JSON document instead of text")
    runtime_parser = commands.add_parser("runtime", help="one runtime: options | versions | install")
    runtime_commands.add_arguments(runtime_parser)
    compat = commands.add_parser("compat", help="what this release was built and tested against")
    compat.add_argument("--json", action="store_true")
    commands.add_parser("pool", help="this user's pools and disk tiers: ls | gc | rm NAME | disk ls | disk gc",
                        add_help=False)
    log = commands.add_parser("log", help="a session log: check | repair [DIR]")
    log_commands.add_arguments(log)
    commands.add_parser("demo", help="a tour of the shared-memory KV pool")
    args, rest = parser.parse_known_args(argv)
    if args.command == "pool":
        return pool_cli.main(rest)
    if args.command == "serve":
        return serve.run(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "runtimes":
        return _runtimes(args.json)
    if args.command == "runtime":
        return runtime_commands.run(args)
    if args.command == "compat":
        return runtime_commands.compat(args.json)
    if args.command == "log":
        return log_commands.run(args)
    return pool_cli.main(["demo"])


def _version() -> str:
    """superfluid's version and the runtime libraries installed beside it."""
    from superfluid import DISTRIBUTION, __version__ as source_version

    try:  # the installed record, as `compat` reports it
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = source_version  # running from a source tree that was never installed
    libraries = [f"{registry.get(r).distribution} {registry.status(r).installed_version or 'not installed'}"
                 for r in registry.RUNTIMES]
    return f"superfluid {version} ({', '.join(libraries)})"


def _reexec_with_openblas(argv: list[str]) -> None:
    environment = blas.preload_environment()
    if environment is not None:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "superfluid", *argv], environment)


def _runtimes(as_json: bool) -> int:
    """Each runtime: its library's version here, the versions tested, whether it imports, its options."""
    report = []
    for runtime_id in registry.RUNTIMES:
        status = registry.status(runtime_id)
        entry = {"id": runtime_id, "installed_version": status.installed_version,
                 "tested_versions": list(status.tested_versions), "tested": status.tested}
        if runtime_id == "mlx":
            found = blas.preload()  # before MLX is imported below
            entry["blas"] = {"path": found.path, "reason": found.reason}
        adapter = registry.adapter(runtime_id)
        entry["options"] = [{"name": o.name, "shape": o.shape, "default": o.default} for o in adapter.options()]
        try:
            for module in registry.get(runtime_id).modules:
                importlib.import_module(module)
            entry["imports"], entry["problem"] = True, None
        except Exception as exc:  # a library missing or broken (ImportError, OSError): report it, go on
            entry["imports"], entry["problem"] = False, f"{type(exc).__name__}: {exc}"
        report.append(entry)
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    for entry in report:
        state = "usable" if entry["imports"] else f"not usable: {entry['problem']}"
        print(f"{entry['id']}: {entry['installed_version'] or 'not installed'} (tested: "
              f"{', '.join(entry['tested_versions'])}) — {state}")
        if "blas" in entry:
            print(f"  BLAS: {entry['blas']['path'] or 'the wheel reference BLAS'} ({entry['blas']['reason']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
