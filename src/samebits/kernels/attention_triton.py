"""Batch-invariant causal attention for CUDA: one Triton kernel for every path.

Prefill over packed sequences, chunked prefill over cached KV, decode and the
trainer's packed forward all launch `attention_kernel` with the same
compile-time configuration. A program owns BLOCK_M rows = (query tokens x the
query heads of one kv head) of one sequence and walks that sequence's keys from
key 0 up in BLOCK_N blocks (flash-style online softmax, fp32 statistics and
accumulator). Blocks start at key 0 whatever the path, so a query row at
position p always meets the same blocks with the same masks; a block wholly past
p is an exact no-op for that row (its max is unchanged, so the rescale factor
is 1.0 and it adds zeros). A row's bits therefore depend on its own query, its
own keys 0..p and nothing else: not the batch, not the chunking, not the rows
sharing its tile. No split-KV.

Keys are read through a page table: key j of sequence b sits at slot
`block_table[b, j // page_size] * page_size + j % page_size` of a
[slots, KVH, D] cache. The trainer passes its packed K/V as a cache with
page_size 1. `paged_attention_ref` in `attention.py` is the portable (CPU)
version of the same contract; the two use different reduction trees and are
compared with a tolerance, each against float64. Both are reached through the
one op `samebits::paged_attention` (`samebits.model.attention`).

Shapes: T = query tokens, H = query heads, KVH = kv heads, G = H // KVH,
D = head dim, B = sequences.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 64, 4, 2
_DTYPES = (torch.bfloat16, torch.float16)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (development only)


@triton.jit
def attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    block_table_ptr,
    q_start_ptr,
    q_len_ptr,
    ctx_len_ptr,
    scale,
    page_size,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    TOKENS: tl.constexpr = BLOCK_M // G_PAD
    q_len = tl.load(q_len_ptr + b)
    if tile * TOKENS >= q_len:
        return
    q_start = tl.load(q_start_ptr + b)
    ctx_len = tl.load(ctx_len_ptr + b)
    rows = tl.arange(0, BLOCK_M)
    tok = tile * TOKENS + rows // G_PAD  # query index within this sequence's chunk
    head = kvh * G + rows % G_PAD
    valid = (tok < q_len) & (rows % G_PAD < G)
    pos = tl.where(valid, ctx_len - q_len + tok, 0)  # [BLOCK_M]; padding rows see key 0 only
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=valid[:, None] & (d[None, :] < D),
        other=0.0,
    )
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    hi = ctx_len - q_len + (tile + 1) * TOKENS  # keys any row of the tile sees
    if hi > ctx_len:
        hi = ctx_len
    for start in range(0, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        in_ctx = keys < hi
        page = tl.load(block_table_ptr + b * stride_bt + keys // page_size, mask=in_ctx, other=0)
        slot = (page * page_size + keys % page_size).to(tl.int64)
        kv_mask = in_ctx[:, None] & (d[None, :] < D)
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N] fp32
        s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=valid[:, None] & (d[None, :] < D),
    )


def attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [slots, KVH, D]
    v_cache: torch.Tensor,  # [slots, KVH, D]
    block_table: torch.Tensor,  # [B, pages] int32
    q_start: torch.Tensor,  # [B] int32: row in T of each sequence's first query
    q_len: torch.Tensor,  # [B] int32: queries of each sequence in this call
    ctx_len: torch.Tensor,  # [B] int32: keys of each sequence, its queries included
    max_q_len: int,
    scale: float,
    page_size: int,
    out: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """Causal attention of every query over its own sequence's keys 0..p -> [T, H, D].

    Query i of sequence b sits at position ctx_len[b] - q_len[b] + i. The K/V of
    this call's tokens must already be in the cache. Rows of T that belong to no
    sequence are left untouched in `out`. `block_n` exists for experiments and negative
    controls: the engine and the trainer always use BLOCK_N.
    """
    check_attention_inputs(q, k_cache, v_cache)
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    g = h // kvh
    g_pad = triton.next_power_of_2(g)
    for name, x in (("block_table", block_table), ("q_start", q_start), ("q_len", q_len), ("ctx_len", ctx_len)):
        if x.dtype != torch.int32 or x.device != q.device:
            raise ValueError(f"attention: {name} must be int32 on {q.device}, got {x.dtype} on {x.device}")
    if out is None:
        out = torch.empty_like(q)
    b = q_len.shape[0]
    if t == 0 or b == 0 or max_q_len == 0:
        return out
    tokens_per_tile = BLOCK_M // g_pad
    grid = (b, triton.cdiv(max_q_len, tokens_per_tile), kvh)
    attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_table,
        q_start,
        q_len,
        ctx_len,
        scale,
        page_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        G=g,
        G_PAD=g_pad,
        D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [slots, KVH, D]
    v_cache: torch.Tensor,  # [slots, KVH, D]
    block_table: torch.Tensor,  # [B, pages] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    query_lens: torch.Tensor,  # [B] int32
    seq_lens: torch.Tensor,  # [B] int32
    max_query_len: int,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """`attention` with the arguments of `samebits::paged_attention` (and of
    `paged_attention_ref`): the CUDA implementation of that op."""
    return attention(
        q,
        k_cache,
        v_cache,
        block_table,
        query_start_loc[:-1],
        query_lens,
        seq_lens,
        max_query_len,
        scale,
        block_size,
    )


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q [T, H, D] and k/v [S, KVH, D] suit `attention_kernel`."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if not (q.is_cuda and k.is_cuda and v.is_cuda) and not _INTERPRET:
        raise ValueError("attention (Triton) needs CUDA tensors; use attention_ref on the CPU")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention (Triton) needs q, k, v of one dtype in {_DTYPES}, got {q.dtype}")
    h, kvh, d = q.shape[1], k.shape[1], q.shape[2]
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kvh})")
    if triton.next_power_of_2(h // kvh) > BLOCK_M:
        raise ValueError(f"attention (Triton) supports at most {BLOCK_M} query heads per kv head")
    if d > 256:
        raise ValueError(f"attention (Triton) supports head_dim <= 256, got {d}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1:
            raise ValueError(f"attention (Triton): {name} must be contiguous in head_dim")
