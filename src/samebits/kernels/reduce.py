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
    """Sum over `dim` in a fixed pairwise order, in x's dtype.

    The order is the halving tree of x padded with -0.0 to a power of two; the pads are
    never built: adding -0.0 leaves every value as it is, so where a half meets pads only
    the real half is kept (a vocabulary row of 151936 would otherwise pad to 262144).
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n == 0:
        out = x.new_zeros(x.shape[:-1])
    else:
        while n > 1:
            half = 1 << (n - 1).bit_length() - 1  # half the padded width
            head, tail = x[..., :half], x[..., half:]  # tail: the n - half real elements past it
            if n == 2 * half:
                x = head + tail
            else:
                x = head.clone()
                x[..., : n - half] += tail
            n = half
        out = x.squeeze(-1)
    if keepdim:
        out = out.unsqueeze(-1).movedim(-1, dim)
    return out
