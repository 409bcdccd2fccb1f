"""Sampling: the filters, and draws that depend only on (seed, position)."""

import numpy as np
import pytest

from superfluid.sampling import Sampling, SamplingError, sample, uniform

LOGITS = np.array([1.0, 3.0, 2.0, 3.0, -1.0, 0.5])


def test_greedy_takes_the_first_highest():
    assert sample(LOGITS, Sampling(), 0) == 1


def test_draws_depend_on_seed_and_position_only():
    assert uniform(7, 123) == uniform(7, 123) != uniform(7, 124)
    assert uniform(8, 123) != uniform(7, 123)
    settings = Sampling(temperature=1.0, seed=42)
    first = [sample(LOGITS, settings, p) for p in range(200)]
    assert first == [sample(LOGITS, settings, p) for p in range(200)]
    assert first[100:] == [sample(LOGITS, settings, p) for p in range(100, 200)]  # a resume mid-stream
    assert len(set(first)) > 2  # it does sample


def test_filters_narrow_the_choice():
    draws = lambda settings: {sample(LOGITS, settings, p) for p in range(300)}  # noqa: E731
    assert draws(Sampling(temperature=1.0, top_k=2)) == {1, 3}
    assert draws(Sampling(temperature=1.0, top_p=0.5)) <= {1, 3}
    assert draws(Sampling(temperature=1.0, min_p=0.5)) == {1, 3}  # exp(2 - 3) = 0.37 < 0.5
    assert draws(Sampling(temperature=1.0, min_p=0.3)) == {1, 2, 3}


def test_the_repetition_penalty_turns_away_from_recent_tokens():
    assert sample(LOGITS, Sampling(repetition_penalty=2.0), 0, recent=[1]) == 3
    assert sample(LOGITS, Sampling(repetition_penalty=2.0), 0, recent=[1, 3]) == 2
    assert sample(LOGITS, Sampling(repetition_penalty=2.0, repetition_window=1), 0, recent=[3, 1, 2]) == 1


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("temperature", float("nan")), ("top_k", -1),
                                          ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.0), ("repetition_penalty", 0.0),
                                          ("seed", -1), ("seed", 1 << 64)])
def test_bad_settings_are_named(field, value):
    with pytest.raises(SamplingError, match=f"sampling {field}="):
        Sampling(**{field: value})
