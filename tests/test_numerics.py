"""Each HF-order op against the transformers module it mirrors, bitwise (rtol=atol=0)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from samebits.numerics import ops
from samebits.numerics.batch_invariant import batch_invariant

DTYPES = [torch.float32, torch.bfloat16]


def _cfg(**kw):
    base = dict(
        vocab_size=64,
        hidden_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        num_experts=5,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        intermediate_size=24,
        rope_theta=10000.0,
    )
    base.update(kw)
    return Qwen3MoeConfig(**base)


def _exact(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(a, b)


@pytest.fixture(params=[False, True], ids=["stock", "batch_invariant"])
def mode(request):
    if request.param:
        with batch_invariant():
            yield
    else:
        yield


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_hf(dtype, mode):
    g = torch.Generator().manual_seed(0)
    norm = hf.Qwen3MoeRMSNorm(40, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(40, generator=g))
    x = (3 * torch.randn(7, 5, 40, generator=g)).to(dtype)
    _exact(ops.rms_norm(x, norm.weight, 1e-6), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_hf_decoder_order(dtype, mode):
    g = torch.Generator().manual_seed(1)
    norm = hf.Qwen3MoeRMSNorm(40, eps=1e-6).to(dtype)
    x, res = (torch.randn(2, 9, 40, generator=g).to(dtype) for _ in range(2))
    h, normed = ops.add_rms_norm(x, res, norm.weight, 1e-6)
    _exact(h, res + x)
    _exact(normed, norm(res + x))


def test_rms_norm_negative_control_fp32_weight_multiply():
    """A fused-style norm that multiplies the weight in fp32 differs: the check can fail."""
    g = torch.Generator().manual_seed(2)
    w = (1 + 0.1 * torch.randn(40, generator=g)).bfloat16()
    x = (3 * torch.randn(64, 40, generator=g)).bfloat16()
    xf = x.float()
    fused = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).bfloat16()
    assert not torch.equal(fused, ops.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_hf(dtype, mode):
    cfg = _cfg(rope_theta=1e6, head_dim=24)
    rot = hf.Qwen3MoeRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 11, 24, generator=g).to(dtype)
    k = torch.randn(2, 2, 11, 24, generator=g).to(dtype)
    pos = torch.tensor([list(range(11)), list(range(3000, 3011))])
    cos, sin = rot(q, pos)
    inv = ops.rotary_inv_freq(24, 1e6)
    assert torch.equal(inv, rot.inv_freq)
    c2, s2 = ops.rotary_cos_sin(q, pos, inv, 1.0)
    _exact(c2, cos)
    _exact(s2, sin)
    qe, ke = hf.apply_rotary_pos_emb(q, k, cos, sin)
    q2, k2 = ops.apply_rotary(q, k, c2, s2, 1)
    _exact(q2, qe)
    _exact(k2, ke)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mrope_matches_omni_thinker(dtype):
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as oc
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as om

    cfg = oc.Qwen3OmniMoeTextConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [6, 5, 5]},
    )
    rot = om.Qwen3OmniMoeThinkerTextRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 9, 64, generator=g).to(dtype)
    pos = torch.randint(0, 500, (3, 1, 9), generator=g)
    cos, sin = rot(x, pos)
    c2, s2 = ops.mrope_cos_sin(x, pos, ops.rotary_inv_freq(32, 1e6), 1.0, [6, 5, 5])
    _exact(c2, cos)
    _exact(s2, sin)
    # negative control: plain 1-D rotary from the T row differs where H/W rows differ
    c3, _ = ops.rotary_cos_sin(x, pos[0], ops.rotary_inv_freq(32, 1e6), 1.0)
    assert not torch.equal(c3, cos)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_topk", [True, False])
def test_router_matches_hf(dtype, norm_topk, mode):
    cfg = _cfg(norm_topk_prob=norm_topk)
    router = hf.Qwen3MoeTopKRouter(cfg).to(dtype)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(5, 40, generator=g))
    x = torch.randn(13, 40, generator=g).to(dtype)
    logits, scores, index = router(x)
    w2, i2 = ops.router(torch.nn.functional.linear(x, router.weight), 3, norm_topk)
    _exact(w2, scores)
    assert torch.equal(i2, index)


@pytest.mark.parametrize("dtype", DTYPES)
def test_deepstack_add_matches_thinker(dtype):
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as om

    g = torch.Generator().manual_seed(6)
    h = torch.randn(1, 10, 16, generator=g).to(dtype)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 3:7] = True
    emb = torch.randn(4, 16, generator=g).to(dtype)
    want = om.Qwen3OmniMoeThinkerTextModel._deepstack_process(None, h, mask, emb)
    _exact(ops.deepstack_add(h, mask, emb), want)


def _op_cases(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 40, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(dtype)
    q = torch.randn(6, 4, 24, generator=g).to(dtype)
    k = torch.randn(6, 2, 24, generator=g).to(dtype)
    pos = torch.arange(6)
    inv = ops.rotary_inv_freq(24, 1e6)
    mask = torch.tensor([False, True, True, False, False, True])
    return {
        "rms_norm": (lambda: ops.rms_norm(x, w, 1e-6)),
        "add_rms_norm": (lambda: ops.add_rms_norm(x, x * 0.5, w, 1e-6)),
        "rotary": (lambda: ops.apply_rotary(q, k, *ops.rotary_cos_sin(q, pos, inv, 1.0), 1)),
        "mrope": (
            lambda: ops.mrope_cos_sin(q, torch.stack([pos, pos * 2, pos * 3])[:, None], inv, 1.0, [4, 4, 4])
        ),
        "router": (lambda: ops.router(x[:, :5], 2, True)),
        "deepstack": (lambda: ops.deepstack_add(x, mask, x[:3] * 2)),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "rotary", "mrope", "router", "deepstack"])
def test_ops_compiled_fullgraph_equal_eager(dtype, name):
    fn = _op_cases(dtype)[name]
    eager = fn()
    compiled = torch.compile(fn, fullgraph=True, backend="inductor")()
    for a, b in zip(
        torch.utils._pytree.tree_leaves(eager),
        torch.utils._pytree.tree_leaves(compiled),
        strict=True,
    ):
        _exact(a, b)


def test_integer_and_bool_sums_keep_aten_dtype_under_batch_invariant():
    """sum over bool/int tensors is int64 as in aten (transformers' get_rope_index subtracts from it)."""
    x = torch.tensor([True, False, True])
    with batch_invariant():
        got = [x.sum(), x.sum(-1), torch.tensor([1, 2], dtype=torch.int32).sum(0)]
    assert [t.dtype for t in got] == [torch.int64] * 3
    assert [int(t) for t in got] == [2, 2, 3]
