"""The pieces around the llama.cpp adapter: library names, devices, the canary, the registry."""

import sys
from types import SimpleNamespace

import pytest

from engines import registry
from engines.base import StepRequest
from engines.errors import OptionError, RuntimeUnavailable
from engines.llamacpp import canary, library
from engines.llamacpp.engine import LlamaCppEngine, resolve_device
from engines.options import OptionSpec, validate
from kvpool import export_budget

GiB = 1 << 30


def _api(prefix, handle=None):
    functions = {prefix + name: (lambda *args, name=name: name) for name in
                 ("seq_rm", "seq_cp", "seq_keep", "seq_pos_min", "seq_pos_max", "clear")}
    if handle:
        functions[handle] = lambda ctx: ("memory of", ctx)
    return SimpleNamespace(**functions)


def test_memory_names_resolve_for_both_generations():
    newest = library.resolve_memory(_api("llama_memory_", "llama_get_memory"))
    assert newest.naming == "llama_memory_*" and newest.handle("ctx") == ("memory of", "ctx")
    older = library.resolve_memory(_api("llama_kv_self_"))
    assert older.naming == "llama_kv_self_*" and older.handle("ctx") == "ctx"
    assert older.seq_cp() == "seq_cp"


def test_a_release_without_known_names_is_refused_by_version():
    with pytest.raises(RuntimeUnavailable, match="0.3.36") as caught:
        library.resolve_memory(_api("llama_kv_cache_"))
    assert "CMAKE_ARGS" in str(caught.value)


def test_the_installed_release_is_the_tested_one():
    loaded = library.load()
    assert loaded.version in library.TESTED_VERSIONS and loaded.tested and loaded.memory.naming == "llama_memory_*"


def test_devices_and_their_budgets():
    assert resolve_device(0, True).is_cpu
    assert resolve_device(99, False).is_cpu  # a CPU-only build ignores offload requests
    gpu = resolve_device(-1, True, "cuda:0", 6 * GiB)
    assert not gpu.is_cpu and gpu.free_bytes == 6 * GiB
    assert export_budget(resolve_device(0, True), 4 * GiB, 20 * GiB).bytes == 4 * GiB
    assert export_budget(gpu, 16 * GiB, 20 * GiB, headroom=GiB).bytes == 5 * GiB
    silent = export_budget(resolve_device(-1, True, "cuda:0", None), 16 * GiB, 20 * GiB, headroom=GiB)
    assert silent.bytes == 0 and "headroom" in silent.reason


def test_canary_reports_a_crashing_build(tmp_path, tiny_models):
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    model = tmp_path / "other.gguf"
    model.write_bytes(tiny_models["q8_0"].gguf.read_bytes() + b"\0")  # a model not yet checked
    with pytest.raises(RuntimeUnavailable, match="crashed \\(SIGSEGV\\).*CMAKE_ARGS"):
        canary.ensure(model, crash)
    assert not canary.passed_marker(model).exists()
    with pytest.raises(RuntimeUnavailable, match="boom"):
        canary.ensure(model, [sys.executable, "-c", "import sys; sys.exit('boom')"])


def test_canary_passes_once_and_is_remembered(tmp_path, tiny_models):
    model = tmp_path / "again.gguf"
    model.write_bytes(tiny_models["f16"].gguf.read_bytes() + b"\0\0")
    canary.ensure(model)
    assert canary.passed_marker(model).exists()
    canary.ensure(model, [sys.executable, "-c", "raise SystemExit(3)"])  # not run again
    canary.passed_marker(model).unlink()


def test_registry():
    assert registry.runtime_for("models/x.GGUF") == "llamacpp"
    assert registry.adapter("llamacpp") is LlamaCppEngine
    status = registry.status("llamacpp")
    assert status.installed_version in status.tested_versions and status.tested
    with pytest.raises(RuntimeUnavailable, match="unknown runtime 'vllm'"):
        registry.get("vllm")
    with pytest.raises(RuntimeUnavailable, match="no runtime loads"):
        registry.runtime_for("model.bin")


def test_option_validation_converts_command_line_text():
    specs = [OptionSpec("n", "int", 1, "a count", minimum=0), OptionSpec("on", "bool", False, "a switch"),
             OptionSpec("split", "floats", None, "shares"), OptionSpec("x", "float", 0.5, "a scale", maximum=1)]
    typed = validate("demo", specs, {"n": "12", "on": "yes", "split": "3,1"})
    assert typed == {"n": 12, "on": True, "split": (3.0, 1.0), "x": 0.5}
    for values, message in (({"n": "-1"}, ">= 0"), ({"x": 2}, "<= 1"), ({"on": 2}, "true or false"),
                            ({"n": True}, "whole number")):
        with pytest.raises(OptionError, match=message):
            validate("demo", specs, values)


GiB = 1 << 30


@pytest.mark.parametrize("n_ctx, available, cells, reason", [
    (4096, 16 * GiB, 4096, "n_ctx=4096, as given"),
    (0, 16 * GiB, 8192, "the model's training context (n_ctx=0)"),
    # memory would hold more than 8 sessions of the trained context: the sessions bound it
    (-1, 16 * GiB, 65536, "8 sequences at once (n_seq_max) at the model's training context of 8,192 tokens; an "
                          "eighth of the 16.00 GiB of memory available would hold 93,206 (n_ctx=-1)"),
    # memory holds fewer: it bounds them, rounded down to whole 256-cell blocks
    (-1, 2 * GiB, 11520, "what an eighth of the 2.00 GiB of memory available holds at 23,040 bytes a cell (n_ctx=-1)"),
    (-1, 16 << 20, 256, "the fewest cells a context is given: an eighth of the 16.0 MiB of memory available holds "
                        "only 91 (n_ctx=-1)"),
])
def test_the_cells_say_why_they_are_that_many(n_ctx, available, cells, reason):
    from engines.llamacpp import settings

    assert settings.context_cells(n_ctx, 8192, 8, 23040, available) == (cells, reason)


def test_a_model_naming_no_training_context_is_sized_by_memory_alone():
    from engines.llamacpp import settings

    cells, reason = settings.context_cells(-1, 0, 8, 23040, 2 * GiB)
    assert cells == 11520 and reason.startswith("what an eighth of the 2.00 GiB")


def test_every_declared_llamacpp_option_has_help_and_a_valid_default():
    names = {spec.name for spec in LlamaCppEngine.options()}
    assert {"threads", "n_ctx", "n_seq_max", "cache_type_k", "cache_type_v", "flash_attn", "swa_full",
            "rope_freq_base", "yarn_orig_ctx", "tensor_split", "split_mode", "kv_offload", "op_offload"} <= names
    assert all(spec.help for spec in LlamaCppEngine.options())
    from engines.llamacpp import settings

    assert settings.check({})["cache_type_k"] == "f16"


def test_memory_functions_under_their_older_names(engine_for):
    """Releases that still bind llama_kv_self_* (0.3.16 binds both) drive real llama.cpp
    through those names just as through llama_memory_*."""
    loaded = library.load()
    older_names = {name: getattr(loaded.api, name) for name in dir(loaded.api) if name.startswith("llama_kv_self_")}
    if not older_names:
        assert loaded.version == library.TESTED_VERSIONS[0] and loaded.memory.naming == "llama_memory_*"
        return
    engine = engine_for("f32")
    older = library.resolve_memory(SimpleNamespace(**older_names))
    assert older.naming == "llama_kv_self_*"
    engine._memory, engine._mem = older, older.handle(engine._ctx)
    seq = engine.new_sequence()
    tokens = engine.tokenize("The capital of France is Paris.")
    engine.step([StepRequest(seq, tokens)])
    child = engine.fork(seq)
    engine.truncate(child, 3)
    assert (engine.length(seq), engine.length(child)) == (len(tokens), 3)
    assert older.seq_pos_max(engine._mem, child) == 2 and older.seq_pos_max(engine._mem, seq) == len(tokens) - 1


def test_a_release_without_a_unified_cache_is_refused_by_name():
    import ctypes

    from engines.llamacpp import settings

    class OldParams(ctypes.Structure):  # the fields of a release before kv_unified (0.3.14)
        _fields_ = [("n_ctx", ctypes.c_uint32), ("flash_attn", ctypes.c_bool), ("swa_full", ctypes.c_bool)]

    api = SimpleNamespace(llama_context_default_params=OldParams)
    with pytest.raises(RuntimeUnavailable, match="0.3.14 cannot hold several sequences.*kv_unified"):
        settings.context_params(api, settings.check({}), 512, "0.3.14")
