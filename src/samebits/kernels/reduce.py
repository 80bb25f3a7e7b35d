"""Fixed-order sums: a pairwise halving tree over one dim, padded with -0.0.

Adding -0.0 is the identity for every float (including -0.0 and +0.0), so a
row padded to any larger power of two reduces to the same bits: the first
halving steps only add pads. A row's sum therefore depends on its own values
and length class alone, never on the batch it sits in or the padded width of
that batch. Every step is an elementwise add, so no library kernel chooses the
order.
"""

from __future__ import annotations

import torch


def tree_sum_ref(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over `dim` in a fixed pairwise order, in x's dtype."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = x.new_full((*x.shape[:-1], width - n), -0.0)
        x = torch.cat([x, pad], dim=-1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    out = x.squeeze(-1) if n > 0 else x.new_zeros(x.shape[:-1])
    if keepdim:
        out = out.unsqueeze(-1).movedim(-1, dim)
    return out


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """`tree_sum_ref`'s bits; on CUDA, float32 rows of up to 8192 elements take one Triton
    launch (`reduce_triton.tree_sum`) instead of a launch per halving."""
    if x.is_cuda and x.dtype == torch.float32 and x.dim():
        from samebits.kernels import reduce_triton

        if 1 <= x.shape[dim] <= reduce_triton.MAX_WIDTH:
            return reduce_triton.tree_sum(x, dim, keepdim)
    return tree_sum_ref(x, dim, keepdim)
