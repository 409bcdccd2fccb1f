"""The step planner's cost model: steps measured by the tokens they carried predict how many
tokens fit in a target, never more than the measurements support."""

from types import SimpleNamespace

import pytest

from engines.base import StepRequest
from superfluid.host.planner import (COST_RANGE, MIN_PIECE, MIN_PREFILL_CHUNK, MIN_SLOPE_STEPS, RECENT_ARRIVALS,
                                     Planner, StepCosts, depth_of, prefill_budget, step_seconds)
from superfluid.host.policy import Policy


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
    for _ in range(30):
        costs.observe(100, 0.5)  # the context shrank, or the machine is free again
    assert costs.seconds_for(100) == pytest.approx(0.5, rel=0.01)


def deep(tokens: int, depth: float) -> float:
    """A step whose tokens also attend the cells before them: 2.5 ms a token, 0.5 us a cell
    attended (SmolLM2's prompt chunks on 2 cores: 2.47 ms a token early in a 1,800-token prompt,
    3.25 late)."""
    return tokens * (0.0025 + 0.5e-6 * depth)


def prompt_in_chunks(costs: StepCosts, chunk: int = 256, prompt: int = 1800, cost=deep) -> None:
    """Measure a prompt fed in chunks: each step's tokens at their mean depth."""
    for start in range(0, prompt, chunk):
        depth = start + (chunk + 1) / 2
        costs.observe(chunk, cost(chunk, depth), depth)


def test_a_step_late_in_a_long_context_is_predicted_dearer_than_an_early_one():
    costs = StepCosts()
    prompt_in_chunks(costs)
    early, late = costs.seconds_for(256, 128.5), costs.seconds_for(256, 1664.5)
    assert early == pytest.approx(deep(256, 128.5), rel=0.01) and late == pytest.approx(deep(256, 1664.5), rel=0.01)
    # by token count alone both would be one average: the late one is 1.3x the early one
    assert late > 1.25 * early
    # so fewer tokens fit in a target late in a prompt, and the budget the planner gives follows
    assert costs.tokens_within(0.5, start=0) > costs.tokens_within(0.5, start=1536) + 40
    assert prefill_budget(costs, 512, 0.5, 0, start=1536) == costs.tokens_within(0.5, start=1536)


def test_a_slope_needs_enough_steps_spread_in_depth_and_comes_from_neighbouring_sizes():
    few = StepCosts()
    prompt_in_chunks(few, prompt=MIN_SLOPE_STEPS * 256 - 512)  # two steps short
    assert few.seconds_for(256, 128.5) == pytest.approx(few.seconds_for(256, 1664.5))  # their average
    together = StepCosts()  # steps of 200 and of 300 (buckets of 128-255 and 256-511): one slope
    for start in range(0, 2000, 250):
        tokens = 200 if start % 500 else 300
        together.observe(tokens, deep(tokens, start + 125), start + 125)
    assert together.seconds_for(250, 1700) == pytest.approx(deep(250, 1700), rel=0.02)
    for _ in range(20):  # one decoding lane that stayed near 600 cells
        together.observe(1, deep(1, 600), 600)
    # no step of a size near one token says what depth costs it: its average, whatever the depth
    assert together.seconds_for(1, 1600) == pytest.approx(deep(1, 600))


def test_a_slow_step_does_not_pass_for_a_slope():
    flat = lambda tokens, depth: tokens * 0.0025  # noqa: E731 - a model whose depth costs nothing
    costs = StepCosts()
    prompt_in_chunks(costs, cost=flat)
    costs.observe(256, 3 * flat(256, 0), 1900.5)  # the deepest step three times as slow: a stall
    prompt_in_chunks(costs, cost=flat)  # the next prompt, as fast as before
    assert costs.seconds_for(256, 1900) == pytest.approx(flat(256, 0), rel=0.15)


def test_a_noisy_slope_never_makes_depth_cheaper_nor_a_step_free_nor_forbidden():
    costs = StepCosts()
    for index, start in enumerate(range(0, 1800, 256)):  # deeper steps measured faster (the machine freed)
        costs.observe(256, 0.8 - 0.05 * index, start + 128.5)
    assert costs.seconds_for(256, 1800) == pytest.approx(costs.seconds_for(256, 100))
    steep = StepCosts()
    for start in range(30000, 32000, 200):  # far into a context: a steep slope
        steep.observe(256, deep(256, 50 * start), start)
    average = steep.seconds_for(256, steep._buckets[8].depth)
    assert steep.seconds_for(256, 0) == pytest.approx(COST_RANGE[0] * average)
    assert steep.seconds_for(256, 10 ** 7) == pytest.approx(COST_RANGE[1] * average)


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


class Lane(str):
    """A lane as pieces() reads it: a name (equal to the plain string) at context position `kv`."""

    kv = 0


def shapes(steps: list[list]) -> list[list[tuple]]:
    return [[(lane, len(request.tokens), request.logits) for lane, request in step] for step in steps]


def test_a_step_runs_its_long_chunks_in_pieces_the_first_beside_the_decode_tokens():
    planner = planner_of(1.0)  # nothing measured: pieces of MIN_PIECE
    decode, short = (Lane("d"), StepRequest(0, [5])), (Lane("s"), StepRequest(1, list(range(40))))
    first, second = (Lane("a"), StepRequest(2, list(range(384)), "none")), (Lane("b"), StepRequest(3, list(range(1000, 1300))))
    steps = planner.pieces([decode, short, first, second], 101.0)
    assert MIN_PIECE == 128
    assert shapes(steps) == [[("d", 1, "last"), ("s", 40, "last"), ("a", 128, "none")], [("a", 128, "none")],
                             [("a", 128, "none")], [("b", 150, "none")], [("b", 150, "last")]]
    for lane, request in (first, second):  # each chunk's tokens, in order, once
        assert [t for step in steps for name, piece in step if name == lane for t in piece.tokens] == request.tokens
    # chunks under a piece each: one piece each where they run in forwards of their own anyway,
    # else together in the first sub-step (one forward carries them)
    two = [decode, (Lane("a"), StepRequest(2, list(range(111)), "none")), (Lane("b"), StepRequest(3, list(range(100))))]
    assert shapes(planner.pieces(two, 101.0)) == [[("d", 1, "last"), ("a", 111, "none")], [("b", 100, "last")]]
    assert planner_of(1.0, chunks_apart=False).pieces(two, 101.0) == [two]
    small = [decode, short, (Lane("c"), StepRequest(4, list(range(63))))]  # under half a piece: not apart
    assert planner.pieces(small, 101.0) == [small]


def test_pieces_grow_to_a_quarter_of_the_first_token_target_where_the_costs_fit_more():
    planner = planner_of(1.0)
    planner.costs.observe(1000, 0.5)  # 2,000 tokens a second: 500 in a quarter of the target
    chunk = (Lane("a"), StepRequest(0, list(range(1200))))
    assert shapes(planner.pieces([chunk], 101.0)) == [[("a", 600, "none")], [("a", 600, "last")]]
    nearly_two = (Lane("b"), StepRequest(1, list(range(950))))  # 1.9 pieces' worth: two pieces
    assert shapes(planner.pieces([nearly_two], 101.0)) == [[("b", 475, "none")], [("b", 475, "last")]]
    under_one_and_a_half = (Lane("c"), StepRequest(2, list(range(700))))  # 1.4: one piece, not cut
    assert shapes(planner.pieces([under_one_and_a_half], 101.0)) == [[("c", 700, "last")]]


def test_pieces_late_in_a_long_prompt_carry_fewer_tokens():
    planner = planner_of(4.0)  # pieces of about a second
    prompt_in_chunks(planner.costs)
    early, late = Lane("a"), Lane("b")
    late.kv = 3000
    sizes = [[len(request.tokens) for _, request in step]
             for lane in (early, late) for step in planner.pieces([(lane, StepRequest(0, list(range(1000))))], 101.0)]
    # a second fits ~390 tokens from the start (three pieces), ~240 after 3,000 cells (four)
    assert sizes == [[333], [333], [334], [250], [250], [250], [250]]


def test_a_tokens_depth_is_the_cells_it_attends_itself_included():
    first, later = Lane("a"), Lane("b")
    later.kv = 100
    assert depth_of([(first, StepRequest(0, [1, 2, 3]))]) == 2.0  # positions 0, 1, 2 attend 1, 2, 3
    assert depth_of([(later, StepRequest(1, [7]))]) == 101.0  # a decode token after 100 cells
    assert depth_of([(first, StepRequest(0, [1, 2, 3])), (later, StepRequest(1, [7]))]) == 107 / 4
    assert depth_of([]) == 0.0


def test_without_a_first_token_target_or_a_request_going_first_lately_a_step_is_one_piece():
    step = [(Lane("a"), StepRequest(0, list(range(2000))))]
    assert planner_of(None).pieces(step, 101.0) == [step]
    # 15.6 pieces' worth of 128 tokens: 16 pieces, until RECENT_ARRIVALS after the arrival
    assert len(planner_of(1.0).pieces(step, 100.0 + RECENT_ARRIVALS)) == 16
    assert planner_of(1.0).pieces(step, 100.1 + RECENT_ARRIVALS) == [step]
    quiet = Planner(Policy(), None, True, urgency=lambda live, tokens: ())
    assert quiet.pieces(step, 0.0) == [step]  # none ever went first
