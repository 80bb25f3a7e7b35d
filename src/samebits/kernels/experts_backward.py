"""The MoE experts' gradients in closed form, on grouped GEMMs (the CUDA backward).

Gradients carry no bitwise contract, so this runs stock kernels. It replaces recomputing the
forward with differentiable ops and letting autograd walk that graph: autograd rebuilt the
expert outputs y (a GEMM it never needs) and ran ~40 host ops with a graph node each, a
measured ~3 ms of host time a layer (`benchmarks/trainer_profile.py`, docs/performance.md).

Forward, per pair p = (t, k) routed to expert e (experts_grouped_mm's roundings):
    [gate; up]_p = x_t GU_e^T,   a_p = silu(gate_p) * up_p,   y_p = a_p D_e^T,
    out_t = sum_k w_tk y_p
Backward, given g = dL/dout:
    u_p = g_t D_e                       (GEMM 2; y itself is never rebuilt)
    dw_tk = <g_t, y_p> = <u_p, a_p>
    da_p = w_tk u_p;   dgate = da up silu'(gate);   dup = da silu(gate)
    dx_t = sum_k [dgate; dup]_p GU_e    (GEMM 3; the k slots summed in fp32)
    dGU_e = sum_p [dgate; dup]_p^T x_t, dD_e = sum_p (w_tk g_t)^T a_p   (only when wanted)

Reductions use `out=` overloads: on CUDA the backward runs on autograd's device thread, where
every call of an op that `batch_invariant()` overrides (sum.dim, mm, ...) goes through the
overrides' Python wrapper before reaching the stock kernel; an `out=` overload is not overridden.

Shapes: T tokens, K top-k, N = T*K pairs, E experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from samebits.kernels.experts import route

# (a [N, K'], b [E, K', M] or a [K'', N] with b [N, M], offs [E] int32 ends) -> [N, M] or [E, K'', M]
GroupedMM = Callable[..., torch.Tensor]


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a, b, offs=offs)` as one `a @ b` per group, any dtype (float64 in
    tests): 2-D x 3-D groups a's rows; 2-D x 2-D groups the shared K (-> [E, a rows, b cols])."""
    ends = [0, *offs.tolist()]
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e in range(b.shape[0]):
            out[ends[e] : ends[e + 1]] = a[ends[e] : ends[e + 1]] @ b[e]
        return out
    return torch.stack([a[:, ends[e] : ends[e + 1]] @ b[ends[e] : ends[e + 1]] for e in range(len(offs))])


def _to_pair_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows in expert order -> rows in pair order (row j of x is pair order[j]; order is a
    permutation, so every row is written)."""
    return x.new_empty(x.shape).index_copy_(0, order, x)


def _sum(x: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    shape = [s for d, s in enumerate(x.shape) if d != dim % x.dim()]
    return torch.sum(x, dim, dtype=dtype, out=x.new_empty(shape, dtype=dtype))


def pointwise_ref(
    gate_up: torch.Tensor,  # [N, 2I]: [gate; up] of each pair, in expert order
    u: torch.Tensor,  # [N, I]: g_t D_e
    order: torch.Tensor,  # [N]: the pair of each expert-order row
    top_k_weights: torch.Tensor,  # [T, K]
    want_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward's elementwise middle -> (dh = [dgate; dup] [N, 2I] in expert order, in
    gate_up's dtype; dw_tk = <u_p, a_p> [T * K] fp32 in pair order, or None), with
    da = w u, dgate = da up silu'(gate), dup = da silu(gate), a = silu(gate) up (module docstring)."""
    inter = u.shape[1]
    gate, up = gate_up.split(inter, dim=-1)
    order = order.long()
    act = F.silu(gate)
    da = u * top_k_weights.reshape(-1)[order].to(u.dtype)[:, None]
    dh = torch.cat([torch.ops.aten.silu_backward(da * up, gate), da * act], dim=-1)
    if not want_dw:
        return dh, None
    acc = torch.promote_types(u.dtype, torch.float32)  # bf16/fp16 sum in fp32
    dw = _sum(u.to(acc) * (act * up).to(acc), -1, acc)  # [N] in expert order
    return dh, _to_pair_order(dw, order)


def experts_backward(
    grad_out: torch.Tensor,  # [T, H]
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, K]
    top_k_weights: torch.Tensor,  # [T, K]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
    wants: tuple[bool, bool, bool, bool],  # grads of (hidden, weights, gate_up, down)
    gmm: GroupedMM = torch._grouped_mm,
    route_pairs: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = route,
    pointwise: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = pointwise_ref,
) -> tuple[torch.Tensor | None, ...]:
    """-> (d hidden [T, H], d weights [T, K], d gate_up [E, 2I, H], d down [E, H, I]), None
    where not wanted: the gradients of `experts_grouped_mm` (SiLU) in three grouped GEMMs, five
    when the expert weights want theirs (returned contiguous, in the parameters' layout).
    `route_pairs`: `experts.route` or a kernel giving its (order, offsets) (on CUDA the
    forward's one-launch routing); `pointwise`: `pointwise_ref` or a kernel with its contract
    (on CUDA one launch). Expert ids must lie in [0, E), as the forward requires: the order
    must be a permutation of the pairs (every row is put back by it)."""
    t, k = top_k_index.shape
    if t == 0:
        zeros = (hidden_states, top_k_weights, gate_up_proj, down_proj)
        return tuple(torch.zeros_like(z) if w else None for z, w in zip(zeros, wants, strict=True))
    order, offsets = route_pairs(top_k_index, gate_up_proj.shape[0])
    offs, pairs = offsets[1:], order.long()
    tok = pairs // k
    xs, gs = hidden_states[tok], grad_out.to(hidden_states.dtype)[tok]  # [N, H] in expert order
    gate_up = gmm(xs, gate_up_proj.transpose(1, 2), offs=offs)  # [N, 2I]
    u = gmm(gs, down_proj, offs=offs)  # [N, I]
    dh, dw = pointwise(gate_up, u, order, top_k_weights, wants[1])  # [N, 2I]; [T * K] fp32 or None
    acc = torch.promote_types(hidden_states.dtype, torch.float32)  # bf16/fp16 sum in fp32
    grads: list[torch.Tensor | None] = [None] * 4
    if wants[0]:
        per_pair = gmm(dh, gate_up_proj, offs=offs)  # [N, H] in expert order
        per_slot = _to_pair_order(per_pair, pairs).view(t, k, -1)  # [T, K, H]
        grads[0] = _sum(per_slot, 1, acc).to(hidden_states.dtype)
    if wants[1]:
        grads[1] = dw.view(t, k).to(top_k_weights.dtype)
    if wants[2]:
        grads[2] = gmm(dh.t(), xs, offs=offs)  # [E, 2I, H], the parameter's own layout
    if wants[3]:
        gate, up = gate_up.split(down_proj.shape[2], dim=-1)
        ws = top_k_weights.reshape(-1)[pairs].to(hidden_states.dtype)  # [N]
        grads[3] = gmm((gs * ws[:, None]).t(), F.silu(gate) * up, offs=offs)  # [E, H, I]
    return tuple(grads)
