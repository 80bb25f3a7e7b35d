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
