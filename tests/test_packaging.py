"""What users import: `superfluid` alone, whose `engines` and `kvpool` must be its own."""

import subprocess
import sys
import tomllib
from pathlib import Path

import superfluid

ROOT = Path(__file__).resolve().parent.parent


def test_superfluid_is_the_one_import_the_readme_needs():
    import engines.base
    import engines.models
    import kvpool
    from engines.llamacpp.engine import LlamaCppEngine

    assert superfluid.Pool is kvpool.Pool and superfluid.Budget is kvpool.Budget
    assert superfluid.StepRequest is engines.base.StepRequest and superfluid.LlamaCppEngine is LlamaCppEngine
    assert superfluid.models is engines.models and superfluid.transfer.export
    assert set(superfluid._LAZY) <= set(superfluid.__all__)
    try:
        superfluid.Nothing
    except AttributeError as exc:
        assert "Nothing" in str(exc)
    else:
        raise AssertionError("an unknown name must be an AttributeError")


def test_the_distribution_has_a_name_of_its_own_on_pypi():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == superfluid.DISTRIBUTION == "superfluid-llm"  # PyPI's "superfluid" is another project


def test_another_distributions_engines_package_is_refused_by_name(tmp_path):
    foreign = tmp_path / "engines"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("VERSION = 'someone else'\n")
    done = subprocess.run([sys.executable, "-c", "import superfluid"], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("superfluid.parts.ForeignPart: the `engines` package") and str(foreign) in last
    assert "is not superfluid's" in last


def test_serving_installs_what_the_engines_import_when_they_run():
    # scripts/setup installs only the runtimes' extras for serving: MLX reads a GGUF's K-quant
    # weights through the gguf package, so the mlx extra must bring it (not only the test extra)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("gguf") for requirement in extras["mlx"])
    assert "import gguf" in (ROOT / "engines" / "mlx" / "gguf.py").read_text()
