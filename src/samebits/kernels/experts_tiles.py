"""The Triton MoE experts' tile table: (BLOCK_M, BLOCK_N, num_warps, num_stages) by batch size.

Plain Python (no torch, no Triton), so the table is testable on any machine; the kernels
are in `experts_triton.py`, their launchers in `experts_launch.py`.

Why the tiles may follow the batch and the bits still may not: every output element of
`gate_up_kernel` and `down_kernel` is one program's fp32 accumulator walking its K
(H, then I) from 0 up in BLOCK_K steps, no split-K. BLOCK_M, BLOCK_N, warps and stages
decide which rows and columns share a program and how loads are pipelined, never the
order in which an element's K products are added. BLOCK_K is not in this table: it is one
constant for every batch. So an element's bits are a function of its own token, its
expert's weights and K alone, whichever entry ran. Measured on the H200 (2026-12-03,
`benchmarks/experts_configs.py`): every choice tried (BLOCK_M 16-128, BLOCK_N 32-128, 4 or
8 warps, 3 or 4 stages) gave the default's bits at T = 1 .. 4096. (Per docs/performance.md
BLOCK_K 32 did too, as the MMAs add K in 16-wide steps in order either way; samebits
keeps BLOCK_K fixed regardless, the one choice that could reorder K.)

The entries, by routed (token, slot) pairs N = T * top_k (a function of the batch's token
count T alone for a given model). Eager us at the Qwen3-30B-A3B shape (128 experts, top-8,
H 2048, I 768), the whole layer's gate_up + down (H200, 2026-12-04, `experts_configs.py`;
"grid": the row blocks in the launch grid, `m_in_grid_for`):

    tiles                       T=256  T=1024  T=2048  T=4096  T=8192
    (64, 64, 4, 3)                329     645    1077    1937    3709  <- 1024 <= N < 8192
    (128, 128, 8, 3)              434     583     865    1402    2497     (rows walked per program)
    (128, 128, 8, 3) grid         440     586     788    1205    2066
    (128, 128, 8, 4) grid         401     559     724    1113    1959  <- N >= 8192 (prefill)

The last is 0.78-0.79x (128, 128, 8, 3) with rows walked per program at T >= 4096: 6.2 x 10^11
FLOP in 1,959 us at T = 8192, 316 TFLOP/s, a third of the tensor peak. Every entry gave the
default's bits.

The decode entry, from `benchmarks/experts_decode.py` (H200, 2026-12-04; the
whole `experts_forward` in a CUDA graph over 8 layers of distinct weights, us a layer; every
configuration gave the table's bits):

    tiles, rows in grid         T=1    T=4   T=16   T=64  T=256
    floor (touched experts)    17.6   63.7  191.0  276.6  281.0
    (64, 64, 4, 3) walked      44.7   80.0  216.9  310.9  334.4   (rows walked per program)
    (16, 32, 2, 6) grid        29.3   79.6  205.4  296.1  355.4   <- N < 1024 (T < 128)
    (32, 64, 4, 4) grid        33.7   81.4  215.4  310.0  333.2

At one token the small tiles ran 96 programs with rows among 1,536 (8 experts x 12 column
tiles of 64), each streaming a 512 KB slab on a 3-stage pipeline; (16, 32) tiles with rows in
the grid give 9 x 24 programs, 192 of them with rows, on 6 stages.

At decode sizes the large tiles leave most of each 128-row tile empty (T * 8 / 128
experts = 16 rows per expert at T = 256). Between the entries: at T = 1024 the small tiles
with grid rows measured 541 us against the large entry's 559 (3%, one eager sample), and the
large entry wins from T = 2048 (724 against 792), so no middle entry. Shared memory:
(128, 128, 8, 4) with BLOCK_K 64 in bf16 needs about 192 KB (4 stages x (x tile + gate and
up tiles)); it fits on H100/H200 (227 KB a block); the launcher takes fewer stages on a GPU
with less (`experts_launch._stages_that_fit`), which changes no bit.
"""

from __future__ import annotations


def slot_tree_fits(k: int) -> bool:
    """Whether the Triton slot sum (`experts_triton.slot_sum_kernel`, and the norm that sums
    slots) takes top-k = k: a power of two up to 16, its halving tree written out."""
    return 0 < k <= 16 and not k & (k - 1)


BLOCK_K = 64  # the K step of both kernels, for every batch: fixes each element's K order
DECODE_TILES = (16, 32, 2, 6)  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
SMALL_TILES = (64, 64, 4, 3)
LARGE_TILES = (128, 128, 8, 4)
# (first N = routed pairs, tiles, row blocks in the grid), starts increasing: the last entry
# whose start <= N is used. 1024 pairs = 128 tokens, 8192 = 1024 tokens at top-8.
TILES_FROM_PAIRS = ((0, DECODE_TILES, True), (1024, SMALL_TILES, False), (8192, LARGE_TILES, True))


def _entry(pairs: int) -> tuple[int, tuple[int, int, int, int], bool]:
    if pairs < 0:
        raise ValueError(f"experts tiles: pairs must be >= 0 (tokens * top_k), got {pairs}")
    chosen = TILES_FROM_PAIRS[0]
    for entry in TILES_FROM_PAIRS:
        if pairs >= entry[0]:
            chosen = entry
    return chosen


def tiles_for(pairs: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a call routing `pairs` = T * top_k pairs.

    Depends on the batch only through its size; BLOCK_K is never part of the choice.
    """
    return _entry(pairs)[1]


def m_in_grid_for(pairs: int) -> bool:
    """Whether a call routing `pairs` pairs puts the experts' row blocks in the launch grid
    (`experts_triton._m_range`): one program per BLOCK_M rows of an expert instead of one per
    expert walking its rows. The decode entry: only the experts with rows get programs (9 row
    blocks at one token instead of 128 experts). The large tiles: an expert's several blocks run
    side by side and share its weight tile in L2 instead of one program re-reading it."""
    return _entry(pairs)[2]


# down's own tiles with the large entry: 256 columns a tile read each row block of the
# intermediate half as often from L2. H200, T = 8192 at top-8 (65,536 pairs), gate_up + down
# eager us, same bits (docs/performance.md, 2026-12-05): down at (128, 128, 8, 4) 1970.5,
# (128, 256, 8, 4) 1774.6, (128, 256, 8, 3) 1814.5, (256, 128, 8, 3) 1926.0, (64, 256, 8, 4)
# 1875.0. gate_up keeps (128, 128): its two accumulators at 256 columns would not fit.
DOWN_LARGE_TILES = (128, 256, 8, 4)


def down_tiles_for(pairs: int) -> tuple[int, int, int, int]:
    """down's (BLOCK_M, BLOCK_N, num_warps, num_stages): `tiles_for`'s, but DOWN_LARGE_TILES
    with the large entry. BLOCK_K is never part of the choice."""
    tiles = tiles_for(pairs)
    return DOWN_LARGE_TILES if tiles == LARGE_TILES else tiles


# From TMA_FROM_PAIRS routed pairs (prefill chunks) gate_up's weight tiles, and down's
# intermediate and weight tiles, are loaded by tensor descriptors (TMA) rather than pointers:
# the same dots over the same BLOCK_K steps, so the same bits. (gate_up's rows of x are
# gathered through the pair order, which TMA on Hopper cannot do in place.) H200, T = 8192,
# eager us (docs/performance.md, 2026-12-05): 1970.5 pointer loads, 1899.3 with gate_up's
# weights by TMA, 1918.7 with both; at down's (128, 256) tiles 1774.6 -> 1768.3 with both.
TMA_FROM_PAIRS = 8192


def tma_for(pairs: int) -> tuple[bool, bool]:
    """(gate_up's weights, down's operands) by TMA at `pairs` routed (token, slot) pairs."""
    on = pairs >= TMA_FROM_PAIRS
    return on, on
