"""How one step's requests are grouped into llama_decode calls.

With flash attention on the CPU, ggml computes attention for a forward of 64 or more tokens in
tiles of 64 query rows (GGML_FA_TILE_Q in ggml-cpu), and a tile skips a block of 64 cells only
where the mask hides the block from every row of the tile. Rows of two sequences in one tile
therefore attend over the cells of both: a decode token beside a prompt chunk makes the chunk's
tile read the decoding sequence's whole context, and the forward costs far more than the same
tokens run apart. Measured on SmolLM2 (2 threads, a 1,000-token prompt fed 128 tokens beside
4 sequences decoding at 1,850 tokens): 1,091 ms in one forward, 649 ms as two (558 ms for the
chunk alone). A forward of fewer than 64 tokens takes the kernel's row-by-row path, where each
row skips the hidden cells one by one, so small requests of different sequences share a forward
at no such cost, and one forward reads the weights once for all of them.

Hence the grouping: a request of QUERY_TILE tokens or more runs in a forward of its own; the
smaller ones (decode tokens, short chunks) are packed in order into forwards of fewer than
QUERY_TILE tokens. Without flash attention (attention is one product over every cell for every
row, whatever the sequences), over a cache the kernel does not tile (K and V not both f16 or both
f32: each row is computed apart, cell by cell) or off the CPU, one forward carries everything.
"""

from __future__ import annotations

from collections.abc import Sequence

# Query rows per tile of ggml's CPU flash-attention kernel (GGML_FA_TILE_Q); a forward of fewer
# tokens is computed row by row.
QUERY_TILE = 64


def group(sizes: Sequence[int], tiled_attention: bool) -> list[list[int]]:
    """The requests of one step (their token counts, in order) as groups of indices, one
    llama_decode call per group (before splitting at the batch size). `tiled_attention`: the
    forward runs ggml's CPU flash-attention kernel, whose tiles mix sequences."""
    if not tiled_attention:
        return [list(range(len(sizes)))] if sizes else []
    groups: list[list[int]] = []
    small: list[int] = []
    small_tokens = 0
    for index, size in enumerate(sizes):
        if size >= QUERY_TILE:
            groups.append([index])
            continue
        if small and small_tokens + size >= QUERY_TILE:
            groups.append(small)
            small, small_tokens = [], 0
        small.append(index)
        small_tokens += size
    if small:
        groups.append(small)
    return groups
