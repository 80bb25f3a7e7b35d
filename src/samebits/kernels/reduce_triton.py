"""`tree_sum_ref`'s bits on CUDA in one launch: one row per program, the halving tree in registers.

`batch_invariant()`'s sum and mean overrides reduce floating rows with `tree_sum_ref`: about
log2(n) elementwise launches (plus a pad) per reduction. Transformers' RMSNorm takes such a
mean four times a layer, so in the trainer's forward those launches were a large share of the
host time (`benchmarks/trainer_profile.py`). `tree_sum` computes the same tree in one kernel,
-0.0 results included (see `tree_sum_kernel`); `tree_sum_block` is the tree itself, shared
with the fused norms. The `samebits::tree_sum` op (`numerics.registry`) picks it where it applies.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from samebits.kernels.grid import next_power_of_2
from samebits.kernels.launch import fast_launch

MAX_WIDTH = 8192  # the widest row tree_sum_block reduces (13 halvings)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (development only)


@triton.jit
def _halve(s, WIDTH: tl.constexpr):
    """[WIDTH] -> [WIDTH // 2]: element j is s[j] + s[j + WIDTH // 2] (one exact add each)."""
    return tl.sum(tl.reshape(s, (2, WIDTH // 2)), axis=0)


@triton.jit
def tree_sum_block(s, BLOCK: tl.constexpr):
    """[BLOCK] (a power of two <= MAX_WIDTH) -> its pairwise halving tree sum, `tree_sum_ref`'s order."""
    if BLOCK >= 2:
        s = _halve(s, BLOCK)
    if BLOCK >= 4:
        s = _halve(s, BLOCK // 2)
    if BLOCK >= 8:
        s = _halve(s, BLOCK // 4)
    if BLOCK >= 16:
        s = _halve(s, BLOCK // 8)
    if BLOCK >= 32:
        s = _halve(s, BLOCK // 16)
    if BLOCK >= 64:
        s = _halve(s, BLOCK // 32)
    if BLOCK >= 128:
        s = _halve(s, BLOCK // 64)
    if BLOCK >= 256:
        s = _halve(s, BLOCK // 128)
    if BLOCK >= 512:
        s = _halve(s, BLOCK // 256)
    if BLOCK >= 1024:
        s = _halve(s, BLOCK // 512)
    if BLOCK >= 2048:
        s = _halve(s, BLOCK // 1024)
    if BLOCK >= 4096:
        s = _halve(s, BLOCK // 2048)
    if BLOCK >= 8192:
        s = _halve(s, BLOCK // 4096)
    return tl.sum(s, axis=0)  # one element left


@fast_launch
@triton.jit
def tree_sum_kernel(x_ptr, out_ptr, n, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    total = tree_sum_block(x, BLOCK)
    # tree_sum_ref pads with -0.0. A float sum is -0.0 exactly when every addend is -0.0, and
    # +0.0 pads change nothing else, so only that case needs its sign set (from the bits:
    # a -0.0 literal or a reduction's +0.0 start can lose it)
    neg_zero_bits = -2147483648
    all_neg_zero = tl.min(tl.where(mask, x.to(tl.int32, bitcast=True) == neg_zero_bits, 1).to(tl.int32), axis=0)
    neg_zero = tl.full((), neg_zero_bits, tl.int32).to(tl.float32, bitcast=True)
    tl.store(out_ptr + row, tl.where(all_neg_zero == 1, neg_zero, total))


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """`tree_sum_ref(x, dim, keepdim)` bit for bit, for a float32 CUDA tensor whose reduced
    dim has 1..MAX_WIDTH elements."""
    if x.dtype != torch.float32 or not (x.is_cuda or _INTERPRET):
        raise ValueError(f"tree_sum (Triton) needs a float32 CUDA tensor, got {x.dtype} on {x.device}")
    n = x.shape[dim]
    if not 1 <= n <= MAX_WIDTH:
        raise ValueError(f"tree_sum (Triton) reduces 1..{MAX_WIDTH} elements, got {n}")
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        tree_sum_kernel[(rows.shape[0],)](rows, out, n, rows.stride(0), BLOCK=next_power_of_2(n))
    out = out.view(moved.shape[:-1])
    return out.unsqueeze(-1).movedim(-1, dim) if keepdim else out
