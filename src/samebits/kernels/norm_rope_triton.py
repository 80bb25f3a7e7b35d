"""Fused HF-order RMSNorm (+ residual add) and rotary for CUDA, in transformers' bits.

Each kernel does in one launch what `numerics.ops` does in 7-12 aten kernels,
with the same roundings in the same order, so the bits are those of the
transformers module under `batch_invariant()`:
- RMSNorm: x in fp32, x*x, the pairwise halving tree of `tree_sum_ref` (padded
  to a power of two; the pads are +0.0 here, which leaves a sum of squares
  unchanged), times the fp32 reciprocal of H (CUDA divides by a scalar that
  way), + eps, rsqrt, x * r, rounded to the activation dtype, times the weight
  rounded again. With a residual, `residual + x` is rounded first.
- Rotary: `q*cos` and `rotate_half(q)*sin` each rounded, then their sum rounded.
Every launch passes `enable_fp_fusion=False`: with Triton's default, LLVM contracts a
multiply and the add after it into one FMA, dropping the product's rounding. That was the
whole difference measured before (rotary: 45,192 of 262,144 elements on the H200; the
norm's `mean * (1/H) + eps` at widths that are not powers of two, where 1/H is inexact).
The registry (`numerics.registry`) uses both in the exact and the fast profile (the norms
inside `batch_invariant()` only: outside it the composite's mean is aten's stock one).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from samebits.kernels.reduce_triton import tree_sum_block


@triton.jit
def rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n,
    inv_n,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)  # residual + x, rounded
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tree_sum_block(h * h, BLOCK) * inv_n
    h = h * tl.math.rsqrt(variance + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(tl.float32) * h.to(x_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [..., H] (and residual) -> norm, or (residual + x, norm) when residual is given."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x2) if residual is not None else out
    r2 = residual.reshape(-1, h).contiguous() if residual is not None else x2
    block = triton.next_power_of_2(h)
    if x2.shape[0]:
        rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            summed,
            h,
            float(np.float32(1.0) / np.float32(h)),
            eps,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            summed.stride(0),
            HAS_RES=residual is not None,
            BLOCK=block,
            num_warps=4 if block >= 1024 else 1,
            enable_fp_fusion=False,  # keep `variance + eps` and the other products rounded
        )
    out = out.view(x.shape)
    return out if residual is None else (summed.view(x.shape), out)


@triton.jit
def rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_c,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, 2 * HALF)[None, :]
    mask = hh < heads
    base = x_ptr + t * stride_xt + hh * stride_xh
    x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(base + (d + HALF) % (2 * HALF), mask=mask, other=0.0).to(tl.float32)
    rot = tl.where(d < HALF, -partner, partner)  # rotate_half: cat(-x2, x1)
    cos = tl.load(cos_ptr + t * stride_c + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_c + d).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    y = ((x * cos).to(dt).to(tl.float32) + (rot * sin).to(dt).to(tl.float32)).to(dt)
    tl.store(out_ptr + t * stride_ot + hh * stride_oh + d, y, mask=mask)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, H, D], k [T, KVH, D], cos/sin [T, D] (D even, a power of two) -> (q_embed, k_embed)."""
    outs = []
    cos, sin = cos.contiguous(), sin.contiguous()
    for x in (q, k):
        x = x if x.stride(-1) == 1 else x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.shape[0]:
            rotary_kernel[(x.shape[0],)](
                x,
                cos,
                sin,
                out,
                x.shape[1],
                x.stride(0),
                x.stride(1),
                out.stride(0),
                out.stride(1),
                cos.stride(0),
                HALF=x.shape[2] // 2,
                BLOCK_H=triton.next_power_of_2(x.shape[1]),
                num_warps=4,
                enable_fp_fusion=False,  # keep each product rounded before the add
            )
        outs.append(out)
    return outs[0], outs[1]


def rotary_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, unsqueeze_dim: int) -> bool:
    d = q.shape[-1]
    return (
        q.dim() == 3
        and k.dim() == 3
        and cos.dim() == 2
        and unsqueeze_dim == 1
        and d >= 2
        and d & (d - 1) == 0
        and q.dtype == k.dtype == cos.dtype
    )
