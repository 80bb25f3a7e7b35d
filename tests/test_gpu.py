"""CUDA: the Triton matmul is batch invariant; HF-order ops on CUDA; the probe on CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float32]


def _g(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(2048, 4096), (4096, 2048), (2048, 768), (130, 257), (2048, 20000)])
def test_triton_matmul_row_invariant_and_close_to_float64(dtype, k, n):
    from samebits.kernels.matmul_triton import matmul

    a = torch.randn(300, k, device="cuda", generator=_g(0)).to(dtype)  # 300 > 256: the large tiles
    w = torch.randn(n, k, device="cuda", generator=_g(1)).to(dtype)  # nn.Linear layout
    full = matmul(a, w.t())
    for m in (1, 2, 7, 16, 17, 64, 65, 128, 257):  # across the tile switches (16, 64, 256; wide N: M > 64)
        for start in (0, 300 - m):
            assert torch.equal(matmul(a[start : start + m], w.t()), full[start : start + m]), (
                m,
                start,
            )
    # Control: the same sum in another K order gives other bits, which the comparison above sees.
    assert not torch.equal(matmul(a.flip(1), w.flip(1).t()), full)
    want = a.double() @ w.double().t()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3  # fp32: K * eps * |x|; TF32 is tested below
    err = ((full.double() - want).abs() / (want.abs() + 1)).max().item()
    assert err < tol, err


@pytest.mark.parametrize(
    "k,n,bias,n_major",
    [
        (2048, 5120, False, False),
        (4096, 2048, True, False),
        (2056, 2056, False, False),  # K and N not multiples of the tiles
        (2048, 5120, True, True),  # b N-major
    ],
)
def test_triton_matmul_rows_across_the_tma_switch(monkeypatch, k, n, bias, n_major):
    """From TMA_FROM_M rows `matmul` loads its operand tiles by tensor descriptors; every row is
    bitwise the row of a decode-sized launch (M = 1, 16, 17, 300: the pointer kernel's tile
    switches) and of the pointer kernel at the same M: with a bias, with K and N not multiples
    of the tiles (2056: the descriptors' zero fill past the edge), and with b N-major (a
    contiguous [K, N]) as well as a weight's `.t()`. Control: K reversed gives other bits."""
    from samebits.kernels import matmul_triton as mt
    from samebits.kernels.device_facts import tma_compared
    from samebits.kernels.matmul_tiles import TMA_FROM_M

    if not tma_compared(torch.device("cuda")):
        pytest.skip("TMA tiles run only where their bits were compared (NVIDIA compute capability 9.x)")
    ran = []
    launch = mt._launch_tma
    monkeypatch.setattr(mt, "_launch_tma", lambda *a: ran.append(1) or launch(*a))
    m = TMA_FROM_M + 77  # partial tiles at the end
    a = torch.randn(m, k, device="cuda", generator=_g(40)).bfloat16()
    w = torch.randn(n, k, device="cuda", generator=_g(41)).bfloat16()
    b = torch.randn(n, device="cuda", generator=_g(42)).bfloat16() if bias else None
    wt = w.t().contiguous() if n_major else w.t()
    full = mt.matmul(a, wt, b)
    assert ran, "the TMA launch did not run"
    assert torch.equal(full, mt.matmul(a, wt, b, tiles=mt.tiles_for(m, n)))  # the pointer kernel
    for rows in (1, 16, 17, 300):
        for start in (0, m - rows):
            assert torch.equal(mt.matmul(a[start : start + rows], wt, b), full[start : start + rows])
    assert not torch.equal(mt.matmul(a.flip(1).contiguous(), w.flip(1).t(), b), full)


def test_triton_matmul_outputs_past_two_to_the_31_elements():
    """An output of more than 2**31 elements (the lm_head over 14,200 tokens, as a trainer's large
    micro-batch computes it) is written at 64-bit offsets: its last rows equal the same rows in
    a small launch. (With 32-bit offsets they landed 2**32 elements short.)"""
    from samebits.kernels.matmul_triton import matmul

    m, k, n = 14200, 64, 151936  # m * n = 2.16e9 > 2**31
    a = torch.randn(m, k, device="cuda", generator=_g(43)).bfloat16()
    w = torch.randn(n, k, device="cuda", generator=_g(44)).bfloat16()
    full = matmul(a, w.t())
    assert torch.equal(full[-3:], matmul(a[-3:], w.t()))
    assert torch.equal(full[:3], matmul(a[:3], w.t()))


def test_triton_matmul_fp32_is_ieee_not_tf32():
    from samebits.kernels.matmul_triton import matmul

    a = torch.randn(64, 1024, device="cuda", generator=_g(2))
    b = torch.randn(1024, 256, device="cuda", generator=_g(3))
    want = a.double() @ b.double()
    ieee = (matmul(a, b).double() - want).abs().max().item()
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        tf32 = ((a @ b).double() - want).abs().max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    assert ieee < 1e-3 < tf32  # negative control: TF32 is visibly coarser


def test_negative_control_cublas_rows_depend_on_m():
    """Stock cuBLAS: a row computed at small M differs from the same row at large M (K=4096)."""
    a = torch.randn(512, 4096, device="cuda", generator=_g(4)).bfloat16()
    w = torch.randn(2048, 4096, device="cuda", generator=_g(5)).bfloat16()
    full = a @ w.t()
    assert any(not torch.equal((a[:m] @ w.t()), full[:m]) for m in (1, 8, 64, 100))


def test_batch_invariant_mode_on_cuda_linear_and_reductions():
    from samebits import batch_invariant

    x = torch.randn(33, 2048, device="cuda", generator=_g(6)).bfloat16()
    w = torch.randn(768, 2048, device="cuda", generator=_g(7)).bfloat16()
    with batch_invariant():
        full = torch.nn.functional.linear(x, w)
        rows = [torch.nn.functional.linear(x[i : i + 1], w)[0] for i in range(33)]
        lsm = torch.log_softmax(full.float(), -1)
        lsm1 = torch.log_softmax(full[5:6].float(), -1)
        mean = x.float().pow(2).mean(-1)
        mean1 = x[7:8].float().pow(2).mean(-1)
    assert all(torch.equal(r, full[i]) for i, r in enumerate(rows))
    assert torch.equal(lsm[5], lsm1[0]) and torch.equal(mean[7], mean1[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_order_ops_on_cuda_match_transformers(dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    from samebits import batch_invariant
    from samebits.numerics import ops

    norm = hf.Qwen3MoeRMSNorm(2048, eps=1e-6).to("cuda", dtype)
    x = torch.randn(4, 9, 2048, device="cuda", generator=_g(8)).to(dtype)
    assert torch.equal(ops.rms_norm(x, norm.weight, 1e-6), norm(x))
    cfg = Qwen3MoeConfig(hidden_size=2048, num_attention_heads=32, head_dim=128, rope_theta=1e6)
    rot = hf.Qwen3MoeRotaryEmbedding(cfg).to("cuda")
    rot.inv_freq.copy_(ops.rotary_inv_freq(128, 1e6))
    pos = torch.arange(5000, 5009, device="cuda")[None]
    q = torch.randn(1, 32, 9, 128, device="cuda", generator=_g(9)).to(dtype)
    cos, sin = rot(q, pos)
    c2, s2 = ops.rotary_cos_sin(q, pos, ops.rotary_inv_freq(128, 1e6), 1.0)
    assert torch.equal(c2, cos) and torch.equal(s2, sin)
    router = hf.Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8)).to(
        "cuda", dtype
    )
    with torch.no_grad():
        router.weight.normal_(std=0.02, generator=_g(10))  # std 1 underflows to exact-0 ties
    h = x.view(-1, 2048)
    with batch_invariant():  # one deterministic GEMM for both sides (cuBLAS fp32 may not repeat)
        _, scores, index = router(h)
        w2, i2 = ops.router(torch.nn.functional.linear(h, router.weight), 8, router.norm_topk_prob)
    assert torch.equal(w2, scores) and torch.equal(i2, index)


def test_verify_probe_on_cuda(tmp_path, monkeypatch):
    from samebits import verify

    monkeypatch.setenv("SAMEBITS_CACHE", str(tmp_path))
    results = verify.run(device="cuda", tokens=64, log=lambda *_: None)
    verify.print_table(results)
    assert verify.passed(results)


def test_reported_logprobs_equal_the_trainer_line_on_cuda_per_row():
    """Per-row temperatures in one batch = `torch.log_softmax(logits.float() / T, dim=-1)` row by
    row, T a Python float (a multiply by float32 1/T on CUDA). Control: dividing by the float32
    temperatures, the rule the CPU line follows, differs on CUDA."""
    from samebits import batch_invariant
    from samebits.numerics.ops import reported_logprobs

    temps = [0.7, 1.0, 1.3, 0.0] * 2
    logits = (torch.randn(8, 151936, device="cuda", generator=_g(5)) * 4).bfloat16()
    with batch_invariant():
        got = reported_logprobs(logits, temps)
        want = torch.cat(
            [torch.log_softmax(logits[i : i + 1].float() / (t or 1.0), dim=-1) for i, t in enumerate(temps)]
        )
        t32 = torch.tensor([t or 1.0 for t in temps], device="cuda")
        divided = torch.log_softmax(logits.float() / t32[:, None], dim=-1)
    assert torch.equal(got, want)
    assert not torch.equal(divided[0], want[0]) and not torch.equal(divided[2], want[2])


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_rollout_equals_trainer_on_cuda_at_temperature(tmp_path, temperature):
    """On CUDA `x / python_float` multiplies by the reciprocal; both sides must share one op."""
    from samebits import LLM, SamplingParams, batch_invariant, trainer
    from samebits.model.qwen3_moe.tiny import build_tiny_checkpoint
    from samebits.verify import make_prompts

    path = build_tiny_checkpoint(tmp_path / "t", seed=4)
    llm = LLM(path, device="cuda", max_num_seqs=4, max_model_len=96)
    prompts = make_prompts((7, 13, 21), llm.config.vocab_size, seed=2)
    outs = llm.generate(
        prompts, SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=3)
    )
    model = trainer.load_hf_model(path, device="cuda")
    with batch_invariant():
        lps = trainer.token_logprobs(
            model,
            [o.prompt_token_ids + o.token_ids for o in outs],
            [len(p) for p in prompts],
            packed=True,
            temperature=temperature,
        )
    assert all(torch.equal(o.logprobs, lp.cpu()) for o, lp in zip(outs, lps, strict=True))
