"""Transposed-orientation decode/prefill attention: bits, speed, registers (CUDA; experiment)

    python benchmarks/attention_transposed.py --only-lmma --out lmma.json   # the L_MMA section only
    python benchmarks/attention_transposed.py --out transposed.json         # L_MMA first, then the rest
    TRITON_INTERPRET=1 PYTHONPATH=/tmp/tritonsite:src \
        python benchmarks/attention_transposed.py --interpret-check [--skip-old]

`attention_t` has the semantics of `attention_triton.attention` (whole path only, no split),
but its MMAs put the KEYS on the MMA's M dimension (64 keys: wgmma's M=64 is full) and the
tile's query rows on N: S^T = K Q^T [BLOCK_N, BLOCK_Q], O^T = V^T P^T [D, BLOCK_Q]. BLOCK_Q
(query rows per tile, rows = (token, head) as in `_tile_rows`) is 16 for decode (8 real rows
at G=8) and 64 for prefill, so a decode tile wastes half of N instead of 7/8 of M. Chunking is
the current kernel's (CHUNK keys from key 0, fresh statistics per chunk, merged in order with
the same `_merge` math), FMA contraction off. `TREE` sums p^T over the keys with an explicit
halving tree instead of `tl.sum(axis=0)`.

L_MMA (section "lmma", run first): the per-block sum l of p comes from an MMA in both
orientations, bf16(p) @ ones[BLOCK_N, 16] in `attention_n` (a copy of the current kernel's whole
path) and ones[64, BLOCK_N] @ bf16(p^T) in `attention_t`, its one nonzero column/row taken
exactly. If S, O and these sums are bitwise equal between the orientations (`mma_probe` checks
each MMA alone), transposed decode (16-row tiles) equals normal prefill (64-row tiles) bitwise.

The question the CUDA run answers: does a row get the same bits whether its tile has 16 or
64 rows (decode vs prefill vs chunked prefill), and what does the layout cost or save.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import triton
import triton.language as tl

from samebits.kernels import attention_triton as at

H, KVH, D, PAGE = 32, 4, 128, 16
BLOCK_N, CHUNK = 64, 256
BLOCK_Q_DECODE, BLOCK_Q_PREFILL = 16, 64
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LAST: dict = {}  # the compiled kernel of the last launch (n_regs, n_spills)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _col_tree(p, N: tl.constexpr, BQ: tl.constexpr):
    """[N, BQ] -> [BQ]: each column's halving tree over axis 0 (pairs i, i + n/2), N a power
    of two <= 256: the order is fixed by the code, not by the register layout."""
    if N >= 2:
        p = tl.sum(tl.reshape(p, (2, N // 2, BQ)), axis=0)
    if N >= 4:
        p = tl.sum(tl.reshape(p, (2, N // 4, BQ)), axis=0)
    if N >= 8:
        p = tl.sum(tl.reshape(p, (2, N // 8, BQ)), axis=0)
    if N >= 16:
        p = tl.sum(tl.reshape(p, (2, N // 16, BQ)), axis=0)
    if N >= 32:
        p = tl.sum(tl.reshape(p, (2, N // 32, BQ)), axis=0)
    if N >= 64:
        p = tl.sum(tl.reshape(p, (2, N // 64, BQ)), axis=0)
    if N >= 128:
        p = tl.sum(tl.reshape(p, (2, N // 128, BQ)), axis=0)
    if N >= 256:
        p = tl.sum(tl.reshape(p, (2, N // 256, BQ)), axis=0)
    return tl.reshape(p, (BQ,))


@triton.jit
def _attend_block_t(
    qt, k_ptr, v_ptr, block_table_ptr, b, kvh, start, end, pos, d, scale, page_size,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, m_i, l_i, acc,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, TREE: tl.constexpr,
    L_MMA: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N block of keys [start, start + BLOCK_N) (those < end) folded into the
    column statistics m_i, l_i [BLOCK_Q] and acc [BLOCK_D, BLOCK_Q] (O^T). L_MMA: the block's
    column sums of p come from an MMA, ones[64, BLOCK_N] @ bf16(p^T) (M = 64: wgmma), row 0
    taken exactly (a one-hot sum: one value plus zeros)."""
    keys = start + tl.arange(0, BLOCK_N)
    in_ctx = keys < end
    page = tl.load(block_table_ptr + b * stride_bt + keys // page_size, mask=in_ctx, other=0)
    slot = (page * page_size + keys % page_size).to(tl.int64)
    kv_mask = in_ctx[:, None] & (d[None, :] < D)
    k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(k, qt) * scale  # [BLOCK_N, BLOCK_Q] fp32 = S^T
    s = tl.where(keys[:, None] <= pos[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[None, :])
    pb = p.to(v.dtype)
    if L_MMA:
        r = tl.dot(tl.full((64, BLOCK_N), 1.0, v.dtype), pb)  # [64, BLOCK_Q], every row the sums
        ps = tl.sum(tl.where((tl.arange(0, 64) == 0)[:, None], r, 0.0), 0)
    elif TREE:
        ps = _col_tree(p, BLOCK_N, BLOCK_Q)
    else:
        ps = tl.sum(p, 0)
    l_i = l_i * alpha + ps
    acc = acc * alpha[None, :]
    acc = tl.dot(tl.trans(v), pb, acc)  # [BLOCK_D, BLOCK_Q] += V^T P^T
    return m_new, l_i, acc


@triton.jit
def _merge_t(m, l_run, acc, m_c, l_c, acc_c):
    """`attention_triton._merge` with the accumulators transposed ([BLOCK_D, BLOCK_Q])."""
    m_new = tl.maximum(m, m_c)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m - m_safe)
    c = tl.exp(m_c - m_safe)
    skip = m_c == float("-inf")
    l_new = l_run * a + l_c * c
    acc_new = acc * a[None, :] + acc_c * c[None, :]
    return tl.where(skip, m, m_new), tl.where(skip, l_run, l_new), tl.where(skip[None, :], acc, acc_new)


@triton.jit
def attention_t_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_table_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr,
    scale, page_size,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, TREE: tl.constexpr,
    L_MMA: tl.constexpr,
):  # fmt: skip
    """Program (sequence, tile, kv head) walks its keys' chunks in order, merging each."""
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_len, q_start, tok, head, valid, pos, hi = at._tile_rows(
        b, tile, kvh, q_start_ptr, q_len_ptr, ctx_len_ptr, G, G_PAD, BLOCK_Q
    )
    if tile * (BLOCK_Q // G_PAD) >= q_len:
        return
    d = tl.arange(0, BLOCK_D)
    qt = tl.load(  # Q^T [BLOCK_D, BLOCK_Q]
        q_ptr + (q_start + tok)[None, :] * stride_qt + head[None, :] * stride_qh + d[:, None],
        mask=valid[None, :] & (d[:, None] < D),
        other=0.0,
    )
    m = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_run = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_D, BLOCK_Q), tl.float32)
    m_c = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_c = tl.zeros((BLOCK_Q,), tl.float32)
    acc_c = tl.zeros((BLOCK_D, BLOCK_Q), tl.float32)
    for start in range(0, hi, BLOCK_N):
        m_c, l_c, acc_c = _attend_block_t(
            qt, k_ptr, v_ptr, block_table_ptr, b, kvh, start, hi, pos, d, scale, page_size,
            stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, m_c, l_c, acc_c, D, BLOCK_N, BLOCK_Q, TREE,
            L_MMA,
        )  # fmt: skip
        if ((start + BLOCK_N) % CHUNK == 0) | (start + BLOCK_N >= hi):  # the chunk's last block
            m, l_run, acc = _merge_t(m, l_run, acc, m_c, l_c, acc_c)
            m_c = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
            l_c = tl.zeros((BLOCK_Q,), tl.float32)
            acc_c = tl.zeros((BLOCK_D, BLOCK_Q), tl.float32)
    o = tl.trans(acc / l_run[None, :])  # [BLOCK_Q, BLOCK_D]; the division is per element
    tl.store(
        o_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=valid[:, None] & (d[None, :] < D),
    )


def attention_t(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [slots, KVH, D]
    v_cache: torch.Tensor,  # [slots, KVH, D]
    block_table: torch.Tensor,  # [B, pages] int32
    q_start: torch.Tensor,  # [B] int32
    q_len: torch.Tensor,  # [B] int32
    ctx_len: torch.Tensor,  # [B] int32
    max_q_len: int,
    scale: float,
    page_size: int,
    out: torch.Tensor | None = None,
    block_q: int | None = None,
    tree: bool = False,
    num_stages: int = 3,
    num_warps: int = 4,
    l_mma: bool = False,
) -> torch.Tensor:
    """`attention_triton.attention` (whole path) with the transposed MMAs. block_q None: 16
    rows when every sequence's queries fit one 16-row tile (decode), else 64."""
    at.check_attention_inputs(q, k_cache, v_cache)
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    g = h // kvh
    g_pad = triton.next_power_of_2(g)
    if block_q is None:
        block_q = BLOCK_Q_DECODE if max_q_len * g_pad <= BLOCK_Q_DECODE else BLOCK_Q_PREFILL
    block_q = max(block_q, g_pad, 16)
    for name, x in (("block_table", block_table), ("q_start", q_start), ("q_len", q_len), ("ctx_len", ctx_len)):
        if x.dtype != torch.int32 or x.device != q.device:
            raise ValueError(f"attention_t: {name} must be int32 on {q.device}, got {x.dtype} on {x.device}")
    if out is None:
        out = torch.empty_like(q)
    b = q_len.shape[0]
    if t == 0 or b == 0 or max_q_len == 0:
        return out
    tokens = block_q // g_pad
    grid = (b, triton.cdiv(max_q_len, tokens), kvh)
    kern = attention_t_kernel[grid](
        q, k_cache, v_cache, out, block_table, q_start, q_len, ctx_len,
        scale, page_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0),
        G=g, G_PAD=g_pad, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N, CHUNK=CHUNK, TREE=tree, L_MMA=l_mma,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
    )  # fmt: skip
    _LAST["kernel"] = kern
    return out


# ----------------------------------------------------------------------------- normal orientation, L_MMA


@triton.jit
def _attend_block_n(
    q, k_ptr, v_ptr, block_table_ptr, b, kvh, start, end, pos, d, scale, page_size,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, m_i, l_i, acc,
    D: tl.constexpr, BLOCK_N: tl.constexpr, L_MMA: tl.constexpr,
):  # fmt: skip
    """`attention_triton._attend_block`; L_MMA: the block's row sums of p come from an MMA,
    bf16(p) @ ones[BLOCK_N, 16], column 0 taken exactly (a one-hot sum)."""
    keys = start + tl.arange(0, BLOCK_N)
    in_ctx = keys < end
    page = tl.load(block_table_ptr + b * stride_bt + keys // page_size, mask=in_ctx, other=0)
    slot = (page * page_size + keys % page_size).to(tl.int64)
    kv_mask = in_ctx[:, None] & (d[None, :] < D)
    k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N] fp32
    s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    pb = p.to(v.dtype)
    if L_MMA:
        r = tl.dot(pb, tl.full((BLOCK_N, 16), 1.0, v.dtype))  # [BLOCK_M, 16], every column the sums
        ps = tl.sum(tl.where((tl.arange(0, 16) == 0)[None, :], r, 0.0), 1)
    else:
        ps = tl.sum(p, 1)
    l_i = l_i * alpha + ps
    acc = acc * alpha[:, None]
    acc = tl.dot(pb, v, acc)
    return m_new, l_i, acc


@triton.jit
def attention_n_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_table_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr,
    scale, page_size,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, L_MMA: tl.constexpr,
):  # fmt: skip
    """`attention_triton.attention_kernel`'s whole path (SPLIT False), L_MMA optional."""
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_len, q_start, tok, head, valid, pos, hi = at._tile_rows(
        b, tile, kvh, q_start_ptr, q_len_ptr, ctx_len_ptr, G, G_PAD, BLOCK_M
    )
    if tile * (BLOCK_M // G_PAD) >= q_len:
        return
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=valid[:, None] & (d[None, :] < D),
        other=0.0,
    )
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_run = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    m_c = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_c = tl.zeros((BLOCK_M,), tl.float32)
    acc_c = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(0, hi, BLOCK_N):
        m_c, l_c, acc_c = _attend_block_n(
            q, k_ptr, v_ptr, block_table_ptr, b, kvh, start, hi, pos, d, scale, page_size,
            stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, m_c, l_c, acc_c, D, BLOCK_N, L_MMA,
        )  # fmt: skip
        if ((start + BLOCK_N) % CHUNK == 0) | (start + BLOCK_N >= hi):  # the chunk's last block
            m, l_run, acc = at._merge(m, l_run, acc, m_c, l_c, acc_c)
            m_c = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_c = tl.zeros((BLOCK_M,), tl.float32)
            acc_c = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    tl.store(
        o_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        (acc / l_run[:, None]).to(o_ptr.dtype.element_ty),
        mask=valid[:, None] & (d[None, :] < D),
    )


def attention_n(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [slots, KVH, D]
    v_cache: torch.Tensor,  # [slots, KVH, D]
    block_table: torch.Tensor,  # [B, pages] int32
    q_start: torch.Tensor,  # [B] int32
    q_len: torch.Tensor,  # [B] int32
    ctx_len: torch.Tensor,  # [B] int32
    max_q_len: int,
    scale: float,
    page_size: int,
    out: torch.Tensor | None = None,
    l_mma: bool = True,
) -> torch.Tensor:
    """`attention_triton.attention`'s whole path (its launch configuration: BLOCK_M 64, BLOCK_N
    64, CHUNK 256, 4 warps, 3 stages, no FMA contraction) with the row sum l optionally from an
    MMA. l_mma False: the current kernel's bits (a check of the copy)."""
    at.check_attention_inputs(q, k_cache, v_cache)
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    g = h // kvh
    g_pad = triton.next_power_of_2(g)
    if out is None:
        out = torch.empty_like(q)
    b = q_len.shape[0]
    if t == 0 or b == 0 or max_q_len == 0:
        return out
    grid = (b, triton.cdiv(max_q_len, at.BLOCK_M // g_pad), kvh)
    kern = attention_n_kernel[grid](
        q, k_cache, v_cache, out, block_table, q_start, q_len, ctx_len,
        scale, page_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0),
        G=g, G_PAD=g_pad, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=at.BLOCK_M,
        BLOCK_N=at.BLOCK_N, CHUNK=at.CHUNK, L_MMA=l_mma,
        num_warps=at.NUM_WARPS, num_stages=at.NUM_STAGES, enable_fp_fusion=False,
    )  # fmt: skip
    _LAST["kernel"] = kern
    return out


# ----------------------------------------------------------------------------- MMA probes


@triton.jit
def _probe_n_kernel(q_ptr, k_ptr, p_ptr, v_ptr, s_ptr, o_ptr, l_ptr, M: tl.constexpr, D: tl.constexpr):
    """Normal orientation, one [M=64, *] tile per program: S = Q K^T [M, 64], O = P V [M, D],
    L = (P @ ones[64, 16])[:, 0] [M] (as `_attend_block_n`)."""
    t = tl.program_id(0)
    r = tl.arange(0, M)
    n = tl.arange(0, 64)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t * M * D + r[:, None] * D + d[None, :])
    k = tl.load(k_ptr + t * 64 * D + n[:, None] * D + d[None, :])
    p = tl.load(p_ptr + t * M * 64 + r[:, None] * 64 + n[None, :])
    v = tl.load(v_ptr + t * 64 * D + n[:, None] * D + d[None, :])
    tl.store(s_ptr + t * M * 64 + r[:, None] * 64 + n[None, :], tl.dot(q, tl.trans(k)))
    tl.store(o_ptr + t * M * D + r[:, None] * D + d[None, :], tl.dot(p, v))
    lr = tl.dot(p, tl.full((64, 16), 1.0, p.dtype))
    tl.store(l_ptr + t * M + r, tl.sum(tl.where((tl.arange(0, 16) == 0)[None, :], lr, 0.0), 1))


@triton.jit
def _probe_t_kernel(
    q_ptr, k_ptr, p_ptr, v_ptr, s_ptr, o_ptr, l_ptr, M: tl.constexpr, BQ: tl.constexpr, D: tl.constexpr
):
    """Transposed orientation on the first BQ rows of each tile of `_probe_n_kernel`:
    S^T = K Q^T [64, BQ], O^T = V^T P^T [D, BQ], L = (ones[64, 64] @ P^T)[0, :] [BQ] (as
    `_attend_block_t`); Q^T and P^T loaded transposed through pointers, as there."""
    t = tl.program_id(0)
    c = tl.arange(0, BQ)
    n = tl.arange(0, 64)
    d = tl.arange(0, D)
    qt = tl.load(q_ptr + t * M * D + c[None, :] * D + d[:, None])  # [D, BQ]
    k = tl.load(k_ptr + t * 64 * D + n[:, None] * D + d[None, :])
    pt = tl.load(p_ptr + t * M * 64 + c[None, :] * 64 + n[:, None])  # [64, BQ]
    v = tl.load(v_ptr + t * 64 * D + n[:, None] * D + d[None, :])
    tl.store(s_ptr + t * 64 * BQ + n[:, None] * BQ + c[None, :], tl.dot(k, qt))
    tl.store(o_ptr + t * D * BQ + d[:, None] * BQ + c[None, :], tl.dot(tl.trans(v), pt))
    lr = tl.dot(tl.full((64, 64), 1.0, pt.dtype), pt)
    tl.store(l_ptr + t * BQ + c, tl.sum(tl.where((tl.arange(0, 64) == 0)[:, None], lr, 0.0), 0))


def mma_probe(dtype, dev, tiles=64, seed=5) -> dict:
    """Is each MMA product bitwise the same in both orientations? S (scaled inputs like
    q, k), O = P V and the row sums L, for the transposed tile widths 16 and 64."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    m = 64
    q = torch.randn(tiles, m, D, generator=g).to(dtype).to(dev)
    k = torch.randn(tiles, 64, D, generator=g).to(dtype).to(dev)
    v = torch.randn(tiles, 64, D, generator=g).to(dtype).to(dev)
    p = torch.exp(-4 * torch.rand(tiles, m, 64, generator=g)).to(dtype).to(dev)  # like exp(s - m)
    s = torch.empty(tiles, m, 64, dtype=torch.float32, device=dev)
    o = torch.empty(tiles, m, D, dtype=torch.float32, device=dev)
    ln = torch.empty(tiles, m, dtype=torch.float32, device=dev)
    _probe_n_kernel[(tiles,)](q, k, p, v, s, o, ln, M=m, D=D, num_warps=4, enable_fp_fusion=False)
    res = {}
    for bq in (16, 64):
        st = torch.empty(tiles, 64, bq, dtype=torch.float32, device=dev)
        ot = torch.empty(tiles, D, bq, dtype=torch.float32, device=dev)
        lt = torch.empty(tiles, bq, dtype=torch.float32, device=dev)
        _probe_t_kernel[(tiles,)](q, k, p, v, st, ot, lt, M=m, BQ=bq, D=D, num_warps=4, enable_fp_fusion=False)
        pairs = {
            "S": (s[:, :bq, :], st.transpose(1, 2)),
            "O": (o[:, :bq, :], ot.transpose(1, 2)),
            "L": (ln[:, :bq], lt),
        }
        for name, (a, b) in pairs.items():
            res[f"{name}_bq{bq}_mismatch"] = _mismatch(a, b)
            res[f"{name}_bq{bq}_maxdiff"] = float((a.double() - b.double()).abs().max())
    lsum = p.float().sum(-1)
    res["L_vs_fp32_sum_maxdiff"] = float((ln.double() - lsum.double()).abs().max())
    res["elements"] = {"S": tiles * 16 * 64, "O": tiles * 16 * D, "L": tiles * 16, "bq64": "x4"}
    return res


def kernel_info(kern) -> dict:
    """n_regs, n_spills and shared memory of a compiled kernel (launched at least once)."""
    if kern is None:
        return {"error": "no compiled kernel (interpreter?)"}
    if getattr(kern, "n_regs", None) is None and hasattr(kern, "_init_handles"):
        kern._init_handles()
    return {
        "n_regs": getattr(kern, "n_regs", None),
        "n_spills": getattr(kern, "n_spills", None),
        "shared_bytes": getattr(getattr(kern, "metadata", None), "shared", None),
    }


def current_launch_handle(
    q, k_cache, v_cache, block_table, q_start, q_len, ctx_len, max_q_len, scale, page_size
):
    """The current kernel's whole-path launch exactly as `attention_triton.attention` makes it
    (split off), returning the compiled kernel (for n_regs / n_spills)."""
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    g = h // kvh
    g_pad = triton.next_power_of_2(g)
    out = torch.empty_like(q)
    b = q_len.shape[0]
    chunks = triton.cdiv(block_table.shape[1] * page_size, at.CHUNK)
    grid = (b, triton.cdiv(max_q_len, at.BLOCK_M // g_pad), kvh)
    return at.attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, q_start, q_len, ctx_len, out, out, out, chunks,
        scale, page_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0),
        G=g, G_PAD=g_pad, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=at.BLOCK_M, CHUNK=at.CHUNK,
        BLOCK_N=at.BLOCK_N, SPLIT=False, num_warps=at.NUM_WARPS, num_stages=at.NUM_STAGES,
        enable_fp_fusion=False,
    )  # fmt: skip


# ----------------------------------------------------------------------------- inputs and reference


def _dev() -> torch.device:
    return torch.device("cpu") if _INTERPRET or not torch.cuda.is_available() else torch.device("cuda")


def paged_kv(lengths, dtype, dev, seed=0, heads=H, kv_heads=KVH, dim=D):
    """K/V caches of `lengths` sequences on scattered PAGE-token pages, one table row each, and
    per-token queries (one [L, H, D] block per sequence, packed in order)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = max(-(-n // PAGE) for n in lengths)
    nb = len(lengths)
    k = torch.randn(nb * pages * PAGE, kv_heads, dim, generator=g).to(dtype).to(dev)
    v = torch.randn(nb * pages * PAGE, kv_heads, dim, generator=g).to(dtype).to(dev)
    table = torch.randperm(nb * pages, generator=g).int().view(nb, pages).contiguous().to(dev)
    q = torch.randn(sum(lengths), heads, dim, generator=g).to(dtype).to(dev)
    return q, k, v, table


def _i32(x, dev):
    return torch.tensor(x, dtype=torch.int32, device=dev)


def ref64(q, k, v, table, q_start, q_len, ctx_len, scale):
    """Float64 causal paged attention -> [T, H, D] float64 (rows outside sequences 0)."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    g = q.shape[1] // k.shape[1]
    for b in range(len(q_len)):
        n, c, s = int(q_len[b]), int(ctx_len[b]), int(q_start[b])
        if n == 0:
            continue
        key = torch.arange(c, device=q.device)
        slots = table[b].long()[key // PAGE] * PAGE + key % PAGE
        kk = k[slots].double().repeat_interleave(g, 1)  # [c, H, D]
        vv = v[slots].double().repeat_interleave(g, 1)
        qq = q[s : s + n].double()  # [n, H, D]
        sc = torch.einsum("nhd,chd->hnc", qq, kk) * scale
        posn = c - n + torch.arange(n, device=q.device)
        sc = sc.masked_fill(key[None, None, :] > posn[None, :, None], float("-inf"))
        out[s : s + n] = torch.einsum("hnc,chd->nhd", sc.softmax(-1), vv)
    return out


def _err(a, ref):
    return float((a.double() - ref).abs().max())


def _mismatch(a, b):
    """Elements whose bits differ (NaN-safe: compares the raw bits)."""
    if a.shape != b.shape:
        return -1
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return int((a.contiguous().view(bits) != b.contiguous().view(bits)).sum())


# ----------------------------------------------------------------------------- checks


def correctness(dtype, dev, variants, dec_ctx=(1, 64, 300, 700), pre_len=300, n_pre=4):
    """Decode (len(dec_ctx) sequences, one query each) and packed prefill (n_pre x pre_len)
    against float64 and against the current kernel."""
    res = {}
    scale = D**-0.5
    # decode: the last token of each sequence
    q_all, k, v, table = paged_kv(list(dec_ctx), dtype, dev, seed=1)
    ends = torch.tensor(dec_ctx).cumsum(0) - 1
    q = q_all[ends.to(dev)].contiguous()
    nb = len(dec_ctx)
    dmeta = (table, _i32(list(range(nb)), dev), _i32([1] * nb, dev), _i32(list(dec_ctx), dev))
    dref = ref64(q, k, v, *dmeta, scale)
    # prefill: n_pre sequences of pre_len tokens packed
    pq, pk, pv, ptable = paged_kv([pre_len] * n_pre, dtype, dev, seed=2)
    pmeta = (
        ptable,
        _i32([i * pre_len for i in range(n_pre)], dev),
        _i32([pre_len] * n_pre, dev),
        _i32([pre_len] * n_pre, dev),
    )
    pref = ref64(pq, pk, pv, *pmeta, scale)
    cur_d = at.attention(q, k, v, *dmeta, 1, scale, PAGE, split=False)
    cur_p = at.attention(pq, pk, pv, *pmeta, pre_len, scale, PAGE)
    res["current"] = {"decode_err_f64": _err(cur_d, dref), "prefill_err_f64": _err(cur_p, pref)}
    for name, kw in variants.items():
        try:
            od = attention_t(q, k, v, *dmeta, 1, scale, PAGE, **kw)
            op = attention_t(pq, pk, pv, *pmeta, pre_len, scale, PAGE, **kw)
            od64 = attention_t(q, k, v, *dmeta, 1, scale, PAGE, **{**kw, "block_q": 64})
            res[name] = {
                "decode_err_f64": _err(od, dref),
                "decode_bq64_err_f64": _err(od64, dref),
                "prefill_err_f64": _err(op, pref),
                "decode_maxdiff_vs_current": float((od.double() - cur_d.double()).abs().max()),
                "prefill_maxdiff_vs_current": float((op.double() - cur_p.double()).abs().max()),
                "decode_mismatch_vs_current": _mismatch(od, cur_d),
                "finite": bool(torch.isfinite(od).all() and torch.isfinite(op).all()),
            }
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    return res


def _decode_picks(lengths, positions_per_seq, gen):
    """(seq, p) decode rows: the chunk/block edges in range and `positions_per_seq` random ones."""
    picks = []
    for s, n in enumerate(lengths):
        ps = {0, n - 1, *(x for x in (1, 36, 37, 63, 64, 65, 255, 256, 257, 511, 512, 1023, 1024) if x < n)}
        ps |= {int(x) for x in torch.randint(0, n, (positions_per_seq,), generator=gen)}
        picks += [(s, p) for p in sorted(ps)]
    return picks


def consistency(dtype, dev, variants, lengths, positions_per_seq=8, head_len=37, batch_big=256, seed=3):
    """Bitwise: full packed prefill (BLOCK_Q 64) vs decode (BLOCK_Q 16, one call per (seq, p)
    batched) vs chunked prefill (head_len tokens then the rest) vs prefill with 16-row tiles vs
    decode with 64-row tiles; decode of one row in a batch of 1 vs a batch of `batch_big`."""
    scale = D**-0.5
    q, k, v, table = paged_kv(list(lengths), dtype, dev, seed=seed)
    nb = len(lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    pmeta = (table, _i32(starts[:-1], dev), _i32(list(lengths), dev), _i32(list(lengths), dev))
    maxlen = max(lengths)
    # decode rows: several positions per sequence, always the chunk/block edges in range
    gen = torch.Generator().manual_seed(seed)
    picks = _decode_picks(lengths, positions_per_seq, gen)  # (seq, p)
    rows = torch.tensor([starts[s] + p for s, p in picks], device=dev)
    dq = q[rows].contiguous()
    nd = len(picks)
    dmeta = (
        table[torch.tensor([s for s, _ in picks], device=dev)].contiguous(),
        _i32(list(range(nd)), dev),
        _i32([1] * nd, dev),
        _i32([p + 1 for _, p in picks], dev),
    )
    # chunked prefill: tokens [0, head_len) then [head_len, n) over the cached keys
    long_seqs = [s for s, n in enumerate(lengths) if n > head_len]
    c1 = (
        table,
        _i32([starts[s] for s in range(nb)], dev),
        _i32([min(head_len, n) for n in lengths], dev),
        _i32([min(head_len, n) for n in lengths], dev),
    )
    c2_idx = torch.tensor(long_seqs, device=dev)
    c2 = (
        table[c2_idx].contiguous(),
        _i32([starts[s] + head_len for s in long_seqs], dev),
        _i32([lengths[s] - head_len for s in long_seqs], dev),
        _i32([lengths[s] for s in long_seqs], dev),
    )
    # batch 1 vs batch_big for one decode row (the longest sequence's last token)
    s0 = max(range(nb), key=lambda s: lengths[s])
    p0 = lengths[s0] - 1
    others = [(int(torch.randint(0, nb, (1,), generator=gen)), 0) for _ in range(batch_big)]
    others = [(s, int(torch.randint(0, lengths[s], (1,), generator=gen))) for s, _ in others]
    at_i = batch_big // 3
    others[at_i] = (s0, p0)
    brows = torch.tensor([starts[s] + p for s, p in others], device=dev)
    bmeta = (
        table[torch.tensor([s for s, _ in others], device=dev)].contiguous(),
        _i32(list(range(batch_big)), dev),
        _i32([1] * batch_big, dev),
        _i32([p + 1 for _, p in others], dev),
    )
    one = (table[s0 : s0 + 1].contiguous(), _i32([0], dev), _i32([1], dev), _i32([p0 + 1], dev))
    ref = ref64(q, k, v, *pmeta, scale)
    res = {"lengths": list(lengths), "decode_rows": nd, "elements_per_row": H * D, "big_batch": batch_big}
    for name, kw in variants.items():
        try:
            kw = {x: y for x, y in kw.items() if x != "block_q"}
            full = attention_t(q, k, v, *pmeta, maxlen, scale, PAGE, block_q=64, **kw)
            full16 = attention_t(q, k, v, *pmeta, maxlen, scale, PAGE, block_q=16, **kw)
            dec = attention_t(dq, k, v, *dmeta, 1, scale, PAGE, block_q=16, **kw)
            dec64 = attention_t(dq, k, v, *dmeta, 1, scale, PAGE, block_q=64, **kw)
            ch = torch.zeros_like(q)
            attention_t(q, k, v, *c1, head_len, scale, PAGE, out=ch, block_q=64, **kw)
            attention_t(q, k, v, *c2, maxlen - head_len, scale, PAGE, out=ch, block_q=64, **kw)
            big = attention_t(q[brows].contiguous(), k, v, *bmeta, 1, scale, PAGE, block_q=16, **kw)
            single = attention_t(
                q[brows[at_i : at_i + 1]].contiguous(), k, v, *one, 1, scale, PAGE, block_q=16, **kw
            )
            bits = torch.int16 if dec.element_size() == 2 else torch.int32
            bad_rows = (dec.view(nd, -1).view(bits) != full[rows].view(nd, -1).view(bits)).any(1)
            res[name] = {
                "prefill64_err_f64": _err(full, ref),
                "decode16_vs_prefill64": _mismatch(dec, full[rows]),
                "decode16_vs_prefill64_rows_differing": int(bad_rows.sum()),
                "decode16_vs_prefill64_first_bad_picks": [
                    picks[i] for i in bad_rows.nonzero().flatten()[:10].tolist()
                ],
                "decode64_vs_prefill64": _mismatch(dec64, full[rows]),
                "decode16_vs_decode64": _mismatch(dec, dec64),
                "prefill16_vs_prefill64": _mismatch(full16, full),
                "chunked_prefill_vs_prefill64": _mismatch(ch, full),
                "batch1_vs_batch256": _mismatch(single, big[at_i : at_i + 1]),
                "decode16_maxdiff_vs_prefill64": float((dec.double() - full[rows].double()).abs().max()),
            }
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    return res


def cross_variant_bits(dtype, dev, variants, lengths=(300, 1100), seed=4):
    """Do the stages (not meant to change bits) and TREE give bitwise-equal prefill outputs?"""
    scale = D**-0.5
    q, k, v, table = paged_kv(list(lengths), dtype, dev, seed=seed)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    pmeta = (table, _i32(starts[:-1], dev), _i32(list(lengths), dev), _i32(list(lengths), dev))
    outs = {}
    for name, kw in variants.items():
        try:
            kw = {x: y for x, y in kw.items() if x != "block_q"}
            outs[name] = attention_t(q, k, v, *pmeta, max(lengths), scale, PAGE, block_q=64, **kw)
        except Exception:
            pass
    names = list(outs)
    return {f"{a} vs {b}": _mismatch(outs[a], outs[b]) for i, a in enumerate(names) for b in names[i + 1 :]}


# ----------------------------------------------------------------------------- timing (CUDA)


def _decode_inputs(batch, context, seed=0):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attention_configs import _inputs

    return _inputs(batch, context, seed)


def _prefill_inputs(nseq, length, seed=0):
    q, k, v, table = paged_kv([length] * nseq, torch.bfloat16, torch.device("cuda"), seed=seed)
    dev = q.device
    meta = (
        table,
        _i32([i * length for i in range(nseq)], dev),
        _i32([length] * nseq, dev),
        _i32([length] * nseq, dev),
    )
    return q, k, v, meta


def timing(variants, batches=(1, 64, 256), context=1024, prefill=(8, 1024)):
    from samebits.bench.core import copy_bandwidth

    bw = copy_bandwidth(torch.device("cuda"))
    res = {"copy_bandwidth_GBps": bw / 1e9, "decode": {}, "prefill": {}, "regs": {}}
    scale = D**-0.5

    def bench(fn):
        return 1000 * triton.testing.do_bench(fn, warmup=25, rep=100)

    for b in batches:
        q, k, v, meta = _decode_inputs(b, context)
        floor = 1e6 * 2 * b * context * KVH * D * 2 / bw
        row = {"floor_us": floor}
        ref = at.attention(q, k, v, *meta, 1, scale, PAGE)
        try:
            row["current_default"] = bench(lambda: at.attention(q, k, v, *meta, 1, scale, PAGE))  # noqa: B023
            row["current_whole"] = bench(lambda: at.attention(q, k, v, *meta, 1, scale, PAGE, split=False))  # noqa: B023,E501
        except Exception as e:
            row["current_error"] = f"{type(e).__name__}: {e}"
        for name, kw in variants.items():
            try:
                o = attention_t(q, k, v, *meta, 1, scale, PAGE, **kw)
                row[name] = bench(lambda kw=kw: attention_t(q, k, v, *meta, 1, scale, PAGE, **kw))  # noqa: B023
                row[name + ":maxdiff_vs_current"] = float((o.float() - ref.float()).abs().max())
                if b == max(batches):
                    res["regs"][name] = kernel_info(_LAST.get("kernel"))
            except Exception as e:
                row[name] = f"error {type(e).__name__}: {e}"
        if b == max(batches):
            try:
                res["regs"]["current_whole"] = kernel_info(
                    current_launch_handle(q, k, v, *meta, 1, scale, PAGE)
                )
            except Exception as e:
                res["regs"]["current_whole"] = {"error": f"{type(e).__name__}: {e}"}
        res["decode"][f"B={b}"] = row
        del q, k, v, meta
    nseq, length = prefill
    q, k, v, meta = _prefill_inputs(nseq, length)
    floor = 1e6 * 2 * nseq * length * KVH * D * 2 / bw
    flops = 4 * nseq * H * D * length * (length + 1) / 2  # causal QK^T + PV
    row = {"floor_us": floor, "causal_TFLOP": flops / 1e12}
    row["current"] = bench(lambda: at.attention(q, k, v, *meta, length, scale, PAGE))
    for name, kw in variants.items():
        kw = {x: y for x, y in kw.items() if x != "block_q"}
        try:
            row[name] = bench(lambda kw=kw: attention_t(q, k, v, *meta, length, scale, PAGE, block_q=64, **kw))
        except Exception as e:
            row[name] = f"error {type(e).__name__}: {e}"
    res["prefill"][f"{nseq}x{length}"] = row
    return res


# ----------------------------------------------------------------------------- L_MMA: l from an MMA


def _lmma_kernels() -> dict:
    """name -> fn(q, k, v, meta, max_q_len, block_q): block_q (16 or 64) only for the transposed.
    current = `attention_triton.attention`'s whole path; n_* = its copy here, t_* = `attention_t`."""
    sc = D**-0.5
    return {
        "current": lambda q, k, v, m, n, bq: at.attention(q, k, v, *m, n, sc, PAGE, split=False),
        "n_plain": lambda q, k, v, m, n, bq: attention_n(q, k, v, *m, n, sc, PAGE, l_mma=False),
        "n_lmma": lambda q, k, v, m, n, bq: attention_n(q, k, v, *m, n, sc, PAGE, l_mma=True),
        "t_plain": lambda q, k, v, m, n, bq: attention_t(q, k, v, *m, n, sc, PAGE, block_q=bq),
        "t_lmma": lambda q, k, v, m, n, bq: attention_t(q, k, v, *m, n, sc, PAGE, block_q=bq, l_mma=True),
    }


def _cmp(a, b, picks=None) -> dict:
    """Mismatching elements, rows (of [T, H, D]) and max |diff| of two outputs."""
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    bad = (a.reshape(a.shape[0], -1).view(bits) != b.reshape(b.shape[0], -1).view(bits)).any(1)
    r = {
        "mismatch": _mismatch(a, b),
        "rows": int(bad.sum()),
        "of_rows": a.shape[0],
        "maxdiff": float((a.double() - b.double()).abs().max()),
    }
    if picks is not None:
        r["first_bad_picks"] = [picks[i] for i in bad.nonzero().flatten()[:8].tolist()]
    return r


def lmma_bits(dtype, dev, lengths, positions_per_seq=8, seed=3) -> dict:
    """Bitwise, over `consistency`'s decode rows (the same lengths, seed and picks): decode with
    each kernel's decode tile (transposed 16 rows, normal 64) vs packed prefill (64-row tiles)."""
    kern = _lmma_kernels()
    q, k, v, table = paged_kv(list(lengths), dtype, dev, seed=seed)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    pmeta = (table, _i32(starts[:-1], dev), _i32(list(lengths), dev), _i32(list(lengths), dev))
    picks = _decode_picks(lengths, positions_per_seq, torch.Generator().manual_seed(seed))
    rows = torch.tensor([starts[s] + p for s, p in picks], device=dev)
    nd = len(picks)
    dq = q[rows].contiguous()
    dmeta = (
        table[torch.tensor([s for s, _ in picks], device=dev)].contiguous(),
        _i32(list(range(nd)), dev),
        _i32([1] * nd, dev),
        _i32([p + 1 for _, p in picks], dev),
    )
    ref = ref64(q, k, v, *pmeta, D**-0.5)
    res = {"lengths": list(lengths), "decode_rows": nd, "elements_per_row": H * D, "prefill_err_f64": {}}
    pre, dec, errs = {}, {}, {}
    for name, fn in kern.items():
        try:
            pre[name] = fn(q, k, v, pmeta, max(lengths), 64)
            dec[name] = fn(dq, k, v, dmeta, 1, 16)
            res["prefill_err_f64"][name] = _err(pre[name], ref)
        except Exception as e:
            errs[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    res["errors"] = errs
    pairs = [  # (label, decode of, prefill of): decode rows vs the same rows of a packed prefill
        ("t_lmma dec16 ~ n_lmma prefill", "t_lmma", "n_lmma"),  # the question
        ("n_lmma dec ~ n_lmma prefill", "n_lmma", "n_lmma"),
        ("t_lmma dec16 ~ t_lmma prefill64", "t_lmma", "t_lmma"),
        ("t_plain dec16 ~ current prefill", "t_plain", "current"),  # baseline: l orders differ
        ("t_plain dec16 ~ t_plain prefill64", "t_plain", "t_plain"),
        ("n_plain dec ~ current prefill", "n_plain", "current"),  # the copy: expect 0
    ]
    res["decode_vs_prefill"] = {}
    for label, a, b in pairs:
        if a in dec and b in pre:
            res["decode_vs_prefill"][label] = _cmp(dec[a], pre[b][rows], picks)
    full = [  # whole packed prefills
        ("t_lmma prefill64 ~ n_lmma prefill", "t_lmma", "n_lmma"),
        ("n_plain prefill ~ current prefill", "n_plain", "current"),
        ("n_lmma prefill ~ current prefill", "n_lmma", "current"),  # what L_MMA changes
        ("t_plain prefill64 ~ current prefill", "t_plain", "current"),
    ]
    res["prefill_vs_prefill"] = {}
    for label, a, b in full:
        if a in pre and b in pre:
            res["prefill_vs_prefill"][label] = _cmp(pre[a], pre[b])
    return res


def _accuracy_inputs(dtype, dev, dec_ctx=(1, 64, 300, 700), pre_len=300, n_pre=4):
    """`correctness`'s inputs: decode (one query per sequence of dec_ctx keys) and packed prefill."""
    q_all, k, v, table = paged_kv(list(dec_ctx), dtype, dev, seed=1)
    ends = torch.tensor(dec_ctx).cumsum(0) - 1
    q = q_all[ends.to(dev)].contiguous()
    nb = len(dec_ctx)
    dmeta = (table, _i32(list(range(nb)), dev), _i32([1] * nb, dev), _i32(list(dec_ctx), dev))
    pq, pk, pv, ptable = paged_kv([pre_len] * n_pre, dtype, dev, seed=2)
    pmeta = (
        ptable,
        _i32([i * pre_len for i in range(n_pre)], dev),
        _i32([pre_len] * n_pre, dev),
        _i32([pre_len] * n_pre, dev),
    )
    return (q, k, v, dmeta), (pq, pk, pv, pmeta, pre_len)


def lmma_accuracy(dtype, dev, **kw) -> dict:
    """Max |error| vs float64 of every kernel: decode B=4 (transposed: 16-row tiles) and
    packed prefill (4 x 300 by default; transposed: 64-row tiles)."""
    (q, k, v, dmeta), (pq, pk, pv, pmeta, pre_len) = _accuracy_inputs(dtype, dev, **kw)
    dref = ref64(q, k, v, *dmeta, D**-0.5)
    pref = ref64(pq, pk, pv, *pmeta, D**-0.5)
    res = {}
    for name, fn in _lmma_kernels().items():
        try:
            od = fn(q, k, v, dmeta, 1, 16)
            op = fn(pq, pk, pv, pmeta, pre_len, 64)
            res[name] = {
                "decode_err_f64": _err(od, dref),
                "prefill_err_f64": _err(op, pref),
                "finite": bool(torch.isfinite(od).all() and torch.isfinite(op).all()),
            }
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
    return res


CROSS_PAIRS = (  # decode vs decode, the two orientations (and the copy)
    ("t_plain", "current"),
    ("t_lmma", "n_lmma"),
    ("n_plain", "current"),
    ("n_lmma", "current"),
)


def lmma_cross_decode(dtype, dev, batches=(64, 256), context=1024) -> dict:
    """Decode vs decode across orientations at B=4 (`correctness`'s set) and, on CUDA, the
    timing inputs at `batches`: do the mismatches of t_plain ~ current vanish for t_lmma ~ n_lmma?"""
    sets = {"B=4": _accuracy_inputs(dtype, dev)[0]}
    if dev.type == "cuda":
        for b in batches:
            q, k, v, meta = _decode_inputs(b, context)
            sets[f"B={b}"] = (q, k, v, meta)
    kern = _lmma_kernels()
    res = {}
    for sname, (q, k, v, meta) in sets.items():
        outs, row = {}, {}
        for name, fn in kern.items():
            try:
                outs[name] = fn(q, k, v, meta, 1, 16)
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"
        for a, b in CROSS_PAIRS:
            if a in outs and b in outs:
                row[f"{a} ~ {b}"] = _cmp(outs[a], outs[b])
        res[sname] = row
    return res


def lmma_timing(batches=(1, 64, 256), context=1024, prefill=(8, 1024)) -> dict:
    """us per call (do_bench): decode (current default and whole, t_plain, t_lmma, n_lmma),
    prefill (current, n_plain, n_lmma, t_lmma); registers of every kernel at the largest batch."""
    from samebits.bench.core import copy_bandwidth

    bw = copy_bandwidth(torch.device("cuda"))
    sc = D**-0.5
    kern = _lmma_kernels()
    res = {"copy_bandwidth_GBps": bw / 1e9, "decode": {}, "prefill": {}, "regs": {}}

    def bench(fn):
        return 1000 * triton.testing.do_bench(fn, warmup=25, rep=100)

    for b in batches:
        q, k, v, meta = _decode_inputs(b, context)
        row = {"floor_us": 1e6 * 2 * b * context * KVH * D * 2 / bw}
        try:
            row["current_default"] = bench(lambda: at.attention(q, k, v, *meta, 1, sc, PAGE))  # noqa: B023
        except Exception as e:
            row["current_default"] = f"error {type(e).__name__}: {e}"
        for name in ("current", "t_plain", "t_lmma", "n_lmma"):
            fn = kern[name]
            try:
                fn(q, k, v, meta, 1, 16)
                if b == max(batches):
                    if name == "current":
                        res["regs"]["current_whole"] = kernel_info(
                            current_launch_handle(q, k, v, *meta, 1, sc, PAGE)
                        )
                    else:
                        res["regs"][name] = kernel_info(_LAST.get("kernel"))
                row[name if name != "current" else "current_whole"] = bench(
                    lambda fn=fn: fn(q, k, v, meta, 1, 16)  # noqa: B023
                )
            except Exception as e:
                row[name] = f"error {type(e).__name__}: {e}"
        res["decode"][f"B={b}"] = row
        del q, k, v, meta
    nseq, length = prefill
    q, k, v, meta = _prefill_inputs(nseq, length)
    row = {"floor_us": 1e6 * 2 * nseq * length * KVH * D * 2 / bw}
    for name in ("current", "n_plain", "n_lmma", "t_lmma"):
        fn = kern[name]
        try:
            fn(q, k, v, meta, length, 64)
            if name == "n_lmma":
                res["regs"]["n_lmma_prefill"] = kernel_info(_LAST.get("kernel"))
            row[name] = bench(lambda fn=fn: fn(q, k, v, meta, length, 64))
        except Exception as e:
            row[name] = f"error {type(e).__name__}: {e}"
    res["prefill"][f"{nseq}x{length}"] = row
    return res


def lmma_section(dtype, dev, lengths, timing_on=True, out=None, doc=None, **bits_kw) -> dict:
    """The L_MMA experiment: probe, bits, cross-orientation decode, accuracy, timing; each
    part in try/except, the JSON (doc[\"lmma\"]) rewritten after each when `out` is given."""
    res = {} if doc is None else doc.setdefault("lmma", {})
    parts = [
        ("probe", lambda: mma_probe(dtype, dev, tiles=64 if dev.type == "cuda" else 2)),
        ("bits", lambda: lmma_bits(dtype, dev, lengths, **bits_kw)),
        ("cross_decode", lambda: lmma_cross_decode(dtype, dev)),
        ("accuracy", lambda: lmma_accuracy(dtype, dev)),
    ]
    if timing_on:
        parts.append(("timing", lmma_timing))
    for name, fn in parts:
        try:
            res[name] = fn()
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        if out is not None:
            with open(out, "w") as f:
                json.dump(doc if doc is not None else {"lmma": res}, f, indent=1)
    return res


def summarize_lmma(r: dict) -> None:
    """A compact print of the L_MMA section."""
    print("== lmma (l as an MMA product: n = normal orientation copy, t = transposed)")
    for part in ("probe", "bits", "cross_decode", "accuracy", "timing"):
        x = r.get(part)
        if x is None:
            continue
        if isinstance(x, dict) and isinstance(x.get("error"), str):
            print(f"  {part}: ERROR {x['error'].splitlines()[0][:200]}")
            continue
        if part == "probe":
            cells = [f"{k[:-9]}={v}" for k, v in x.items() if k.endswith("_mismatch")]
            print(f"  probe (mismatching elements, n vs t MMA): {', '.join(cells)};"
                  f" L vs fp32 sum maxdiff {x['L_vs_fp32_sum_maxdiff']:.3g}")  # fmt: skip
        elif part == "bits":
            print(f"  bits: lengths {x['lengths']}, {x['decode_rows']} decode rows x {x['elements_per_row']}")
            for name, e in x["errors"].items():
                print(f"    {name}: ERROR {e.splitlines()[0][:200]}")
            for group in ("decode_vs_prefill", "prefill_vs_prefill"):
                for label, c in x[group].items():
                    bad = f", first bad {c['first_bad_picks']}" if c.get("first_bad_picks") else ""
                    print(f"    {label}: {c['mismatch']} elements, {c['rows']}/{c['of_rows']} rows,"
                          f" maxdiff {c['maxdiff']:.3g}{bad}")  # fmt: skip
            print("    prefill err_f64: " + ", ".join(f"{k}={v:.3g}" for k, v in x["prefill_err_f64"].items()))
        elif part == "cross_decode":
            for sname, row in x.items():
                cells = [
                    f"{k}: {v['mismatch']} el/{v['rows']} rows (max {v['maxdiff']:.2g})"
                    if isinstance(v, dict)
                    else f"{k}: {v}"
                    for k, v in row.items()
                ]
                print(f"  cross decode {sname}: " + "; ".join(cells))
        elif part == "accuracy":
            for name, a in x.items():
                print(
                    f"  accuracy {name}: " + ", ".join(f"{k}={_short(v)}" for k, v in a.items() if k != "trace")
                )
        elif part == "timing":
            print(f"  timing (us), copy bandwidth {x['copy_bandwidth_GBps']:.0f} GB/s")
            for group in ("decode", "prefill"):
                for shape, row in x[group].items():
                    print(f"    {group} {shape}: " + ", ".join(f"{k}={_short(v)}" for k, v in row.items()))
            for name, ri in x["regs"].items():
                print(f"    regs {name}: " + ", ".join(f"{k}={v}" for k, v in ri.items()))


# ----------------------------------------------------------------------------- main


CONSISTENCY_LENGTHS = (1, 2, 37, 64, 65, 255, 256, 257, 300, 513, 777, 1024, 1100)
VARIANTS = {f"t_s{s}_tree{int(tr)}": dict(num_stages=s, tree=tr) for tr in (False, True) for s in (2, 3)}


def _short(x):
    if isinstance(x, dict) and "error" in x:
        return "ERROR " + x["error"].splitlines()[0][:160]
    if isinstance(x, float):
        return f"{x:.3g}"
    if isinstance(x, str) and x.startswith("error"):
        return x.splitlines()[0][:60]
    return str(x)


def summarize(step: str, r: dict) -> None:
    """A compact print of one step (the JSON keeps everything)."""
    if "error" in r and isinstance(r.get("error"), str):
        print(f"== {step}: {_short(r)}")
        return
    print(f"== {step}")
    if step == "correctness":
        for name, x in r.items():
            if "error" in x:
                print(f"  {name}: {_short(x)}")
            else:
                print("  " + name + ": " + ", ".join(f"{k}={_short(v)}" for k, v in x.items()))
    elif step == "consistency":
        print(f"  lengths {r['lengths']}, {r['decode_rows']} decode rows x {r['elements_per_row']} elements;"
              " mismatching elements (0 = bitwise equal):")  # fmt: skip
        for name, x in r.items():
            if not isinstance(x, dict):
                continue
            if "error" in x:
                print(f"  {name}: {_short(x)}")
                continue
            bad = x["decode16_vs_prefill64_rows_differing"]
            print(f"  {name}: dec16~pre64 {x['decode16_vs_prefill64']} ({bad} rows,"
                  f" maxdiff {x['decode16_maxdiff_vs_prefill64']:.3g}),"
                  f" dec64~pre64 {x['decode64_vs_prefill64']},"
                  f" dec16~dec64 {x['decode16_vs_decode64']}, pre16~pre64 {x['prefill16_vs_prefill64']},"
                  f" chunked~pre64 {x['chunked_prefill_vs_prefill64']},"
                  f" batch1~batch{r['big_batch']} {x['batch1_vs_batch256']},"
                  f" err_f64 {x['prefill64_err_f64']:.3g}")  # fmt: skip
            if x["decode16_vs_prefill64_first_bad_picks"]:
                print(f"    first differing (seq, pos): {x['decode16_vs_prefill64_first_bad_picks']}")
    elif step == "cross_variant_bits":
        for pair, n in r.items():
            print(f"  {pair}: {n} mismatching")
    elif step == "timing":
        print(f"  copy bandwidth {r['copy_bandwidth_GBps']:.0f} GB/s; us per call")
        for group in ("decode", "prefill"):
            for shape, row in r[group].items():
                cells = [f"{k}={_short(v)}" for k, v in row.items() if not k.endswith("maxdiff_vs_current")]
                print(f"  {group} {shape}: " + ", ".join(cells))
        for name, x in r["regs"].items():
            print(f"  regs {name}: " + ", ".join(f"{k}={v}" for k, v in x.items()))
    else:
        print(json.dumps(r, indent=1)[:3000])


def interpret_check() -> dict:
    """Small correctness checks on Triton's CPU interpreter (float16; bits not meaningful)."""
    if not _INTERPRET:
        raise SystemExit("--interpret-check needs TRITON_INTERPRET=1")
    dev = torch.device("cpu")
    variants = {"t_tree0": dict(tree=False), "t_tree1": dict(tree=True)}
    out = {
        "correctness": correctness(
            torch.float16, dev, variants, dec_ctx=(1, 64, 300, 600), pre_len=300, n_pre=2
        ),
        "consistency": consistency(torch.float16, dev, variants, lengths=(1, 70, 300, 530), positions_per_seq=2,
                                   batch_big=8),
    }  # fmt: skip
    for name, r in out.items():
        summarize(name, r)
    return out


def interpret_check_lmma(lengths=(1, 70, 300, 530)) -> dict:
    """The L_MMA section on the interpreter (float16, no timing) plus a tolerance check vs float64:
    each kernel's error at most twice the current kernel's plus 1e-3."""
    if not _INTERPRET:
        raise SystemExit("--interpret-check needs TRITON_INTERPRET=1")
    r = lmma_section(torch.float16, torch.device("cpu"), lengths, timing_on=False, positions_per_seq=2)
    acc = r.get("accuracy", {})
    cur = acc.get("current", {})
    bits = r.get("bits", {})
    checks = {}
    for name, a in acc.items():
        for key in ("decode_err_f64", "prefill_err_f64"):
            if key in a and key in cur:
                checks[f"{name}:{key}"] = a[key] <= 2 * cur[key] + 1e-3
            else:
                checks[f"{name}:{key}"] = False
    for name, e in bits.get("prefill_err_f64", {}).items():
        checks[f"{name}:bits_prefill_err_f64"] = e <= 2 * bits["prefill_err_f64"].get("current", 0) + 1e-3
    r["tolerance_checks"] = checks
    summarize_lmma(r)
    print(f"  tolerance checks: {sum(checks.values())}/{len(checks)} pass"
          + "".join(f"\n    FAIL {k}" for k, ok in checks.items() if not ok))  # fmt: skip
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="attention_transposed.json")
    p.add_argument("--interpret-check", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--only-lmma", action="store_true", help="only the L_MMA section (the one to run now)")
    p.add_argument("--skip-old", action="store_true", help="with --interpret-check: only the L_MMA part")
    args = p.parse_args()
    if args.interpret_check:
        res = {} if args.only_lmma or args.skip_old else interpret_check()
        res["lmma"] = interpret_check_lmma()
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return
    dev = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}
    try:  # the new section first; it rewrites the JSON after each of its parts
        lmma_section(
            torch.bfloat16, dev, CONSISTENCY_LENGTHS, timing_on=not args.skip_timing, out=args.out, doc=res
        )
    except Exception as e:
        res["lmma_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    summarize_lmma(res.get("lmma", {}))
    if args.only_lmma:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")
        return
    steps = [  # the key result first: a timeout later keeps it
        ("consistency", lambda: consistency(
            torch.bfloat16, dev, VARIANTS, lengths=CONSISTENCY_LENGTHS)),
        ("correctness", lambda: correctness(torch.bfloat16, dev, VARIANTS)),
    ]  # fmt: skip
    if not args.skip_timing:
        steps.append(("timing", lambda: timing(VARIANTS)))
    steps.append(("cross_variant_bits", lambda: cross_variant_bits(torch.bfloat16, dev, VARIANTS)))
    for name, fn in steps:
        try:
            res[name] = fn()
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        with open(args.out, "w") as f:  # written after every step: a crash later keeps the rest
            json.dump(res, f, indent=1)
        summarize(name, res[name])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
