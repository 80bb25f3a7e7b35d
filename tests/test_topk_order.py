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


_LINEAR = """
import samebits.kernels.router_one_launch as r1
from samebits.kernels import matmul_triton, tickets
r1.supported = lambda logits, k: True
g = torch.Generator().manual_seed(0)
# (T, H, E, k): one and several row blocks of 64 (T <= 256) and of 128 (T > 256), H past a
# BLOCK_K edge, one and four column blocks
for t, h, e, k in [(1, 96, 128, 8), (70, 160, 128, 8), (300, 64, 64, 4), (9, 64, 16, 2)]:
    x = torch.randn(t, h, generator=g).half()
    w = (torch.randn(e, h, generator=g) / 8).half()
    for norm in (True, False):
        weights, index, logits = r1.linear_router(x, w, k, norm)
        want_logits = matmul_triton.matmul(x, w.t())
        want_w, want_i = r1.router(want_logits, k, norm)
        assert torch.equal(logits, want_logits), (t, h, e)
        assert torch.equal(index, want_i) and torch.equal(weights, want_w), (t, h, e, k, norm)
counters = tickets.counters("router", torch.device("cpu"), 1)
assert not counters.any()
# control: row block 0's counter one ahead, so its third of four column programs draws the last
# ticket and routes before the fourth has stored its logits (the buffer holds another input's)
x = torch.randn(40, 128, generator=g).half()
w = torch.randn(128, 128, generator=g).half()
want_w, want_i = r1.router(matmul_triton.matmul(x, w.t()), 8, True)
counters[0] = 1
early_w, early_i, _ = r1.linear_router(x, w, 8, True)
counters.zero_()
assert not (torch.equal(early_i, want_i) and torch.equal(early_w, want_w))
assert torch.equal(r1.linear_router(x, w, 8, True)[1], want_i)
print("OK")
"""


def test_router_with_its_linear_in_one_launch_is_the_matmul_then_the_router_in_tritons_interpreter():
    """`router_one_launch.linear_router` (fp16, Triton's CPU interpreter): its logits are
    `matmul_triton.matmul`'s, and its weights and indices the one-launch router's on them, over
    one and several row and column blocks, with the counters back to 0 after each call. Control:
    a counter one ahead, and a row block is routed before its last column block's logits are
    stored. Needs Triton."""
    run_interpreted(_LINEAR)


def test_refuses_what_it_does_not_reproduce():
    with pytest.raises(ValueError, match="NaN or -0.0"):
        topk_cuda_order_ref(torch.tensor([[1.0, float("nan"), 0.5]]), 2)
    with pytest.raises(ValueError, match="NaN or -0.0"):
        topk_cuda_order_ref(torch.tensor([[1.0, -0.0, 0.5]]), 2)
    with pytest.raises(ValueError, match="1 <= k <= min"):
        topk_cuda_order_ref(torch.rand(2, 4), 5)
