"""superfluid -> engines -> kvpool: imports point one way only."""

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


# What makes a pool entry (reserving, committing, verifying, sharing, evicting) is the host's
# half of the boundary (superfluid.transfer): engines are handed memory, never the pool.
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
