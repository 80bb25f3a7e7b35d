"""The host side of the CUDA MoE expert kernels (`experts_triton.py`): their launchers.

`experts_forward` checks its inputs (`_check`), routes the pairs (`route_pairs`: one launch
of `route_kernel`, or the torch ops past MAX_ROUTED), takes the tiles from
`experts_tiles` (or the caller's, for experiments), fits the stages to the device's shared
memory (`_stages_that_fit`), picks the pointer or the tensor-descriptor (TMA) loads
(`_tma_choice`), and launches `gate_up_kernel` then `down_kernel`; `slot_sum` sums the
weighted top-k slots (`slot_sum_kernel`). None of these choices changes a bit: BLOCK_K and
every element's K order are fixed (`experts_triton.py`'s docstring).

Shapes: T = tokens, K = top-k, N = T*K pairs, E = experts, H = hidden,
I = expert intermediate.
"""

from __future__ import annotations

import os

import torch

from samebits.kernels.device_facts import shared_memory_per_block, tma_usable
from samebits.kernels.experts import route
from samebits.kernels.experts_tiles import (
    BLOCK_K,
    down_tiles_for,
    m_in_grid_for,
    slot_tree_fits,
    tiles_for,
    tma_for,
)
from samebits.kernels.experts_triton import (
    MAX_ROUTED,
    ROUTE_PAIRS,
    down_kernel,
    gate_up_kernel,
    route_kernel,
    slot_sum_kernel,
)
from samebits.kernels.grid import cdiv, next_power_of_2
from samebits.kernels.pdl import launch_args
from samebits.kernels.reduce import tree_sum_ref

_DTYPES = (torch.bfloat16, torch.float16)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (development only)


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
