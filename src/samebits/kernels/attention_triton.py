"""Batch-invariant causal attention for CUDA: one Triton kernel for every path.

Prefill over packed sequences, chunked prefill over cached KV, decode and the
trainer's packed forward all launch `attention_kernel`. A tile is a set of (query token,
query head of one kv head) rows of one sequence: BLOCK_M = 64 rows, or for decode a
transposed tile of BLOCK_Q = 16 rows whose MMAs put the 64 keys of a block on M and the
rows on N (S^T = K Q^T, O^T = V^T P^T), so a decode tile wastes half of N instead of 7/8
of M. Its keys are split into chunks of CHUNK keys from key 0: [0, CHUNK),
[CHUNK, 2 CHUNK), ...; each chunk is walked in BLOCK_N blocks with a flash-style online
softmax from fresh statistics (fp32), and the chunks' (max, sum, accumulator) are merged in
chunk order. Either one program walks every block of its tile in one loop, merging each
chunk after its last block and starting the next from fresh statistics (one loop rather
than a loop per chunk, so the compiler pipelines the K/V loads across chunk edges: 13%
faster at decode batch 256 and 8% in prefill on the H200, the same bits;
docs/performance.md), or (`split`, for calls with one tile per sequence and fewer programs
than the SMs: small decode batches) one program per chunk stores its statistics and the
last of a row's chunk programs to finish merges them (a ticket counter; in 64-row tiles, or
with `merge_last=False`, `combine_kernel` in a second launch) in the same order with the same
operations; every launch turns off FMA contraction, so all give the same bits. Chunks and blocks start at key 0
whatever the path, so a query row at position p always meets the same chunks and blocks
with the same masks; a block or chunk wholly past p is an exact no-op for that row.

The two orientations give a row the same bits because each product element is one
tensor-core dot product of the same operands wherever it sits in the tile, and the row
sums of p are one more such product (bf16(p) against a block of ones) rather than
`tl.sum`, whose order follows the register layout. A row's bits therefore depend on its
own query, its own keys 0..p and nothing else: not the batch, not the chunking of the
prefill, not the rows sharing its tile, not the tile's orientation, not whether its chunks
ran in one program or several. `attention_plan.plan` picks the path.

Keys are read through a page table: key j of sequence b sits at slot
`block_table[b, j // page_size] * page_size + j % page_size` of a
[slots, KVH, D] cache. The trainer passes its packed K/V as a cache with
page_size 1. `paged_attention_ref` in `attention.py` is the portable (CPU)
version of the same contract; the two use different reduction trees and are
compared with a tolerance, each against float64. Both are reached through the
one op `samebits::paged_attention` (`samebits.model.attention`), whose CUDA implementation
is the launcher in `attention_launch.py`.

Shapes: T = query tokens, H = query heads, KVH = kv heads, G = H // KVH,
D = head dim, B = sequences.
"""

from __future__ import annotations

import triton
import triton.language as tl

from samebits.kernels.launch import fast_launch
from samebits.kernels.pdl import pdl_release, pdl_wait

BLOCK_N = 64
NUM_WARPS = 4  # combine_kernel's; attention_kernel's launch is `attention_plan.plan`'s
# Keys per chunk. Every path splits a row's keys into chunks [0, CHUNK), [CHUNK, 2 CHUNK), ...;
# each chunk's online softmax starts afresh and the chunks merge in order, either in the same
# program (prefill, the trainer, big decode batches) or in parallel programs merged by the last
# of them to finish or by a second launch (small decode batches): the same operations, so the
# same bits.
CHUNK = 256
# The row sums of p are taken by an MMA against a block of ones; its other dimension (the
# ones' columns, or rows when transposed) is the smallest the MMA takes in that position.
_ONES_N, _ONES_M = tl.constexpr(16), tl.constexpr(64)


@triton.jit
def _per_row(x, TRANSPOSED: tl.constexpr):
    """A [ROWS] row statistic shaped to broadcast against a tile: [ROWS, 1], or [1, ROWS]
    when the tile is transposed (rows on the second dimension)."""
    if TRANSPOSED:
        y = x[None, :]
    else:
        y = x[:, None]
    return y


@triton.jit
def _row_offsets(row_off, d, TRANSPOSED: tl.constexpr):
    """Offsets of a [ROWS, BLOCK_D] tile (row offsets + d), or of its transpose [BLOCK_D, ROWS]."""
    if TRANSPOSED:
        y = row_off[None, :] + d[:, None]
    else:
        y = row_off[:, None] + d[None, :]
    return y


@triton.jit
def _row_mask(valid, d, D: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The tile's valid rows and d < D, shaped as `_row_offsets`."""
    if TRANSPOSED:
        y = valid[None, :] & (d[:, None] < D)
    else:
        y = valid[:, None] & (d[None, :] < D)
    return y


@triton.jit
def _attend_block(
    q, k_ptr, v_ptr, block_table_ptr, b, kvh, start, end, pos, d, scale, page_size,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, m_i, l_i, acc,
    D: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr, L_MMA: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N block of keys [start, start + BLOCK_N) (those < end) folded into the
    online-softmax statistics (m_i, l_i, acc) of the tile's rows.

    Normal orientation: q [ROWS, BLOCK_D], S = Q K^T, acc [ROWS, BLOCK_D] += P V. Transposed
    (q is Q^T [BLOCK_D, ROWS]): S^T = K Q^T, acc [BLOCK_D, ROWS] += V^T P^T, so the 64 keys
    fill the MMA's M and a decode tile's few rows sit on N. Each product element is the same
    K-long dot product in either orientation, and the tensor cores' order for it does not
    depend on where it sits in the tile (H200, 2026-12-03: bitwise equal).
    The row sum of p is one more such product, bf16(p) against ones, rather than `tl.sum`,
    whose order follows the register layout, which differs between the orientations (L_MMA
    False: `tl.sum`, the negative control of that claim)."""
    keys = start + tl.arange(0, BLOCK_N)
    in_ctx = keys < end
    page = tl.load(block_table_ptr + b * stride_bt + keys // page_size, mask=in_ctx, other=0)
    slot = (page * page_size + keys % page_size).to(tl.int64)
    kv_mask = in_ctx[:, None] & (d[None, :] < D)
    k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    if TRANSPOSED:
        s = tl.dot(k, q) * scale  # [BLOCK_N, ROWS] fp32 = S^T
        s = tl.where(keys[:, None] <= pos[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
    else:
        s = tl.dot(q, tl.trans(k)) * scale  # [ROWS, BLOCK_N] fp32
        s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays at 0s
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - _per_row(m_safe, TRANSPOSED))
    pb = p.to(v.dtype)
    if not L_MMA:  # the control
        if TRANSPOSED:
            ps = tl.sum(p, 0)
        else:
            ps = tl.sum(p, 1)
    elif TRANSPOSED:  # ones [64, BLOCK_N] @ P^T: every row holds the sums; row 0 taken exactly
        r = tl.dot(tl.full((_ONES_M, BLOCK_N), 1.0, v.dtype), pb)
        ps = tl.sum(tl.where((tl.arange(0, _ONES_M) == 0)[:, None], r, 0.0), 0)
    else:  # P @ ones [BLOCK_N, 16]: every column holds the sums; column 0 taken exactly
        r = tl.dot(pb, tl.full((BLOCK_N, _ONES_N), 1.0, v.dtype))
        ps = tl.sum(tl.where((tl.arange(0, _ONES_N) == 0)[None, :], r, 0.0), 1)
    l_i = l_i * alpha + ps
    acc = acc * _per_row(alpha, TRANSPOSED)
    if TRANSPOSED:
        acc = tl.dot(tl.trans(v), pb, acc)
    else:
        acc = tl.dot(pb, v, acc)
    return m_new, l_i, acc


@triton.jit
def _fresh(ROWS: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Statistics of no key yet: m = -inf, l = 0, acc = 0 ([ROWS, BLOCK_D] or its transpose)."""
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    if TRANSPOSED:
        acc = tl.zeros((BLOCK_D, ROWS), tl.float32)
    else:
        acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    return m, l_i, acc


@triton.jit
def _attend_chunk(
    q, k_ptr, v_ptr, block_table_ptr, b, kvh, c_start, c_end, pos, d, scale, page_size,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    TRANSPOSED: tl.constexpr, L_MMA: tl.constexpr,
):  # fmt: skip
    """Online softmax of the tile's rows over keys [c_start, c_end) (one chunk), from fresh
    statistics -> (m, l, acc). A row with no key in the chunk gets m = -inf, l = 0, acc = 0."""
    m_i, l_i, acc = _fresh(ROWS, BLOCK_D, TRANSPOSED)
    for start in range(c_start, c_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, k_ptr, v_ptr, block_table_ptr, b, kvh, start, c_end, pos, d, scale, page_size,
            stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, m_i, l_i, acc, D, BLOCK_N, TRANSPOSED,
            L_MMA,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _chunk_end(c_start, hi, CHUNK: tl.constexpr):
    c_end = c_start + CHUNK
    if c_end > hi:
        c_end = hi
    return c_end


@triton.jit
def _merge(m, l_run, acc, m_c, l_c, acc_c, TRANSPOSED: tl.constexpr):
    """Fold one chunk's statistics into the running ones; a chunk the row has no key in
    (m_c = -inf) leaves them exactly as they were. Elementwise, so the orientation only
    decides how a row's statistics broadcast."""
    m_new = tl.maximum(m, m_c)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m - m_safe)
    c = tl.exp(m_c - m_safe)
    skip = m_c == float("-inf")
    l_new = l_run * a + l_c * c
    acc_new = acc * _per_row(a, TRANSPOSED) + acc_c * _per_row(c, TRANSPOSED)
    return (
        tl.where(skip, m, m_new),
        tl.where(skip, l_run, l_new),
        tl.where(_per_row(skip, TRANSPOSED), acc, acc_new),
    )


@triton.jit
def _merge_chunks(
    part_m_ptr, part_l_ptr, part_acc_ptr, row, head, valid, d, row_mask, chunks, n_chunks, heads,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSED: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """A split call's chunk statistics [T, chunks, heads] of the tile's rows (query row `row`,
    head `head`), merged in chunk order from fresh statistics -> (m, l, acc). Elementwise, so
    the orientation only decides the layout: `combine_kernel` and the last chunk program
    (MERGE_LAST) get the same bits."""
    m, l_run, acc = _fresh(ROWS, BLOCK_D, TRANSPOSED)
    for c in range(0, n_chunks):
        at = (row.to(tl.int64) * chunks + c) * heads + head
        m_c = tl.load(part_m_ptr + at, mask=valid, other=float("-inf"), cache_modifier=CACHE)
        l_c = tl.load(part_l_ptr + at, mask=valid, other=0.0, cache_modifier=CACHE)
        acc_c = tl.load(
            part_acc_ptr + _row_offsets(at * D, d, TRANSPOSED), mask=row_mask, other=0.0, cache_modifier=CACHE
        )
        m, l_run, acc = _merge(m, l_run, acc, m_c, l_c, acc_c, TRANSPOSED)
    return m, l_run, acc


@triton.jit
def _tile_rows(
    b,
    tile,
    kvh,
    q_start_ptr,
    q_len_ptr,
    ctx_len_ptr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The tile's rows (query tokens x the kv head's query heads): (q_len, q_start, token,
    head, valid, position, hi = keys any row of the tile sees)."""
    TOKENS: tl.constexpr = ROWS // G_PAD
    q_len = tl.load(q_len_ptr + b)
    q_start = tl.load(q_start_ptr + b)
    ctx_len = tl.load(ctx_len_ptr + b)
    rows = tl.arange(0, ROWS)
    tok = tile * TOKENS + rows // G_PAD  # query index within this sequence's chunk
    head = kvh * G + rows % G_PAD
    valid = (tok < q_len) & (rows % G_PAD < G)
    pos = tl.where(valid, ctx_len - q_len + tok, 0)  # [ROWS]; padding rows see key 0 only
    hi = ctx_len - q_len + (tile + 1) * TOKENS
    if hi > ctx_len:
        hi = ctx_len
    return q_len, q_start, tok, head, valid, pos, hi


@fast_launch
@triton.jit
def attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_table_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, chunks, ticket_ptr,
    scale, page_size,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr,
    TRANSPOSED: tl.constexpr, L_MMA: tl.constexpr, MERGE_LAST: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """Whole (SPLIT False): program (sequence, tile, kv head) walks the chunks of its keys in
    order, merging each. Split: program (sequence, chunk, kv head) of a one-tile call computes
    one chunk and stores its statistics at [query row, chunk, head] for `combine_kernel`, or
    (MERGE_LAST) takes a ticket at ticket[sequence, kv head] after its stores, and the
    program that draws the last one merges the chunks as `combine_kernel` does (`_merge_chunks`)
    and puts the ticket back to 0 for the next call. A tile is ROWS (query token, head) rows:
    BLOCK_M in the normal orientation, BLOCK_Q transposed (`_attend_block`)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(2)
    tile = 0 if SPLIT else tl.program_id(1)
    q_len, q_start, tok, head, valid, pos, hi = _tile_rows(
        b, tile, kvh, q_start_ptr, q_len_ptr, ctx_len_ptr, G, G_PAD, ROWS
    )
    if tile * (ROWS // G_PAD) >= q_len:
        return
    d = tl.arange(0, BLOCK_D)
    row_mask = _row_mask(valid, d, D, TRANSPOSED)
    q = tl.load(
        q_ptr + _row_offsets((q_start + tok) * stride_qt + head * stride_qh, d, TRANSPOSED),
        mask=row_mask,
        other=0.0,
    )
    if SPLIT:
        c_start = tl.program_id(1) * CHUNK
        if c_start >= hi:
            return
        m_c, l_c, acc_c = _attend_chunk(
            q, k_ptr, v_ptr, block_table_ptr, b, kvh, c_start, _chunk_end(c_start, hi, CHUNK), pos, d,
            scale, page_size, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
            D, ROWS, BLOCK_D, BLOCK_N, TRANSPOSED, L_MMA,
        )  # fmt: skip
        pdl_release(PDL)
        at = ((q_start + tok).to(tl.int64) * chunks + tl.program_id(1)) * (G * tl.num_programs(2)) + head
        tl.store(part_m_ptr + at, m_c, mask=valid)
        tl.store(part_l_ptr + at, l_c, mask=valid)
        tl.store(part_acc_ptr + _row_offsets(at * D, d, TRANSPOSED), acc_c, mask=row_mask)
        if MERGE_LAST:
            # every thread's stores before the ticket (the barrier, then the release: Triton 3.6
            # puts no barrier before a scalar atomic itself); the last ticket's program then
            # sees every chunk's (the acquire; `.cg` on its loads as well, past L1). The count is
            # clamped to the grid's chunks, so no call can leave a counter short of its reset.
            tl.debug_barrier()
            ticket = ticket_ptr + b * tl.num_programs(2) + kvh
            n_chunks = tl.minimum(tl.cdiv(hi, CHUNK), chunks)
            if tl.atomic_add(ticket, 1, sem="acq_rel") == n_chunks - 1:
                tl.atomic_xchg(ticket, 0, sem="relaxed")
                m, l_run, acc = _merge_chunks(
                    part_m_ptr, part_l_ptr, part_acc_ptr, q_start + tok, head, valid, d, row_mask, chunks,
                    n_chunks, G * tl.num_programs(2), D, ROWS, BLOCK_D, TRANSPOSED, ".cg",
                )  # fmt: skip
                tl.store(
                    o_ptr + _row_offsets((q_start + tok) * stride_ot + head * stride_oh, d, TRANSPOSED),
                    (acc / _per_row(l_run, TRANSPOSED)).to(o_ptr.dtype.element_ty),
                    mask=row_mask,
                )
    else:
        m, l_run, acc = _fresh(ROWS, BLOCK_D, TRANSPOSED)
        m_c, l_c, acc_c = _fresh(ROWS, BLOCK_D, TRANSPOSED)
        for start in range(0, hi, BLOCK_N):
            m_c, l_c, acc_c = _attend_block(
                q, k_ptr, v_ptr, block_table_ptr, b, kvh, start, hi, pos, d, scale, page_size,
                stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, m_c, l_c, acc_c, D, BLOCK_N, TRANSPOSED,
                L_MMA,
            )  # fmt: skip
            if ((start + BLOCK_N) % CHUNK == 0) | (start + BLOCK_N >= hi):  # the chunk's last block
                m, l_run, acc = _merge(m, l_run, acc, m_c, l_c, acc_c, TRANSPOSED)
                m_c, l_c, acc_c = _fresh(ROWS, BLOCK_D, TRANSPOSED)
        pdl_release(PDL)
        tl.store(
            o_ptr + _row_offsets((q_start + tok) * stride_ot + head * stride_oh, d, TRANSPOSED),
            (acc / _per_row(l_run, TRANSPOSED)).to(o_ptr.dtype.element_ty),
            mask=row_mask,
        )


@fast_launch
@triton.jit
def combine_kernel(
    o_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, chunks,
    stride_ot, stride_oh,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (sequence, kv head) of a split call: the chunks' statistics merged in order,
    as the whole kernel merges them, then the output rows (elementwise: the orientation the
    chunks ran in does not matter here)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    q_len, q_start, tok, head, valid, pos, hi = _tile_rows(
        b, 0, kvh, q_start_ptr, q_len_ptr, ctx_len_ptr, G, G_PAD, BLOCK_M
    )
    if q_len <= 0:
        return
    d = tl.arange(0, BLOCK_D)
    m, l_run, acc = _merge_chunks(
        part_m_ptr, part_l_ptr, part_acc_ptr, q_start + tok, head, valid, d, _row_mask(valid, d, D, False),
        chunks, tl.cdiv(hi, CHUNK), G * tl.num_programs(1), D, BLOCK_M, BLOCK_D, False, "",
    )  # fmt: skip
    pdl_release(PDL)
    tl.store(
        o_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        (acc / l_run[:, None]).to(o_ptr.dtype.element_ty),
        mask=valid[:, None] & (d[None, :] < D),
    )
