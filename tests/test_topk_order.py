"""`kernels.topk_order.topk_cuda_order_ref`: PyTorch's CUDA top-k order written out (CPU part;
the comparison with CUDA `torch.topk` on rows full of ties is in `test_gpu_router.py`)."""

from __future__ import annotations

import pytest
import torch

from samebits.kernels.topk_order import topk_cuda_order_ref


@pytest.mark.parametrize("k", [1, 2, 3, 8, 17, 32])
def test_distinct_values_come_out_sorted_descending(k):
    """Without ties every top-k order is the same, so the network must sort descending (CPU
    `torch.topk` is the oracle here; ties are the GPU test's)."""
    x = torch.rand(50, 128, generator=torch.Generator().manual_seed(k))
    values, indices = topk_cuda_order_ref(x, k)
    want_v, want_i = torch.topk(x, k)
    assert torch.equal(values, want_v) and torch.equal(indices, want_i)


def test_ties_keep_the_gathered_set_and_can_leave_index_order():
    """Ten equal values, k = 8: the eight lowest indices are gathered (the gather kernel's rule),
    and the network orders them otherwise than by index (it is unstable)."""
    x = torch.tensor([[0.5] * 10 + [0.1] * 118])
    values, indices = topk_cuda_order_ref(x, 8)
    assert sorted(indices[0].tolist()) == list(range(8)) and torch.all(values == 0.5)
    assert indices[0].tolist() != list(range(8))


def test_refuses_what_it_does_not_reproduce():
    with pytest.raises(ValueError, match="NaN or -0.0"):
        topk_cuda_order_ref(torch.tensor([[1.0, float("nan"), 0.5]]), 2)
    with pytest.raises(ValueError, match="NaN or -0.0"):
        topk_cuda_order_ref(torch.tensor([[1.0, -0.0, 0.5]]), 2)
    with pytest.raises(ValueError, match="1 <= k <= min"):
        topk_cuda_order_ref(torch.rand(2, 4), 5)
