"""The Triton matmul's tile table: (BLOCK_M, BLOCK_N, num_warps, num_stages) by M and N.

Plain Python (no torch, no Triton), so the table is testable on any machine; the kernel is
in `matmul_triton.py`. BLOCK_K is not in the table: it is one constant per dtype
(`matmul_triton.BLOCK_K`), so no entry moves the order in which an output element's K
products are added, and a row's bits do not depend on which entry ran (the GPU test
`test_gpu.py::test_triton_matmul_row_invariant_and_close_to_float64` compares rows across
every switch below).
"""

from __future__ import annotations

# (BLOCK_M, BLOCK_N, warps, stages) by M. BLOCK_K is the same for every entry: measured on
# the H200 (benchmarks/matmul_configs.py, matmul_decode.py), these choices give identical bits
# for every row; narrow tiles give small-M GEMMs enough programs to fill the SMs. Up to 16 rows
# the 16 x 16 tiles in 2 warps (mma.sync) keep 8 stages of weight in flight: in a CUDA graph over
# weight copies past L2, us at M = 1 / 8 (docs/performance.md, 2026-12-04): q+k+v 8.7 / 8.3
# against 10.8 / 11.3, o_proj 11.6 / 10.1 against 12.7 / 14.5, the router 6.3 / 5.5 against
# 6.7 / 7.9.
TILES_BY_M = ((16, (16, 16, 2, 8)), (256, (64, 32, 4, 6)), (None, (128, 128, 8, 3)))
# Up to 64 rows an output of at most 2048 columns (o_proj, the router) takes 16 columns a tile:
# o_proj 11.8 against 14.6 us at M = 64, the router 6.5 against 7.9 (same bits); q+k+v (5120
# columns) stays on the 64 x 32 tiles (11.1 against 16.2).
NARROW_N, NARROW_UP_TO_M, NARROW_TILES = 2048, 64, (64, 16, 4, 8)
# A wide output (the lm_head, N = 151,936) has programs enough at any M; past M = 64 the
# narrow tiles re-read its weights once per 64 rows: 674 us at M = 256 vs 348 us with the
# large tiles (H200, matmul_configs.py, 2026-12-03; same bits).
WIDE_N, WIDE_FROM_M = 16384, 65
WIDE_SMALL_M_TILES = (64, 32, 4, 6)


def tiles_for(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for an (m, K) @ (K, n) product."""
    if n >= WIDE_N:  # the lm_head: the small-M tiles were timed only up to 5120 columns
        return TILES_BY_M[-1][1] if m >= WIDE_FROM_M else WIDE_SMALL_M_TILES
    if n <= NARROW_N and TILES_BY_M[0][0] < m <= NARROW_UP_TO_M:
        return NARROW_TILES
    for limit, tiles in TILES_BY_M:
        if limit is None or m <= limit:
            return tiles
    raise AssertionError("TILES_BY_M must end with a catch-all entry")


# From TMA_FROM_M rows at outputs of TMA_MIN_N to WIDE_N columns the operand tiles are loaded by
# tensor descriptors (`matmul_triton.matmul_tma`): the same BLOCK_K walk and dot, so the same
# bits (compared on the H200 for every shape below). H200, bf16, eager us, pointer table ->
# TMA (128, 128, 8, 3) (docs/performance.md, 2026-12-05): q+k+v (K 2048, N 5120) at M =
# 1024 / 4096 / 8192: 54.0 -> 47.3, 161.0 -> 127.9, 339.6 -> 263.8; o_proj (4096, 2048) at
# 4096 / 8192: 125.9 -> 99.0, 255.1 -> 210.6. Below TMA_FROM_M a call is short enough that the
# descriptors' host cost shows (o_proj at M = 1024: 47.5 -> 68.7 in the same timing, as the
# router's 128 columns at every M). The lm_head (WIDE_N columns and more) stays on the pointer
# kernel: TMA gained at M = 1024 (1208 -> 992) but lost in the one sample at 2048 (1921 ->
# 2012), and no larger M was timed.
TMA_FROM_M, TMA_MIN_N, TMA_TILES = 2048, 1024, (128, 128, 8, 3)


def tma_tiles_for(m: int, n: int) -> tuple[int, int, int, int] | None:
    """The TMA launch's (BLOCK_M, BLOCK_N, num_warps, num_stages) for an (m, K) @ (K, n)
    product, or None where the pointer kernel (`tiles_for`) runs."""
    return TMA_TILES if m >= TMA_FROM_M and TMA_MIN_N <= n < WIDE_N else None
