"""CUDA: batch_invariant()'s log_softmax over a vocabulary runs the sampler's fused kernels
(`sample_launch.log_softmax`) and gives the bits of the composite (`log_softmax_ref` with the
device's tree sum): the trainer's line `torch.log_softmax(logits.float() / T, dim=-1)` at the
Qwen3 vocabulary, with rows of -inf, +inf and NaN logits, and its gradient."""

from __future__ import annotations

import pytest
import torch

from samebits.kernels.softmax import log_softmax_ref
from samebits.numerics import registry
from samebits.numerics.batch_invariant import batch_invariant

pytestmark = pytest.mark.gpu

V = 151936


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(n, V, device="cuda", generator=g) * 3).bfloat16()
    x[0, 100:200] = float("-inf")  # banned-like ids
    if n > 3:
        x[1, 5] = float("inf")
        x[2, 9] = float("nan")
        x[3] = float("-inf")
    return x


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every bit equal, NaN where NaN (whatever its payload); -0.0 differs from +0.0."""
    nan = a.isnan()
    if a.dtype != b.dtype or not torch.equal(nan, b.isnan()):
        return False
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.view(as_int)[~nan], b.view(as_int)[~nan])


def _spy(monkeypatch) -> list:
    from samebits.kernels import sample_launch

    calls = []
    fused = sample_launch.log_softmax
    monkeypatch.setattr(sample_launch, "log_softmax", lambda *a: calls.append(1) or fused(*a))
    return calls


@pytest.mark.parametrize("n", [1, 7, 300])
def test_the_trainer_line_takes_the_fused_kernels_with_the_composite_bits(n, monkeypatch):
    logits = _logits(n, n)
    tree = registry.pick("tree_sum", "cuda", registry.ANY)
    calls = _spy(monkeypatch)

    def fused(fn):  # fn() under batch_invariant(), which must take the fused kernels once
        calls.clear()
        with batch_invariant():
            out = fn()
        assert len(calls) == 1, "log_softmax over the vocabulary on CUDA should take the fused kernels"
        return out

    for temp in (1.0, 0.7):
        got = fused(lambda t=temp: torch.log_softmax(logits.float() / t, dim=-1))
        want = log_softmax_ref(logits.float() / temp, -1, torch.float32, tree)
        assert _bits_equal(got, want)
    # low-precision inputs: the composite computes in float32 and rounds once to the out dtype
    got16 = fused(lambda: torch.log_softmax(logits, dim=-1))
    assert got16.dtype == torch.bfloat16
    assert _bits_equal(got16, log_softmax_ref(logits, -1, torch.bfloat16, tree))
    half = logits.half()
    got_h2f = fused(lambda: torch._log_softmax(half, -1, True))  # half_to_float: a float32 result
    assert _bits_equal(got_h2f, log_softmax_ref(half, -1, torch.float32, tree))
    # the trainer's [batch, tokens, V] logits: the rows of the last dim
    three = logits.float()[None].expand(2, -1, -1)
    got3 = fused(lambda: torch.log_softmax(three, dim=2))
    assert got3.shape == three.shape
    assert _bits_equal(got3[1], log_softmax_ref(logits.float(), -1, torch.float32, tree))
    if n == 300:
        # negative control: aten's stock log_softmax (its own sum order) gives other bits
        stock = torch.log_softmax(logits.float(), dim=-1)
        assert not _bits_equal(stock, fused(lambda: torch.log_softmax(logits.float(), dim=-1)))


def test_the_gradient_is_the_composite_paths_gradient(monkeypatch):
    """The backward is aten's, from the output: the fused forward's equal output gives the
    gradient the composite forward gives through the same `torch.log_softmax`."""
    logits = _logits(16, 3)[4:].float()  # finite rows
    targets = torch.randint(0, V, (12,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    grads = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(registry, "_fused_sample_ok", lambda rows: False)  # the composite
        calls = _spy(monkeypatch)
        x = logits.clone().requires_grad_(True)
        with batch_invariant():
            torch.log_softmax(x, dim=-1).gather(-1, targets[:, None]).sum().backward()
        assert bool(calls) == fused
        grads.append(x.grad)
    assert torch.isfinite(grads[0]).all() and _bits_equal(grads[0], grads[1])


def test_other_shapes_take_the_composite(monkeypatch):
    calls = _spy(monkeypatch)
    small = torch.randn(4, 1000, device="cuda")  # rows below the fused kernels' 4097
    with batch_invariant():
        torch.log_softmax(small, dim=-1)
        torch.log_softmax(torch.randn(5000, 8, device="cuda"), dim=0)  # not the last dim
        torch.log_softmax(torch.randn(2, 5000, device="cuda", dtype=torch.float64), dim=-1)
    assert not calls
