"""CUDA: the Triton experts pick their tiles by the batch size (`experts_tiles.tiles_for`), and
no row's bits follow. At the real Qwen3-30B-A3B experts shape (128 experts, top-8, H 2048,
I 768), where an element sums 2048 (gate/up) and 768 (down) products, so its K order shows
in the bits (the controls below)."""

from __future__ import annotations

import pytest
import torch

from samebits.kernels.experts_tiles import DECODE_TILES, DOWN_LARGE_TILES, LARGE_TILES, SMALL_TILES, tiles_for

pytestmark = pytest.mark.gpu

E, K, H, INTER, T_BIG = 128, 8, 2048, 768, 1500


def _g(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.fixture(scope="module")
def inputs():
    """x [T_BIG, H], index and weights [T_BIG, K], gate_up [E, 2I, H], down [E, H, I]; bf16."""
    x = torch.randn(T_BIG, H, device="cuda", generator=_g(0)).bfloat16()
    logits = torch.randn(T_BIG, E, device="cuda", generator=_g(1))
    weights, index = torch.softmax(logits, -1).topk(K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    gate_up = (torch.randn(E, 2 * INTER, H, device="cuda", generator=_g(2)) * H**-0.5).bfloat16()
    down = (torch.randn(E, H, INTER, device="cuda", generator=_g(3)) * INTER**-0.5).bfloat16()
    return x, index, weights, gate_up, down


def _forward(inputs, rows=slice(None), **kw):
    from samebits.kernels.experts_launch import experts_forward

    x, index, weights, gate_up, down = inputs
    return experts_forward(x[rows], index[rows], weights[rows], gate_up, down, **kw)


@pytest.mark.parametrize("t", [1, 8, 127, 128, 1023, 1024, T_BIG])
def test_the_automatic_tiles_give_the_bits_of_every_entry_forced(inputs, t):
    """On both sides of each switch (128 and 1024 tokens at top-8), the table's choice and each
    entry forced, with the row blocks walked in a program or laid out in the grid, give one
    result, bit for bit (from 1024 tokens the table's down runs DOWN_LARGE_TILES)."""
    rows = slice(T_BIG - t, T_BIG)
    auto = _forward(inputs, rows)
    if t >= 1024:  # the table's down tiles (and TMA) against down's 128 columns and pointer loads
        assert torch.equal(auto, _forward(inputs, rows, tiles=LARGE_TILES, tma=(False, False)))
    for tiles in (DECODE_TILES, SMALL_TILES, LARGE_TILES):
        for m_in_grid in (False, True):  # an expert's row blocks walked by one program, or in the grid
            assert torch.equal(auto, _forward(inputs, rows, tiles=tiles, m_in_grid=m_in_grid)), (t, tiles)


def test_rows_of_a_prefill_sized_call_equal_the_same_rows_in_decode_sized_calls(inputs):
    """Rows computed inside one T_BIG call (large tiles) equal them computed in calls under the
    switches (small and decode tiles), at the start, middle and end of the batch; and in a
    second call over the switch at another offset."""
    assert tiles_for(T_BIG * K) == LARGE_TILES
    full = _forward(inputs)
    for start, m in ((0, 1), (T_BIG - 1, 1), (700, 7), (333, 64), (1100, 300), (0, 1023), (T_BIG - 1024, 1024)):
        assert tiles_for(m * K) == (LARGE_TILES if m >= 1024 else SMALL_TILES if m >= 128 else DECODE_TILES)
        rows = slice(start, start + m)
        assert torch.equal(_forward(inputs, rows), full[rows]), (start, m)


def _roll_h(inputs, s):
    """The same sums with each gate/up element's H products in another order (rotated by s)."""
    x, index, weights, gate_up, down = inputs
    return x.roll(s, dims=1), index, weights, gate_up.roll(s, dims=2), down


def _roll_i(inputs, s):
    """The same sums with each down element's I products in another order: the intermediate
    columns rotated by s (gate and up rows of gate_up, the columns of down)."""
    x, index, weights, gate_up, down = inputs
    gate_up = gate_up.view(E, 2, INTER, H).roll(s, dims=2).reshape(E, 2 * INTER, H)
    return x, index, weights, gate_up, down.roll(s, dims=2)


@pytest.mark.parametrize("reorder", [_roll_h, _roll_i], ids=["gate_up_K", "down_K"])
def test_control_another_k_order_changes_the_bits_the_tiles_do_not(inputs, reorder):
    """Negative control for the reason the table is safe: the tiles never change an element's
    K order, and at this shape the K order is visible. The same products summed from another
    start (exactly the same math) give other bits, in both kernels, with either tile entry;
    the difference is rounding-sized."""
    for tiles in (DECODE_TILES, SMALL_TILES, LARGE_TILES):
        base = _forward(inputs, tiles=tiles)
        other = _forward(reorder(inputs, 40), tiles=tiles)
        assert not torch.equal(other, base), tiles
        err = ((other.double() - base.double()).abs() / (base.double().abs() + 1)).max().item()
        assert err < 3e-2, (tiles, err)


def test_tma_loads_give_the_pointer_loads_bits(inputs, monkeypatch):
    """At prefill sizes (`tma_for`) the kernels load gate_up's weight tiles and down's operand
    tiles by tensor descriptors: with either or both, at each of the large entries, every bit
    equals the pointer loads' (the control above runs with them on: T_BIG is past the switch)."""
    from samebits.kernels import experts_launch as el
    from samebits.kernels.device_facts import tma_compared

    if not tma_compared(torch.device("cuda")):
        pytest.skip("TMA tiles run only where their bits were compared (NVIDIA compute capability 9.x)")
    assert el.tma_for(T_BIG * K) == (True, True)
    made = []
    descriptor = el._descriptor
    monkeypatch.setattr(el, "_descriptor", lambda *a: made.append(1) or descriptor(*a))
    pointer = _forward(inputs, tma=(False, False))
    assert not made
    assert torch.equal(_forward(inputs), pointer) and len(made) == 3  # the table's choice: both
    for tiles in (SMALL_TILES, LARGE_TILES):
        for tma in ((True, False), (False, True), (True, True)):
            assert torch.equal(_forward(inputs, tiles=tiles, tma=tma), pointer), (tiles, tma)


def test_tma_loads_at_widths_that_are_not_multiples_of_the_tiles():
    """TMA at H = 2056 and I = 776 (neither a multiple of BLOCK_K or of the column tiles): gate's
    last column tile reads up's rows, up's the next expert's, down's the next expert's rows, and
    the K tails are the descriptors' zero fill; none of it may reach a stored element. Every
    combination, at the large tiles and down's wide ones, equals the pointer loads bit for bit."""
    from samebits.kernels.device_facts import tma_compared
    from samebits.kernels.experts_launch import experts_forward

    if not tma_compared(torch.device("cuda")):
        pytest.skip("TMA tiles run only where their bits were compared (NVIDIA compute capability 9.x)")
    e, k, h, inter, t = 16, 2, 2056, 776, 4200  # 8400 pairs: past the TMA switch
    x = torch.randn(t, h, device="cuda", generator=_g(20)).bfloat16()
    weights, index = torch.softmax(torch.randn(t, e, device="cuda", generator=_g(21)), -1).topk(k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    gate_up = (torch.randn(e, 2 * inter, h, device="cuda", generator=_g(22)) * h**-0.5).bfloat16()
    down = (torch.randn(e, h, inter, device="cuda", generator=_g(23)) * inter**-0.5).bfloat16()
    args = (x, index, weights, gate_up, down)
    pointer = experts_forward(*args, tiles=LARGE_TILES, tma=(False, False))
    for down_tiles in (LARGE_TILES, DOWN_LARGE_TILES):
        for tma in ((True, False), (False, True), (True, True)):
            got = experts_forward(*args, tiles=LARGE_TILES, tma=tma, down_tiles=down_tiles)
            assert torch.equal(got, pointer), (down_tiles, tma)
