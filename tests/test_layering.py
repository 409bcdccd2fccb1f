"""superfluid -> engines -> kvpool: imports point one way only; and inside superfluid, the command
line -> the HTTP face -> the host."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"kvpool": {"engines", "superfluid"}, "engines": {"superfluid"}}


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources found under {package}/"
    offenders = [f"{path.relative_to(ROOT)} imports {name}" for path in files
                 for name in _imports(path) if name in FORBIDDEN[package]]
    assert not offenders, offenders


# Inside superfluid the folders are its architecture: the host (the engine's thread, sessions, the
# log) knows nothing of HTTP or the command line, and the HTTP face nothing of the command line.
# The top-level package is what `import superfluid` loads: the host's surface, without a web server.
SUPERFLUID_LAYERS = {"superfluid.host": {"superfluid.http", "superfluid.cli"},
                     "superfluid.http": {"superfluid.cli"}, "superfluid.cli": set(),
                     "superfluid": {"superfluid.http", "superfluid.cli"}}


def _module_of(path):
    """`superfluid/http/app.py` -> ("superfluid.http.app", is_package=False)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def _absolute_imports(module, package, source):
    """Every module `source` (module `module`, a package's __init__ when `package`) imports, relative
    imports resolved against its package, with each name of `from x import name` (it may be a module)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target
            yield from (f"{target}.{alias.name}" for alias in node.names)


def _layer_of(path):
    module, _ = _module_of(path)
    return next((layer for layer in sorted(SUPERFLUID_LAYERS, key=len, reverse=True)
                 if module == layer or module.startswith(layer + ".")), None)


def _within(name, package):
    return name == package or name.startswith(package + ".")


def test_superfluid_folders_import_one_way():
    files = sorted((ROOT / "superfluid").rglob("*.py"))
    layers = {_layer_of(path) for path in files}
    assert {"superfluid.host", "superfluid.http", "superfluid.cli"} <= layers, layers
    offenders = []
    for path in files:
        layer = _layer_of(path)
        top_level = layer == "superfluid" and path.name == "__init__.py" and path.parent == ROOT / "superfluid"
        if layer == "superfluid" and not top_level:
            continue  # superfluid/__main__.py is the command's other door
        for name in _absolute_imports(*_module_of(path), path.read_text()):
            bad = [package for package in SUPERFLUID_LAYERS[layer] if _within(name, package)]
            if bad:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders


def test_the_layering_check_resolves_relative_imports():
    names = set(_absolute_imports("superfluid.host.kv", False, "from ..http import app\nfrom . import lane\n"))
    assert {"superfluid.http.app", "superfluid.host.lane"} <= names
    names = set(_absolute_imports("superfluid.host", True, "from .scheduler import Scheduler\n"))
    assert "superfluid.host.scheduler" in names


# What makes a pool entry (reserving, committing, verifying, sharing, evicting) is the host's
# half of the boundary (superfluid.host.transfer): engines are handed memory, never the pool.
POOL_WRITING = {"Pool", "Writer", "reserve", "reserve_blob", "put", "put_blob", "commit", "verify", "share",
                "release", "evict", "pin"}


def test_engines_never_reach_into_the_pool():
    offenders = []
    for path in sorted((ROOT / "engines").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvpool"):
                offenders += [f"{path.relative_to(ROOT)} imports {a.name}" for a in node.names if a.name in POOL_WRITING]
            elif isinstance(node, ast.Attribute) and node.attr in POOL_WRITING and node.attr[0].islower():
                if isinstance(node.value, ast.Name) and node.value.id in ("pool", "view", "writer"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {node.value.id}.{node.attr}")
    assert not offenders, offenders
