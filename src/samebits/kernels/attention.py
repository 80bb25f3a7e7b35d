"""Causal attention with one numerics for every path (portable torch, CPU).

Each query row at position p reduces over its keys 0..p with fixed-order
pairwise trees (`tree_sum_ref`) padded with -0.0: q.k over D, the softmax
denominator and p.v over keys. Keys past p are set to -0.0, exactly what the
padding is, so a row's bits are the same whether it is computed in a packed
trainer forward, in a prefill chunk over cached KV, or alone in decode, and
whatever the padded width of the batch. Scores, softmax and p.v are fp32.

Shapes: B = groups (sequences), R = query rows, L = keys, H = query heads,
KVH = kv heads, G = H // KVH, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Packing:
    """Sequences packed in one row: their (start, end) on the host and, made once, the
    device tensors `attention` reads them through (so a forward over many layers copies
    them to the GPU once, not once per layer)."""

    bounds: tuple[tuple[int, int], ...]
    table: torch.Tensor  # [B, longest] int32: key j of sequence b is packed row table[b, j]
    starts: torch.Tensor  # [B] int32
    lens: torch.Tensor  # [B] int32
    longest: int

    @classmethod
    def of(cls, bounds, device) -> Packing:
        bounds = tuple((int(s), int(e)) for s, e in bounds)
        host = torch.tensor([[s, e - s] for s, e in bounds], dtype=torch.int32)  # [B, 2]
        starts, lens = host.to(device, non_blocking=True).unbind(1)
        longest = max(e - s for s, e in bounds)
        table = torch.arange(longest, dtype=torch.int32, device=device)[None, :] + starts[:, None]
        return cls(bounds, table, starts.contiguous(), lens.contiguous(), longest)


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
