"""The RMSNorm's backward on CUDA in one launch (+ a column sum for dw): `rms_norm_backward_ref`'s
formula (`kernels/norm_backward.py`), fp32 inside, no bitwise contract.

Each program walks a contiguous block of rows: per row it recomputes r = rsqrt(mean(x^2) + eps)
and writes dx = r (g - xn mean(g xn)), g = dy w; it accumulates dy cast(xn) over its rows in
registers and writes that partial dw row once. The partials [programs, D] are then summed by
one torch launch. Replaces ~20 elementwise launches (and their host time) per norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samebits.kernels.device_facts import sm_count
from samebits.kernels.grid import cdiv, next_power_of_2
from samebits.kernels.launch import fast_launch

MAX_WIDTH = 8192  # one row in registers
_PROGRAMS_PER_SM = 4


@fast_launch
@triton.jit
def rms_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    dx_ptr,
    dw_part_ptr,
    rows,
    n,
    rows_per_program,
    inv_n,
    eps,
    stride_dy,
    stride_x,
    stride_dx,
    WANT_DX: tl.constexpr,
    WANT_DW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    in_row = cols < n
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(rows_per_program):
        row = first + i
        mask = in_row & (row < rows)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        x32 = x.to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) * inv_n + eps)
        xn = x32 * r
        if WANT_DX:
            g = dy * w
            dot = tl.sum(g * xn, axis=0) * inv_n
            dx = r * (g - xn * dot)
            tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if WANT_DW:
            dw += dy * xn.to(x_ptr.dtype.element_ty).to(tl.float32)
    if WANT_DW:
        tl.store(dw_part_ptr + pid * n + cols, dw, mask=in_row)


def supported(x: torch.Tensor) -> bool:
    """Rows of at most MAX_WIDTH elements of a CUDA float tensor."""
    return x.is_cuda and x.is_floating_point() and 0 < x.shape[-1] <= MAX_WIDTH


def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, wants: tuple[bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`rms_norm_backward_ref` in one kernel launch (and a column sum when dw is wanted)."""
    if not supported(x):
        raise ValueError(
            f"rms_norm_backward: rows of 1..{MAX_WIDTH} elements of a CUDA tensor, got {tuple(x.shape)}"
        )
    if grad.shape != x.shape or weight.shape != (x.shape[-1],) or not weight.is_contiguous():
        raise ValueError(
            f"rms_norm_backward: grad {tuple(grad.shape)} and x {tuple(x.shape)} must match and weight "
            f"{tuple(weight.shape)} be a contiguous [{x.shape[-1]}]"
        )
    n = x.shape[-1]
    x2, dy2 = (t.reshape(-1, n) for t in (x, grad))
    x2, dy2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, dy2))
    rows = x2.shape[0]
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if wants[0] else None
    if not wants[0] and not wants[1]:
        return None, None
    if rows == 0:
        return (dx.view(x.shape) if wants[0] else None), (torch.zeros_like(weight) if wants[1] else None)
    programs = min(rows, _PROGRAMS_PER_SM * sm_count(x.device))
    per_program = cdiv(rows, programs)
    programs = cdiv(rows, per_program)
    part = torch.empty(programs, n, dtype=torch.float32, device=x.device) if wants[1] else x2
    block = next_power_of_2(n)
    rms_norm_backward_kernel[(programs,)](
        dy2,
        x2,
        weight,
        dx if dx is not None else x2,
        part,
        rows,
        n,
        per_program,
        1.0 / n,
        eps,
        dy2.stride(0),
        x2.stride(0),
        n,
        WANT_DX=wants[0],
        WANT_DW=wants[1],
        BLOCK=block,
        num_warps=4 if block >= 1024 else 1,
    )
    dw = torch.sum(part, 0, out=part.new_empty(n)).to(weight.dtype) if wants[1] else None
    return (dx.view(x.shape) if dx is not None else None), dw
