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

from samebits.kernels.experts_tiles import slot_tree_fits
from samebits.kernels.experts_triton import _slot_tree_sum
from samebits.kernels.grid import next_power_of_2
from samebits.kernels.launch import fast_launch
from samebits.kernels.pdl import launch_args, pdl_release, pdl_wait
from samebits.kernels.reduce_triton import tree_sum_block


@fast_launch
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
    SLOTS: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """One row: RMSNorm of x, or of `residual + x` (HAS_RES; the sum stored too). SLOTS = K > 0:
    x is the MoE experts' weighted slot outputs [T, K, n] fp32, summed over K as `slot_sum_kernel`
    sums them and rounded to the residual's dtype first (the experts' output, never stored)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    if SLOTS > 0:
        x = _slot_tree_sum(x_ptr, row, cols, n, SLOTS, BLOCK).to(res_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # residual + x, rounded
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tree_sum_block(h * h, BLOCK) * inv_n
    h = h * tl.math.rsqrt(variance + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(tl.float32) * h.to(x.dtype).to(tl.float32)).to(out_ptr.dtype.element_ty)
    pdl_release(PDL)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


# The slot norm's warps: 8 for a wide row at decode sizes, 2 from SLOT_NORM_FEW_WARPS_FROM rows
# (prefill chunks), where more programs a SM hide the loads of the K fp32 slot rows better: H200,
# 8192 rows of 8 x 2048 slots, us (floor 149 at the copy bandwidth; 2026-12-05,
# docs/performance.md): 8 warps 225.5, 16 194.7, 4 174.7, 2 162.2, every launch the same bits.
SLOT_NORM_FEW_WARPS_FROM = 4096


def _slot_norm_warps(rows: int, block: int) -> int:
    if block < 1024:
        return 2
    return 2 if rows >= SLOT_NORM_FEW_WARPS_FROM else 8


def slot_add_rms_norm(
    slots: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, warps: int | None = None
):
    """slots [T, K, H] fp32 (the MoE experts' weighted outputs before their top-k sum, K a power
    of two <= 16), residual [T, H] -> (residual + sum, norm) in one launch: `slot_sum_kernel`'s
    sum rounded to the residual's dtype, then `rms_norm(sum, weight, eps, residual)`'s bits.
    `warps` overrides the launch's (experiments: every row's order is the code's tree)."""
    t, k, h = slots.shape
    if (
        residual.shape != (t, h)
        or not slots.is_contiguous()
        or slots.dtype != torch.float32
        or not slot_tree_fits(k)
    ):
        raise ValueError(
            f"slot_add_rms_norm: slots [T, K, H] contiguous fp32 with K a power of two <= 16 and residual "
            f"[T, H], got {tuple(slots.shape)} {slots.dtype} and {tuple(residual.shape)}"
        )
    r2 = residual.contiguous()
    out = torch.empty(t, h, dtype=torch.promote_types(residual.dtype, weight.dtype), device=residual.device)
    summed = torch.empty_like(r2)
    block = next_power_of_2(h)
    if t:
        rms_norm_kernel[(t,)](
            slots, r2, weight, out, summed, h, float(np.float32(1.0) / np.float32(h)), eps,
            k * h, r2.stride(0), out.stride(0), summed.stride(0),
            HAS_RES=True, BLOCK=block, SLOTS=k,
            num_warps=warps or _slot_norm_warps(t, block), enable_fp_fusion=False,
            **launch_args(residual.device),
        )  # fmt: skip
    return summed, out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    warps: int | None = None,
):
    """x [..., H] (and residual) -> norm, or (residual + x, norm) when residual is given.
    `warps` overrides the launch's (experiments: every row's order is the code's tree)."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x2) if residual is not None else out
    r2 = residual.reshape(-1, h).contiguous() if residual is not None else x2
    block = next_power_of_2(h)
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
            num_warps=warps or (4 if block >= 1024 else 1),
            enable_fp_fusion=False,  # keep `variance + eps` and the other products rounded
            **launch_args(x.device),
        )
    out = out.view(x.shape)
    return out if residual is None else (summed.view(x.shape), out)


@fast_launch
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
                BLOCK_H=next_power_of_2(x.shape[1]),
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


@triton.jit
def _row_tree(s, ROWS: tl.constexpr, D: tl.constexpr):
    """[ROWS, D] -> [ROWS]: each row's halving tree (`tree_sum_block`'s order, D a power of two
    <= 256)."""
    if D >= 2:
        s = tl.sum(tl.reshape(s, (ROWS, 2, D // 2)), axis=1)
    if D >= 4:
        s = tl.sum(tl.reshape(s, (ROWS, 2, D // 4)), axis=1)
    if D >= 8:
        s = tl.sum(tl.reshape(s, (ROWS, 2, D // 8)), axis=1)
    if D >= 16:
        s = tl.sum(tl.reshape(s, (ROWS, 2, D // 16)), axis=1)
    if D >= 32:
        s = tl.sum(tl.reshape(s, (ROWS, 2, D // 32)), axis=1)
    if D >= 64:
        s = tl.sum(tl.reshape(s, (ROWS, 2, D // 64)), axis=1)
    if D >= 128:
        s = tl.sum(tl.reshape(s, (ROWS, 2, D // 128)), axis=1)
    if D >= 256:
        s = tl.sum(tl.reshape(s, (ROWS, 2, D // 256)), axis=1)
    return tl.reshape(s, (ROWS,))


@triton.jit
def _norm_rope_heads(x_ptr, w_ptr, heads, cos, sin, inv_n, eps, d, BLOCK_H: tl.constexpr, D: tl.constexpr):
    """x [BLOCK_H, D] rows at x_ptr (row stride D) -> RMSNorm'd (weight w) then rotated, in the
    activation dtype: what `rms_norm` then `apply_rotary` give, each rounding on its own."""
    hh = tl.arange(0, BLOCK_H)[:, None]
    mask = hh < heads
    partner_d = (d + D // 2) % D
    x = tl.load(x_ptr + hh * D + d, mask=mask, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    xp = tl.load(x_ptr + hh * D + partner_d, mask=mask, other=0.0).to(tl.float32)
    rsq = tl.math.rsqrt(_row_tree(xf * xf, BLOCK_H, D) * inv_n + eps)[:, None]
    w = tl.load(w_ptr + d).to(tl.float32)
    wp = tl.load(w_ptr + partner_d).to(tl.float32)
    normed = (w * (xf * rsq).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    normed_p = (wp * (xp * rsq).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    rot = tl.where(d < D // 2, -normed_p, normed_p)  # rotate_half: cat(-x2, x1)
    return ((normed * cos).to(dt).to(tl.float32) + (rot * sin).to(dt).to(tl.float32)).to(dt), mask


@fast_launch
@triton.jit
def qk_norm_rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    heads, kv_heads, inv_n, eps,
    stride_qt, stride_kt, stride_vt, stride_ct, stride_qo, stride_cache,
    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """One token per program: q and k RMSNorm'd and rotated, q written out, k and v written to
    their cache slot (what `paged_attention`'s index_put writes)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)[None, :]
    cos = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_ct + d).to(tl.float32)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    q, q_mask = _norm_rope_heads(q_ptr + t * stride_qt, qw_ptr, heads, cos, sin, inv_n, eps, d, BLOCK_H, D)
    tl.store(q_out_ptr + t * stride_qo + tl.arange(0, BLOCK_H)[:, None] * D + d, q, mask=q_mask)
    k, k_mask = _norm_rope_heads(k_ptr + t * stride_kt, kw_ptr, kv_heads, cos, sin, inv_n, eps, d, BLOCK_KVH, D)
    kv_rows = tl.arange(0, BLOCK_KVH)[:, None] * D + d
    tl.store(k_cache_ptr + slot * stride_cache + kv_rows, k, mask=k_mask)
    v = tl.load(v_ptr + t * stride_vt + kv_rows, mask=k_mask, other=0.0)
    pdl_release(PDL)
    tl.store(v_cache_ptr + slot * stride_cache + kv_rows, v, mask=k_mask)


def qk_norm_rope_cache_supported(q, k, v, q_weight, k_weight, cos, k_cache, v_cache) -> bool:
    """3-D q/k/v of one dtype whose heads are contiguous rows of D (a power of two <= 256), norm
    weights of that dtype, cos [T, D], and caches [slots, KVH, D] contiguous."""
    d = q.shape[-1]
    tensors = (q, k, v)
    return (
        all(x.dim() == 3 and x.shape[-1] == d and x.stride(2) == 1 and x.stride(1) == d for x in tensors)
        and q.dtype == k.dtype == v.dtype == q_weight.dtype == k_weight.dtype == cos.dtype == k_cache.dtype
        and d & (d - 1) == 0
        and 2 <= d <= 256
        and cos.dim() == 2
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape[1:] == k.shape[1:]
        and v_cache.shape == k_cache.shape
    )


def qk_norm_rope_cache(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slot_mapping):
    """q [T, H, D], k/v [T, KVH, D] -> q RMSNorm'd and rotated [T, H, D]; k (RMSNorm'd, rotated)
    and v written into k_cache/v_cache [slots, KVH, D] at slot_mapping [T]. One launch for what
    `rms_norm` x2, `apply_rotary` and two index_puts do, with their bits."""
    t, h, d = q.shape
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    if t:
        cos, sin = cos.contiguous(), sin.contiguous()
        qk_norm_rope_cache_kernel[(t,)](
            q, k, v, q_weight, k_weight, cos, sin, out, k_cache, v_cache, slot_mapping,
            h, k.shape[1], float(np.float32(1.0) / np.float32(d)), eps,
            q.stride(0), k.stride(0), v.stride(0), cos.stride(0), out.stride(0), k_cache.stride(0),
            BLOCK_H=next_power_of_2(h), BLOCK_KVH=next_power_of_2(k.shape[1]), D=d,
            num_warps=4, enable_fp_fusion=False, **launch_args(q.device),
        )  # fmt: skip
    return out
