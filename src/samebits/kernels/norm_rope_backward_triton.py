"""The backward of a layer's q/k RMSNorm + rotary on CUDA in one launch (+ a column sum per
norm weight wanted): `qk_norm_rope_backward_ref`'s formula (`kernels/norm_backward.py`), fp32
inside, no bitwise contract.

The trainer's attention block (`trainer/attention_forward.py`) runs `qk_norm_rope_cache`
forward; backward, per token and head row, given g = the grad of the rotated, normed row:
    gn = g cos + sign * g[partner] sin[partner]   (rotate_half's transpose; partner = d +- D/2)
    dx = r (gn w - xn mean(gn w xn)),   r = rsqrt(mean(x^2) + eps),  xn = x r
    dw += gn cast(xn)
written straight into the q/k columns of d[q; k; v] [T, (H + 2 KVH) D] (v's grad copied into
its columns), the layout of the joined q/k/v GEMM whose backward reads it. Replaces two rotary
transposes, two norm backwards and the concatenation: ~15 host ops a layer.

Each program walks a contiguous block of tokens, accumulating its dw rows in registers and
writing one partial row per weight; one torch sum per weight closes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samebits.kernels.device_facts import sm_count
from samebits.kernels.grid import cdiv, next_power_of_2
from samebits.kernels.launch import fast_launch

_PROGRAMS_PER_SM = 4
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _heads_backward(
    g_ptr, x_ptr, w, cos, sin_p, heads, live, inv_n, eps, d, partner, sign, BLOCK: tl.constexpr, D: tl.constexpr
):
    """One token's head rows [BLOCK, D] (row stride D) of g, the grad of rotate(norm(x)), and x
    -> (dx fp32, gn * cast(xn) fp32 for the weight's grad, the rows' mask)."""
    hh = tl.arange(0, BLOCK)[:, None]
    mask = (hh < heads) & live
    g = tl.load(g_ptr + hh * D + d, mask=mask, other=0.0).to(tl.float32)
    g_p = tl.load(g_ptr + hh * D + partner, mask=mask, other=0.0).to(tl.float32)
    gn = g * cos + sign * g_p * sin_p  # the grad of the normed row
    x = tl.load(x_ptr + hh * D + d, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    r = tl.math.rsqrt(tl.sum(xf * xf, axis=1) * inv_n + eps)[:, None]
    xn = xf * r
    gw = gn * w
    dx = r * (gw - xn * (tl.sum(gw * xn, axis=1) * inv_n)[:, None])
    return dx, gn * xn.to(x.dtype).to(tl.float32), mask


@fast_launch
@triton.jit
def qk_norm_rope_backward_kernel(
    dq_ptr, dk_ptr, dv_ptr, q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, out_ptr, dwq_ptr, dwk_ptr,
    tokens, heads, kv_heads, per_program, inv_n, eps,
    stride_dq, stride_dk, stride_dv, stride_q, stride_k, stride_c, stride_o,
    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, D: tl.constexpr,
    WANT_DWQ: tl.constexpr, WANT_DWK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    d = tl.arange(0, D)[None, :]
    partner = (d + D // 2) % D
    sign = tl.where(d < D // 2, 1.0, -1.0)  # rotate_half's transpose: [z2, -z1]
    wq = tl.load(qw_ptr + d).to(tl.float32)
    wk = tl.load(kw_ptr + d).to(tl.float32)
    dwq = tl.zeros([D], dtype=tl.float32)  # summed over heads every token: few registers
    dwk = tl.zeros([D], dtype=tl.float32)
    hq = tl.arange(0, BLOCK_H)[:, None]
    hk = tl.arange(0, BLOCK_KVH)[:, None]
    first = pid.to(tl.int64) * per_program
    for i in range(per_program):
        t = first + i
        live = t < tokens
        cos = tl.load(cos_ptr + t * stride_c + d, mask=live & (d < D), other=0.0).to(tl.float32)
        sin_p = tl.load(sin_ptr + t * stride_c + partner, mask=live & (d < D), other=0.0).to(tl.float32)
        row = out_ptr + t * stride_o
        dx, part, mask = _heads_backward(
            dq_ptr + t * stride_dq, q_ptr + t * stride_q, wq, cos, sin_p,
            heads, live, inv_n, eps, d, partner, sign, BLOCK_H, D,
        )  # fmt: skip
        tl.store(row + hq * D + d, dx.to(out_ptr.dtype.element_ty), mask=mask)
        if WANT_DWQ:
            dwq += tl.sum(part, axis=0)
        dx, part, mask = _heads_backward(
            dk_ptr + t * stride_dk, k_ptr + t * stride_k, wk, cos, sin_p,
            kv_heads, live, inv_n, eps, d, partner, sign, BLOCK_KVH, D,
        )  # fmt: skip
        tl.store(row + (heads + hk) * D + d, dx.to(out_ptr.dtype.element_ty), mask=mask)
        if WANT_DWK:
            dwk += tl.sum(part, axis=0)
        v = tl.load(dv_ptr + t * stride_dv + hk * D + d, mask=mask, other=0.0)
        tl.store(row + (heads + kv_heads + hk) * D + d, v.to(out_ptr.dtype.element_ty), mask=mask)
    if WANT_DWQ:
        tl.store(dwq_ptr + pid * D + tl.arange(0, D), dwq)
    if WANT_DWK:
        tl.store(dwk_ptr + pid * D + tl.arange(0, D), dwk)


def _heads_rows(x: torch.Tensor, d: int) -> bool:
    return x.dim() == 3 and x.shape[-1] == d and x.stride(2) == 1 and x.stride(1) == d


def supported(dq, dk, dv, q, k, q_weight, k_weight, cos, sin) -> bool:
    """CUDA float tensors: q/k (and their grads, dv) [T, heads, D] whose heads are contiguous rows
    of D, a power of two from 2 to 256; weights contiguous [D]; cos/sin [T, D] rows contiguous."""
    d = q.shape[-1] if q.dim() == 3 else 0
    return (
        q.is_cuda
        and q.dtype in _DTYPES
        and d >= 2
        and d & (d - 1) == 0
        and d <= 256
        and all(_heads_rows(x, d) for x in (dq, dk, dv, q, k))
        and dq.shape == q.shape
        and dk.shape == dv.shape == k.shape
        and k.shape[0] == q.shape[0]
        and all(w.shape == (d,) and w.is_contiguous() for w in (q_weight, k_weight))
        and all(c.shape == (q.shape[0], d) and c.stride(1) == 1 for c in (cos, sin))
        and cos.stride(0) == sin.stride(0)
    )


def qk_norm_rope_backward(dq, dk, dv, q, k, q_weight, k_weight, eps, cos, sin, wants):
    """`qk_norm_rope_backward_ref` in one launch (and a column sum per weight wanted)."""
    if not supported(dq, dk, dv, q, k, q_weight, k_weight, cos, sin):
        raise ValueError(
            f"qk_norm_rope_backward: q {tuple(q.shape)} / k {tuple(k.shape)} (and grads) must be CUDA "
            "[T, heads, D] with contiguous head rows, D a power of two in [2, 256], weights [D], cos/sin [T, D]"
        )
    t, h, d = q.shape
    kvh = k.shape[1]
    out = torch.empty(t, (h + 2 * kvh) * d, dtype=q.dtype, device=q.device)
    if t == 0:
        return out, *(
            torch.zeros_like(w) if want else None for w, want in zip((q_weight, k_weight), wants, strict=True)
        )
    programs = min(t, _PROGRAMS_PER_SM * sm_count(q.device))
    per_program = cdiv(t, programs)
    programs = cdiv(t, per_program)
    parts = [torch.empty(programs, d, dtype=torch.float32, device=q.device) if w else out for w in wants]
    qk_norm_rope_backward_kernel[(programs,)](
        dq, dk, dv, q, k, q_weight, k_weight, cos, sin, out, parts[0], parts[1],
        t, h, kvh, per_program, 1.0 / d, eps,
        dq.stride(0), dk.stride(0), dv.stride(0), q.stride(0), k.stride(0), cos.stride(0), out.stride(0),
        BLOCK_H=next_power_of_2(h), BLOCK_KVH=next_power_of_2(kvh), D=d, WANT_DWQ=wants[0], WANT_DWK=wants[1],
        num_warps=8 if next_power_of_2(h) * d >= 4096 else 4,
    )  # fmt: skip
    dws = [
        torch.sum(p, 0, out=p.new_empty(d)).to(w.dtype) if want else None
        for p, w, want in zip(parts, (q_weight, k_weight), wants, strict=True)
    ]
    return out, *dws
