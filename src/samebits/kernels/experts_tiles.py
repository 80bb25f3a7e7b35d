"""The Triton MoE experts' tile table: (BLOCK_M, BLOCK_N, num_warps, num_stages) by batch size.

Plain Python (no torch, no Triton), so the table is testable on any machine; the kernels
are in `experts_triton.py`.

Why the tiles may follow the batch and the bits still may not: every output element of
`gate_up_kernel` and `down_kernel` is one program's fp32 accumulator walking its K
(H, then I) from 0 up in BLOCK_K steps, no split-K. BLOCK_M, BLOCK_N, warps and stages
decide which rows and columns share a program and how loads are pipelined, never the
order in which an element's K products are added. BLOCK_K is not in this table: it is one
constant for every batch. So an element's bits are a function of its own token, its
expert's weights and K alone, whichever entry ran. Measured on the H200 (2026-12-03,
`benchmarks/experts_configs.py`): every choice tried (BLOCK_M 16-128, BLOCK_N 32-128, 4 or
8 warps, 3 or 4 stages) gave the default's bits at T = 1 .. 4096. (Per docs/perf-notes.md
BLOCK_K 32 did too, as the MMAs add K in 16-wide steps in order either way; samebits
keeps BLOCK_K fixed regardless, the one choice that could reorder K.)

The entries, by routed (token, slot) pairs N = T * top_k (a function of the batch's token
count T alone for a given model). Eager us at the Qwen3-30B-A3B shape (128 experts, top-8,
H 2048, I 768), the whole layer's gate_up + down (H200, 2026-12-04, `experts_configs.py`;
"grid": the row blocks in the launch grid, `m_in_grid_for`):

    tiles                       T=256  T=1024  T=2048  T=4096  T=8192
    (64, 64, 4, 3)                329     645    1077    1937    3709  <- N < 8192 (decode)
    (128, 128, 8, 3)              434     583     865    1402    2497     (the table until then)
    (128, 128, 8, 3) grid         440     586     788    1205    2066
    (128, 128, 8, 4) grid         401     559     724    1113    1959  <- N >= 8192 (prefill)

The last is 0.78-0.79x the old large entry at T >= 4096: 6.2 x 10^11 FLOP in 1,959 us at
T = 8192, 316 TFLOP/s, a third of the tensor peak. Every entry gave the default's bits.

At decode sizes the large tiles leave most of each 128-row tile empty (T * 8 / 128
experts = 16 rows per expert at T = 256). Between the entries: at T = 1024 the small tiles
with grid rows measured 541 us against the large entry's 559 (3%, one eager sample), and the
large entry wins from T = 2048 (724 against 792), so no middle entry. Shared memory:
(128, 128, 8, 4) with BLOCK_K 64 in bf16 needs about 192 KB (4 stages x (x tile + gate and
up tiles)); it fits on H100/H200 (227 KB a block); the launcher takes fewer stages on a GPU
with less (`experts_triton._stages_that_fit`), which changes no bit.
"""

from __future__ import annotations

BLOCK_K = 64  # the K step of both kernels, for every batch: fixes each element's K order
SMALL_TILES = (64, 64, 4, 3)  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
LARGE_TILES = (128, 128, 8, 4)
# (first N = routed pairs, tiles), starts increasing: the last entry whose start <= N is used
TILES_FROM_PAIRS = ((0, SMALL_TILES), (8192, LARGE_TILES))  # 8192 pairs = 1024 tokens at top-8


def tiles_for(pairs: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a call routing `pairs` = T * top_k pairs.

    Depends on the batch only through its size; BLOCK_K is never part of the choice.
    """
    if pairs < 0:
        raise ValueError(f"experts tiles: pairs must be >= 0 (tokens * top_k), got {pairs}")
    chosen = TILES_FROM_PAIRS[0][1]
    for start, tiles in TILES_FROM_PAIRS:
        if pairs >= start:
            chosen = tiles
    return chosen


# Row blocks in the launch grid (`experts_triton._m_range`) from this many pairs on (the large
# tiles' range): where an expert has several BLOCK_M blocks, the programs of one weight tile
# then run side by side instead of one program re-reading the tile for each of its blocks.
M_IN_GRID_FROM_PAIRS = 8192


def m_in_grid_for(pairs: int) -> bool:
    """Whether a call routing `pairs` pairs puts the experts' row blocks in the grid."""
    return pairs >= M_IN_GRID_FROM_PAIRS
