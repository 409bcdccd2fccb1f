"""Every Python code sample in the README and docs/ runs, as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = re.compile(r"```python\n(.*?)```", re.S)
SAMPLES = [(path, index, code) for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
           for index, code in enumerate(SAMPLE.findall(path.read_text()))]


def test_there_are_samples():
    assert SAMPLES


@pytest.mark.parametrize("path, index, code", [
    pytest.param(p, i, code, id=f"{p.name}-{i}",
                 marks=[pytest.mark.real_model] if "default_model()" in code else [])
    for p, i, code in SAMPLES])
def test_sample_runs(path, index, code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, f"{path.name} sample {index} failed:\n{done.stderr}"


def test_readme_starts_with_the_two_commands_and_ci_runs_the_second():
    commands = re.findall(r"```sh\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)[:2]
    assert commands[0].startswith("./scripts/setup") and commands[1].startswith("./scripts/setup")
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
