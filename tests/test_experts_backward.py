"""The experts' closed-form backward (`kernels/experts_backward.py`, the CUDA backward) against
autograd through the forward, in float64 (gradients carry no bitwise contract: this checks the
formula, the routing bookkeeping and the grouped GEMM layouts)."""

from __future__ import annotations

import pytest
import torch

from samebits.kernels.experts_backward import experts_backward, grouped_mm_loop


def _inputs(dtype, t=29, e=7, k=3, h=40, i=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = 0.2 * torch.randn(e, 2 * i, h, generator=g)
    down = 0.2 * torch.randn(e, h, i, generator=g)
    x = torch.randn(t, h, generator=g)
    # experts 0..e-2 only: the last one gets no token (an empty group in every grouped GEMM)
    rows = [torch.randperm(e - 1, generator=g)[:k] for _ in range(t)]
    index = torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.long)
    weights = torch.softmax(torch.randn(t, k, generator=g), -1)
    grad = torch.randn(t, h, generator=g)
    return [v.to(dtype) for v in (x, weights, gate_up, down)], index, grad.to(dtype)


def _forward(x, index, weights, gate_up, down):
    """The experts, one token slot at a time, in the inputs' dtype throughout."""
    out = torch.zeros_like(x)
    for slot in range(index.shape[1]):
        for e in index[:, slot].unique().tolist():
            tok = (index[:, slot] == e).nonzero()[:, 0]
            gate, up = (x[tok] @ gate_up[e].t()).chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ down[e].t()
            out = out.index_add(0, tok, y * weights[tok, slot][:, None])
    return out


def _autograd(leaves, index, grad, wants):
    inputs = [v.detach().requires_grad_(w) for v, w in zip(leaves, wants, strict=True)]
    out = _forward(inputs[0], index, *inputs[1:])
    wanted = [v for v in inputs if v.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, grad))
    return [next(grads) if v.requires_grad else None for v in inputs]


@pytest.mark.parametrize(
    "wants", [(True, True, True, True), (True, True, False, False), (False, True, False, True)]
)
def test_closed_form_equals_autograd_in_float64(wants):
    leaves, index, grad = _inputs(torch.float64)
    got = experts_backward(grad, leaves[0], index, *leaves[1:], wants, gmm=grouped_mm_loop)
    want = _autograd(leaves, index, grad, wants)
    for name, a, b in zip(("hidden", "weights", "gate_up", "down"), got, want, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    assert not torch.equal(want[1], torch.zeros_like(want[1]))  # the routing weights do get a gradient


def test_no_tokens_gives_zero_gradients():
    leaves, index, grad = _inputs(torch.float64, t=0)
    got = experts_backward(grad, leaves[0], index, *leaves[1:], (True, True, False, True), gmm=grouped_mm_loop)
    assert [None if g is None else g.shape for g in got] == [(0, 40), (0, 3), None, leaves[3].shape]


def test_torch_grouped_mm_layouts_in_float32():
    """The default `gmm` (`torch._grouped_mm`, where this torch has it on the CPU) accepts the
    row- and column-major operands the backward hands it, and gives float64's gradients to fp32."""
    leaves, index, grad = _inputs(torch.float32)
    try:
        got = experts_backward(grad, leaves[0], index, *leaves[1:], (True,) * 4)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm on the CPU: {e}")
    want = _autograd([v.double() for v in leaves], index, grad.double(), (True,) * 4)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_the_routing_is_the_given_kernels():
    """`route_pairs` gives the (order, offsets) the backward groups by (on CUDA the forward's
    one-launch routing): a kernel giving `route`'s answer gives the same gradients, and one
    giving a wrong order does not (the control)."""
    from samebits.kernels.experts import route

    leaves, index, grad = _inputs(torch.float64)
    wants = (True, True, False, False)
    seen = []

    def recorded(top_k_index, num_experts):
        seen.append(num_experts)
        return route(top_k_index, num_experts)

    def wrong(top_k_index, num_experts):
        order, offsets = route(top_k_index, num_experts)
        return order.flip(0), offsets

    want = experts_backward(grad, leaves[0], index, *leaves[1:], wants, gmm=grouped_mm_loop)
    got = experts_backward(
        grad, leaves[0], index, *leaves[1:], wants, gmm=grouped_mm_loop, route_pairs=recorded
    )
    bad = experts_backward(grad, leaves[0], index, *leaves[1:], wants, gmm=grouped_mm_loop, route_pairs=wrong)
    assert seen == [leaves[2].shape[0]]
    assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2], strict=True))
    assert not torch.allclose(bad[0], want[0])


_POINTWISE = """
from samebits.kernels import experts_backward_triton as m
from samebits.kernels.experts_backward import experts_backward, grouped_mm_loop, pointwise_ref
m.MAX_BLOCK_I = 16  # a row's columns in several steps, the last one partial
g = torch.Generator().manual_seed(0)
for n, inter, want_dw in ((13, 40, True), (8, 16, False), (1, 3, True)):
    gate_up, u = torch.randn(n, 2 * inter, generator=g), torch.randn(n, inter, generator=g)
    order = torch.randperm(n, generator=g).to(torch.int32)
    weights = torch.rand(n, generator=g).view(n, 1)
    args = (gate_up, u, order, weights, want_dw)
    got, want = m.pointwise(*args), pointwise_ref(*args)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == b.shape and ((a - b).norm() / b.norm()).item() < 1e-5, (n, inter)
# the whole backward with it, against the torch middle (fp32, the loop's grouped GEMMs)
t, e, k, h, i = 11, 5, 2, 24, 20
x, grad = torch.randn(t, h, generator=g), torch.randn(t, h, generator=g)
gate_up, down = 0.2 * torch.randn(e, 2 * i, h, generator=g), 0.2 * torch.randn(e, h, i, generator=g)
index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
weights = torch.softmax(torch.randn(t, k, generator=g), -1)
args = (grad, x, index, weights, gate_up, down, (True,) * 4)
want = experts_backward(*args, gmm=grouped_mm_loop)
got = experts_backward(*args, gmm=grouped_mm_loop, pointwise=m.pointwise)
for a, b in zip(got, want):
    assert ((a - b).norm() / b.norm()).item() < 1e-5
print("OK")
"""


def test_the_triton_pointwise_middle_under_the_interpreter_equals_the_torch_one():
    """`experts_backward_triton.pointwise` (row blocks, column steps, dw written at each pair's
    own position) against `pointwise_ref`, and the whole backward with it, fp32, under Triton's
    CPU interpreter."""
    from interpreted import run_interpreted

    run_interpreted(_POINTWISE)
