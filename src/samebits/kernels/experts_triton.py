"""Batch-invariant fused MoE experts for CUDA: two Triton kernels and a backward.

The (token, slot) pairs are sorted by expert on the device (no host sync, so
the step can be captured in a CUDA graph). `gate_up_kernel` gives each program
one expert and one tile of I columns; it walks that expert's rows in BLOCK_M
chunks (from 8192 pairs, one chunk a program: `_m_range`) and H in BLOCK_K
steps, for the gate and the up half at once, and writes
`act(gate) * up` (each rounded to the activation dtype, as transformers rounds
them). `down_kernel` does the same over I for the down projection, keeps the
result in fp32, multiplies it by the routing weight in fp32 and stores it at the
pair's own slot. The top-k slots are then summed in a fixed pairwise tree and
rounded once. No split-K and one BLOCK_K for every batch: each element's K order
is fixed, so a row's bits depend on its own token and weights alone. The other tile
choices (BLOCK_M, BLOCK_N, warps, stages) follow the number of routed pairs
(`experts_tiles.tiles_for`: narrow tiles below 128 tokens, small ones up to 1024,
large ones for prefill chunks);
they never change that order, so they never change a bit. Expert weights
are read in place in the transformers layout: gate_up_proj [E, 2I, H] ([gate;
up] on dim 1), down_proj [E, H, I].

This module is the forward's kernels; their launchers (`experts_forward`, `route_pairs`,
`slot_sum`) are in `experts_launch.py`. The `samebits::experts` op
(`samebits.numerics.ops`) gives it a backward, the closed form of
`experts_backward.experts_backward` on grouped GEMMs: gradients reach the hidden
states, the routing weights and both expert weights. Only the forward carries the
bitwise contract.

Shapes: T = tokens, K = top-k, N = T*K pairs, E = experts, H = hidden,
I = expert intermediate.
"""

from __future__ import annotations

import triton
import triton.language as tl

from samebits.kernels.experts_tiles import DECODE_TILES
from samebits.kernels.launch import fast_launch
from samebits.kernels.pdl import pdl_release, pdl_wait

BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = DECODE_TILES  # the decode entry of the tile table


MAX_ROUTED = 4096  # pairs `route_kernel` places (decode batches up to 512 x 8); more: the torch ops
ROUTE_PAIRS = 64  # most pairs a `route_kernel` program places ([pairs, E] one-hot counts)


@fast_launch
@triton.jit
def route_kernel(
    index_ptr, order_ptr, offsets_ptr, n,
    N_PAD: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, PAIRS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """`experts.route`, counted rather than sorted: program p places pairs [p PAIRS, (p + 1)
    PAIRS). Pair i of expert e goes to (pairs of experts < e) + (pairs of expert e before i),
    which is where a stable sort by expert puts it. Each program histograms all n pairs (n
    <= MAX_ROUTED, one load) for those counts; program 0 also writes the offsets."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    first = pid * PAIRS
    pairs = tl.arange(0, N_PAD)
    valid = pairs < n
    expert = tl.load(index_ptr + pairs, mask=valid, other=0).to(tl.int32)
    counts = tl.histogram(expert, E_PAD, mask=valid)
    ends = tl.cumsum(counts, 0)
    base = ends - counts + tl.histogram(expert, E_PAD, mask=valid & (pairs < first))  # [E_PAD]
    mine = first + tl.arange(0, PAIRS)
    in_chunk = mine < n
    e_mine = tl.load(index_ptr + mine, mask=in_chunk, other=0).to(tl.int32)
    bins = tl.arange(0, E_PAD)
    onehot = ((e_mine[:, None] == bins[None, :]) & in_chunk[:, None]).to(tl.int32)  # [PAIRS, E_PAD]
    rank = tl.cumsum(onehot, 0) - onehot  # the chunk's earlier pairs of the same expert
    pdl_release(PDL)
    tl.store(order_ptr + tl.sum(onehot * (base[None, :] + rank), 1), mine, mask=in_chunk)
    if pid == 0:
        tl.store(offsets_ptr + 1 + bins, ends, mask=bins < E)
        tl.store(offsets_ptr + bins, 0, mask=bins == 0)


@fast_launch
@triton.jit
def slot_sum_kernel(per_slot_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """[T, K, H] fp32 -> [T, H] in out's dtype: the top-k slots summed in `tree_sum_ref`'s
    halving order (slot j onto j + K/2, ...; K a power of two), rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    x = _slot_tree_sum(per_slot_ptr, t, cols, H, K, BLOCK_H)
    tl.store(out_ptr + t * H + cols, x.to(out_ptr.dtype.element_ty), mask=cols < H)


@triton.jit
def _slot_tree_sum(per_slot_ptr, t, cols, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Columns `cols` of token t's K slots in [T, K, H] fp32 -> [BLOCK_H] fp32, summed in
    `tree_sum_ref`'s halving order (the sum over K is per column, so any column blocking gives
    the same bits). Shared by `slot_sum_kernel` and the fused norm (`norm_rope_triton`)."""
    slots = tl.arange(0, K)
    x = tl.load(
        per_slot_ptr + (t * K + slots[:, None]) * H + cols[None, :], mask=(cols < H)[None, :], other=0.0
    )
    if K >= 2:
        x = tl.sum(tl.reshape(x, (2, K // 2, BLOCK_H)), axis=0)
    if K >= 4:
        x = tl.sum(tl.reshape(x, (2, K // 4, BLOCK_H)), axis=0)
    if K >= 8:
        x = tl.sum(tl.reshape(x, (2, K // 8, BLOCK_H)), axis=0)
    if K >= 16:
        x = tl.sum(tl.reshape(x, (2, K // 16, BLOCK_H)), axis=0)
    return tl.reshape(x, (BLOCK_H,))


@triton.jit
def _m_range(
    offsets_ptr, e, BLOCK_M: tl.constexpr, M_IN_GRID: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr
):
    """-> (expert, first row, end of this program's rows, end of the expert's rows).
    M_IN_GRID=False: program axis 0 is the expert, which walks all its rows. M_IN_GRID=True:
    axis 0 is a BLOCK_M block of some expert's rows (expert e's blocks follow expert e-1's;
    programs past the last block get an empty range): the same row blocks, one a program, so
    programs sharing an expert's weight tile run side by side and share it in L2."""
    if M_IN_GRID:
        b = e
        experts = tl.arange(0, E_PAD)
        ends = tl.load(offsets_ptr + 1 + experts, mask=experts < E, other=0)
        starts = tl.load(offsets_ptr + experts, mask=experts < E, other=0)
        blocks = tl.where(experts < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        block_ends = tl.cumsum(blocks, 0)
        e = tl.sum((block_ends <= b).to(tl.int32), 0)  # the expert whose blocks hold b
        e_ok = e < E
        e = tl.where(e_ok, e, 0)
        first_block = tl.sum(tl.where(experts == e, block_ends - blocks, 0), 0)
        start = tl.load(offsets_ptr + e)
        end = tl.load(offsets_ptr + e + 1)
        m_lo = start + (b - first_block) * BLOCK_M
        m_hi = tl.where(e_ok, m_lo + 1, m_lo)  # one block, or none past the last
    else:
        start = tl.load(offsets_ptr + e)
        end = tl.load(offsets_ptr + e + 1)
        m_lo = start
        m_hi = end
    return e, m_lo, m_hi, end


@fast_launch
@triton.jit
def gate_up_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    order_ptr,
    offsets_ptr,
    w_desc,  # W_TMA: a tensor descriptor over w as [E * 2I, H]; else not read (w itself)
    H,
    INTER,
    TOP_K,
    stride_xt,
    stride_we,
    stride_wn,
    stride_hn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_IN_GRID: tl.constexpr = False,
    E: tl.constexpr = 1,
    E_PAD: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    W_TMA: tl.constexpr = False,
):
    pdl_wait(PDL)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e, m_lo, m_hi, end = _m_range(offsets_ptr, tl.program_id(0), BLOCK_M, M_IN_GRID, E, E_PAD)
    kk = tl.arange(0, BLOCK_K)
    w_row = e * (2 * INTER) + tl.program_id(1) * BLOCK_N  # W_TMA: gate's first row in [E * 2I, H]
    w_gate = w_ptr + e.to(tl.int64) * stride_we + cols[None, :] * stride_wn + kk[:, None]  # [BK, BN]
    w_up = w_gate + INTER * stride_wn
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        in_rows = rows < end
        token = tl.load(order_ptr + rows, mask=in_rows, other=0) // TOP_K
        x_rows = x_ptr + token.to(tl.int64)[:, None] * stride_xt + kk[None, :]
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = kk < H - k0
            x = tl.load(x_rows + k0, mask=in_rows[:, None] & k_ok[None, :], other=0.0)
            if W_TMA:  # columns past H load as 0; rows past I are other columns, never stored
                acc_gate = tl.dot(x, w_desc.load([w_row, k0]).T, acc_gate)
                acc_up = tl.dot(x, w_desc.load([w_row + INTER, k0]).T, acc_up)
            else:
                w_mask = k_ok[:, None] & (cols[None, :] < INTER)
                acc_gate = tl.dot(x, tl.load(w_gate + k0, mask=w_mask, other=0.0), acc_gate)
                acc_up = tl.dot(x, tl.load(w_up + k0, mask=w_mask, other=0.0), acc_up)
        pdl_release(PDL)  # after each row block's K loop (a repeat is a no-op)
        gate = acc_gate.to(h_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(h_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(h_ptr.dtype.element_ty).to(tl.float32)  # silu
        h = (act * up).to(h_ptr.dtype.element_ty)
        tl.store(
            h_ptr + rows.to(tl.int64)[:, None] * stride_hn + cols[None, :],
            h,
            mask=in_rows[:, None] & (cols[None, :] < INTER),
        )


@fast_launch
@triton.jit
def down_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    order_ptr,
    offsets_ptr,
    h_desc,  # TMA: tensor descriptors over h [N, I] and w as [E * H, I]; else not read
    w_desc,
    H,
    INTER,
    stride_hn,
    stride_we,
    stride_wn,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_IN_GRID: tl.constexpr = False,
    E: tl.constexpr = 1,
    E_PAD: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    TMA: tl.constexpr = False,
):
    pdl_wait(PDL)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e, m_lo, m_hi, end = _m_range(offsets_ptr, tl.program_id(0), BLOCK_M, M_IN_GRID, E, E_PAD)
    kk = tl.arange(0, BLOCK_K)
    w_row = e * H + tl.program_id(1) * BLOCK_N  # TMA: the tile's first row in [E * H, I]
    w_tile = w_ptr + e.to(tl.int64) * stride_we + cols[None, :] * stride_wn + kk[:, None]  # [BK, BN]
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        in_rows = rows < end
        h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hn + kk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            if TMA:  # past I loads 0; rows past the expert's (or columns past H) are never stored
                acc = tl.dot(h_desc.load([m0, k0]), w_desc.load([w_row, k0]).T, acc)
            else:
                k_ok = kk < INTER - k0
                a = tl.load(h_rows + k0, mask=in_rows[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_tile + k0, mask=k_ok[:, None] & (cols[None, :] < H), other=0.0)
                acc = tl.dot(a, w, acc)
        pdl_release(PDL)  # after each row block's K loop (a repeat is a no-op)
        slot = tl.load(order_ptr + rows, mask=in_rows, other=0)
        weight = tl.load(weights_ptr + slot, mask=in_rows, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + slot.to(tl.int64)[:, None] * stride_on + cols[None, :],
            acc * weight[:, None],
            mask=in_rows[:, None] & (cols[None, :] < H),
        )
