"""The MoE router after its linear, in two Triton launches around `torch.topk`. The registry's
CUDA router runs `router_one_launch` instead where torch.topk's tie order was checked on the
installed torch (`topk_order.order_checked`); this module is the path everywhere else, and
that kernel takes its softmax from here (`_probs`).

transformers' `Qwen3MoeTopKRouter` (and the Omni thinker's) does, after the linear:

    probs = softmax(logits, dtype=float32)          # max, exp, sum, divide
    top_value, top_index = torch.topk(probs, k)
    top_value /= top_value.sum(-1, keepdim=True)    # norm_topk_prob
    top_value.to(logits.dtype)

Inside `batch_invariant()` each of those is its own launch (the softmax's sum and the renorm
sum are the fixed halving tree, `tree_sum_ref`'s order): about ten a layer. Here
`softmax_kernel` is the softmax in one launch and `renorm_kernel` the renorm and the cast in
one; `torch.topk` stays torch's, so the experts chosen and their order (ties included) are
the trainer's by construction. Each rounding is the composite's:

- the max is exact; `x - max` is one fp32 subtraction;
- exp is libdevice's `expf`, what torch's CUDA exp calls (`sample_triton._expf`; Triton's
  libdevice flushes subnormal results to zero, so a probability below ~1.2e-38 is 0 here
  where torch keeps a subnormal: it adds nothing to a sum that holds exp(0) = 1, and such an
  expert is chosen only where fewer than k experts are above it);
- the sums are the halving tree (`norm_rope_triton._row_tree`, E and k powers of two);
- the divisions are IEEE (`div_rn`), as torch's `/`; the cast rounds to nearest even.

Shapes: T = tokens, E = experts, K = top-k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samebits.kernels.grid import cdiv
from samebits.kernels.launch import fast_launch
from samebits.kernels.norm_rope_triton import _row_tree
from samebits.kernels.sample_triton import _expf

ROWS = 8  # tokens a program handles
MAX_WIDTH = 256  # `_row_tree`'s widest row
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@fast_launch
@triton.jit
def softmax_kernel(x_ptr, p_ptr, T, stride_x, ROWS: tl.constexpr, E: tl.constexpr):
    """[T, E] logits -> [T, E] fp32 probabilities: the composite softmax's roundings."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, E)
    p = _probs(x_ptr, rows, T, stride_x, ROWS, E)
    tl.store(p_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], p, mask=(rows < T)[:, None])


@triton.jit
def _probs(x_ptr, rows, T, stride_x, ROWS: tl.constexpr, E: tl.constexpr):
    """Rows `rows` of [T, E] logits -> [ROWS, E] fp32 probabilities (rows past T: garbage)."""
    cols = tl.arange(0, E)
    mask = (rows < T)[:, None]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    e = _expf(x - tl.max(x, 1)[:, None])
    return tl.div_rn(e, _row_tree(e, ROWS, E)[:, None])


@fast_launch
@triton.jit
def renorm_kernel(v_ptr, w_ptr, T, ROWS: tl.constexpr, K: tl.constexpr):
    """[T, K] fp32 top values -> [T, K] in w's dtype: each row over its tree sum, cast once."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, K)
    mask = (rows < T)[:, None]
    at = rows.to(tl.int64)[:, None] * K + cols[None, :]
    v = tl.load(v_ptr + at, mask=mask, other=1.0)
    w = tl.div_rn(v, _row_tree(v, ROWS, K)[:, None])
    tl.store(w_ptr + at, w.to(w_ptr.dtype.element_ty), mask=mask)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(router_logits: torch.Tensor, top_k: int) -> bool:
    """Whether `router` takes these inputs (else the composite runs): 2-D logits on CUDA whose
    rows are contiguous, E and top_k powers of two up to MAX_WIDTH, top_k <= E."""
    if router_logits.dim() != 2 or router_logits.dtype not in _DTYPES or router_logits.device.type != "cuda":
        return False
    e = router_logits.shape[1]
    return (
        router_logits.stride(1) == 1
        and _power_of_two(e)
        and e <= MAX_WIDTH
        and _power_of_two(top_k)
        and top_k <= e
    )


def router(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`samebits::router` (fp32 softmax, top-k, fp32 renorm, cast back) -> (weights [T, K] in
    the logits' dtype, indices [T, K] int64), with the composite's bits inside
    batch_invariant() (module docstring). Call only where `supported`."""
    top_value, top_index = torch.topk(softmax(router_logits), top_k, dim=-1)
    if not norm_topk_prob:
        return top_value.to(router_logits.dtype), top_index
    t = top_value.shape[0]
    weights = torch.empty(t, top_k, dtype=router_logits.dtype, device=router_logits.device)
    if t:
        renorm_kernel[(cdiv(t, ROWS),)](
            top_value, weights, t, ROWS=ROWS, K=top_k, num_warps=1, enable_fp_fusion=False
        )
    return weights, top_index


def softmax(router_logits: torch.Tensor) -> torch.Tensor:
    """[T, E] -> [T, E] fp32: `softmax(logits, dtype=float32)`'s bits inside batch_invariant()."""
    t, e = router_logits.shape
    probs = torch.empty(t, e, dtype=torch.float32, device=router_logits.device)
    if t:
        softmax_kernel[(cdiv(t, ROWS),)](
            router_logits, probs, t, router_logits.stride(0),
            ROWS=ROWS, E=e, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return probs
