"""Batch-invariant MoE experts in the transformers layout (portable torch).

Tokens are grouped by expert; each expert's rows go through the row-invariant
GEMMs of `batch_invariant()`, so a token's expert outputs never depend on which
other tokens chose that expert. gate_up and `act(gate) * up` round in the
activation dtype as transformers does; the down projection stays in fp32, is
weighted in fp32 and the top-k slots are summed in fp32 by a fixed pairwise
tree, rounded once at the end: what a fused GPU kernel does, and one rounding
fewer than transformers' `grouped_mm` path (which is why that path is the
negative control). `experts_ref` is a forward kernel (`matmul_ref` has no
backward); `linear=F.linear` inside `batch_invariant()` gives the same bits through
differentiable ops, which is how the `samebits::experts` op's backward recomputes it.

`experts_stock_ref` and `experts_grouped_mm` are the stock twins (the fast profile):
a per-expert `F.linear` loop and `torch._grouped_mm` (CUDA). The choice between them
all is made in `samebits.numerics.registry`, never here.

Shapes: T = tokens, K = top-k, E = experts, H = hidden, I = expert intermediate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from samebits.kernels.matmul import matmul_ref
from samebits.kernels.reduce import tree_sum_ref

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [n, in], w [out, in]) -> [n, out]


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, w)` through `matmul_ref`: the call the batch_invariant mm override makes."""
    return matmul_ref(x, w.t())


def experts_ref(
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, K]
    top_k_weights: torch.Tensor,  # [T, K]
    gate_up_proj: torch.Tensor,  # [E, 2I, H], [gate; up] on dim 1
    down_proj: torch.Tensor,  # [E, H, I]
    act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    linear: Linear = linear_ref,
) -> torch.Tensor:
    """Sum over k of `weight_k * down_e(act(gate_e(x)) * up_e(x))`, e = top_k_index[t, k] -> [T, H]."""
    weighted = experts_ref_slots(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn, linear
    )
    return sum_slots_ref(weighted, hidden_states.dtype)


def sum_slots_ref(weighted: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, K, H] fp32 weighted slot outputs -> [T, H] in `dtype`: the top-k sum in
    `tree_sum_ref`'s halving order, rounded once (the experts' closing step)."""
    return tree_sum_ref(weighted, dim=1).to(dtype)


def experts_ref_slots(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    linear: Linear = linear_ref,
) -> torch.Tensor:
    """`experts_ref` before its top-k sum: [T, K, H] fp32, slot k of token t holding
    `weight_k * down_e(act(gate_e(x)) * up_e(x))`."""
    if top_k_index.shape != top_k_weights.shape or hidden_states.shape[0] != top_k_index.shape[0]:
        raise ValueError(
            f"experts: hidden {tuple(hidden_states.shape)}, top_k_index {tuple(top_k_index.shape)} "
            f"and top_k_weights {tuple(top_k_weights.shape)} disagree"
        )
    t, k = top_k_index.shape
    h = hidden_states.shape[-1]
    if t == 0:
        return hidden_states.new_zeros(0, k, h, dtype=torch.float32)
    flat = top_k_index.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up_proj.shape[0]).tolist()
    outs, start = [], 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = hidden_states[order[start : start + count] // k]
        gate, up = linear(rows, gate_up_proj[e]).chunk(2, dim=-1)
        hidden = act_fn(gate) * up  # [n, I] activation dtype
        outs.append(linear(hidden.float(), down_proj[e].float()))  # [n, H] fp32
        start += count
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_slot = torch.cat(outs, dim=0)[inverse].view(t, k, h)  # [T, K, H] fp32
    return per_slot * top_k_weights.float().unsqueeze(-1)


def experts_stock_ref(
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, K]
    top_k_weights: torch.Tensor,  # [T, K]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:
    """The same function in stock torch kernels, one `F.linear` pair per expert: fast where
    `torch._grouped_mm` is missing, not batch invariant (the fast profile on the CPU)."""
    order, offsets = route(top_k_index, gate_up_proj.shape[0])
    order = order.long()
    rows = hidden_states[order // top_k_index.shape[1]]  # [N, H] sorted by expert
    outs, start = [], 0
    for e, n in enumerate((offsets[1:] - offsets[:-1]).tolist()):
        gate, up = F.linear(rows[start : start + n], gate_up_proj[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down_proj[e]).float())
        start += n
    return _weighted_sum(torch.cat(outs), order, top_k_weights, hidden_states.dtype)


def experts_grouped_mm(
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, K]
    top_k_weights: torch.Tensor,  # [T, K]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:
    """`experts_stock_ref` on `torch._grouped_mm` (CUDA): what transformers' `grouped_mm` runs.
    The fast profile on CUDA, and the differentiable recompute behind the Triton experts' backward."""
    order, offsets = route(top_k_index, gate_up_proj.shape[0])
    order = order.long()
    rows = hidden_states[order // top_k_index.shape[1]]  # [N, H] sorted by expert
    offs = offsets[1:]
    gate, up = torch._grouped_mm(rows, gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(1, 2), offs=offs).float()
    return _weighted_sum(y, order, top_k_weights, hidden_states.dtype)


def _weighted_sum(y, order, top_k_weights, dtype) -> torch.Tensor:
    """y [N, H] fp32 in expert order -> sum over k of weight * y, stock `sum` -> [T, H] in dtype."""
    t, k = top_k_weights.shape
    per_slot = torch.zeros_like(y).index_copy(0, order, y)
    return (per_slot.view(t, k, -1) * top_k_weights.float().unsqueeze(-1)).sum(1).to(dtype)


def route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] expert ids -> (order [N] int32: pair ids sorted by expert, stably; offsets [E + 1] int32).

    Device ops only, no host sync.
    """
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, offsets
