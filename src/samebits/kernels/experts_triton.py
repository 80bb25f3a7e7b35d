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

This module is the forward only. The `samebits::experts` op
(`samebits.numerics.ops`) gives it a backward, the closed form of
`experts_backward.experts_backward` on grouped GEMMs: gradients reach the hidden
states, the routing weights and both expert weights. Only the forward carries the
bitwise contract.

Shapes: T = tokens, K = top-k, N = T*K pairs, E = experts, H = hidden,
I = expert intermediate.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from samebits.kernels.device_facts import shared_memory_per_block, tma_usable
from samebits.kernels.experts import route
from samebits.kernels.experts_tiles import (
    BLOCK_K,
    DECODE_TILES,
    down_tiles_for,
    m_in_grid_for,
    slot_tree_fits,
    tiles_for,
    tma_for,
)
from samebits.kernels.grid import cdiv, next_power_of_2
from samebits.kernels.launch import fast_launch
from samebits.kernels.pdl import launch_args, pdl_release, pdl_wait
from samebits.kernels.reduce import tree_sum_ref

BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = DECODE_TILES  # the decode entry of the tile table
_DTYPES = (torch.bfloat16, torch.float16)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (development only)


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


def experts_forward(
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, K]
    top_k_weights: torch.Tensor,  # [T, K]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
    block_k: int = BLOCK_K,
    tiles: tuple[int, int, int, int] | None = None,
    m_in_grid: bool | None = None,
    sum_slots: bool = True,
    tma: tuple[bool, bool] | None = None,
    down_tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Sum over k of `weight_k * down_e(silu(gate_e(x)) * up_e(x))` -> [T, H], batch invariant.

    The tiles are `tiles_for(T * K)`: chosen by the batch's size alone, and with BLOCK_K
    fixed a row's bits do not depend on which entry ran (module docstring). `tiles` =
    (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the table for experiments and tests
    (`benchmarks/experts_configs.py`). `block_k` exists for experiments; samebits always
    uses BLOCK_K. `m_in_grid`: one program per (BLOCK_M rows of an expert, column tile)
    instead of one per (expert, column tile) walking its rows (`_m_range`); the same row
    blocks, so the same bits. None: `m_in_grid_for(T * K)`. `sum_slots=False`: return the
    weighted slot outputs [T, K, H] fp32 before the top-k sum (`experts_ref_slots`), for a
    consumer that sums them itself (`norm_rope_triton.slot_add_rms_norm`). `tma`: (gate_up's
    weight tiles, down's operand tiles) loaded by tensor descriptors (the same dots in the
    same order, so the same bits); None: `tma_for(T * K)` where the tensors allow it.
    `down_tiles`: down's own (BLOCK_M, BLOCK_N, num_warps, num_stages) (None: `tiles`, or
    without `tiles` the table's `down_tiles_for(T * K)`).
    """
    _check(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    t, k = top_k_index.shape
    block_m, block_n, warps, stages = tiles or tiles_for(t * k)
    stages = _stages_that_fit(hidden_states.device, block_m, block_n, block_k, stages)
    e, two_i, h = gate_up_proj.shape
    i = two_i // 2
    if t == 0:
        return hidden_states.new_zeros(0, h) if sum_slots else torch.zeros(0, k, h, device=hidden_states.device)
    order, offsets = route_pairs(top_k_index, e)
    in_grid = m_in_grid_for(t * k) if m_in_grid is None else m_in_grid
    # M_IN_GRID: an expert's blocks are floor(its pairs / BLOCK_M), plus one partial block if it
    # has pairs at all, so at most cdiv(pairs, BLOCK_M) + min(E, pairs) blocks (9 at one token)
    rows_axis = cdiv(t * k, block_m) + min(e, t * k) if in_grid else e
    grid_m = dict(M_IN_GRID=in_grid, E=e, E_PAD=next_power_of_2(e))
    inter = torch.empty(t * k, i, dtype=hidden_states.dtype, device=hidden_states.device)
    tma_gate_up, tma_down = _tma_choice(tma, t * k, gate_up_proj, down_proj)
    # a descriptor is a positional runtime argument (the weights themselves, not read, without
    # TMA): `fast_launch` binds only launches whose runtime arguments all come by position
    gu_desc = _descriptor(gate_up_proj.view(e * two_i, h), [block_n, block_k]) if tma_gate_up else gate_up_proj
    gate_up_kernel[(rows_axis, cdiv(i, block_n))](
        hidden_states,
        gate_up_proj,
        inter,
        order,
        offsets,
        gu_desc,
        h,
        i,
        k,
        hidden_states.stride(0),
        gate_up_proj.stride(0),
        gate_up_proj.stride(1),
        inter.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
        **grid_m,
        W_TMA=tma_gate_up,
        **launch_args(hidden_states.device),
    )
    per_slot = torch.empty(t * k, h, dtype=torch.float32, device=hidden_states.device)
    if down_tiles is None:
        down_tiles = (block_m, block_n, warps, stages) if tiles is not None else down_tiles_for(t * k)
    d_block_m, d_block_n, d_warps, d_stages = down_tiles
    d_stages = _stages_that_fit(hidden_states.device, d_block_m, d_block_n, block_k, d_stages, weight_tiles=1)
    d_rows_axis = cdiv(t * k, d_block_m) + min(e, t * k) if in_grid else e
    h_desc, dw_desc = inter, down_proj
    if tma_down:
        h_desc = _descriptor(inter, [d_block_m, block_k])
        dw_desc = _descriptor(down_proj.view(e * h, i), [d_block_n, block_k])
    down_kernel[(d_rows_axis, cdiv(h, d_block_n))](
        inter,
        down_proj,
        per_slot,
        top_k_weights,
        order,
        offsets,
        h_desc,
        dw_desc,
        h,
        i,
        inter.stride(0),
        down_proj.stride(0),
        down_proj.stride(1),
        per_slot.stride(0),
        BLOCK_M=d_block_m,
        BLOCK_N=d_block_n,
        BLOCK_K=block_k,
        num_warps=d_warps,
        num_stages=d_stages,
        **grid_m,
        TMA=tma_down,
        **launch_args(hidden_states.device),
    )
    per_slot = per_slot.view(t, k, h)
    return per_slot if not sum_slots else slot_sum(per_slot, hidden_states.dtype)


# `SAMEBITS_TMA_EXPERTS=0`: the pointer loads at every size (A/B timing; the same bits).
TMA = os.environ.get("SAMEBITS_TMA_EXPERTS", "1") != "0"


def _tma_choice(tma, pairs, gate_up, down) -> tuple[bool, bool]:
    """`tma` as given (refused where the tensors do not allow it), or the table's where they do."""
    if tma is not None:
        if any(tma) and not _tma_fits(gate_up, down):
            raise ValueError(
                "experts (Triton): TMA needs an NVIDIA compute capability 9.x device, contiguous weights with "
                "16-byte aligned rows, and no CUDA graph capture"
            )
        return tma
    want = tma_for(pairs) if TMA else (False, False)
    return want if any(want) and _tma_fits(gate_up, down) else (False, False)


def _tma_fits(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Descriptors over the weights (and the intermediate): a device where their bits were
    compared and no graph capture (`device_facts.tma_usable`; Triton's interpreter in
    development), contiguous weights with 16-byte aligned bases and rows (H and I multiples of 8
    at 16 bits)."""
    return (
        (_INTERPRET or tma_usable(gate_up.device))
        and gate_up.is_contiguous()
        and down.is_contiguous()
        and gate_up.shape[2] % 8 == 0
        and down.shape[2] % 8 == 0
        and gate_up.data_ptr() % 16 == 0
        and down.data_ptr() % 16 == 0
    )


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


SLOT_BLOCK_H = 512


def slot_sum(slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, K, H] fp32 weighted slot outputs -> [T, H] in `dtype`: the top-k sum `experts_forward`
    ends with (`slot_sum_kernel`; `tree_sum_ref`, the same order, where the kernel's tree does
    not fit K)."""
    t, k, h = slots.shape
    if not slot_tree_fits(k):
        return tree_sum_ref(slots, dim=1).to(dtype)
    slots = slots.contiguous()
    out = torch.empty(t, h, dtype=dtype, device=slots.device)
    if t:
        slot_sum_kernel[(t, cdiv(h, SLOT_BLOCK_H))](slots, out, h, K=k, BLOCK_H=SLOT_BLOCK_H, num_warps=4)
    return out


def _stages_that_fit(
    device: torch.device, block_m: int, block_n: int, block_k: int, stages: int, weight_tiles: int = 2
) -> int:
    """`stages`, or fewer where the device's shared memory a block cannot hold that many copies
    of a kernel's tiles (x [BM, BK] and `weight_tiles` [BK, BN]: gate_up's gate and up, down's
    one; 2 bytes an element). Stages only pipeline the loads: no element's K order, so no bit,
    depends on them."""
    shared = shared_memory_per_block(device)
    if not shared:  # unknown here: the stages are taken as they are
        return stages
    per_stage = (block_m * block_k + weight_tiles * block_k * block_n) * 2
    return max(2, min(stages, shared // per_stage))


def route_pairs(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`experts.route` (the same order and offsets): one launch of n / ROUTE_PAIRS programs up
    to MAX_ROUTED pairs, else the torch ops."""
    n = top_k_index.numel()
    if n > MAX_ROUTED:
        return route(top_k_index, num_experts)
    flat = top_k_index.reshape(-1)
    order = torch.empty(n, dtype=torch.int32, device=flat.device)
    if n == 0:
        return order, torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=flat.device)
    n_pad = next_power_of_2(n)
    pairs = min(ROUTE_PAIRS, n_pad)
    route_kernel[(cdiv(n, pairs),)](
        flat, order, offsets, n,
        N_PAD=n_pad, E=num_experts, E_PAD=next_power_of_2(num_experts), PAIRS=pairs, num_warps=4,
        **launch_args(flat.device),
    )  # fmt: skip
    return order, offsets


def _check(x, index, weights, gate_up, down) -> None:
    if x.dim() != 2 or index.shape != weights.shape or index.shape[0] != x.shape[0]:
        raise ValueError(
            f"experts: hidden {tuple(x.shape)}, top_k_index {tuple(index.shape)} and top_k_weights "
            f"{tuple(weights.shape)} disagree"
        )
    e, two_i, h = gate_up.shape
    if x.shape[1] != h or down.shape != (e, h, two_i // 2):
        raise ValueError(
            f"experts: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} disagree"
        )
    if not all(t.is_cuda for t in (x, index, weights, gate_up, down)) and not _INTERPRET:
        raise ValueError("experts (Triton) needs CUDA tensors; use experts_ref on the CPU")
    if x.dtype not in _DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"experts (Triton) needs hidden and expert weights of one dtype in {_DTYPES}")
    if x.stride(1) != 1 or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("experts (Triton): hidden and expert weights must be contiguous in their last dim")
    if not weights.is_contiguous():
        raise ValueError("experts (Triton): top_k_weights must be contiguous")
