"""Row-wise softmax and log_softmax with a fixed-order sum (portable torch)."""

from __future__ import annotations

import torch

from samebits.kernels.reduce import tree_sum


def log_softmax_ref(x: torch.Tensor, dim: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`log_softmax` over `dim`, computed in fp32 for low-precision inputs."""
    xf = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    shifted = xf - xf.amax(dim=dim, keepdim=True)
    total = tree_sum(shifted.exp(), dim=dim, keepdim=True)
    return (shifted - total.log()).to(out_dtype or x.dtype)


def softmax_ref(x: torch.Tensor, dim: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`softmax` over `dim`, computed in fp32 for low-precision inputs."""
    xf = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    e = (xf - xf.amax(dim=dim, keepdim=True)).exp()
    return (e / tree_sum(e, dim=dim, keepdim=True)).to(out_dtype or x.dtype)
