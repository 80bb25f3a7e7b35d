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
