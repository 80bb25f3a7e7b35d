"""CUDA: Triton attention and experts are batch invariant and accurate; CUDA graphs replay eager bits."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _g(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _paged(k, v, page, seed):
    """k/v [n, KVH, D] -> caches [slots, KVH, D] in shuffled pages, block table [1, pages] int32."""
    n = k.shape[0]
    pages = -(-n // page)
    perm = torch.randperm(pages + 5, generator=torch.Generator().manual_seed(seed))[:pages].to(
        "cuda", torch.int32
    )
    kc = torch.zeros((pages + 5) * page, *k.shape[1:], dtype=k.dtype, device="cuda")
    vc = torch.zeros_like(kc)
    pos = torch.arange(n, device="cuda")
    slots = perm.long()[pos // page] * page + pos % page
    kc[slots], vc[slots] = k, v
    return kc, vc, perm[None]


def _int(*xs):
    return [torch.tensor([x], dtype=torch.int32, device="cuda") for x in xs]


def _decode_paths(h, kvh, d):
    """(split, transposed) for one query per sequence: transposed tiles where `plan` takes them."""
    from samebits.kernels.attention_plan import transposed_fits

    fits = transposed_fits(1, h // kvh, d, torch.bfloat16) is None
    return [(s, t) for s in (True, False) for t in (True, False) if fits or not t]


@pytest.mark.parametrize("h,kvh,d", [(32, 4, 128), (6, 2, 24)])
def test_triton_attention_same_bits_packed_chunked_and_decode(h, kvh, d):
    from samebits.kernels.attention import varlen_attention as varlen_ref
    from samebits.kernels.attention_launch import attention
    from samebits.model.attention import AttentionBatch
    from samebits.model.attention import attention as attention_op

    bounds = [(0, 10), (10, 300), (300, 301), (301, 500)]
    s = 500
    q = torch.randn(s, h, d, device="cuda", generator=_g(0)).bfloat16()
    k = torch.randn(s, kvh, d, device="cuda", generator=_g(1)).bfloat16()
    v = torch.randn(s, kvh, d, device="cuda", generator=_g(2)).bfloat16()
    scale = d**-0.5
    trainer_batch = AttentionBatch.packed([e - b for b, e in bounds], "cuda")  # page size 1
    packed = attention_op(q, k, v, trainer_batch, scale)
    start, end = bounds[1]
    n = end - start
    kc, vc, table = _paged(k[start:end], v[start:end], 16, seed=3)
    for i in (0, 1, 63, 64, 65, 200, n - 1):  # decode: one query over the paged cache, every path
        for split, transposed in _decode_paths(h, kvh, d):
            out = attention(
                q[start + i : start + i + 1].contiguous(), kc, vc, table, *_int(0, 1, i + 1), 1, scale, 16,
                split=split, transposed=transposed,
            )  # fmt: skip
            assert torch.equal(out[0], packed[start + i]), (i, split, transposed)
    for lo, hi in ((0, 37), (37, 200), (200, n)):  # chunked prefill over cached keys
        out = attention(
            q[start + lo : start + hi].contiguous(), kc, vc, table, *_int(0, hi - lo, hi), hi - lo, scale, 16
        )
        assert torch.equal(out, packed[start + lo : start + hi]), (lo, hi)
    pos = torch.cat([torch.arange(e - b, device="cuda") for b, e in bounds])
    want = varlen_ref(q.double(), k.double(), v.double(), pos, scale)
    err = (packed.double() - want).abs().max().item()
    ref_err = (varlen_ref(q, k, v, pos, scale).double() - want).abs().max().item()
    assert err < 2 * ref_err + 1e-2, (err, ref_err)  # as close to float64 as the portable version
    # negative control: other key blocks reduce in another order, and the check sees it
    out = attention(q[start:end].contiguous(), kc, vc, table, *_int(0, n, n), n, scale, 16, block_n=32)
    assert not torch.equal(out, packed[start:end])


@pytest.mark.parametrize("h,kvh,d", [(32, 4, 128), (6, 2, 24)])
def test_split_keys_give_the_bits_of_one_program_per_tile(h, kvh, d):
    """Decode batches whose keys are split into parallel programs (merged by a second launch or
    by the last of them to finish) give the bits of the one-program path and of the trainer's
    packed rows, at positions on both sides of every chunk edge, one query per sequence and
    several. Control: another chunk size changes rows past its first chunk and none before it."""
    from samebits.kernels.attention_launch import attention
    from samebits.kernels.attention_triton import CHUNK

    lens = [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7, 1000]
    s = max(lens)
    q = torch.randn(s, h, d, device="cuda", generator=_g(40)).bfloat16()
    k = torch.randn(s, kvh, d, device="cuda", generator=_g(41)).bfloat16()
    v = torch.randn(s, kvh, d, device="cuda", generator=_g(42)).bfloat16()
    scale = d**-0.5
    table1 = torch.arange(s, dtype=torch.int32, device="cuda")[None]
    packed = attention(q, k, v, table1, *_int(0, s, s), s, scale, 1)  # the trainer's path, one program per tile
    kc, vc, table = _paged(k, v, 16, seed=43)
    tables = table.expand(len(lens), -1).contiguous()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    starts = torch.arange(len(lens), dtype=torch.int32, device="cuda")
    ones = torch.ones(len(lens), dtype=torch.int32, device="cuda")
    qs = torch.stack([q[n - 1] for n in lens])
    for split, transposed in _decode_paths(h, kvh, d):
        for merge_last in (False, True) if split else (None,):  # the combine launch, the last program
            if merge_last:  # other partials in the buffers the allocator hands out again
                attention(-qs, kc, vc, tables, starts, ones, lens_t, 1, scale, 16, split=True, merge_last=False)
            out = attention(
                qs, kc, vc, tables, starts, ones, lens_t, 1, scale, 16, split=split, transposed=transposed,
                merge_last=merge_last,
            )  # fmt: skip
            for i, n in enumerate(lens):
                assert torch.equal(out[i], packed[n - 1]), (split, transposed, merge_last, n)
    three = [n for n in lens if n >= 3]  # 3 queries per sequence in one split call
    q3 = torch.cat([q[n - 3 : n] for n in three]).contiguous()
    for merge_last in (False, True):
        out = attention(
            q3, kc, vc, tables[: len(three)], starts[: len(three)] * 3, ones[: len(three)] * 3,
            torch.tensor(three, dtype=torch.int32, device="cuda"), 3, scale, 16, split=True,
            merge_last=merge_last,
        )  # fmt: skip
        for i, n in enumerate(three):
            assert torch.equal(out[3 * i : 3 * i + 3], packed[n - 3 : n]), (merge_last, n)
    if len(_decode_paths(h, kvh, d)) == 4:  # 2 queries per sequence x 8 heads: one transposed tile
        two = [n for n in lens if n >= 2]
        q2 = torch.cat([q[n - 2 : n] for n in two]).contiguous()
        lens2 = torch.tensor(two, dtype=torch.int32, device="cuda")
        for split, merge_last in ((True, False), (True, True), (False, None)):
            out = attention(
                q2, kc, vc, tables[: len(two)], starts[: len(two)] * 2, ones[: len(two)] * 2, lens2, 2,
                scale, 16, split=split, transposed=True, merge_last=merge_last,
            )  # fmt: skip
            for i, n in enumerate(two):
                assert torch.equal(out[2 * i : 2 * i + 2], packed[n - 2 : n]), (split, merge_last, n)
    other = attention(q, k, v, table1, *_int(0, s, s), s, scale, 1, chunk=CHUNK // 2)
    assert torch.equal(other[: CHUNK // 2], packed[: CHUNK // 2])
    assert not torch.equal(other[CHUNK // 2 :], packed[CHUNK // 2 :])


def test_split_merged_in_the_last_program_keeps_its_bits_across_calls_and_graph_replays():
    """A split call merged by its last chunk program (`merge_last`: a ticket counter per
    sequence and kv head, put back to 0 by the merging program) gives the combine launch's bits
    at the real layout, eagerly and in a CUDA graph replayed several times, and leaves every
    ticket at 0. Two inputs alternate, so each call's partial buffers (handed out again by the
    allocator, or the graph's own) hold the other input's partials: a merge that read a chunk
    before its program had stored it would read the wrong values. Control: a stale ticket
    count (4 where a sequence has 4 chunks), and no program of that sequence and kv head
    merges: its rows stay as they were, the other kv heads' and sequences' keep their bits.
    (A count one short is no reliable control: whether the early merger finds the last chunk
    stored is a race.)"""
    from samebits.kernels import attention_launch as at

    h, kvh, d = 32, 4, 128
    lens = [1, 255, 256, 257, 1000, 777, 513, 1100]
    s = max(lens)
    qs = [torch.randn(len(lens), h, d, device="cuda", generator=_g(50 + i)).bfloat16() for i in range(2)]
    k = torch.randn(s, kvh, d, device="cuda", generator=_g(52)).bfloat16()
    v = torch.randn(s, kvh, d, device="cuda", generator=_g(53)).bfloat16()
    kc, vc, table = _paged(k, v, 16, seed=54)
    i32 = dict(dtype=torch.int32, device="cuda")
    meta = (
        table.expand(len(lens), -1).contiguous(), torch.arange(len(lens), **i32),
        torch.ones(len(lens), **i32), torch.tensor(lens, **i32),
    )  # fmt: skip
    rest = (kc, vc, *meta, 1, d**-0.5, 16)
    want = [at.attention(q, *rest, split=True, merge_last=False) for q in qs]
    assert not torch.equal(want[0], want[1])
    out = torch.zeros_like(qs[0])
    tickets = at._tickets(qs[0].device, len(lens) * kvh)
    try:
        for i in (0, 1, 0, 1):
            at.attention(qs[i], *rest, split=True, merge_last=True, out=out)
            assert torch.equal(out, want[i]) and not tickets.any(), i
        q = qs[0].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            at.attention(q, *rest, split=True, merge_last=True, out=out)
        for i in (1, 0, 1, 0, 1, 0):
            q.copy_(qs[i])
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want[i]) and not tickets.any(), i
        tickets[4 * kvh + 2] = 4  # sequence 4 (1000 keys: 4 chunks), kv head 2: its tickets run 4..7
        stale = at.attention(qs[0], *rest, split=True, merge_last=True, out=torch.zeros_like(q))
    finally:
        tickets.zero_()
    heads = slice(2 * h // kvh, 3 * h // kvh)
    assert not stale[4, heads].any()  # no program drew the last ticket: the rows were never merged
    assert torch.equal(stale[4, : 2 * h // kvh], want[0][4, : 2 * h // kvh])
    assert torch.equal(stale[:4], want[0][:4]) and torch.equal(stale[5:], want[0][5:])


def test_transposed_tiles_give_the_bits_of_normal_tiles():
    """Decode in transposed 16-row tiles (keys on the MMA's M) equals the 64-row tiles of
    prefill and the trainer, row for row, at 512 positions of sequences up to 1100 keys, at
    each (warps, stages) `attention_plan.plan` launches.
    Control: with the row sum of p taken by `tl.sum` (its order follows each orientation's
    register layout) instead of an MMA against ones, some rows differ."""
    from samebits.kernels.attention_launch import attention

    h, kvh, d, s, rows = 32, 4, 128, 1100, 512
    q = torch.randn(s, h, d, device="cuda", generator=_g(60)).bfloat16()
    k = torch.randn(s, kvh, d, device="cuda", generator=_g(61)).bfloat16()
    v = torch.randn(s, kvh, d, device="cuda", generator=_g(62)).bfloat16()
    scale = d**-0.5
    kc, vc, table = _paged(k, v, 16, seed=63)
    pos = torch.randperm(s, generator=torch.Generator().manual_seed(64))[:rows].sort().values.to("cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    meta = (
        table.expand(rows, -1).contiguous(), torch.arange(rows, **i32), torch.ones(rows, **i32),
        (pos + 1).to(torch.int32),
    )  # fmt: skip
    from samebits.kernels.attention_plan import DECODE_LAUNCH, DECODE_LAUNCH_MANY, LAUNCH, SPLIT_DECODE_LAUNCH

    want = attention(q, kc, vc, table, *_int(0, s, s), s, scale, 16)  # the trainer's path and launch
    for launch in (DECODE_LAUNCH, DECODE_LAUNCH_MANY, LAUNCH, SPLIT_DECODE_LAUNCH):  # the plan's: the same bits
        out = attention(
            q[pos].contiguous(), kc, vc, *meta, 1, scale, 16, split=False, transposed=True, launch=launch
        )
        assert torch.equal(out, want[pos]), launch
    for l_by_mma in (True, False):
        packed = attention(q, kc, vc, table, *_int(0, s, s), s, scale, 16, l_by_mma=l_by_mma)
        out = attention(
            q[pos].contiguous(), kc, vc, *meta, 1, scale, 16, split=False, transposed=True, l_by_mma=l_by_mma
        )
        normal = attention(
            q[pos].contiguous(), kc, vc, *meta, 1, scale, 16, split=False, transposed=False, l_by_mma=l_by_mma
        )
        assert torch.equal(normal, packed[pos]), l_by_mma  # 64-row tiles: one or 64 queries alike
        if l_by_mma:
            assert torch.equal(out, packed[pos])
        else:
            assert not torch.equal(out, packed[pos])


def _experts_inputs(t, e=128, k=8, h=2048, i=768, seed=0):
    x = torch.randn(t, h, device="cuda", generator=_g(seed)).bfloat16()
    logits = torch.randn(t, e, device="cuda", generator=_g(seed + 1))
    weights, index = torch.softmax(logits, -1).topk(k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=_g(seed + 2)) * h**-0.5).bfloat16()
    down = (torch.randn(e, h, i, device="cuda", generator=_g(seed + 3)) * i**-0.5).bfloat16()
    return x, index, weights, gate_up, down


def test_triton_experts_rows_do_not_depend_on_the_batch():
    from samebits.kernels.experts_launch import experts_forward

    x, index, weights, gate_up, down = _experts_inputs(300)
    full = experts_forward(x, index, weights, gate_up, down)
    for m in (1, 3, 64, 65, 200):
        for start in (0, 300 - m):
            sl = slice(start, start + m)
            assert torch.equal(experts_forward(x[sl], index[sl], weights[sl], gate_up, down), full[sl]), (
                m,
                start,
            )
    want = torch.zeros(300, 2048, dtype=torch.float64, device="cuda")
    for e in range(128):
        tok, slot = (index == e).nonzero(as_tuple=True)
        if tok.numel():
            g, u = (x[tok].double() @ gate_up[e].double().t()).chunk(2, dim=-1)
            y = (torch.nn.functional.silu(g) * u) @ down[e].double().t()
            want.index_add_(0, tok, y * weights[tok, slot].double()[:, None])
    err = ((full.double() - want).abs() / (want.abs() + 1)).max().item()
    assert err < 3e-2, err
    # negative control: the stock grouped_mm experts (what transformers runs) differ in the bits
    from samebits.kernels.experts import experts_grouped_mm

    assert not torch.equal(experts_grouped_mm(x, index, weights, gate_up, down), full)


def test_triton_experts_backward_matches_float64():
    from samebits.numerics.ops import experts  # the Triton forward, the closed-form backward

    x, index, weights, gate_up, down = _experts_inputs(64, e=8, k=2, h=256, i=128, seed=5)
    leaves = [t.float().requires_grad_() for t in (x, weights, gate_up, down)]
    out = experts(leaves[0].bfloat16(), index, leaves[1].bfloat16(), leaves[2].bfloat16(), leaves[3].bfloat16())
    grad = torch.randn(out.shape, device="cuda", generator=_g(9)).bfloat16()
    got = torch.autograd.grad(out, leaves, grad)
    dl = [t.detach().double().requires_grad_() for t in leaves]
    ref = torch.zeros(64, 256, dtype=torch.float64, device="cuda")
    for e in range(8):
        tok, slot = (index == e).nonzero(as_tuple=True)
        g, u = (dl[0][tok] @ dl[2][e].t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(g) * u) @ dl[3][e].t()
        ref = ref.index_add(0, tok, y * dl[1][tok, slot][:, None])
    want = torch.autograd.grad(ref, dl, grad.double())
    for a, b in zip(got, want, strict=True):
        rel = ((a.double() - b).norm() / b.norm()).item()
        assert rel < 2e-2, rel


@pytest.mark.parametrize("path", ["flash", "sdpa"])
def test_packed_attention_backward_matches_float64(path, monkeypatch):
    """The backward against float64 autograd: flash's variable-length kernels for every sequence
    at once (bf16, the default; the per-sequence fallback made to raise, so it is not what
    ran), and the fallback, sdpa per sequence with K/V heads repeated."""
    from samebits.kernels import attention as ka
    from samebits.model import attention as ma
    from samebits.model.attention import AttentionBatch, packed_attention

    if path == "flash":
        monkeypatch.setattr(ka, "packed_attention_backward_sdpa", _raise_fallback)
    else:
        monkeypatch.setitem(ma._BACKWARD, "cuda", lambda *a: ka.packed_attention_backward_sdpa(*a[:-1]))

    bounds, (h, kvh, d) = [(0, 70), (70, 71), (71, 200)], (32, 4, 128)
    q, k, v = (torch.randn(200, n, d, device="cuda", generator=_g(i)) for i, n in enumerate((h, kvh, kvh)))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = packed_attention(
        *(t.bfloat16() for t in leaves), AttentionBatch.packed([e - s for s, e in bounds], "cuda"), d**-0.5
    )
    grad = torch.randn(out.shape, device="cuda", generator=_g(7)).bfloat16()
    got = torch.autograd.grad(out, leaves, grad)
    dl = [t.detach().double().requires_grad_() for t in leaves]
    ref = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                *(t[s:e].transpose(0, 1) for t in dl), is_causal=True, scale=d**-0.5, enable_gqa=True
            ).transpose(0, 1)
            for s, e in bounds
        ]
    )
    want = torch.autograd.grad(ref, dl, grad.double())
    for a, b in zip(got, want, strict=True):
        rel = ((a.double() - b).norm() / b.norm()).item()
        assert rel < 2e-2, rel


def _raise_fallback(*args):
    raise AssertionError("the per-sequence sdpa fallback ran")


@pytest.mark.parametrize(
    "shape,dim",
    [
        ((33, 2048), -1),
        ((5, 7, 128), -1),
        ((9, 96), 1),
        ((17, 24), -1),
        ((40, 8), -1),
        ((3, 8192), -1),
        ((6, 3000), -1),
        ((11, 5), 0),
        ((4, 1), -1),
    ],
)
def test_triton_tree_sum_gives_tree_sum_ref_bits(shape, dim):
    from samebits.kernels.reduce import tree_sum_ref
    from samebits.kernels.reduce_triton import tree_sum

    x = torch.randn(shape, device="cuda", generator=_g(3)) * torch.logspace(-4, 4, shape[-1], device="cuda")
    x[0] = -0.0  # all -0.0: the one sum whose sign depends on the pads
    x[1, 0] = float("inf")

    def bits(t):
        return t.contiguous().view(torch.int32)

    for keepdim in (False, True):
        want, got = tree_sum_ref(x, dim, keepdim), tree_sum(x, dim, keepdim)
        assert got.shape == want.shape and torch.equal(bits(got), bits(want))
    # negative control: torch's own sum orders the adds otherwise, and the check sees it
    if x.shape[dim] >= 24:
        assert not torch.equal(bits(x.sum(dim)), bits(tree_sum_ref(x, dim)))


def test_trainer_trains_through_cuda_kernels(tmp_path):
    from samebits import batch_invariant, trainer
    from samebits.model.qwen3_moe.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "t", seed=1)
    model = trainer.load_hf_model(path, device="cuda")
    model.train()
    seqs = [list(range(3, 40)), list(range(5, 30))]
    with batch_invariant():
        lps = trainer.token_logprobs(model, seqs, [5, 5], packed=True, with_grad=True)
    torch.stack([lp.sum() for lp in lps]).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any("experts.gate_up_proj" in n for n in grads) and any("q_proj" in n for n in grads)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "experts" in n)


def test_cuda_graph_decode_equals_eager(tmp_path, monkeypatch):
    from samebits import LLM, SamplingParams
    from samebits.kernels.experts import experts_grouped_mm
    from samebits.model.qwen3_moe.tiny import build_tiny_checkpoint
    from samebits.numerics import registry
    from samebits.verify import make_prompts

    path = build_tiny_checkpoint(tmp_path / "t", seed=2)
    prompts = make_prompts((5, 9, 17, 3, 11), 384, seed=1)  # the tiny vocabulary
    params = [SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=4)] * 3 + [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=48, min_tokens=40, seed=5),  # sampling rules
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    ]
    runs = {}
    for graphs in (True, False):
        llm = LLM(path, device="cuda", max_num_seqs=8, max_model_len=96, cuda_graphs=graphs)
        runs[graphs] = llm.generate(prompts, params)
        assert (llm.runner.graphs is not None) == graphs and (not graphs or llm.runner.graphs.graphs)
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
    # negative control: the same comparison sees other experts numerics (the stock grouped_mm,
    # forced here: the fast profile itself runs the Triton experts, as exact does)
    monkeypatch.setitem(registry.TABLE["experts"]["cuda"], "fast", experts_grouped_mm)
    fast = LLM(path, device="cuda", max_num_seqs=8, max_model_len=96, numerics="fast").generate(prompts, params)
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(fast, runs[True], strict=True))


@pytest.mark.parametrize("h", [2048, 128, 96, 24])
def test_fused_norm_and_rotary_give_transformers_bits(h):
    """The fused kernels (the exact profile's norms under batch_invariant() and its rotary)
    equal the transformers modules at every width. Controls, for the roundings they keep: the
    rotary kernel compiled with Triton's default FMA contraction differs from transformers, and
    so does the usual fused RMSNorm numerics (weight applied in fp32, one rounding)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    from samebits import batch_invariant
    from samebits.kernels import norm_rope_triton as nr
    from samebits.numerics import ops, registry

    assert registry.pick("apply_rotary", "cuda", "exact") is registry._apply_rotary_cuda
    norm = hf.Qwen3MoeRMSNorm(h, eps=1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1, generator=_g(20))
    x = torch.randn(4096, h, device="cuda", generator=_g(21)).bfloat16()
    res = torch.randn(4096, h, device="cuda", generator=_g(22)).bfloat16()
    with batch_invariant():
        want = norm(x)
        assert torch.equal(nr.rms_norm(x, norm.weight, 1e-6), want)
        assert torch.equal(ops.rms_norm(x, norm.weight, 1e-6), want)
        summed, normed = nr.rms_norm(x, norm.weight, 1e-6, residual=res)
        assert torch.equal(summed, res + x) and torch.equal(normed, norm(res + x))
    xf = x.float()
    h32 = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert not torch.equal((norm.weight.float() * h32).bfloat16(), norm(x))
    cfg = Qwen3MoeConfig(hidden_size=2048, num_attention_heads=32, head_dim=128, rope_theta=1e6)
    rot = hf.Qwen3MoeRotaryEmbedding(cfg).to("cuda")
    rot.inv_freq.copy_(ops.rotary_inv_freq(128, 1e6))
    pos = torch.arange(3000, 3333, device="cuda")
    q = torch.randn(333, 32, 128, device="cuda", generator=_g(23)).bfloat16()
    k = torch.randn(333, 4, 128, device="cuda", generator=_g(24)).bfloat16()
    cos, sin = rot(q, pos[None])
    want_q, want_k = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    want_q, want_k = want_q[0].transpose(0, 1), want_k[0].transpose(0, 1)
    q2, k2 = ops.apply_rotary(q, k, cos[0], sin[0], 1)  # the fused kernel, in every profile
    assert torch.equal(q2, want_q) and torch.equal(k2, want_k)
    contracted = torch.empty_like(q)  # control: the same kernel with FMA contraction
    c, s = cos[0].contiguous(), sin[0].contiguous()
    nr.rotary_kernel[(333,)](
        q, c, s, contracted, 32, q.stride(0), q.stride(1), q.stride(0), q.stride(1), c.stride(0),
        HALF=64, BLOCK_H=32, num_warps=4,
    )  # fmt: skip
    assert not torch.equal(contracted, want_q)


def test_one_gemm_over_adjacent_qkv_gives_each_projection_its_own_bits():
    """The loader's layout (q, k, v back to back in one buffer) lets the exact profile run the
    three projections as one Triton GEMM: each output equals its own GEMM bitwise at every M.
    (Its control, a GEMM that picks its blocking by shape and so changes a column's bits when
    joined, runs on the CPU: tests/test_ops_registry.py. cuBLAS happened to keep them here.)"""
    from torch.nn.functional import linear

    from samebits import batch_invariant
    from samebits.numerics import ops

    buf = (torch.randn(5120, 2048, device="cuda", generator=_g(30)) * 2048**-0.5).bfloat16()
    weights = [buf[:4096], buf[4096:4608], buf[4608:]]
    x = torch.randn(300, 2048, device="cuda", generator=_g(31)).bfloat16()
    for m in (1, 7, 64, 257, 300):
        with batch_invariant():
            joined = ops.projections(x[:m], weights)
            alone = [linear(x[:m], w) for w in weights]
        assert joined[0].untyped_storage().data_ptr() == joined[2].untyped_storage().data_ptr()  # one GEMM
        for a, b in zip(joined, alone, strict=True):
            assert torch.equal(a, b), m
    scattered = [w.clone() for w in weights]  # not adjacent: three GEMMs, the same bits
    with batch_invariant():
        three = ops.projections(x, scattered)
        alone = [linear(x, w) for w in weights]
    assert three[0].untyped_storage().data_ptr() != three[1].untyped_storage().data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(three, alone, strict=True))


@pytest.mark.parametrize("t", [1, 7, 300])
def test_one_launch_qk_norm_rope_and_cache_writes_give_the_op_by_op_bits(t):
    """The fused q/k RMSNorm + rotary + K/V cache writes equal `rms_norm`, `apply_rotary` and the
    index_puts op by op under batch_invariant(), on q/k/v that are column views of one q/k/v
    GEMM. Control: the same kernel with FMA contraction (Triton's default) differs."""
    import numpy as np
    import triton

    from samebits import batch_invariant
    from samebits.kernels import norm_rope_triton as nr
    from samebits.numerics import registry
    from samebits.numerics.ops import rotary_cos_sin, rotary_inv_freq

    h, kvh, d = 32, 4, 128
    qkv = torch.randn(t, (h + 2 * kvh) * d, device="cuda", generator=_g(50)).bfloat16()
    q, k, v = (y.view(t, -1, d) for y in qkv.split([h * d, kvh * d, kvh * d], -1))
    qw = (1 + 0.1 * torch.randn(d, device="cuda", generator=_g(51))).bfloat16()
    kw = (1 + 0.1 * torch.randn(d, device="cuda", generator=_g(52))).bfloat16()
    pos = torch.randint(0, 4000, (t,), device="cuda", generator=_g(53))
    cos, sin = rotary_cos_sin(q, pos, rotary_inv_freq(d, 1e6).cuda(), 1.0)
    slots = torch.randperm(512, device="cuda", generator=_g(54))[:t]
    caches = [torch.zeros(512, kvh, d, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    assert nr.qk_norm_rope_cache_supported(q, k, v, qw, kw, cos, caches[2], caches[3])
    with batch_invariant():
        want = registry._qk_norm_rope_cache_composite(
            q, k, v, qw, kw, 1e-6, cos, sin, caches[0], caches[1], slots
        )
    got = nr.qk_norm_rope_cache(q, k, v, qw, kw, 1e-6, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(got, want)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    contracted = torch.empty_like(got)
    c, s = cos.contiguous(), sin.contiguous()
    nr.qk_norm_rope_cache_kernel[(t,)](
        q, k, v, qw, kw, c, s, contracted, caches[2], caches[3], slots,
        h, kvh, float(np.float32(1.0) / np.float32(d)), 1e-6,
        q.stride(0), k.stride(0), v.stride(0), c.stride(0), contracted.stride(0), caches[2].stride(0),
        BLOCK_H=h, BLOCK_KVH=triton.next_power_of_2(kvh), D=d, num_warps=4,
    )  # fmt: skip
    assert not torch.equal(contracted, want)


@pytest.mark.parametrize("e,k,t", [(60, 6, 100), (60, 6, 682), (128, 8, 511), (8, 2, 3)])
def test_routing_kernel_gives_the_stable_sort_for_any_expert_count(e, k, t):
    """`route_kernel` places pairs by counting, n / ROUTE_PAIRS programs: other expert counts
    and top-k than Qwen3's, a partial last program (600, 4092 and 4088 pairs), skewed routing."""
    from samebits.kernels.experts import route
    from samebits.kernels.experts_launch import route_pairs
    from samebits.kernels.experts_triton import MAX_ROUTED

    g = torch.Generator().manual_seed(e + t)
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).cuda()
    index[: t // 3, 0] = e - 1  # the last expert holds many pairs
    assert index.numel() <= MAX_ROUTED
    order, offsets = route_pairs(index, e)
    want_order, want_offsets = route(index, e)
    assert torch.equal(order, want_order) and torch.equal(offsets, want_offsets)


@pytest.mark.parametrize("t", [1, 7, 64, 512, 600])
def test_one_launch_routing_and_slot_sum_give_the_torch_ops_results(t):
    """`route_kernel` gives `experts.route`'s order and offsets exactly (600 x 8 pairs: past
    MAX_ROUTED, the torch ops themselves), and `slot_sum_kernel` the bits of `tree_sum_ref` over
    the top-k slots. Control: summing the slots left to right rounds differently."""
    from samebits.kernels import experts_launch as el
    from samebits.kernels.experts import route
    from samebits.kernels.experts_triton import slot_sum_kernel
    from samebits.kernels.reduce import tree_sum_ref

    g = torch.Generator().manual_seed(t)
    index = torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(t)]).cuda()
    index[: t // 2, 0] = 5  # one expert holds many pairs
    order, offsets = el.route_pairs(index, 128)
    want_order, want_offsets = route(index, 128)
    assert torch.equal(order, want_order) and torch.equal(offsets, want_offsets)
    per_slot = (
        torch.randn(t * 8, 2048, device="cuda", generator=_g(t)) * torch.rand(t * 8, 1, device="cuda") * 100
    )
    out = torch.empty(t, 2048, dtype=torch.bfloat16, device="cuda")
    slot_sum_kernel[(t, 2048 // el.SLOT_BLOCK_H)](per_slot, out, 2048, K=8, BLOCK_H=el.SLOT_BLOCK_H)
    view = per_slot.view(t, 8, 2048)
    assert torch.equal(out, tree_sum_ref(view, dim=1).bfloat16())
    left_to_right = view[:, 0]
    for j in range(1, 8):
        left_to_right = left_to_right + view[:, j]
    assert not torch.equal(left_to_right, tree_sum_ref(view, dim=1))


@pytest.mark.parametrize("t", [1, 7, 300, 4100])  # 4100: past SLOT_NORM_FEW_WARPS_FROM
def test_slot_add_rms_norm_kernel_is_slot_sum_then_add_rms_norm_on_cuda(t):
    """`norm_rope_triton.slot_add_rms_norm` (a MoE layer's top-k sum, residual add and norm in
    one launch; `registry.SLOTS_ON_CUDA` turns it on) = `slot_sum_kernel`, then the add+norm
    kernel, bit for bit, at the Qwen3-30B-A3B width. Control: the slots summed left to right
    give another residual stream where slots j and j + 4 nearly cancel. (aten's CUDA `sum(1)`
    is no control: its vectorized reduction adds slot j to slot j + 4 first, the tree's own
    first level, and gave the tree's bits on the H200.)"""
    from samebits.kernels import experts_launch as el
    from samebits.kernels import norm_rope_triton as nt

    big = 1e5 * torch.randn(t, 4, 2048, device="cuda", generator=_g(t))
    slots = torch.cat([big, -big + torch.randn(t, 4, 2048, device="cuda", generator=_g(t + 1))], 1).contiguous()
    residual = torch.randn(t, 2048, device="cuda", generator=_g(t + 2)).bfloat16()
    w = (1 + 0.1 * torch.randn(2048, device="cuda", generator=_g(t + 3))).bfloat16()
    got = nt.slot_add_rms_norm(slots, residual, w, 1e-6)
    want = nt.rms_norm(el.slot_sum(slots, torch.bfloat16), w, 1e-6, residual=residual)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    left_to_right = slots[:, 0]
    for j in range(1, 8):
        left_to_right = left_to_right + slots[:, j]
    other = nt.rms_norm(left_to_right.bfloat16(), w, 1e-6, residual=residual)
    assert not torch.equal(other[0], want[0])


def _tiny_engine(tmp_path, seed):
    """() -> the CUDA engine's outputs (CUDA graphs on) for five prompts of the tiny model,
    sampled at temperature 1: a fresh engine each call, so switches set between calls apply."""
    from samebits import LLM, SamplingParams
    from samebits.model.qwen3_moe.tiny import build_tiny_checkpoint
    from samebits.verify import make_prompts

    path = build_tiny_checkpoint(tmp_path / "t", seed=seed)
    prompts = make_prompts((5, 9, 17, 3, 11), 384, seed=seed - 1)
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=seed + 2)
    return lambda: LLM(path, device="cuda", max_num_seqs=8, max_model_len=96).generate(prompts, params)


def test_engine_with_slots_summed_in_the_next_norm_gives_the_same_bits(tmp_path, monkeypatch):
    """The engine on CUDA with `registry.SLOTS_ON_CUDA` (each MoE layer's top-k sum made in the
    next norm's launch) samples the tokens and log-probs it samples without (the experts' own
    sum), CUDA graphs on; the fused norm ran. Control: the experts' sum added to the residual
    before its own rounding to bf16 (one rounding where transformers makes two) changes the
    log-probs."""
    from samebits.kernels import norm_rope_triton
    from samebits.kernels.experts import sum_slots_ref
    from samebits.numerics import registry

    run = _tiny_engine(tmp_path, seed=2)
    base = run()
    calls = []
    fused = norm_rope_triton.slot_add_rms_norm
    monkeypatch.setattr(norm_rope_triton, "slot_add_rms_norm", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setattr(registry, "SLOTS_ON_CUDA", True)
    slots = run()
    assert calls, "the fused slot norm should have run"
    for a, b in zip(base, slots, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)

    def one_rounding(s, r, w, eps):  # the experts' sum added to the residual before its rounding
        h = (sum_slots_ref(s, torch.float32) + r.float()).to(r.dtype)
        return h, norm_rope_triton.rms_norm(h, w, eps)

    monkeypatch.setattr(norm_rope_triton, "slot_add_rms_norm", one_rounding)
    other = run()
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(base, other, strict=True))


def test_engine_with_programmatic_dependent_launch_gives_the_same_bits(tmp_path, monkeypatch):
    """The engine on CUDA with PDL between its decode kernels (`kernels/pdl.py`: each kernel
    may be scheduled while the one before finishes, and waits for it before touching memory)
    samples the tokens and log-probs it samples with PDL off, CUDA graphs on; PDL launches ran.
    (No negative control: a kernel that skipped its wait would race, with no reproducible
    outcome; the bits are the kernels' own, which the other engine tests pin.)"""
    from samebits.kernels import pdl

    if not pdl.supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0 or later")
    run = _tiny_engine(tmp_path, seed=3)
    monkeypatch.setattr(pdl, "ENABLED", False)
    base = run()
    launches = []
    real = pdl.launch_args
    monkeypatch.setattr(pdl, "ENABLED", True)

    def counted(device):
        args = real(device)
        launches.extend([1] if args else [])
        return args

    monkeypatch.setattr(pdl, "launch_args", counted)
    for module in (
        "matmul_triton",
        "norm_rope_triton",
        "attention_launch",
        "experts_launch",
        "router_one_launch",
    ):
        monkeypatch.setattr(f"samebits.kernels.{module}.launch_args", pdl.launch_args)
    with_pdl = run()
    assert launches, "no kernel launched with PDL"
    for a, b in zip(base, with_pdl, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
