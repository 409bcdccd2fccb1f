"""`superfluid runtime ...` and `superfluid compat`: which runtimes work here, what they take, and
installing a tested version.

    superfluid runtime options <id>          the options, with value shapes, defaults and help
    superfluid runtime versions <id> [--json] the tested versions, newest first, and the one installed
    superfluid runtime install <id> [--version V] [--untested] [--dry-run]
    superfluid compat [--json]                what this release was built and tested against
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys

from engines import registry
from engines.errors import RuntimeUnavailable
from engines.llamacpp import library as llamacpp_library
from superfluid import DISTRIBUTION

# How each runtime's library is installed: extra packages beside it, and the build environment.
INSTALL_EXTRAS = {"mlx": ["mlx[cpu]==0.32.4"] if sys.platform.startswith("linux") else ["mlx==0.32.4"]}
BUILD_ENV = {"llamacpp": {"CMAKE_ARGS": llamacpp_library.BUILD_FLAGS}}  # portable: the native build uses AMX, which these VMs refuse
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`runtime options|versions|install`."""
    verbs = parser.add_subparsers(dest="verb", required=True)
    options = verbs.add_parser("options", help="the options a runtime takes")
    options.add_argument("runtime")
    options.add_argument("--json", action="store_true")
    versions = verbs.add_parser("versions", help="the versions tested, newest first, and the one installed")
    versions.add_argument("runtime")
    versions.add_argument("--json", action="store_true")
    install = verbs.add_parser("install", help="install a tested version of a runtime's library")
    install.add_argument("runtime")
    install.add_argument("--version", help="default: the newest tested")
    install.add_argument("--untested", action="store_true", help="allow a version this release did not test")
    install.add_argument("--dry-run", action="store_true", help="print the command instead of running it")


def run(args: argparse.Namespace) -> int:
    """The `runtime` command; its exit code."""
    try:
        runtime = registry.get(args.runtime)
    except RuntimeUnavailable as exc:
        print(f"superfluid runtime: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.verb == "options":
        specs = registry.adapter(runtime.id).options()
        if args.json:
            print(json.dumps([{"name": s.name, "shape": s.shape, "default": s.default, "help": s.help,
                               "choices": list(s.choices), "minimum": s.minimum, "maximum": s.maximum} for s in specs],
                             indent=2))
        else:
            for s in specs:
                shape = f"one of {', '.join(s.choices)}" if s.choices else s.shape
                print(f"--{runtime.id}-{s.name.replace('_', '-')} ({shape}, default {s.default!r}): {s.help}")
        return EXIT_OK
    status = registry.status(runtime.id)
    if args.verb == "versions":
        if args.json:
            print(json.dumps({"runtime": runtime.id, "distribution": runtime.distribution,
                              "tested": list(runtime.tested_versions), "installed": status.installed_version}))
        else:
            for version in runtime.tested_versions:
                mark = "  (installed)" if version == status.installed_version else ""
                print(f"{runtime.distribution} {version}{mark}")
            if status.installed_version and not status.tested:
                print(f"installed: {status.installed_version} (not tested by this release)")
        return EXIT_OK
    version = args.version or runtime.tested_versions[0]
    if version not in runtime.tested_versions and not args.untested:
        print(f"superfluid runtime install: {runtime.distribution} {version} was not tested by this release (tested: "
              f"{', '.join(runtime.tested_versions)}); pass --untested to install it anyway", file=sys.stderr)
        return EXIT_USAGE
    command = [sys.executable, "-m", "pip", "install", *INSTALL_EXTRAS.get(runtime.id, []),
               f"{runtime.distribution}=={version}"]
    environment = BUILD_ENV.get(runtime.id, {})
    shown = " ".join([*(f"{k}={v!r}" for k, v in environment.items()), *command])
    if args.dry_run:
        print(shown)
        return EXIT_OK
    print(f"superfluid: {shown}", flush=True)
    done = subprocess.run(command, env={**os.environ, **environment})
    return EXIT_OK if done.returncode == 0 else EXIT_FAILED


def compat(as_json: bool) -> int:
    """What this release was built and tested against, per runtime."""
    report = {"superfluid": importlib.metadata.version(DISTRIBUTION), "python": sys.version.split()[0],
              "runtimes": {r.id: {"distribution": r.distribution, "tested": list(r.tested_versions),
                                  "installed": registry.status(r.id).installed_version,
                                  "extras": INSTALL_EXTRAS.get(r.id, []), "build": BUILD_ENV.get(r.id, {})}
                           for r in registry.RUNTIMES.values()}}
    if as_json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    print(f"superfluid {report['superfluid']} on Python {report['python']}")
    for runtime_id, entry in report["runtimes"].items():
        build = " ".join(f"{k}={v}" for k, v in entry["build"].items())
        print(f"{runtime_id}: {entry['distribution']} tested {', '.join(entry['tested'])}; installed "
              f"{entry['installed'] or 'none'}" + (f"; built with {build}" if build else ""))
    return EXIT_OK
