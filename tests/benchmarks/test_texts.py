"""The benchmarks' texts are the token counts they claim, on SmolLM2's tokenizer."""

import pytest

from benchmarks.texts import WORDS, text_of
from engines import models

pytestmark = pytest.mark.real_model


def test_every_text_is_exactly_its_token_count():
    from llama_cpp import Llama

    vocabulary = Llama(str(models.default_model()), vocab_only=True, verbose=False)
    assert len(WORDS) == 61
    for tokens in (1, 16, 32, 128, 1000):
        for salt in range(0, 2000, 97):
            counted = len(vocabulary.tokenize(text_of(tokens, salt).encode(), add_bos=False))
            assert counted == tokens, (tokens, salt)
    assert text_of(16, 0) != text_of(16, 1)
    with pytest.raises(ValueError, match="tokens"):
        text_of(0)
