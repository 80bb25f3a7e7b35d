"""The RMSNorm's gradients in closed form (portable torch: the CPU path and the test oracle).

Forward (transformers' Qwen3 RMSNorm): r = rsqrt(mean(x^2) + eps), xn = x r (fp32),
y = w * cast(xn). Backward, given dy:
    g = dy w;   dx = r (g - xn mean(g xn));   dw = sum over rows of dy cast(xn)
Gradients carry no bitwise contract: fp32 throughout, one rounding of each result.
Reductions use `out=` overloads: on CUDA this runs on autograd's device thread, where an op
that `batch_invariant()` overrides (mean.dim, sum.dim) would cross the overrides' Python wrapper.
"""

from __future__ import annotations

import torch


def _mean_last(x: torch.Tensor) -> torch.Tensor:
    return torch.mean(x, -1, keepdim=True, out=x.new_empty(*x.shape[:-1], 1))


def rms_norm_backward_ref(
    grad: torch.Tensor,  # [..., D], the output's dtype
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    wants: tuple[bool, bool],  # grads of (x, weight)
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """-> (dx in x's dtype, dw in weight's dtype), None where not wanted."""
    x32 = x.float()
    r = torch.rsqrt(_mean_last(x32 * x32) + eps)
    xn = x32 * r
    dx = dw = None
    if wants[0]:
        g = grad.float() * weight.float()
        dx = (r * (g - xn * _mean_last(g * xn))).to(x.dtype)
    if wants[1]:
        rows = (grad.float() * xn.to(x.dtype).float()).reshape(-1, x.shape[-1])
        dw = torch.sum(rows, 0, out=rows.new_empty(rows.shape[1])).to(weight.dtype)
    return dx, dw


def rotary_backward_ref(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The transpose of `x*cos + rotate_half(x)*sin` (rotate_half(x) = [-x2, x1]) applied to
    grad [..., D], cos/sin broadcasting to it: grad*cos + [(grad*sin)2, -(grad*sin)1], fp32."""
    g, half = grad.float(), grad.shape[-1] // 2
    gs = g * sin.float()
    return g * cos.float() + torch.cat((gs[..., half:], -gs[..., :half]), dim=-1)


def qk_norm_rope_backward_ref(
    dq: torch.Tensor,  # [T, H, D]: the grad of the rotated, normed q
    dk: torch.Tensor,  # [T, KVH, D]
    dv: torch.Tensor,  # [T, KVH, D]
    q: torch.Tensor,  # [T, H, D]: q before its RMSNorm
    k: torch.Tensor,  # [T, KVH, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    eps: float,
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    wants: tuple[bool, bool],  # grads of (q_weight, k_weight)
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward of a layer's q/k RMSNorm + rotary (`qk_norm_rope_cache`'s arithmetic) ->
    (d[q; k; v] [T, (H + 2 KVH) D] in q's dtype, the q-projection's columns first as the joined
    GEMM lays them; d q_weight; d k_weight), None where not wanted. fp32 inside."""
    c, s = cos[:, None], sin[:, None]  # [T, 1, D]
    dxq, dwq = rms_norm_backward_ref(rotary_backward_ref(dq, c, s), q, q_weight, eps, (True, wants[0]))
    dxk, dwk = rms_norm_backward_ref(rotary_backward_ref(dk, c, s), k, k_weight, eps, (True, wants[1]))
    t = q.shape[0]
    return torch.cat([x.reshape(t, -1).to(q.dtype) for x in (dxq, dxk, dv)], dim=-1), dwq, dwk
