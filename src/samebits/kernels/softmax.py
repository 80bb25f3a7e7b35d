"""Row-wise softmax and log_softmax with a fixed-order sum (portable torch).

`tree_sum` is the fixed-order sum to use: `tree_sum_ref` by default; the registry passes
the device's op (`samebits::tree_sum`, one Triton launch on CUDA), which gives the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from samebits.kernels.reduce import tree_sum_ref

TreeSum = Callable[..., torch.Tensor]  # (x, dim, keepdim) -> x summed over dim in tree order


def log_softmax_ref(
    x: torch.Tensor, dim: int, out_dtype: torch.dtype | None = None, tree_sum: TreeSum = tree_sum_ref
) -> torch.Tensor:
    """`log_softmax` over `dim`, computed in fp32 for low-precision inputs."""
    xf = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    shifted = xf - xf.amax(dim=dim, keepdim=True)
    total = tree_sum(shifted.exp(), dim, True)
    return (shifted - total.log()).to(out_dtype or x.dtype)


def softmax_ref(
    x: torch.Tensor, dim: int, out_dtype: torch.dtype | None = None, tree_sum: TreeSum = tree_sum_ref
) -> torch.Tensor:
    """`softmax` over `dim`, computed in fp32 for low-precision inputs."""
    xf = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    e = (xf - xf.amax(dim=dim, keepdim=True)).exp()
    return (e / tree_sum(e, dim, True)).to(out_dtype or x.dtype)
