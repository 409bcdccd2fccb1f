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
