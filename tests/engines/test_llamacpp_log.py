"""llama.cpp's log in Python's logging at its real levels (engines/llamacpp/log.py), and no
warning at start that does not apply to the engine's configuration."""

import logging

import pytest

from engines.llamacpp import log

# ggml's enum ggml_log_level, as llama.cpp 0.3.16's and 0.3.36's ggml.h define it
DEBUG, INFO, WARN, ERROR, CONT = 1, 2, 3, 4, 5


@pytest.fixture
def records(caplog):
    caplog.set_level(logging.DEBUG, logger="llama.cpp")
    return lambda: [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "llama.cpp"]


def test_each_line_is_logged_at_its_own_level_with_its_continuations(records):
    log._receive(INFO, b"load: 30 layers\n", None)
    log._receive(WARN, b"a warning ", None)
    log._receive(CONT, b"in two pieces\n", None)
    log._receive(ERROR, b"error: tensor out of bounds\nsecond line\n", None)
    log._receive(DEBUG, b"detail\n", None)
    assert records() == [(logging.INFO, "load: 30 layers"), (logging.WARNING, "a warning in two pieces"),
                         (logging.ERROR, "error: tensor out of bounds"), (logging.ERROR, "second line"),
                         (logging.DEBUG, "detail")]


def test_an_expected_warning_is_dropped_only_while_it_is_expected(records):
    with log.expecting(r"n_ctx_seq \(\d+\) > n_ctx_train"):
        log._receive(WARN, b"llama_context: n_ctx_seq (4096) > n_ctx_train (2048) -- possible overflow\n", None)
        log._receive(WARN, b"another warning\n", None)
    log._receive(WARN, b"llama_context: n_ctx_seq (4096) > n_ctx_train (2048) -- possible overflow\n", None)
    assert [message for _, message in records()] == ["another warning",
                                                      "llama_context: n_ctx_seq (4096) > n_ctx_train (2048) -- "
                                                      "possible overflow"]


def test_a_cache_larger_than_the_trained_context_starts_without_the_overflow_warning(engine_for, records):
    engine = engine_for(n_ctx=4096)  # the tiny model is trained on 2,048 positions
    assert engine.describe().kv_cells >= 4096 and engine.describe().context_length == 2048
    logged = records()
    assert any(level == logging.INFO for level, _ in logged)  # llama.cpp's own lines arrive
    assert not [message for _, message in logged if "training context overflow" in message]
