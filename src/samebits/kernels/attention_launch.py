"""The host side of the CUDA attention kernels (`attention_triton.py`): their launcher.

`attention` checks the inputs (`check_attention_inputs`), takes the path from
`attention_plan.plan` (or the caller's overrides, for experiments), sizes the grid and the
split path's per-chunk statistics, and launches `attention_kernel` (and, for a split call
merged in a second launch, `combine_kernel`). The MERGE_LAST ticket counters are one
allocation per device (`_tickets`). `paged_attention` is the same call with the arguments
of the op `samebits::paged_attention`: its CUDA implementation (`samebits.model.attention`).

Shapes: T = query tokens, H = query heads, KVH = kv heads, G = H // KVH,
D = head dim, B = sequences.
"""

from __future__ import annotations

import os

import torch

from samebits.kernels.attention_plan import BLOCK_M, plan
from samebits.kernels.attention_triton import BLOCK_N, CHUNK, NUM_WARPS, attention_kernel, combine_kernel
from samebits.kernels.device_facts import sm_count
from samebits.kernels.grid import cdiv, next_power_of_2
from samebits.kernels.pdl import launch_args

_DTYPES = (torch.bfloat16, torch.float16)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (development only)
_TICKETS: dict[int, torch.Tensor] = {}  # CUDA device index (-1: the interpreter's CPU) -> counters
TICKETS = 1024  # counters per device: a split call has sequences x kv heads < the SMs


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    """The MERGE_LAST counters of `device`: zeros, put back to zero by every call that used
    them (by the last program of each sequence and kv head), so one allocation serves every
    later call, CUDA graph replays included (the engine runs each size eagerly before it
    captures it, so the allocation is not captured; a first split call inside a capture is
    refused, since the zeros would only be written on replay). Split calls on one device must
    not run at once on two streams: the engine's decode runs on one."""
    if n > TICKETS:
        raise ValueError(f"attention: a split call of {n} (sequence, kv head) pairs exceeds {TICKETS} tickets")
    if device.type != "cuda":
        key = -1  # Triton's CPU interpreter
    else:
        key = device.index if device.index is not None else torch.cuda.current_device()
    buf = _TICKETS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "attention: the first split decode call on this device is inside a CUDA graph capture; "
                "run one call eagerly first (the engine warms each size up before capturing it)"
            )
        buf = _TICKETS[key] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return buf


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
    chunk: int = CHUNK,
    split: bool | None = None,
    transposed: bool | None = None,
    l_by_mma: bool = True,
    merge_last: bool | None = None,
    launch: tuple[int, int] | None = None,
    rows: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query over its own sequence's keys 0..p -> [T, H, D].

    Query i of sequence b sits at position ctx_len[b] - q_len[b] + i. The K/V of
    this call's tokens must already be in the cache. Rows of T that belong to no
    sequence are left untouched in `out`. `split`: compute the chunks in parallel programs
    and merge them in the last of them to finish (or a second launch: `merge_last`);
    `transposed`: tiles of BLOCK_Q rows with the keys on the MMA's M. Both give the same
    bits; None leaves the choice to `attention_plan.plan` (transposed for decode at the head
    layout where that was compared, split below the SM count's programs). `block_n`, `chunk`
    and `l_by_mma` (False: row sums by `tl.sum`) exist for experiments and negative controls:
    the engine and the trainer always use the defaults.
    `merge_last` (a split call): merge the chunks in the last chunk program to finish rather
    than in a second launch (`attention_kernel`'s MERGE_LAST; the same bits); None: the plan's.
    `launch`: (num_warps, num_stages) instead of the plan's (experiments; the same bits at the
    compared layout). `rows`: (token, head) rows of a normal-orientation tile instead of the
    plan's (experiments; a power of two of at least the padded group).
    """
    check_attention_inputs(q, k_cache, v_cache)
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    g = h // kvh
    for name, x in (("block_table", block_table), ("q_start", q_start), ("q_len", q_len), ("ctx_len", ctx_len)):
        if x.dtype != torch.int32 or x.device != q.device:
            raise ValueError(f"attention: {name} must be int32 on {q.device}, got {x.dtype} on {x.device}")
    if chunk % block_n:
        raise ValueError(f"attention: chunk ({chunk}) must be a multiple of block_n ({block_n})")
    if out is None:
        out = torch.empty_like(q)
    b = q_len.shape[0]
    if t == 0 or b == 0 or max_q_len == 0:
        return out
    block_d = max(16, next_power_of_2(d))
    path = plan(max_q_len, b, kvh, g, d, q.dtype, sm_count(q.device), split, transposed)
    split, transposed = path.split, path.transposed
    if rows is not None and transposed:
        raise ValueError("attention: `rows` applies to normal-orientation tiles; pass transposed=False with it")
    if rows is None:
        rows, tokens_per_tile = path.rows, path.tokens_per_tile
    else:
        g_pad = next_power_of_2(g)
        if rows & (rows - 1) or rows < g_pad:
            raise ValueError(f"attention: rows must be a power of two of at least {g_pad}, got {rows}")
        tokens_per_tile = rows // g_pad
        if split:
            raise ValueError("attention: `rows` applies to calls in one program per tile, not split calls")
    warps, stages = launch or (path.warps, path.stages)
    chunks = cdiv(block_table.shape[1] * page_size, chunk)  # a bound on any sequence's chunks
    merge_last = split and (path.merge_last if merge_last is None else merge_last)
    if split:
        part_m = torch.empty(t, chunks, h, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(t, chunks, h, d, dtype=torch.float32, device=q.device)
        grid = (b, chunks, kvh)
    else:
        part_m = part_l = part_acc = out  # not read
        grid = (b, cdiv(max_q_len, tokens_per_tile), kvh)
    tickets = _tickets(q.device, b * kvh) if merge_last else part_m  # not read unless merge_last
    shape = dict(G=g, G_PAD=next_power_of_2(g), D=d, BLOCK_D=block_d, CHUNK=chunk)
    attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, q_start, q_len, ctx_len, part_m, part_l, part_acc, chunks,
        tickets, scale, page_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0),
        ROWS=rows, BLOCK_N=block_n, SPLIT=split, TRANSPOSED=transposed, L_MMA=l_by_mma, MERGE_LAST=merge_last,
        num_warps=warps, num_stages=stages, enable_fp_fusion=False, **shape, **launch_args(q.device),
    )  # fmt: skip
    if split and not merge_last:
        combine_kernel[(b, kvh)](
            out, q_start, q_len, ctx_len, part_m, part_l, part_acc, chunks, out.stride(0), out.stride(1),
            BLOCK_M=BLOCK_M, num_warps=NUM_WARPS, enable_fp_fusion=False, **shape, **launch_args(q.device),
        )  # fmt: skip
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
    if next_power_of_2(h // kvh) > BLOCK_M:
        raise ValueError(f"attention (Triton) supports at most {BLOCK_M} query heads per kv head")
    if d > 256:
        raise ValueError(f"attention (Triton) supports head_dim <= 256, got {d}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1:
            raise ValueError(f"attention (Triton): {name} must be contiguous in head_dim")
