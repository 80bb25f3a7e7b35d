"""Causal attention with one numerics for every path (portable torch, CPU).

Each query row at position p reduces over its keys 0..p with fixed-order
pairwise trees (`tree_sum_ref`) padded with -0.0: q.k over D, the softmax
denominator and p.v over keys. Keys past p are set to -0.0, exactly what the
padding is, so a row's bits are the same whether it is computed in a packed
trainer forward, in a prefill chunk over cached KV, or alone in decode, and
whatever the padded width of the batch. Scores, softmax and p.v are fp32.

`paged_attention_ref` is the portable side of the one attention op (the Triton
kernel is the other): it gathers each sequence's keys through its block table and
runs `attention_ref` over them. The packed backward (gradients carry no bitwise
contract) is autograd through `attention_ref` per sequence, or sdpa's on CUDA.

Shapes: B = groups (sequences), R = query rows, L = keys, H = query heads,
KVH = kv heads, G = H // KVH, D = head dim.
"""

from __future__ import annotations

import torch

from samebits.kernels.reduce import tree_sum_ref

# Bound on the elements of one [B, R, H, L, D] product chunk (fp32).
_CHUNK_ELEMS = 1 << 24


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, R, H, D], k/v [B, L, KVH, D], q_pos [B, R] (key j visible iff j <= q_pos) -> [B, R, H, D]."""
    b, r, h, d = q.shape
    kvh, length = k.shape[2], k.shape[1]
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kvh})")
    per_row = max(1, b * h * length * d)
    step = max(1, _CHUNK_ELEMS // per_row)
    outs = [_attend(q[:, s : s + step], k, v, q_pos[:, s : s + step], scale) for s in range(0, r, step)]
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _attend(q, k, v, q_pos, scale):
    b, r, h, d = q.shape
    kvh, length = k.shape[2], k.shape[1]
    g = h // kvh
    qf = q.float().view(b, r, kvh, g, 1, d)
    kf = k.float().permute(0, 2, 1, 3).reshape(b, 1, kvh, 1, length, d)
    vf = v.float().permute(0, 2, 1, 3).reshape(b, 1, kvh, 1, length, d)
    visible = torch.arange(length, device=q.device).view(1, 1, length) <= q_pos.unsqueeze(-1)
    visible = visible.view(b, r, 1, 1, length)  # [B, R, 1, 1, L]
    scores = tree_sum_ref(qf * kf, dim=-1) * scale  # [B, R, KVH, G, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    e = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    e = e.masked_fill(~visible, -0.0)
    p = e / tree_sum_ref(e, dim=-1, keepdim=True)
    pv = (p.unsqueeze(-1) * vf).masked_fill(~visible.unsqueeze(-1), -0.0)  # [B, R, KVH, G, L, D]
    out = tree_sum_ref(pv, dim=-2)  # [B, R, KVH, G, D]
    return out.reshape(b, r, h, d).to(q.dtype)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """`attention_ref` with keys read through a block table, the Triton kernel's contract.

    q [T, H, D]; k_cache/v_cache [slots, KVH, D]; block_table [B, P]: key j of sequence b sits
    at slot `block_table[b, j // block_size] * block_size + j % block_size`; query_start_loc
    [B + 1], query_lens [B], seq_lens [B] (keys after this step). Query i of sequence b is row
    query_start_loc[b] + i of T at position seq_lens[b] - query_lens[b] + i. -> [T, H, D],
    rows of T outside every sequence 0. Keys are gathered to the table's width (P * block_size)
    and past each row's position count as -0.0, so the bits are `attention_ref`'s over the
    sequence's own keys, whatever the pages and the batch.
    """
    if max_query_len == 0 or q.shape[0] == 0:
        return q.new_zeros(q.shape)
    width = block_table.shape[1] * block_size
    key = torch.arange(width, device=q.device)
    slots = block_table.long()[:, key // block_size] * block_size + key % block_size  # [B, L]
    r = torch.arange(max_query_len, device=q.device)
    query_lens = query_lens.long()
    in_chunk = r[None, :] < query_lens[:, None]  # [B, R]
    rows = torch.where(in_chunk, query_start_loc[:-1, None].long() + r, 0)  # [B, R] row in T
    q_pos = torch.where(in_chunk, (seq_lens.long() - query_lens)[:, None] + r, 0)  # [B, R]
    out = attention_ref(q[rows], k_cache[slots], v_cache[slots], q_pos, scale)  # [B, R, H, D]
    result = q.new_zeros(q.shape)
    result[rows[in_chunk]] = out[in_chunk]
    return result


def segment_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[S] positions of one packed row -> (start, end) of each sequence.

    A sequence starts where positions do not continue the previous one (HF
    detects packing the same way, from positions restarting).
    """
    pos = position_ids.tolist()
    starts = [i for i in range(len(pos)) if i == 0 or pos[i] != pos[i - 1] + 1]
    return list(zip(starts, [*starts[1:], len(pos)], strict=True))


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention within packed sequences.

    q [S, H, D], k/v [S, KVH, D], position_ids [S] (restarting per sequence) -> [S, H, D].
    Each sequence's keys are its own tokens; query i attends to keys 0..i of its sequence.
    """
    outs = []
    for start, end in segment_bounds(position_ids):
        n = end - start
        local = torch.arange(n, device=q.device).view(1, n)
        outs.append(attention_ref(q[None, start:end], k[None, start:end], v[None, start:end], local, scale)[0])
    return torch.cat(outs, dim=0)


def _segments(query_start_loc: list[int]) -> list[tuple[int, int]]:
    return list(zip(query_start_loc[:-1], query_start_loc[1:], strict=True))


def packed_attention_backward_ref(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: list[int],
    scale: float,
) -> list[torch.Tensor]:
    """Gradients of packed causal attention (each sequence its own keys), by autograd through
    `attention_ref` per sequence. q [S, H, D], k/v [S, KVH, D], grad_out [S, H, D],
    query_start_loc [B + 1] on the host -> [dq, dk, dv]."""
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for start, end in _segments(query_start_loc):
        parts = [t[None, start:end].detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            local = torch.arange(end - start, device=q.device).view(1, -1)
            out = attention_ref(*parts, local, scale)
            got = torch.autograd.grad(out, parts, grad_out[None, start:end])
        for g, part in zip(grads, got, strict=True):
            g[start:end] = part[0]
    return grads


_FLASH_DTYPES = (torch.bfloat16, torch.float16)


def packed_attention_backward_flash(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: list[int],
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """`packed_attention_backward_ref`'s contract in two launches for every sequence at once:
    flash attention's variable-length forward (its output and log-sum-exp, which the backward
    needs and samebits' forward does not keep) and backward, over the packed rows with their
    K/V heads as they are (flash takes grouped heads). `cu_seqlens`: `query_start_loc` as int32
    on the device (the batch has it), so nothing is copied to the device here. bf16/fp16,
    head_dim a multiple of 8 up to 256, the rows exactly the sequences (flash needs sm80+, as
    samebits' Triton kernels do); anything else takes `packed_attention_backward_sdpa`: one sdpa
    per sequence, about 20 host launches each, which bounded the trainer's update."""
    d = q.shape[-1]
    rows_are_sequences = query_start_loc[0] == 0 and query_start_loc[-1] == q.shape[0]
    if q.dtype not in _FLASH_DTYPES or d % 8 or d > 256 or not rows_are_sequences:
        return packed_attention_backward_sdpa(grad_out, q, k, v, query_start_loc, scale)
    if cu_seqlens is None:
        cu_seqlens = torch.tensor(query_start_loc, dtype=torch.int32, device=q.device)
    longest = max(e - s for s, e in _segments(query_start_loc))
    q, k, v, grad_out = (t.contiguous() for t in (q, k, v, grad_out))
    aten = torch.ops.aten
    lens = (cu_seqlens, cu_seqlens, longest, longest, 0.0, True)  # q and k bounds, longest; no dropout; causal
    out, lse, seed, offset, _ = aten._flash_attention_forward(q, k, v, *lens, False, scale=scale)
    dq, dk, dv = aten._flash_attention_backward(grad_out, q, k, v, out, lse, *lens, seed, offset, scale=scale)
    return [dq, dk, dv]


def packed_attention_backward_sdpa(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: list[int],
    scale: float,
) -> list[torch.Tensor]:
    """`packed_attention_backward_ref`'s contract through sdpa's backward (gradients carry no
    bitwise contract; this is the fast one on CUDA). Inputs are 4-d and K/V heads repeated to
    the query heads, so sdpa can take a fused kernel (3-d or `enable_gqa` inputs run math)."""
    group = q.shape[1] // k.shape[1]
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for start, end in _segments(query_start_loc):
        parts = [
            t[None, start:end].transpose(1, 2).detach().requires_grad_() for t in (q, k, v)
        ]  # [1, heads, n, D]
        with torch.enable_grad():
            kv = [t.repeat_interleave(group, dim=1) for t in parts[1:]]  # [1, H, n, D]
            out = torch.nn.functional.scaled_dot_product_attention(parts[0], *kv, is_causal=True, scale=scale)
            got = torch.autograd.grad(out, parts, grad_out[None, start:end].transpose(1, 2))
        for g, part in zip(grads, got, strict=True):
            g[start:end] = part[0].transpose(0, 1)
    return grads
