"""One attention batch: every path builds an `AttentionBatch` and runs `samebits::paged_attention`.

CPU: the portable reference reads keys through the block table, so a row gets the same bits
through scrambled pages, contiguous pages, a chunked prefill, decode, and the trainer's packed
forward. The negative controls show the comparison can fail for the reason it is about: the
same keys read in another order through the table give other bits, and so does a stock
softmax/matmul attention over the same rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from samebits.kernels.attention import varlen_attention
from samebits.model.attention import AttentionBatch, attention, packed_attention, paged_attention
from samebits.trainer.registration import samebits_attention

DTYPES = [torch.float32, torch.bfloat16]
LENS = (29, 1, 17)  # three sequences, one of a single token


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _qkv(n, heads, kv_heads, d, dtype, seed):
    q = torch.randn(n, heads, d, generator=_g(seed)).to(dtype)
    k = torch.randn(n, kv_heads, d, generator=_g(seed + 1)).to(dtype)
    v = torch.randn(n, kv_heads, d, generator=_g(seed + 2)).to(dtype)
    return q, k, v


def _tables(lens, block_size, scrambled, seed=0):
    """One block table per sequence; scrambled: pages taken out of order from a shuffled pool."""
    pages = [-(-n // block_size) for n in lens]
    pool = torch.randperm(sum(pages) + 7, generator=_g(seed)).tolist() if scrambled else list(range(sum(pages)))
    out, at = [], 0
    for p in pages:
        out.append(pool[at : at + p])
        at += p
    return out, len(pool)


def _cache(num_blocks, block_size, kv_heads, d, dtype):
    shape = (num_blocks * block_size, kv_heads, d)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def _prefill(q, k, v, lens, block_size, scrambled):
    """All sequences prefilled in one step through block tables -> [T, H, D]."""
    tables, blocks = _tables(lens, block_size, scrambled)
    kc, vc = _cache(blocks, block_size, k.shape[1], k.shape[2], k.dtype)
    batch = AttentionBatch.build(tables, [0] * len(lens), list(lens), block_size, "cpu")
    return paged_attention(q, k, v, kc, vc, batch, q.shape[-1] ** -0.5)


def _trainer(q, k, v, lens):
    """transformers' call of the registered attention on one packed row -> [T, H, D]."""
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    module = SimpleNamespace(head_dim=q.shape[-1])
    hf = [t.transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, T, D]
    out, _ = samebits_attention(module, *hf, None, position_ids=pos)
    return out[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_scrambled_pages_give_the_bits_of_contiguous_pages_and_of_the_trainer(
    dtype, heads, kv_heads, block_size
):
    q, k, v = _qkv(sum(LENS), heads, kv_heads, 24, dtype, seed=1)
    scrambled = _prefill(q, k, v, LENS, block_size, scrambled=True)
    assert torch.equal(scrambled, _prefill(q, k, v, LENS, block_size, scrambled=False))
    assert torch.equal(scrambled, _trainer(q, k, v, LENS))
    assert torch.equal(scrambled, attention(q, k, v, AttentionBatch.packed(LENS, "cpu"), 24**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_prefill_chunked_and_packed_rows_are_bitwise_equal(dtype):
    """Sequence A (23 tokens, pages of 4, scrambled) next to sequence B, every way the engine
    and the trainer compute its rows."""
    d, bs, n = 16, 4, 23
    q, k, v = _qkv(n, 4, 2, d, dtype, seed=5)
    qb, kb, vb = _qkv(n, 4, 2, d, dtype, seed=9)
    scale = d**-0.5
    tables = [[9, 2, 7, 0, 5, 11], [3, 1, 10, 4, 8, 6]]  # A, B: out of order, interleaved
    kc, vc = _cache(12, bs, 2, d, dtype)

    def step(s, c):  # one engine step: tokens s..s+c of A, then of B -> A's rows
        batch = AttentionBatch.build(tables, [s, s], [c, c], bs, "cpu")
        qs, ks, vs = (torch.cat([a[s : s + c], b[s : s + c]]) for a, b in ((q, qb), (k, kb), (v, vb)))
        return paged_attention(qs, ks, vs, kc, vc, batch, scale)[:c]

    prefill = step(0, n)
    chunked = torch.cat([step(s, e - s) for s, e in ((0, 6), (6, 7), (7, n))])
    decode = torch.cat([step(t, 1) for t in range(n)])
    packed = _trainer(torch.cat([qb, q]), torch.cat([kb, k]), torch.cat([vb, v]), (n, n))[n:]
    assert torch.equal(chunked, prefill)
    assert torch.equal(decode, prefill)
    assert torch.equal(packed, prefill)


def test_negative_control_the_same_keys_in_another_order_through_the_table_differ():
    """The last row sees every key: read through a table with two pages swapped it meets the
    same (k, v) pairs in another order, which is mathematically the same attention. The bits
    differ, so the equalities above hold because every path reads keys in one order."""
    d, bs, n = 32, 4, 64
    q, k, v = _qkv(n, 4, 2, d, torch.float32, seed=21)
    kc, vc = k.clone(), v.clone()  # a cache whose pages are 0..15 in order
    table = list(range(n // bs))
    right = AttentionBatch.build([table], [n - 1], [1], bs, "cpu")
    table[3], table[12] = table[12], table[3]
    swapped = AttentionBatch.build([table], [n - 1], [1], bs, "cpu")
    a = attention(q[-1:], kc, vc, right, d**-0.5)
    b = attention(q[-1:], kc, vc, swapped, d**-0.5)
    torch.testing.assert_close(a, b)  # the same attention ...
    assert not torch.equal(a, b)  # ... in other bits


def _stock(q, k, v, batch, scale):
    """Stock softmax/matmul attention over the rows the batch describes (keys through its table)."""
    out = torch.empty_like(q)
    bounds = batch.query_start_loc_cpu.tolist()
    for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        n = int(batch.seq_lens[b])
        keys = torch.arange(n)
        slots = (
            batch.block_table[b].long()[keys // batch.block_size] * batch.block_size + keys % batch.block_size
        )
        kk, vv = (t[slots].transpose(0, 1).repeat_interleave(q.shape[1] // k.shape[1], 0) for t in (k, v))
        qq = q[lo:hi].transpose(0, 1)  # [H, R, D]
        pos = torch.arange(n - (hi - lo), n)
        scores = (qq @ kk.transpose(1, 2) * scale).masked_fill(keys[None, :] > pos[:, None], float("-inf"))
        out[lo:hi] = (torch.softmax(scores, -1) @ vv).transpose(0, 1)
    return out


def test_negative_control_stock_attention_rows_depend_on_the_step():
    """The decode/prefill equality with stock attention over the same rows and tables fails."""
    d, bs, n = 64, 16, 80
    q, k, v = _qkv(n, 4, 4, d, torch.float32, seed=31)
    tables = [[4, 1, 3, 0, 2]]
    kc, vc = _cache(5, bs, 4, d, torch.float32)
    prefill = AttentionBatch.build(tables, [0], [n], bs, "cpu")
    paged_attention(q, k, v, kc, vc, prefill, d**-0.5)  # fill the cache
    whole = _stock(q, kc, vc, prefill, d**-0.5)
    decode = torch.cat(
        [
            _stock(q[t : t + 1], kc, vc, AttentionBatch.build(tables, [t], [1], bs, "cpu"), d**-0.5)
            for t in range(n)
        ]
    )
    ours = attention(q, kc, vc, prefill, d**-0.5)
    ours_decode = torch.cat(
        [
            attention(q[t : t + 1], kc, vc, AttentionBatch.build(tables, [t], [1], bs, "cpu"), d**-0.5)
            for t in range(n)
        ]
    )
    assert torch.equal(ours_decode, ours)
    torch.testing.assert_close(whole, ours)
    assert not torch.equal(decode, whole)


def test_build_lays_out_queries_positions_and_slots():
    batch = AttentionBatch.build([[5, 2], [7]], [6, 0], [2, 3], 4, "cpu")
    assert batch.positions.tolist() == [6, 7, 0, 1, 2]
    assert batch.slot_mapping.tolist() == [2 * 4 + 2, 2 * 4 + 3, 28, 29, 30]
    assert batch.block_table.tolist() == [[5, 2], [7, 0]] and batch.block_table.dtype == torch.int32
    assert batch.query_start_loc.tolist() == [0, 2, 5] and batch.query_lens.tolist() == [2, 3]
    assert batch.seq_lens.tolist() == [8, 3] and batch.max_query_len == 3
    with pytest.raises(ValueError, match="sequence 1 has 5 keys but its block table holds 1 pages of 4"):
        AttentionBatch.build([[5, 2], [7]], [6, 2], [2, 3], 4, "cpu")
    with pytest.raises(ValueError, match="one entry per sequence"):
        AttentionBatch.build([[5]], [0, 0], [1], 4, "cpu")


def test_the_op_passes_opcheck_and_trains_through_the_packed_path():
    q, k, v = _qkv(9, 4, 2, 8, torch.float32, seed=41)
    b = AttentionBatch.packed([4, 5], "cpu")
    args = (q, k, v, b.block_table, b.query_start_loc, b.query_lens, b.seq_lens, b.max_query_len, 0.5, 1)
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    result = torch.library.opcheck(torch.ops.samebits.paged_attention.default, args, test_utils=checks)
    assert set(result.values()) == {"SUCCESS"}, result
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = packed_attention(*leaves, b, 0.5)
    grads = torch.autograd.grad(out.sum(), leaves)
    assert all(g.abs().sum() > 0 for g in grads)
    # the CPU backward is autograd through the portable attention, sequence by sequence
    plain = varlen_attention(*leaves, torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4]), 0.5)
    assert torch.equal(out, plain)
    want = torch.autograd.grad(plain.sum(), leaves)
    assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))
    paged = AttentionBatch.build([[0, 1, 2]], [0], [9], 4, "cpu")
    with pytest.raises(ValueError, match="AttentionBatch.packed"):
        packed_attention(*leaves, paged, 0.5)


@pytest.mark.gpu
def test_cuda_op_gives_the_launchers_bits_and_the_trainers_rows():
    """One engine batch (a decode, a chunk over cached keys, a fresh prefill; scrambled pages)
    through the op equals the Triton launcher called with the batch's own fields (query starts,
    lengths, context lengths, block tables), and every row equals the trainer's packed forward
    over the whole sequences."""
    from samebits.kernels.attention_launch import attention as launcher

    h, kvh, d, bs, dev = 32, 4, 128, 16, "cuda"
    starts, counts = [200, 37, 0], [1, 100, 150]
    ends = [s + c for s, c in zip(starts, counts, strict=True)]
    q, k, v = (t.to(dev) for t in _qkv(sum(ends), h, kvh, d, torch.bfloat16, seed=51))  # whole sequences
    tables, blocks = _tables(ends, bs, scrambled=True, seed=3)
    kc, vc = (t.to(dev) for t in _cache(blocks, bs, kvh, d, torch.bfloat16))
    history = AttentionBatch.build(tables, [0, 0, 0], ends, bs, dev)
    kc[history.slot_mapping], vc[history.slot_mapping] = k, v
    offsets = [0, ends[0], ends[0] + ends[1]]
    rows = torch.cat([torch.arange(o + s, o + e) for o, s, e in zip(offsets, starts, ends, strict=True)]).to(
        dev
    )
    batch = AttentionBatch.build(tables, starts, counts, bs, dev)
    out = attention(q[rows], kc, vc, batch, d**-0.5)
    table = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
    old = [torch.tensor(x, dtype=torch.int32, device=dev) for x in ([0, 1, 101], counts, ends)]
    want = launcher(q[rows], kc, vc, table.to(dev), *old, 150, d**-0.5, bs)
    assert torch.equal(out, want)
    packed = attention(q, k, v, AttentionBatch.packed(ends, dev), d**-0.5)
    assert torch.equal(out, packed[rows])
    # negative control: other key blocks reduce in another order, and the check sees it
    other = launcher(q[rows], kc, vc, table.to(dev), *old, 150, d**-0.5, bs, block_n=32)
    assert not torch.equal(other, packed[rows])
