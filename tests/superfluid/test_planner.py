"""The step planner's cost model: steps measured by the tokens they carried predict how many
tokens fit in a target, never more than the measurements support."""

from types import SimpleNamespace

import pytest

from engines.base import StepRequest
from superfluid.host.planner import (MIN_PIECE, MIN_PREFILL_CHUNK, RECENT_ARRIVALS, Planner, StepCosts,
                                     prefill_budget, step_seconds)
from superfluid.host.scheduler import Policy


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


def planner_of(first_token_target: float | None, chunks_apart: bool = True) -> Planner:
    """A planner whose pieces() reads only its targets, costs, arrivals and whether the engine
    runs prompt chunks apart (lanes are opaque to it), a request that went first having arrived
    at 100 s."""
    engine = SimpleNamespace(packing=SimpleNamespace(chunks_apart=chunks_apart))
    planner = Planner(Policy(first_token_target=first_token_target), engine, True, urgency=lambda live, tokens: ())
    planner.arrival_went_first(100.0)
    return planner


def shapes(steps: list[list]) -> list[list[tuple]]:
    return [[(lane, len(request.tokens), request.logits) for lane, request in step] for step in steps]


def test_a_step_runs_its_long_chunks_in_pieces_the_first_beside_the_decode_tokens():
    planner = planner_of(1.0)  # nothing measured: pieces of MIN_PIECE
    decode, short = ("d", StepRequest(0, [5])), ("s", StepRequest(1, list(range(40))))
    first, second = ("a", StepRequest(2, list(range(384)), "none")), ("b", StepRequest(3, list(range(1000, 1300))))
    steps = planner.pieces([decode, short, first, second], 101.0)
    assert MIN_PIECE == 128
    assert shapes(steps) == [[("d", 1, "last"), ("s", 40, "last"), ("a", 128, "none")], [("a", 128, "none")],
                             [("a", 128, "none")], [("b", 150, "none")], [("b", 150, "last")]]
    for lane, request in (first, second):  # each chunk's tokens, in order, once
        assert [t for step in steps for name, piece in step if name == lane for t in piece.tokens] == request.tokens
    # chunks under a piece each: one piece each where they run in forwards of their own anyway,
    # else together in the first sub-step (one forward carries them)
    two = [decode, ("a", StepRequest(2, list(range(111)), "none")), ("b", StepRequest(3, list(range(100))))]
    assert shapes(planner.pieces(two, 101.0)) == [[("d", 1, "last"), ("a", 111, "none")], [("b", 100, "last")]]
    assert planner_of(1.0, chunks_apart=False).pieces(two, 101.0) == [two]
    small = [decode, short, ("c", StepRequest(4, list(range(63))))]  # under half a piece: not apart
    assert planner.pieces(small, 101.0) == [small]


def test_pieces_grow_to_a_quarter_of_the_first_token_target_where_the_costs_fit_more():
    planner = planner_of(1.0)
    planner.costs.observe(1000, 0.5)  # 2,000 tokens a second: 500 in a quarter of the target
    chunk = ("a", StepRequest(0, list(range(1200))))
    assert shapes(planner.pieces([chunk], 101.0)) == [[("a", 600, "none")], [("a", 600, "last")]]
    nearly_two = ("b", StepRequest(1, list(range(950))))  # 1.9 pieces' worth: two pieces
    assert shapes(planner.pieces([nearly_two], 101.0)) == [[("b", 475, "none")], [("b", 475, "last")]]
    under_one_and_a_half = ("c", StepRequest(2, list(range(700))))  # 1.4: one piece, not cut
    assert shapes(planner.pieces([under_one_and_a_half], 101.0)) == [[("c", 700, "last")]]


def test_without_a_first_token_target_or_a_request_going_first_lately_a_step_is_one_piece():
    step = [("a", StepRequest(0, list(range(2000))))]
    assert planner_of(None).pieces(step, 101.0) == [step]
    # 15.6 pieces' worth of 128 tokens: 16 pieces, until RECENT_ARRIVALS after the arrival
    assert len(planner_of(1.0).pieces(step, 100.0 + RECENT_ARRIVALS)) == 16
    assert planner_of(1.0).pieces(step, 100.1 + RECENT_ARRIVALS) == [step]
    quiet = Planner(Policy(), None, True, urgency=lambda live, tokens: ())
    assert quiet.pieces(step, 0.0) == [step]  # none ever went first
