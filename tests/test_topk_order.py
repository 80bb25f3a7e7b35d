"""`kernels.topk_order.topk_cuda_order_ref`: PyTorch's CUDA top-k order written out (CPU part;
the comparison with CUDA `torch.topk` on rows full of ties is in `test_gpu_router.py`)."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted

from samebits.kernels import topk_order
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


@pytest.mark.parametrize(
    "row,k,want",
    [
        ([3.0, 2, 3, 2, 1, 1], 2, [2, 0]),  # CUDA torch.topk's output reported in pytorch/pytorch#127196
        ([0.5] * 40, 8, [7, 6, 4, 5, 1, 0, 2, 3]),
        ([0.5] * 40, 3, [2, 1, 0]),
    ],
)
def test_tie_orders_pinned(row, k, want):
    """Exact tie orders of the network (one observed on CUDA): a swap rule with >= for >, or
    another slot count, changes them."""
    assert topk_cuda_order_ref(torch.tensor([row]), k)[1][0].tolist() == want


def test_one_launch_order_is_trusted_only_where_it_was_checked(monkeypatch):
    """The registry runs the one-launch router only where this order was checked against CUDA
    torch.topk: a listed torch release, not ROCm, k within the 32-slot network."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.version, "hip", None)
    assert topk_order.order_checked(8) and topk_order.order_checked(32)
    assert not topk_order.order_checked(33) and not topk_order.order_checked(0)
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert not topk_order.order_checked(8)
    monkeypatch.setattr(torch, "__version__", "2.11.0+rocm7.0")
    monkeypatch.setattr(torch.version, "hip", "7.0")
    assert not topk_order.order_checked(8)


_INTERPRETED = """
import samebits.kernels.router_triton as rt
import samebits.kernels.router_one_launch as r1
from samebits.kernels import topk_order
from samebits.kernels.topk_order import topk_cuda_order_ref
r1.supported = lambda logits, k: True
g = torch.Generator().manual_seed(0)
for t, e, k in [(13, 128, 8), (8, 16, 2), (9, 32, 32), (3, 8, 1)]:
    for logits in (torch.randn(t, e, generator=g), torch.randint(0, 3, (t, e), generator=g).float()):
        for norm in (True, False):
            w, i = r1.router(logits, k, norm)
            v, want_i = topk_cuda_order_ref(rt.softmax(logits), k)
            want_w = v
            if norm:
                want_w = torch.empty(t, k)
                rt.renorm_kernel[(triton.cdiv(t, rt.ROWS),)](v.contiguous(), want_w, t, ROWS=rt.ROWS, K=k)
            assert torch.equal(i, want_i) and torch.equal(w, want_w), (t, e, k, norm)
print("OK")
"""


def test_one_launch_router_is_the_oracle_in_tritons_interpreter():
    """`router_one_launch` (fp32 logits, Triton's CPU interpreter) = the softmax kernel, then
    this order, then the renorm kernel, on random and heavily tied logits. Needs Triton."""
    run_interpreted(_INTERPRETED)


def test_refuses_what_it_does_not_reproduce():
    with pytest.raises(ValueError, match="NaN or -0.0"):
        topk_cuda_order_ref(torch.tensor([[1.0, float("nan"), 0.5]]), 2)
    with pytest.raises(ValueError, match="NaN or -0.0"):
        topk_cuda_order_ref(torch.tensor([[1.0, -0.0, 0.5]]), 2)
    with pytest.raises(ValueError, match="1 <= k <= min"):
        topk_cuda_order_ref(torch.rand(2, 4), 5)
