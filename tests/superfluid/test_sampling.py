"""Sampling: the filters, and draws that depend only on (seed, position)."""

import numpy as np
import pytest

from superfluid.host.sampling import Sampling, SamplingError, sample, uniform

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
                                          ("seed", -1), ("seed", 1 << 64), ("top_k", 1 << 70), ("repetition_window", 1 << 31)])
def test_bad_settings_are_named(field, value):
    with pytest.raises(SamplingError, match=f"sampling {field}="):
        Sampling(**{field: value})


def reference_candidates(logits: np.ndarray, settings: Sampling) -> set[int]:
    """The tokens the filters leave, by their definition: the whole vocabulary sorted (most likely
    first, ties to the lower id), cut by top-k, then top-p, then min-p."""
    scores = logits.astype(np.float64)
    order = np.argsort(-scores, kind="stable")
    if settings.top_k:
        order = order[:settings.top_k]
    probabilities = np.exp(scores[order] - scores[order[0]])
    probabilities /= probabilities.sum()
    if settings.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(probabilities), settings.top_p)) + 1
        order, probabilities = order[:cut], probabilities[:cut]
    if settings.min_p > 0.0:
        order = order[probabilities / probabilities[0] >= settings.min_p]
    return set(order.tolist())


@pytest.mark.parametrize("n", [1, 2, 5, 64, 100, 999, 1000])
def test_the_best_few_are_found_as_a_sort_of_the_whole_would_order_them(n):
    from superfluid.host.sampling import _best

    scores = np.random.default_rng(n).integers(0, 40, 1000).astype(np.float64)  # many ties
    assert _best(scores, n).tolist() == np.argsort(-scores, kind="stable")[:n].tolist()


@pytest.mark.parametrize("settings", [Sampling(temperature=1.0, top_k=5), Sampling(temperature=1.0, top_p=0.5),
                                      Sampling(temperature=1.0, top_p=0.99), Sampling(temperature=1.0, min_p=0.2),
                                      Sampling(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)],
                         ids=lambda s: f"k{s.top_k}-p{s.top_p}-m{s.min_p}")
def test_the_filters_leave_the_tokens_their_definition_leaves(settings):
    # A flat distribution over 5,000 ids, so that top-p needs far more than the first few best.
    logits = np.random.default_rng(3).normal(0.0, 0.5, 5000).astype(np.float32)
    logits[:10] = logits.max()  # ties at the top
    allowed = reference_candidates(logits, settings)
    drawn = {sample(logits, settings, p) for p in range(3000)}
    assert drawn <= allowed
    if len(allowed) <= 50:
        assert drawn == allowed  # 3,000 draws reach each of a few candidates


def test_draws_follow_the_tempered_distribution():
    logits = np.array([2.0, 1.0, 0.0, 1.0, -1.0])
    settings = Sampling(temperature=0.7, seed=5)
    draws = np.bincount([sample(logits, settings, p) for p in range(20000)], minlength=logits.size) / 20000
    expected = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    assert np.abs(draws - expected).max() < 0.015  # the draws are fixed by (seed, position): no flake


def test_top_p_ending_inside_a_tie_keeps_the_lower_ids():
    logits = np.zeros(40)
    top = [3, 7, 11, 19, 23, 29, 31, 37, 2, 5]
    logits[top] = 5.0  # ten equally likely: 0.35 of the mass takes four of them
    settings = Sampling(temperature=1.0, top_p=0.35)
    assert reference_candidates(logits, settings) == {2, 3, 5, 7}
    assert {sample(logits, settings, p) for p in range(500)} == {2, 3, 5, 7}


@pytest.mark.parametrize("settings", [Sampling(), Sampling(temperature=1.0), Sampling(temperature=1.0, top_p=0.9),
                                      Sampling(temperature=1.0, min_p=0.1), Sampling(temperature=1.0, top_k=2)],
                         ids=lambda s: f"t{s.temperature}-k{s.top_k}-p{s.top_p}-m{s.min_p}")
def test_a_broken_step_s_logits_are_sampled_safely_or_refused_by_name(settings):
    with_nan = np.array([1.0, np.nan, 3.0, np.nan, 2.0])
    assert {sample(with_nan, settings, p) for p in range(200)} <= {0, 2, 4}  # a NaN is never drawn
    assert sample(np.array([1.0, np.inf, 3.0, np.inf]), settings, 0) == 1  # +inf takes all the probability
    with pytest.raises(SamplingError, match="all NaN or -inf"):
        sample(np.array([np.nan, -np.inf, np.nan]), settings, 0)


def test_the_draw_by_blocks_picks_what_one_running_sum_picks():
    from superfluid.host.sampling import DRAW_BLOCK, _draw

    rng = np.random.default_rng(11)
    weights = rng.exponential(size=DRAW_BLOCK * 7 + 13)  # a last block shorter than the others
    weights[rng.integers(0, weights.size, 500)] = 0.0  # ids with no probability are never drawn
    running = np.cumsum(weights)
    draws = rng.random(3000)
    chosen = [_draw(weights, u) for u in draws]
    assert chosen == [int(np.searchsorted(running, u * running[-1], side="right")) for u in draws]
    assert all(weights[c] > 0 for c in chosen)
    assert _draw(weights, 0.0) == int(np.flatnonzero(weights)[0])
    assert _draw(weights, np.nextafter(1.0, 0.0)) == int(np.flatnonzero(weights)[-1])


def test_a_large_vocabulary_samples_as_its_definition_says():
    # the workspace and the blocked draw at a real vocabulary's size, every filter on its path
    logits = np.random.default_rng(5).normal(0.0, 3.0, 49152).astype(np.float32)
    for settings in (Sampling(temperature=1.0), Sampling(temperature=0.8, top_p=0.9),
                     Sampling(temperature=1.0, min_p=0.05), Sampling(temperature=1.0, top_k=40, top_p=0.95)):
        allowed = reference_candidates(logits, settings)
        drawn = [sample(logits, settings, p) for p in range(400)]
        assert set(drawn) <= allowed and len(set(drawn)) > 3
        assert drawn == [sample(logits, settings, p) for p in range(400)]  # a pure function of the position
    assert sample(logits, Sampling(), 0) == int(np.argmax(logits))
