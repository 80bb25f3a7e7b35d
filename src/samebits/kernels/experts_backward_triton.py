"""The experts' backward's elementwise middle on CUDA in one launch: `experts_backward.pointwise_ref`'s
contract, fp32 inside, no bitwise contract (gradients carry none).

Per pair row j in expert order (p = order[j] its pair, w = top_k_weights[p]), over I columns:
    da = w u,   dgate = da up silu'(gate),   dup = da silu(gate)      -> dh[j] = [dgate; dup]
    dw[p] = sum over I of u silu(gate) up                            (only where wanted)
written straight to dw's pair position, so nothing is permuted back afterwards. The torch form
is ~15 host ops a call (a gather of the weights, silu, five products, silu_backward, the
concatenation, the casts and sum of dw, its scatter back to pair order); the trainer's update
is bound by host ops (docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samebits.kernels.grid import cdiv, next_power_of_2
from samebits.kernels.launch import fast_launch

ROWS = 4  # pair rows a program
MAX_BLOCK_I = 1024  # columns a step of a row's loop
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@fast_launch
@triton.jit
def pointwise_kernel(
    gate_up_ptr, u_ptr, order_ptr, w_ptr, dh_ptr, dw_ptr,
    n, inter, stride_gu, stride_u, stride_dh,
    WANT_DW: tl.constexpr, ROWS: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
    live = rows < n
    pair = tl.load(order_ptr + rows, mask=live, other=0).to(tl.int64)
    w = tl.load(w_ptr + pair, mask=live, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK_I], dtype=tl.float32)
    for c in range(0, inter, BLOCK_I):
        cols = c + tl.arange(0, BLOCK_I)[None, :]
        mask = live & (cols < inter)
        gate = tl.load(gate_up_ptr + rows * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + rows * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        act = gate * sig
        da = u * w
        dgate = da * up * (sig * (1.0 + gate * (1.0 - sig)))  # silu'(g) = sig (1 + g (1 - sig))
        out = dh_ptr + rows * stride_dh + cols
        tl.store(out, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(out + inter, (da * act).to(dh_ptr.dtype.element_ty), mask=mask)
        if WANT_DW:
            dw += u * act * up
    if WANT_DW:
        tl.store(dw_ptr + pair, tl.sum(dw, axis=1)[:, None], mask=live)


def supported(gate_up: torch.Tensor, u: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor) -> bool:
    """CUDA float gate_up [N, 2I] and u [N, I] with contiguous rows, order [N] of N = T * K pairs."""
    return (
        gate_up.is_cuda
        and gate_up.dim() == 2
        and u.dim() == 2
        and gate_up.dtype in _DTYPES
        and u.dtype in _DTYPES
        and top_k_weights.dtype in _DTYPES
        and gate_up.shape == (u.shape[0], 2 * u.shape[1])
        and gate_up.stride(1) == 1
        and u.stride(1) == 1
        and order.shape == (u.shape[0],)
        and top_k_weights.numel() == u.shape[0]
    )


def pointwise(gate_up, u, order, top_k_weights, want_dw):
    """`pointwise_ref` in one launch -> (dh [N, 2I] in gate_up's dtype, dw [T * K] fp32 or None)."""
    if not supported(gate_up, u, order, top_k_weights):
        raise ValueError(
            f"experts backward pointwise: CUDA gate_up [N, 2I] {tuple(gate_up.shape)} and u [N, I] "
            f"{tuple(u.shape)} with contiguous rows, order [N] {tuple(order.shape)}, N weights"
        )
    n, inter = u.shape
    dh = torch.empty(n, 2 * inter, dtype=gate_up.dtype, device=gate_up.device)
    dw = torch.empty(n, dtype=torch.float32, device=gate_up.device) if want_dw else None
    if n:
        weights = top_k_weights.reshape(-1)
        pointwise_kernel[(cdiv(n, ROWS),)](
            gate_up, u, order, weights, dh, dw if want_dw else dh,
            n, inter, gate_up.stride(0), u.stride(0), dh.stride(0),
            WANT_DW=want_dw, ROWS=ROWS, BLOCK_I=min(MAX_BLOCK_I, next_power_of_2(inter)), num_warps=4,
        )  # fmt: skip
    return dh, dw
