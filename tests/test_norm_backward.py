"""The RMSNorm's closed-form backward (`kernels/norm_backward.py`, the CUDA kernel in
`kernels/norm_backward_triton.py`) against float64 autograd through transformers' formula.
Gradients carry no bitwise contract: this checks the formula and the kernel's row blocks."""

from __future__ import annotations

import pytest
import torch

from samebits.kernels.norm_backward import rms_norm_backward_ref

EPS = 1e-6


def _case(shape, dtype, weight_dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(weight_dtype)
    dy = torch.randn(shape, generator=g).to(torch.promote_types(dtype, weight_dtype))
    return x.to(device), w.to(device), dy.to(device)


def _float64(x, w, dy):
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    y = wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS))
    return torch.autograd.grad(y, (xd, wd), dy.double())


def _check(got, want, wants, tol):
    for g, a, wanted in zip(got, want, wants, strict=True):
        if not wanted:
            assert g is None
            continue
        assert ((g.double() - a).norm() / a.norm()).item() < tol


@pytest.mark.parametrize("wants", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("shape", [(37, 48), (4, 5, 16), (1, 24)])
def test_closed_form_equals_float64_autograd(shape, wants):
    x, w, dy = _case(shape, torch.float32, torch.float32)
    got = rms_norm_backward_ref(dy, x, w, EPS, wants)
    _check(got, _float64(x, w, dy), wants, 1e-6)
    assert got[0] is None or got[0].dtype == x.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("wants", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize(
    "shape, dtype, weight_dtype",
    [
        ((512, 2048), torch.bfloat16, torch.bfloat16),  # a layer's input norm at 4 x 128 tokens
        ((1, 512, 32, 128), torch.bfloat16, torch.bfloat16),  # q_norm: one row per head
        ((3000, 96), torch.float32, torch.float32),  # many rows a program, a width not a power of two
        ((7, 2048), torch.bfloat16, torch.float32),  # fp32 weights (FSDP master weights)
    ],
)
def test_triton_backward_equals_float64_autograd(shape, dtype, weight_dtype, wants):
    from samebits.kernels.norm_backward_triton import rms_norm_backward

    x, w, dy = _case(shape, dtype, weight_dtype, "cuda")
    strided = torch.empty(*shape[:-1], shape[-1] + 8, dtype=dtype, device="cuda")[..., : shape[-1]]
    strided.copy_(x)  # rows with a stride other than their width
    got = rms_norm_backward(dy, strided, w, EPS, wants)
    _check(got, _float64(x, w, dy), wants, 1e-5 if dtype == torch.float32 else 1e-2)
    ref = rms_norm_backward_ref(dy, x, w, EPS, wants)  # the portable closed form, for scale
    _check(ref, _float64(x, w, dy), wants, 1e-5 if dtype == torch.float32 else 1e-2)


# -- a layer's q/k norms and rotary (`qk_norm_rope_backward`) ------------------------------------


def _qk_case(t, h, kvh, d, dtype, device="cpu", seed=1, q_stride=None):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    joined = rand(t, (h + 2 * kvh) * d).to(dtype)  # q/k as column views of the joined GEMM
    q = joined[:, : h * d].view(t, h, d)
    k = joined[:, h * d : (h + kvh) * d].view(t, kvh, d)
    wq, wk = ((1 + 0.1 * rand(d)).to(dtype) for _ in range(2))
    angle = rand(t, d // 2).repeat(1, 2) * 3  # transformers' cat((freqs, freqs))
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    dq, dk, dv = rand(t, h, d).to(dtype), rand(t, kvh, d).to(dtype), rand(t, kvh, d).to(dtype)
    on = lambda *xs: [x.to(device) for x in xs]  # noqa: E731
    return on(dq, dk, dv, q, k, wq, wk, cos, sin)


def _qk_float64(dq, dk, dv, q, k, wq, wk, cos, sin):
    """float64 autograd through transformers' formula: RMSNorm, then q*cos + rotate_half(q)*sin."""
    leaves = [x.double().requires_grad_() for x in (q, k, wq, wk)]
    c, s = cos.double()[:, None], sin.double()[:, None]

    def norm_rope(x, w):
        y = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))
        half = y.shape[-1] // 2
        return y * c + torch.cat((-y[..., half:], y[..., :half]), -1) * s

    outs = (norm_rope(leaves[0], leaves[2]), norm_rope(leaves[1], leaves[3]))
    gq, gk, gwq, gwk = torch.autograd.grad(outs, leaves, (dq.double(), dk.double()))
    t = q.shape[0]
    return torch.cat([gq.reshape(t, -1), gk.reshape(t, -1), dv.double().reshape(t, -1)], -1), gwq, gwk


@pytest.mark.parametrize("wants", [(True, True), (False, True), (False, False)])
def test_qk_norm_rope_closed_form_equals_float64_autograd(wants):
    from samebits.kernels.norm_backward import qk_norm_rope_backward_ref

    case = _qk_case(7, 4, 2, 16, torch.float32)
    got = qk_norm_rope_backward_ref(*case[:7], EPS, *case[7:], wants)
    _check(got, _qk_float64(*case), (True, *wants), 1e-6)
    assert got[0].shape == (7, (4 + 2 * 2) * 16) and got[0].dtype == torch.float32


def test_control_qk_norm_rope_closed_form_with_the_rotation_untransposed_differs():
    """The rotary's grad taken through rotate_half itself instead of its transpose (the sign on
    the wrong half): far off, so the tolerance above sees the rotation's direction."""
    from samebits.kernels import norm_backward

    case = _qk_case(7, 4, 2, 16, torch.float32)
    real = norm_backward.rotary_backward_ref

    def untransposed(grad, cos, sin):  # grad*cos + rotate_half(grad*sin)
        gs, half = grad.float() * sin, grad.shape[-1] // 2
        return grad.float() * cos + torch.cat((-gs[..., half:], gs[..., :half]), -1)

    norm_backward.rotary_backward_ref = untransposed
    try:
        got = norm_backward.qk_norm_rope_backward_ref(*case[:7], EPS, *case[7:], (True, True))
    finally:
        norm_backward.rotary_backward_ref = real
    want = _qk_float64(*case)
    assert ((got[0].double() - want[0]).norm() / want[0].norm()).item() > 0.1


_QK_TRITON = """
from samebits.kernels.norm_backward import qk_norm_rope_backward_ref
from samebits.kernels.norm_rope_backward_triton import qk_norm_rope_backward
import samebits.kernels.norm_rope_backward_triton as m
m.sm_count = lambda device: 2  # several tokens a program, the last one partial
g = torch.Generator().manual_seed(0)
# q and k heads short of their power-of-two blocks with both weights' grads wanted (the masks)
both, dwk_only, dwq_only = (True, True), (False, True), (True, False)
shapes = ((9, 4, 2, 16, both), (6, 5, 3, 8, both), (5, 3, 1, 8, dwk_only), (1, 2, 2, 4, dwq_only))
for t, h, kvh, d, wants in shapes:
    joined = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    q, k = joined[:, : h * d].view(t, h, d), joined[:, h * d : (h + kvh) * d].view(t, kvh, d)
    wq, wk = 1 + 0.1 * torch.randn(d, generator=g), 1 + 0.1 * torch.randn(d, generator=g)
    angle = torch.randn(t, d // 2, generator=g).repeat(1, 2)
    cos, sin = angle.cos(), angle.sin()
    dq = torch.randn(t, h, d, generator=g)
    dk, dv = torch.randn(t, kvh, d, generator=g), torch.randn(t, kvh, d, generator=g)
    args = (dq, dk, dv, q, k, wq, wk, 1e-6, cos, sin, wants)
    got, want = qk_norm_rope_backward(*args), qk_norm_rope_backward_ref(*args)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert ((a - b).norm() / b.norm()).item() < 1e-5, (t, h, kvh, d, (a - b).abs().max())
print("OK")
"""


def test_qk_norm_rope_triton_backward_under_the_interpreter_equals_the_closed_form():
    """The kernel's token blocks, head masks (3 heads in a block of 4), partner loads and column
    placement against the torch closed form, fp32, under Triton's CPU interpreter."""
    from interpreted import run_interpreted

    run_interpreted(_QK_TRITON)


@pytest.mark.gpu
@pytest.mark.parametrize("wants", [(True, True), (False, False)])
@pytest.mark.parametrize("t, h, kvh, d", [(512, 32, 4, 128), (3000, 4, 1, 64), (1, 6, 2, 32)])
def test_qk_norm_rope_triton_backward_equals_float64_autograd(t, h, kvh, d, wants):
    from samebits.kernels.norm_rope_backward_triton import qk_norm_rope_backward

    case = _qk_case(t, h, kvh, d, torch.bfloat16, "cuda")
    got = qk_norm_rope_backward(*case[:7], EPS, *case[7:], wants)
    _check(got, _qk_float64(*case), (True, *wants), 1e-2)
