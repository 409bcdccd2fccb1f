"""The step planner's cost model: steps measured by the tokens they carried predict how many
tokens fit in a target, never more than the measurements support."""

import pytest

from superfluid.host.planner import MIN_PREFILL_CHUNK, StepCosts, prefill_budget, step_seconds


def affine(tokens: int) -> float:
    """A CPU-like step: 40 ms to read the weights, 5 ms a token."""
    return 0.04 + 0.005 * tokens


def test_nothing_measured_gives_the_whole_budget():
    costs = StepCosts()
    assert costs.seconds_for(100) is None and costs.tokens_within(1.0) is None
    assert prefill_budget(costs, 512, 0.5, decode_tokens=3) == 512


def test_between_measured_steps_the_prediction_is_exact_for_affine_costs():
    costs = StepCosts()
    for tokens in (9, 512):
        costs.observe(tokens, affine(tokens))
    assert costs.seconds_for(100) == pytest.approx(affine(100))
    assert costs.tokens_within(0.5) == 92  # 0.04 + 92 * 0.005 = 0.5
    assert prefill_budget(costs, 512, 0.5, decode_tokens=4) == 88  # the decode tokens come first


def test_past_the_largest_step_measured_the_cost_per_token_is_kept():
    costs = StepCosts()
    costs.observe(64, affine(64))
    # a larger step is cheaper per token (the fixed part spreads): predicting with the measured
    # cost per token overestimates it, so a budget grows only as larger steps are measured
    assert costs.seconds_for(256) == pytest.approx(affine(64) * 4) and costs.seconds_for(256) > affine(256)
    assert costs.tokens_within(1.0) == int(64 * 1.0 / affine(64))


def test_noisy_steps_never_predict_a_larger_step_to_be_faster():
    costs = StepCosts()
    costs.observe(16, 0.2)  # a slow small step (another process took the cores)
    costs.observe(128, 0.1)
    assert costs.seconds_for(128) >= costs.seconds_for(16) == pytest.approx(0.2)


def test_recent_steps_count_most():
    costs = StepCosts()
    costs.observe(100, 1.0)
    for _ in range(20):
        costs.observe(100, 0.5)  # the context shrank, or the machine is free again
    assert costs.seconds_for(100) == pytest.approx(0.5, rel=0.01)


def test_the_budget_is_never_below_the_smallest_chunk_nor_above_the_limit():
    costs = StepCosts()
    costs.observe(10, 1.0)
    assert prefill_budget(costs, 512, 0.05, decode_tokens=8) == MIN_PREFILL_CHUNK
    fast = StepCosts()
    fast.observe(1000, 0.01)
    assert prefill_budget(fast, 512, 1.0, decode_tokens=0) == 512


def test_a_step_is_bounded_by_the_first_token_target_and_by_the_decode_step_target_while_decoding():
    assert step_seconds(1.0, 0.25, streaming=False) == 1.0
    assert step_seconds(1.0, 0.25, streaming=True) == 0.25
    assert step_seconds(None, 0.25, streaming=False) is None
    assert step_seconds(0.2, None, streaming=True) == 0.2
