"""CUDA: the fused router (`kernels/router_triton.py`: softmax in one launch, torch.topk, the
renorm and cast in one) gives the bits of transformers' `Qwen3MoeTopKRouter` inside
batch_invariant(), where each of its ops is its own launch: the trainer's side. At the real
Qwen3-30B-A3B router shape (128 experts, top-8, hidden 2048), with tied logits."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from samebits.numerics import composite, ops
from samebits.numerics.batch_invariant import batch_invariant

pytestmark = pytest.mark.gpu

E, K, H = 128, 8, 2048


def _router(norm_topk_prob: bool, dtype=torch.bfloat16) -> hf.Qwen3MoeTopKRouter:
    cfg = Qwen3MoeConfig(
        hidden_size=H, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob, num_hidden_layers=1
    )
    router = hf.Qwen3MoeTopKRouter(cfg).to("cuda", dtype)
    g = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, device="cuda", generator=g) * H**-0.5 * 3)
        router.weight[9] = router.weight[5]  # experts 5 and 9 tie on every token
    return router


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("launches", ["one", "four"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("t", [1, 7, 64, 300, 4096])
def test_fused_router_gives_the_transformers_router_bits(t, norm_topk_prob, launches, monkeypatch):
    """The registry's CUDA router, in one launch (this torch's topk order checked) and in four
    (torch.topk itself: any other torch), equals transformers' router."""
    from samebits.kernels import router_one_launch, router_triton, topk_order

    if launches == "four":
        monkeypatch.setattr(topk_order, "TOPK_ORDER_TORCH", ())
    elif not topk_order.order_checked(K):
        pytest.skip(f"torch {torch.__version__}: topk's tie order not checked for the one-launch router")
    module = router_one_launch if launches == "one" else router_triton
    router = _router(norm_topk_prob)
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    calls = []
    fused = module.router
    monkeypatch.setattr(module, "router", lambda *a: calls.append(1) or fused(*a))
    with torch.no_grad(), batch_invariant():
        _, want_weights, want_index = router(x)
        logits = torch.nn.functional.linear(x, router.weight)
        weights, index = ops.router(logits, K, norm_topk_prob)
    assert calls, f"the exact profile's router on CUDA should take the {launches}-launch kernels"
    assert torch.equal(index, want_index)
    assert weights.dtype == want_weights.dtype and torch.equal(weights, want_weights)
    with batch_invariant():
        want_probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    assert torch.equal(router_triton.softmax(logits), want_probs)
    if t == 4096:
        # negative control: aten's stock softmax (its own sum order) gives other fp32
        # probabilities, and the comparison sees it
        stock = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        assert not torch.equal(router_triton.softmax(logits), stock)


def test_fp32_router_weights_and_the_renorm_control():
    """fp32 logits give fp32 weights, so the renorm's own roundings show: equal to
    transformers' router, and a renorm summed left to right (another order) differs."""
    from samebits.kernels import router_triton

    router = _router(True, torch.float32)
    x = torch.randn(4096, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    with torch.no_grad(), batch_invariant():
        _, want_weights, want_index = router(x)
        logits = torch.nn.functional.linear(x, router.weight)
        weights, index = router_triton.router(logits, K, True)
        top = torch.topk(router_triton.softmax(logits), K, dim=-1).values
    assert torch.equal(index, want_index) and torch.equal(weights, want_weights)
    left_to_right = top[:, 0]
    for j in range(1, K):
        left_to_right = left_to_right + top[:, j]
    assert not torch.equal(top / left_to_right[:, None], weights)


def test_unsupported_shapes_take_the_composite():
    from samebits.kernels import router_triton

    logits = torch.randn(4, 60, device="cuda")  # 60 experts: not a power of two
    assert not router_triton.supported(logits, 4)
    assert not router_triton.supported(torch.randn(4, 128, device="cuda"), 6)
    assert router_triton.supported(torch.randn(4, 128, device="cuda").bfloat16(), 8)
    with batch_invariant():
        w, i = ops.router(logits, 4, True)
        w2, i2 = composite.router(logits, 4, True)
    assert torch.equal(w, w2) and torch.equal(i, i2)


@pytest.mark.parametrize("e,k", [(128, 8), (60, 4), (128, 1), (16, 2), (40, 32)])
def test_torch_topk_tie_order_on_cuda_is_the_written_out_reference(e, k):
    """CUDA `torch.topk` on rows full of ties (values from a set of 4; the router's softmax with
    duplicated expert rows) equals `topk_cuda_order_ref`, values and indices: what a one-launch
    router must reproduce. Control: ties ordered by index (a stable sort) differ from it."""
    from samebits.kernels.topk_order import topk_cuda_order_ref

    g = torch.Generator(device="cuda").manual_seed(e * 100 + k)
    ties = torch.randint(0, 4, (1024, e), device="cuda", generator=g).float() / 4
    logits = torch.randn(1024, e, device="cuda", generator=g)
    logits[:, 1::3] = logits[:, 0::3][:, : logits[:, 1::3].shape[1]]  # expert 3j+1 = expert 3j
    probs = torch.softmax(logits, -1)
    for x in (ties, probs):
        values, indices = torch.topk(x, k)
        want_v, want_i = topk_cuda_order_ref(x, k)
        assert torch.equal(values.cpu(), want_v) and torch.equal(indices.cpu(), want_i)
    stable_v, stable_i = torch.sort(ties, dim=-1, descending=True, stable=True)
    assert k == 1 or not torch.equal(stable_i[:, :k].cpu(), topk_cuda_order_ref(ties, k)[1])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("t", [1, 7, 300, 4096])
def test_one_launch_router_gives_the_transformers_router_bits(t, norm_topk_prob):
    """`router_one_launch` (softmax, top-k in torch's CUDA order, renorm, cast in one launch)
    equals transformers' router inside batch_invariant(), experts 5 and 9 tied on every token,
    plus logits with expert 3j+1 tied to 3j. Control (t = 4096): ties in index order (a stable
    sort) are not torch.topk's order, so the equality sees the kernel's tie order."""
    from samebits.kernels import router_one_launch

    router = _router(norm_topk_prob)
    g = torch.Generator(device="cuda").manual_seed(t + 1)
    x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    with torch.no_grad(), batch_invariant():
        _, want_weights, want_index = router(x)
        logits = torch.nn.functional.linear(x, router.weight)
    weights, index = router_one_launch.router(logits, K, norm_topk_prob)
    assert torch.equal(index, want_index) and torch.equal(weights, want_weights)
    tied = logits.clone()
    tied[:, 1::3] = tied[:, 0::3][:, : tied[:, 1::3].shape[1]]
    with batch_invariant():
        want = torch.topk(torch.nn.functional.softmax(tied, dtype=torch.float, dim=-1), K)[1]
    assert torch.equal(router_one_launch.router(tied, K, norm_topk_prob)[1], want)
    if t == 4096:  # the control: ties by index, as a stable sort would put them
        stable = torch.sort(
            torch.nn.functional.softmax(tied, dtype=torch.float, dim=-1), dim=-1, descending=True, stable=True
        )[1][:, :K]
        assert not torch.equal(stable, want)
