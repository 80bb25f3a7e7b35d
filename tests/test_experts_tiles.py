"""The Triton experts' tile table (`kernels/experts_tiles.py`): where it switches, and what it may
change. Portable: the table is plain Python; the bits across the switch are
tests/test_gpu_experts_tiles.py."""

from __future__ import annotations

import pytest

from samebits.kernels import experts_tiles
from samebits.kernels.experts_tiles import DECODE_TILES, LARGE_TILES, SMALL_TILES, TILES_FROM_PAIRS, tiles_for


@pytest.mark.parametrize(
    ("tokens", "want"),
    [(0, DECODE_TILES), (1, DECODE_TILES), (64, DECODE_TILES), (127, DECODE_TILES)]
    + [(128, SMALL_TILES), (512, SMALL_TILES), (1023, SMALL_TILES)]
    + [(1024, LARGE_TILES), (1500, LARGE_TILES), (4096, LARGE_TILES), (65536, LARGE_TILES)],
)
def test_decode_batches_get_narrow_tiles_and_prefill_chunks_the_large_ones(tokens, want):
    assert tiles_for(tokens * 8) == want  # top-8: the Qwen3-30B-A3B and Omni thinker experts


def test_the_switches_are_at_1024_and_8192_pairs_and_the_entries_differ():
    assert tiles_for(1023) == DECODE_TILES and tiles_for(1024) == SMALL_TILES
    assert tiles_for(8191) == SMALL_TILES and tiles_for(8192) == LARGE_TILES
    # else the GPU tests across a switch compare a configuration with itself
    assert len({DECODE_TILES, SMALL_TILES, LARGE_TILES}) == 3


def test_row_blocks_go_in_the_grid_for_decode_and_the_large_tiles():
    """The grid layout (same row blocks, same bits: tests/test_gpu_experts_tiles.py) below 1024
    pairs (only experts with rows get programs) and from the large tiles' first batch on, not
    between."""
    assert (
        experts_tiles.m_in_grid_for(0) and experts_tiles.m_in_grid_for(8) and experts_tiles.m_in_grid_for(1023)
    )
    assert not experts_tiles.m_in_grid_for(1024) and not experts_tiles.m_in_grid_for(8191)
    assert experts_tiles.m_in_grid_for(8192) and experts_tiles.m_in_grid_for(65536)


def test_the_table_holds_no_k_step_and_its_entries_are_launchable():
    """Entries are (BLOCK_M, BLOCK_N, warps, stages) only: BLOCK_K is one module constant, so no
    batch size can change an element's K order. Tiles are powers of two >= 16 (tl.dot)."""
    starts = [start for start, _, _ in TILES_FROM_PAIRS]
    assert starts[0] == 0 and starts == sorted(set(starts))
    for _, (block_m, block_n, warps, stages), in_grid in TILES_FROM_PAIRS:
        assert isinstance(in_grid, bool)
        for size in (block_m, block_n):
            assert size >= 16 and size & (size - 1) == 0, size
        assert warps in (1, 2, 4, 8, 16) and stages >= 1
    assert experts_tiles.BLOCK_K == 64


def test_a_negative_pair_count_is_refused():
    with pytest.raises(ValueError, match="pairs must be >= 0"):
        tiles_for(-1)


def test_the_slot_tree_takes_powers_of_two_up_to_16():
    """The Triton slot sum's written-out halving tree: k = 1, 2, 4, 8, 16; others keep
    `tree_sum_ref` (the same order) or refuse the fused norm."""
    assert [k for k in range(0, 40) if experts_tiles.slot_tree_fits(k)] == [1, 2, 4, 8, 16]


def test_prefill_sizes_load_expert_tiles_by_tma():
    """From TMA_FROM_PAIRS routed pairs (the large, in-grid tiles' range) both expert kernels
    load their weight tiles (and down its intermediate tiles) by tensor descriptors."""
    from samebits.kernels.experts_tiles import TMA_FROM_PAIRS, tma_for

    assert tma_for(TMA_FROM_PAIRS) == (True, True) and tma_for(TMA_FROM_PAIRS - 1) == (False, False)
    assert tiles_for(TMA_FROM_PAIRS) == LARGE_TILES


_TMA_EXPERTS = """
from samebits.kernels import experts_launch as el
g = torch.Generator().manual_seed(0)
T, K, E, H, I = 40, 2, 4, 200, 88  # H: a partial K block (BLOCK_K 64); I: partial column tiles
x = torch.randn(T, H, generator=g).half()
idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
wts = torch.rand(T, K, generator=g).half()
gu = (torch.randn(E, 2 * I, H, generator=g) * 0.1).half()
dn = (torch.randn(E, H, I, generator=g) * 0.1).half()
for in_grid in (True, False):
    kw = dict(tiles=(32, 32, 4, 2), m_in_grid=in_grid)
    want = el.experts_forward(x, idx, wts, gu, dn, tma=(False, False), **kw)
    for tma in ((True, False), (False, True), (True, True)):
        got = el.experts_forward(x, idx, wts, gu, dn, tma=tma, **kw)
        assert torch.equal(got, want), (in_grid, tma, (got.float() - want.float()).abs().max())
    # control: the same products summed from the other end of H give other bits
    xf, guf = x.flip(1).contiguous(), gu.flip(2).contiguous()
    flip = el.experts_forward(xf, idx, wts, guf, dn, tma=(True, True), **kw)
    assert not torch.equal(flip, want)
print("OK")
"""


def test_tma_expert_tiles_give_the_pointer_loads_bits_in_tritons_interpreter():
    """`experts_forward` with gate_up's weight tiles, down's operand tiles, or both loaded by
    tensor descriptors = the pointer loads, bit for bit, in Triton's CPU interpreter (fp16),
    with partial K and column tiles, row blocks in the grid and walked. This checks the
    descriptors' row offsets (each expert's gate and up halves, down's rows); the GPU test
    checks the tensor cores' bits. Control: H reversed gives other bits."""
    from interpreted import run_interpreted

    run_interpreted(_TMA_EXPERTS)


def test_down_takes_its_wide_tiles_with_the_large_entry_only():
    """down's tiles (`down_tiles_for`): the gate_up entry's everywhere but with the large entry,
    where it takes DOWN_LARGE_TILES (256 columns; the GPU test compares their bits)."""
    from samebits.kernels.experts_tiles import DOWN_LARGE_TILES, down_tiles_for

    assert down_tiles_for(8192) == DOWN_LARGE_TILES and down_tiles_for(10**6) == DOWN_LARGE_TILES
    for pairs in (0, 8, 1023, 1024, 8191):
        assert down_tiles_for(pairs) == tiles_for(pairs)
