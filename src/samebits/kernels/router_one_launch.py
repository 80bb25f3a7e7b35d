"""The MoE router after its linear in one Triton launch: softmax, top-k in CUDA `torch.topk`'s
order, renorm, cast. The registry's CUDA `router` runs it where `topk_order.order_checked` (else
`router_triton`, which keeps `torch.topk` itself).

`router_triton.router` is four launches (softmax, torch.topk's gather and sort, renorm). Here one
program takes ROWS tokens through all of it:
- the softmax is `router_triton`'s (the same jit helper, so the same bits);
- the top-k is CUDA `torch.topk`'s as `topk_order` writes it out: the k-th largest value v (k
  rounds of taking the row's first maximum), then the elements > v and the first elements == v
  placed in index order, then the 32-slot unstable bitonic network with the same comparator,
  swap rule and invalid padding (`_exchange`, 15 stages);
- the renorm and the cast are `renorm_kernel`'s (the same tree sum and `div_rn`).
The only link not shown on the CPU is that `topk_order` is what the installed torch does; its
GPU test compares them on rows full of ties (`test_gpu_router.py`), and
`topk_order.TOPK_ORDER_TORCH` lists the torch releases on which it passed. On any other torch,
or on ROCm (whose topk is another kernel), the registry keeps `router_triton`. H200, torch
2.11: 4.5 us a launch at T = 1 against the four launches' 11.7 (`benchmarks/router_launches.py`).
Shapes: T = tokens, E = experts (a power of two <= 256), K = top-k (a power of two <= 32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samebits.kernels.grid import cdiv
from samebits.kernels.launch import fast_launch
from samebits.kernels.norm_rope_triton import _row_tree
from samebits.kernels.pdl import launch_args, pdl_release, pdl_wait
from samebits.kernels.router_triton import ROWS, _probs, supported
from samebits.kernels.topk_order import SORT_SLOTS

assert SORT_SLOTS == 32, "the kernel's network is written for topk_order's 32 slots"


@triton.jit
def _exchange(key, idx, valid, ROWS: tl.constexpr, HALF: tl.constexpr, STRIDE: tl.constexpr):
    """One stage of `bitonicSort` on [ROWS, 32] slots: thread t owns the pair (pos, pos + STRIDE),
    pos = 2t - (t & (STRIDE - 1)); it exchanges when `(key_a > key_b and valid_a) or not valid_b`
    equals its direction, `t & HALF != 0` (HALF = 0: the final merge, direction False)."""
    N: tl.constexpr = 32 // (2 * STRIDE)
    t = tl.arange(0, N)[:, None] * STRIDE + tl.arange(0, STRIDE)[None, :]  # [N, STRIDE]
    direction = ((t & HALF) != 0)[None, :, :]
    k_lo, k_hi = tl.split(tl.permute(tl.reshape(key, (ROWS, N, 2, STRIDE)), (0, 1, 3, 2)))
    i_lo, i_hi = tl.split(tl.permute(tl.reshape(idx, (ROWS, N, 2, STRIDE)), (0, 1, 3, 2)))
    v_lo, v_hi = tl.split(tl.permute(tl.reshape(valid, (ROWS, N, 2, STRIDE)), (0, 1, 3, 2)))
    swap = ((k_lo > k_hi) & (v_lo != 0)) | (v_hi == 0)
    ex = swap == direction
    key = tl.join(tl.where(ex, k_hi, k_lo), tl.where(ex, k_lo, k_hi))
    idx = tl.join(tl.where(ex, i_hi, i_lo), tl.where(ex, i_lo, i_hi))
    valid = tl.join(tl.where(ex, v_hi, v_lo), tl.where(ex, v_lo, v_hi))
    key = tl.reshape(tl.permute(key, (0, 1, 3, 2)), (ROWS, 32))
    idx = tl.reshape(tl.permute(idx, (0, 1, 3, 2)), (ROWS, 32))
    valid = tl.reshape(tl.permute(valid, (0, 1, 3, 2)), (ROWS, 32))
    return key, idx, valid


@triton.jit
def _bitonic_sort(key, idx, valid, ROWS: tl.constexpr):
    """`bitonicSort<32>` (PyTorch `SortUtils.cuh`): sizes 2..16 with their directions, then the
    final merge."""
    key, idx, valid = _exchange(key, idx, valid, ROWS, 1, 1)
    key, idx, valid = _exchange(key, idx, valid, ROWS, 2, 2)
    key, idx, valid = _exchange(key, idx, valid, ROWS, 2, 1)
    key, idx, valid = _exchange(key, idx, valid, ROWS, 4, 4)
    key, idx, valid = _exchange(key, idx, valid, ROWS, 4, 2)
    key, idx, valid = _exchange(key, idx, valid, ROWS, 4, 1)
    key, idx, valid = _exchange(key, idx, valid, ROWS, 8, 8)
    key, idx, valid = _exchange(key, idx, valid, ROWS, 8, 4)
    key, idx, valid = _exchange(key, idx, valid, ROWS, 8, 2)
    key, idx, valid = _exchange(key, idx, valid, ROWS, 8, 1)
    for p in tl.static_range(4, -1, -1):  # the final merge: strides 16, 8, 4, 2, 1
        key, idx, valid = _exchange(key, idx, valid, ROWS, 0, 1 << p)
    return key, idx


@triton.jit
def _top_k_store(
    p, rows, T, w_ptr, i_ptr, ROWS: tl.constexpr, E: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr
):
    """[ROWS, E] fp32 probabilities -> their top K in torch.topk's CUDA order, renormed when NORM,
    stored as weights [T, K] in w's dtype and indices [T, K] int64 (rows past T: not stored)."""
    cols = tl.arange(0, E)[None, :]
    left = p
    for _ in tl.static_range(K):  # k rounds of the first maximum: kth = the k-th largest
        kth = tl.max(left, 1)
        first = tl.min(tl.where(left == kth[:, None], cols, E), 1)
        left = tl.where(cols == first[:, None], -float("inf"), left)
    above = (p > kth[:, None]).to(tl.int32)
    equal = (p == kth[:, None]).to(tl.int32)
    pos_above = tl.cumsum(above, 1) - above  # the gather kernel's write positions
    pos_equal = tl.sum(above, 1)[:, None] + tl.cumsum(equal, 1) - equal
    pos = tl.where(above != 0, pos_above, tl.where(equal != 0, pos_equal, 32))
    slots = tl.arange(0, 32)[None, :]
    key = tl.zeros((ROWS, 32), dtype=tl.float32)
    idx = tl.zeros((ROWS, 32), dtype=tl.int32)
    for j in tl.static_range(K):  # slot j <- the one element gathered at position j
        at = pos == j
        key = tl.where(slots == j, tl.max(tl.where(at, p, -float("inf")), 1)[:, None], key)
        idx = tl.where(slots == j, tl.max(tl.where(at, cols, -1), 1)[:, None], idx)
    valid = (slots < K).to(tl.int32) + tl.zeros((ROWS, 32), dtype=tl.int32)
    key, idx = _bitonic_sort(key, idx, valid, ROWS)
    first_k = tl.arange(0, 32 // K)[None, :, None] == 0  # [1, 32 / K, 1]: slots 0..K-1
    top_v = tl.max(tl.where(first_k, tl.reshape(key, (ROWS, 32 // K, K)), -float("inf")), 1)  # [ROWS, K]
    top_i = tl.max(tl.where(first_k, tl.reshape(idx, (ROWS, 32 // K, K)), -1), 1)
    if NORM:
        top_v = tl.div_rn(top_v, _row_tree(top_v, ROWS, K)[:, None])
    mask = (rows < T)[:, None]
    at = rows.to(tl.int64)[:, None] * K + tl.arange(0, K)[None, :]
    tl.store(w_ptr + at, top_v.to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(i_ptr + at, top_i.to(tl.int64), mask=mask)


@fast_launch
@triton.jit
def router_kernel(
    x_ptr, w_ptr, i_ptr, T, stride_x,
    ROWS: tl.constexpr, E: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """[T, E] logits -> weights [T, K] in w's dtype, indices [T, K] int64 (module docstring)."""
    pdl_wait(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    p = _probs(x_ptr, rows, T, stride_x, ROWS, E)  # [ROWS, E] fp32
    pdl_release(PDL)
    _top_k_store(p, rows, T, w_ptr, i_ptr, ROWS, E, K, NORM)


def router(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`router_triton.router`'s outputs in one launch: (weights [T, K] in the logits' dtype,
    indices [T, K] int64). Call only where `router_triton.supported` and top_k <= 32."""
    if not supported(router_logits, top_k) or top_k > SORT_SLOTS:
        raise ValueError(
            f"router (one launch): needs 2-D CUDA logits with contiguous rows, E and top_k powers of two, "
            f"E <= 256 and top_k <= 32; got {tuple(router_logits.shape)} {router_logits.dtype}, top_k {top_k}"
        )
    t = router_logits.shape[0]
    weights = torch.empty(t, top_k, dtype=router_logits.dtype, device=router_logits.device)
    index = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t:
        router_kernel[(cdiv(t, ROWS),)](
            router_logits, weights, index, t, router_logits.stride(0),
            ROWS=ROWS, E=router_logits.shape[1], K=top_k, NORM=norm_topk_prob,
            num_warps=4, enable_fp_fusion=False, **launch_args(router_logits.device),
        )  # fmt: skip
    return weights, index
