"""Batch invariance of the portable kernels: a row alone equals the same row in a batch, bitwise.

Each property has a negative control showing the stock kernel (or a wrong
variant) does differ, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
from cpu_facts import needs_varying_stock_bf16
from interpreted import run_interpreted

from samebits.kernels.attention import attention_ref, varlen_attention
from samebits.kernels.experts import experts_ref, experts_stock_ref
from samebits.kernels.matmul import matmul_ref
from samebits.kernels.reduce import tree_sum_ref
from samebits.kernels.softmax import log_softmax_ref
from samebits.numerics import ops
from samebits.numerics.batch_invariant import batch_invariant

DTYPES = [torch.float32, torch.bfloat16]


def _g(seed):
    return torch.Generator().manual_seed(seed)


def test_tree_sum_is_independent_of_padding_width():
    x = torch.randn(5, 37, generator=_g(0))
    ref = tree_sum_ref(x, -1)
    for extra in (1, 27, 91, 219):
        padded = torch.cat([x, torch.full((5, extra), -0.0)], dim=-1)
        assert torch.equal(tree_sum_ref(padded, -1), ref)
    # control: torch's stock sum over the same -0.0 padded rows changes its bits with the
    # padding width (its vector lanes group the adds by width), so the check can see a width effect
    stock = [
        torch.equal(torch.cat([x, torch.full((5, e), -0.0)], -1).sum(-1), x.sum(-1)) for e in (27, 91, 219)
    ]
    assert not all(stock)


def _padded_tree(x, dim):
    """The halving tree over x padded with -0.0 to a power of two, pads built (the oracle)."""
    x = x.movedim(dim, -1)
    width = 1 << max(x.shape[-1] - 1, 0).bit_length()
    x = torch.cat([x, x.new_full((*x.shape[:-1], width - x.shape[-1]), -0.0)], dim=-1)
    while x.shape[-1] > 1:
        x = x[..., : x.shape[-1] // 2] + x[..., x.shape[-1] // 2 :]
    return x.squeeze(-1)


@pytest.mark.parametrize("dtype,bits", [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)])
def test_tree_sum_builds_no_pads_and_gives_the_padded_trees_bits(dtype, bits):
    for n in [*range(1, 70), 96, 129, 3000, 151936]:
        x = (torch.randn(3, n, generator=_g(n)) * torch.logspace(-4, 4, n)).to(dtype)
        x[0] = -0.0  # the one sum whose sign depends on the pads
        for dim in (-1, 0):
            got, want = tree_sum_ref(x, dim), _padded_tree(x, dim)
            assert torch.equal(got.view(bits), want.view(bits)), (n, dim)
    # negative control: +0.0 pads give the all -0.0 row another sign bit, and the check sees it
    z = torch.full((1, 24), -0.0, dtype=dtype)
    plus = torch.cat([z, torch.zeros(1, 8, dtype=dtype)], dim=-1)
    assert not torch.equal(_padded_tree(plus, -1).view(bits), tree_sum_ref(z, -1).view(bits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(40, 56), (96, 384), (160, 96)])
def test_matmul_row_alone_equals_row_in_batch(dtype, k, n):
    b = torch.randn(k, n, generator=_g(1)).to(dtype)
    a = torch.randn(37, k, generator=_g(2)).to(dtype)
    full = matmul_ref(a, b)
    for m in (1, 2, 5, 16, 17, 33):  # the same rows at different M and offsets
        for start in (0, 37 - m):
            assert torch.equal(matmul_ref(a[start : start + m], b), full[start : start + m])
    for row in range(37):
        assert torch.equal(matmul_ref(a[row : row + 1], b)[0], full[row])


def test_matmul_negative_control_stock_fp32_mm_varies_with_m():
    """Measured: stock CPU fp32 mm gives a row different bits at M=1 and M>=2."""
    b = torch.randn(96, 384, generator=_g(3))
    a = torch.randn(8, 96, generator=_g(4))
    differs = [not torch.equal(torch.mm(a[i : i + 1], b)[0], torch.mm(a, b)[i]) for i in range(8)]
    assert any(differs)


def _model_width_bf16():
    b = (torch.randn(2048, 1536, generator=_g(41)) * 2048**-0.5).bfloat16()
    return torch.randn(20, 2048, generator=_g(42)).bfloat16(), b


def test_matmul_bf16_at_model_width():
    """bf16 at K=2048 (a released model's hidden): each row's bits alone = among 20."""
    a, b = _model_width_bf16()
    full = matmul_ref(a, b)
    for m in (1, 3, 17):
        assert torch.equal(matmul_ref(a[:m], b), full[:m])


@needs_varying_stock_bf16
def test_matmul_bf16_at_model_width_stock_control():
    """Control of the test above: the same comparison on stock mm, whose bf16 rows depend on M
    on CPUs with an AVX-512 MKL path (at the widths above they do not, so there only fp32 has a
    control)."""
    a, b = _model_width_bf16()
    stock = torch.mm(a, b)
    assert any(not torch.equal(torch.mm(a[:m], b), stock[:m]) for m in (1, 3, 17))


def test_matmul_ref_bits_do_not_follow_the_layout_of_b():
    """A transposed view of b (F.linear's weight.t()) and its contiguous copy, fp32 and bf16,
    give one result: `_as_fp32_nt` brings every b to one layout. Control, the reason: where the
    stock fp32 GEMM's bits follow b's layout on this CPU (MKL's AVX2 path), using b as passed
    would give the two layouts other bits."""
    w = torch.randn(9, 16, generator=_g(43))
    a = torch.randn(5, 16, generator=_g(44))
    for dtype in (torch.float32, torch.bfloat16):
        b = w.to(dtype).t()
        assert torch.equal(matmul_ref(a.to(dtype), b), matmul_ref(a.to(dtype), b.contiguous()))
    tile = torch.zeros(16, 16)
    tile[:5] = a
    if not torch.equal(torch.mm(tile, w.t()), torch.mm(tile, w.t().contiguous())):
        assert not torch.equal(matmul_ref(a, w.t()), torch.mm(tile, w.t().contiguous())[:5])


@pytest.mark.parametrize(
    "m,n,want",
    [
        (1, 5120, (16, 16, 2, 8)),  # decode q+k+v: 16 x 16 tiles up to 16 rows
        (16, 2048, (16, 16, 2, 8)),
        (17, 2048, (64, 16, 4, 8)),  # o_proj and the router up to 64 rows: 16 columns a tile
        (64, 128, (64, 16, 4, 8)),
        (64, 5120, (64, 32, 4, 6)),  # q+k+v past 16 rows
        (65, 2048, (64, 32, 4, 6)),
        (256, 2048, (64, 32, 4, 6)),
        (257, 2048, (128, 128, 8, 3)),  # prefill, the trainer
        (1, 151936, (64, 32, 4, 6)),  # the lm_head: 64 x 32 up to 64 rows, then the large tiles
        (64, 151936, (64, 32, 4, 6)),
        (65, 151936, (128, 128, 8, 3)),
    ],
)
def test_the_cuda_matmul_picks_its_tiles_by_m_and_n(m, n, want):
    """(BLOCK_M, BLOCK_N, warps, stages) of `matmul_triton.matmul`; BLOCK_K is one constant, so
    no choice here moves a row's K order (the GPU test compares rows across these switches)."""
    from samebits.kernels.matmul_tiles import tiles_for

    assert tiles_for(m, n) == want


def test_large_products_take_the_tma_launch_and_small_ones_the_pointer_kernel():
    """`matmul` loads operand tiles by tensor descriptors from TMA_FROM_M rows at outputs of
    TMA_MIN_N columns up to the lm_head's width (the GPU test compares rows across the switch)."""
    from samebits.kernels.matmul_tiles import TMA_FROM_M, TMA_MIN_N, TMA_TILES, WIDE_N, tma_tiles_for

    assert tma_tiles_for(TMA_FROM_M, TMA_MIN_N) == TMA_TILES == tma_tiles_for(8192, 5120)
    assert tma_tiles_for(TMA_FROM_M - 1, 5120) is None  # prefill chunks below it, decode
    assert tma_tiles_for(8192, 128) is None  # the router's 128 columns: the pointer kernel won
    assert tma_tiles_for(8192, WIDE_N) is None and tma_tiles_for(8192, 151936) is None  # the lm_head


_TMA_MATMUL = """
from samebits.kernels import matmul_triton as mt
g = torch.Generator().manual_seed(0)
for m, k, n, bias in [(100, 192, 72, False), (130, 136, 64, True), (40, 64, 200, False)]:
    a = torch.randn(m, k, generator=g).half()
    w = torch.randn(n, k, generator=g).half()
    b = torch.randn(n, generator=g).half() if bias else None
    for tiles in ((64, 32, 4, 3), (32, 64, 4, 3)):
        # the pointer kernel at the same tiles (the interpreter's numpy dots round by block shape)
        want = mt.matmul(a, w.t(), b, tiles=tiles)
        for programs in (0, 3):
            assert torch.equal(mt.matmul_tma(a, w.t(), b, tiles, programs), want), (m, tiles, programs)
            assert torch.equal(mt.matmul_tma(a, w.t().contiguous(), b, tiles, programs), want), (m, tiles)
    # control: the same products summed from the other end of K give other bits
    assert not torch.equal(mt.matmul_tma(a.flip(1).contiguous(), w.flip(1).t(), b, tiles), want)
print("OK")
"""


def test_the_tma_matmul_gives_the_pointer_kernels_bits_in_tritons_interpreter():
    """`matmul_tma` (operand tiles by tensor descriptors, one program a tile or a persistent
    grid; b K-major as a weight's `.t()` or N-major) = the pointer `matmul_kernel` at the same
    tiles, bit for bit, with partial tiles at every edge and a bias, in Triton's CPU interpreter
    (fp16). This checks the descriptors' offsets and the epilogue; the GPU test checks the
    tensor cores' bits.
    Control: K reversed gives other bits."""
    from interpreted import run_interpreted

    run_interpreted(_TMA_MATMUL)


def test_batch_invariant_mode_routes_linear_through_the_kernel():
    w = torch.randn(384, 96, generator=_g(5))
    x = torch.randn(8, 96, generator=_g(6))
    with batch_invariant():
        rows = [torch.nn.functional.linear(x[i : i + 1], w)[0] for i in range(8)]
        batch = torch.nn.functional.linear(x, w)
        mean = x.mean(-1)
        lsm = torch.log_softmax(x, -1)
    assert all(torch.equal(r, batch[i]) for i, r in enumerate(rows))
    assert torch.equal(batch, matmul_ref(x, w.t()))
    assert torch.equal(lsm, log_softmax_ref(x, -1))
    assert torch.equal(mean, tree_sum_ref(x, -1) / 96)
    # outside the mode the stock kernel is back (and it is batch-variant here)
    stock = torch.nn.functional.linear(x, w)
    assert any(not torch.equal(torch.nn.functional.linear(x[i : i + 1], w)[0], stock[i]) for i in range(8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_row_invariant(dtype):
    x = (4 * torch.randn(9, 301, generator=_g(7))).to(dtype)
    full = log_softmax_ref(x, -1, torch.float32)
    for i in range(9):
        assert torch.equal(log_softmax_ref(x[i : i + 1], -1, torch.float32)[0], full[i])
    # control: a log_softmax whose row sum is split by the batch size (as split reductions on a
    # GPU choose their split from the shape) gives a row other bits alone. Stock CPU log_softmax
    # cannot serve: it is row-invariant here (measured at widths 301 and 8256).
    split = _batch_split_log_softmax(x)
    assert any(not torch.equal(_batch_split_log_softmax(x[i : i + 1])[0], split[i]) for i in range(9))


def _batch_split_log_softmax(x):
    """log_softmax in fp32 whose row sum adds one partial sum per row of the batch."""
    xf = x.float()
    shifted = xf - xf.amax(-1, keepdim=True)
    parts = [p.sum(-1, keepdim=True) for p in shifted.exp().tensor_split(x.shape[0], dim=-1)]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return shifted - total.log()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2)])
def test_attention_same_bits_packed_chunked_and_decode(dtype, heads, kv_heads):
    d, n = 24, 29
    q = torch.randn(n, heads, d, generator=_g(8)).to(dtype)
    k = torch.randn(n, kv_heads, d, generator=_g(9)).to(dtype)
    v = torch.randn(n, kv_heads, d, generator=_g(10)).to(dtype)
    scale = d**-0.5
    # packed with another sequence in front
    other = 11
    qp = torch.cat([torch.randn(other, heads, d, generator=_g(11)).to(dtype), q])
    kp = torch.cat([torch.randn(other, kv_heads, d, generator=_g(12)).to(dtype), k])
    vp = torch.cat([torch.randn(other, kv_heads, d, generator=_g(13)).to(dtype), v])
    pos = torch.cat([torch.arange(other), torch.arange(n)])
    packed = varlen_attention(qp, kp, vp, pos, scale)[other:]
    alone = varlen_attention(q, k, v, torch.arange(n), scale)
    assert torch.equal(packed, alone)
    # decode: one query at a time over its prefix, keys padded to a longer batch width
    for t in (0, 1, 7, n - 1):
        pad = 40 - (t + 1)
        kk = torch.cat([k[: t + 1], torch.randn(pad, kv_heads, d, generator=_g(t)).to(dtype)])
        vv = torch.cat([v[: t + 1], torch.randn(pad, kv_heads, d, generator=_g(t + 1)).to(dtype)])
        out = attention_ref(q[None, t : t + 1], kk[None], vv[None], torch.tensor([[t]]), scale)
        assert torch.equal(out[0, 0], alone[t])
    # chunked prefill: rows 13..28 over keys 0..28
    chunk = attention_ref(q[None, 13:], k[None], v[None], torch.arange(13, n)[None], scale)
    assert torch.equal(chunk[0], alone[13:])


def test_attention_control_stock_sdpa_decode_differs_from_its_prefill():
    """Control for the decode/chunked claim above: stock sdpa gives a row other bits when it is
    computed alone over keys padded to a batch's width (decode) than inside the full prefill."""
    d, n, h = 24, 29, 4
    q, k, v = (torch.randn(1, h, n, d, generator=_g(s)) for s in (14, 15, 16))
    prefill = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    differs = 0
    for t in (1, 7, 13, n - 1):
        pad = 40 - (t + 1)
        kk = torch.cat([k[:, :, : t + 1], torch.randn(1, h, pad, d, generator=_g(t))], dim=2)
        vv = torch.cat([v[:, :, : t + 1], torch.randn(1, h, pad, d, generator=_g(t + 1))], dim=2)
        mask = (torch.arange(40) <= t).view(1, 1, 1, 40)
        row = torch.nn.functional.scaled_dot_product_attention(q[:, :, t : t + 1], kk, vv, attn_mask=mask)
        differs += not torch.equal(row[:, :, 0], prefill[:, :, t])
    assert differs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k", [(6, 2), (5, 1), (7, 4)])
def test_experts_token_alone_equals_token_in_batch(dtype, experts, top_k):
    h, i, t = 40, 24, 19
    gu = (0.1 * torch.randn(experts, 2 * i, h, generator=_g(17))).to(dtype)
    dn = (0.1 * torch.randn(experts, h, i, generator=_g(18))).to(dtype)
    x = torch.randn(t, h, generator=_g(19)).to(dtype)
    idx = torch.stack([torch.randperm(experts, generator=_g(20 + j))[:top_k] for j in range(t)])
    w = torch.softmax(torch.randn(t, top_k, generator=_g(40)), -1).to(dtype)
    full = experts_ref(x, idx, w, gu, dn)
    for j in range(t):
        assert torch.equal(experts_ref(x[j : j + 1], idx[j : j + 1], w[j : j + 1], gu, dn)[0], full[j])
    # control: the stock experts (per-expert stock GEMMs over the tokens that chose the expert)
    # give a token other bits alone. Measured: in fp32 at every shape here; in bf16 stock rows
    # agree at these widths (and at hidden 2048 / intermediate 768 with 12 tokens), so bf16 has
    # no stock control here; tests/test_wide.py has one at the model width.
    if dtype == torch.float32:
        stock = experts_stock_ref(x, idx, w, gu, dn)
        assert any(
            not torch.equal(experts_stock_ref(x[j : j + 1], idx[j : j + 1], w[j : j + 1], gu, dn)[0], stock[j])
            for j in range(t)
        )


def test_experts_have_a_backward():
    h, i, e, t, k = 16, 8, 4, 6, 2
    gu = torch.randn(e, 2 * i, h, requires_grad=True)
    dn = torch.randn(e, h, i, requires_grad=True)
    x = torch.randn(t, h, requires_grad=True)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1], [2, 0]])
    w = torch.rand(t, k, requires_grad=True)
    ops.experts(x, idx, w, gu, dn).square().sum().backward()  # experts_ref is forward-only; the op trains
    for p in (gu, dn, x, w):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


_SLOT_NORM = """
from samebits.kernels import experts_launch as el, norm_rope_triton as nt
g = torch.Generator().manual_seed(0)
for t, k, h in [(3, 8, 2048), (2, 4, 96), (1, 2, 130), (4, 16, 64)]:
    big = 1e5 * torch.randn(t, k // 2, h, generator=g)
    slots = torch.cat([big, -big + torch.randn(t, k // 2, h, generator=g)], dim=1).contiguous()
    residual = torch.randn(t, h, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    got = nt.slot_add_rms_norm(slots, residual, w, 1e-6)
    want = nt.rms_norm(el.slot_sum(slots, torch.bfloat16), w, 1e-6, residual=residual)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (t, k, h)
    other = nt.rms_norm(slots.sum(1).bfloat16(), w, 1e-6, residual=residual)
    assert k == 2 or not torch.equal(other[0], want[0]), (t, k, h)  # control: another K order
print("OK")
"""


def test_slot_add_rms_norm_kernel_is_slot_sum_then_add_rms_norm_in_tritons_interpreter():
    """`norm_rope_triton.slot_add_rms_norm` (a MoE layer's top-k sum, the residual add and the
    norm in one launch) = `slot_sum_kernel` then the add+norm kernel, bit for bit, in Triton's CPU
    interpreter, at K = 2..16 and H a power of two or not. Control: the slots summed in index
    order (aten's sum) give another residual stream, where slots nearly cancel in pairs."""
    run_interpreted(_SLOT_NORM)


_MERGE_LAST = """
from samebits.kernels import attention_launch as at
g = torch.Generator().manual_seed(0)
H, KVH, D, PAGE = 4, 2, 64, 16
lens = [70, 300, 513, 1000, 777, 256, 257, 900]
b = len(lens)
pages = [-(-n // PAGE) for n in lens]
total = sum(pages) + 3
perm = torch.randperm(total, generator=g)
table = torch.zeros(b, max(pages), dtype=torch.int32)
start = 0
for i, p in enumerate(pages):
    table[i, :p] = perm[start:start + p].int(); start += p
kc = torch.randn(total * PAGE, KVH, D, generator=g).half()
vc = torch.randn(total * PAGE, KVH, D, generator=g).half()
q = torch.randn(b, H, D, generator=g).half()
i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
args = (q, kc, vc, table, i32(list(range(b))), i32([1] * b), i32(lens), 1, D ** -0.5, PAGE)
whole = at.attention(*args, split=False, transposed=False)
launch = at.attention(*args, split=True, transposed=False, merge_last=False)
assert torch.equal(launch, whole)
tickets = at._tickets(q.device, b * KVH)
for _ in range(2):  # the tickets are back to 0 after each call, so the next call merges as well
    last = at.attention(*args, split=True, transposed=False, merge_last=True)
    assert torch.equal(last, launch), (last - launch).abs().max()
    assert not tickets.any(), tickets[: b * KVH]
# control: a stale count (sequence 3 has 4 chunks; its kv head 1's tickets run 4..7) and no
# program draws the last ticket: those rows are never merged, the others keep their bits
tickets[3 * KVH + 1] = 4
stale = at.attention(*args, split=True, transposed=False, merge_last=True, out=torch.zeros_like(q))
tickets.zero_()
heads = slice(H // KVH, 2 * H // KVH)
assert not stale[3, heads].any() and stale[3, : H // KVH].any()
assert torch.equal(stale[:3], launch[:3]) and torch.equal(stale[4:], launch[4:])
print("OK")
"""


def test_split_attention_merged_in_its_last_program_gives_the_combine_launchs_bits_in_tritons_interpreter():
    """A split attention call whose chunks are merged by the last chunk program of each
    (sequence, kv head) to finish (`merge_last`: a ticket counter) = the same call merged by
    `combine_kernel` = one program per tile, bit for bit, in Triton's CPU interpreter (fp16),
    over 8 sequences of 1-4 chunks in shuffled pages, twice (the counters are put back to 0).
    Control: a stale ticket count, and no program of that sequence and kv head merges."""
    run_interpreted(_MERGE_LAST)


def test_tma_runs_only_where_its_bits_were_compared(monkeypatch):
    """`device_facts.tma_usable`, the one gate of the matmul's and the experts' TMA paths: NVIDIA
    compute capability 9.x only (the H200 is where TMA tiles were compared with the pointer
    loads), never on ROCm (which reports 9.x for other hardware), Blackwell or the CPU, and never
    while a CUDA graph is being captured."""
    from samebits.kernels import device_facts as df

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for cc, want in (((9, 0), True), ((10, 0), False), ((8, 9), False)):
        monkeypatch.setattr(df, "compute_capability", lambda d, cc=cc: cc)
        assert df.tma_usable(cuda) is want, cc
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # a graph capture
    assert not df.tma_usable(cuda)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not df.tma_usable(cuda)
    assert not df.tma_usable(torch.device("cpu"))
