"""Where a lane's cells lie in llama.cpp's unified KV cache, and when moving them down pays.

llama.cpp places each forward's tokens in the first free cells from a search point that moves
down to the lowest cell a removal frees, and every forward's attention reads the cache's cells up
to the highest one in use, whichever sequence holds them (a freed cell below that costs a read of
its mask, per row, head and layer). A lane that decodes while a burst of long prompts fills the
cache takes cells past the burst's, one token a step; once the burst ends and its cells are freed,
the lane's cells still reach as high, and every forward reads that far for as long as the lane
lives. Measured on SmolLM2-135M on 2 cores with flash attention: four lanes of 850 cells decoded
in 59 ms with their cells at the cache's start and in 105 ms with 30,000 freed cells below them
(one lane: 25 against 36 ms, about 0.37 us a freed cell a decode row); a 2,500-token reply started
during a burst of seven 3,000-token prompts decoded at 0.81-0.84 of its speed on an idle server
for the rest of its life.

llama.cpp does not say where a sequence's cells are, so the host keeps a bound: each lane's
`seat_mark`, the most cells in use when it last took new ones (its cells lie about that high at
most, since freed cells are filled from the lowest). A lane is *stranded* when the cells in use
have fallen far below its mark; moving it (parked into the pool and imported straight back, two
copies of its KV, which llama.cpp places in the lowest free run of cells) costs in proportion to
the cells it holds, and saves reads of the freed cells at every later token, so it is done for
lanes with many tokens still to decode (measured over HTTP: such a reply after a burst kept
0.96-1.06 of its idle speed with the move, 0.76-0.96 without). The bound can be loose (a lane
whose cells went into low holes, or one below a lane that cannot move), and then a move gains
nothing; each move needs as many cells taken and freed again first, so moves stay rare: one a
burst prompt at most for a reply decoding through a burst fed one prompt after another.

Only llama.cpp's unified cache of plain KV is concerned: MLX keeps each sequence's cache apart,
and a window or recurrent memory holds its state elsewhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from superfluid.host.lane import Live

# A lane is moved only when the cells in use are at least this many below its mark (a forward
# reading 1,024 freed cells more costs a decode row ~0.4 ms of ~25 on the model above) ...
STRANDED_CELLS = 1024
# ... and at least this many times the cells it holds (the copies cost in proportion to them) ...
STRANDED_FACTOR = 2
# ... and while it decodes with at least this many tokens still to come (a reply about to end
# would spend more on the copies than it saves).
STRANDED_TOKENS = 256


def mark_placed(lanes: Iterable[Live], cells_used: int) -> None:
    """After a step fed `lanes` new cells, with `cells_used` cells in use: their marks."""
    for live in lanes:
        if cells_used > live.seat_mark:
            live.seat_mark = cells_used


def stranded(lanes: Iterable[Live], cells_used: int) -> list[Live]:
    """The decoding lanes worth moving down the cache now that `cells_used` cells are in use: far
    below their marks, holding no cells another lane holds too (a fork's shared prefix stays where
    it was written: moving one holder would copy it, and the others keep it high), with many
    tokens still to decode."""
    lanes = list(lanes)
    holders = Counter(group for live in lanes for group in {live.own.group, *(s.group for s in live.borrowed)})
    found = []
    for live in lanes:
        job = live.job
        if job is None or live.seq is None or live.pending != 1:
            continue
        if holders[live.own.group] > 1 or any(holders[span.group] > 1 for span in live.borrowed):
            continue
        if job.request.max_tokens - job.produced < STRANDED_TOKENS:
            continue
        if live.seat_mark - cells_used >= max(STRANDED_CELLS, STRANDED_FACTOR * live.kv):
            found.append(live)
    return found
