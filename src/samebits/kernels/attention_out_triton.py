"""A split attention call's chunk merge inside the o_proj GEMM: one launch where there were two.

For small decode batches `attention_triton` splits each sequence's keys into chunks run by
parallel programs, then `combine_kernel` merges the chunks' statistics in order and writes the
attention output, which the o_proj GEMM (`matmul_triton`) reads back. `combine_matmul_kernel`
is that GEMM with the merge in its A-tile loads: for the K step covering 64 dims of one head it
merges those dims' chunk statistics in chunk order with `combine_kernel`'s operations
(`_fresh`, `_merge`, `acc / l`, the cast; elementwise, so a tile of 64 dims gets the bits the
combine gives them in its 128), and feeds the result to the same K loop as `matmul_kernel`
(BLOCK_K steps from 0, fp32 accumulation, one rounding). So the output has the bits of the
combine then the o_proj linear inside `batch_invariant()`, with the attention output never
stored. Needs the head dim a multiple of BLOCK_K and no o_proj bias.

Not used by default: `numerics.registry.COMBINE_IN_O_PROJ` turns it on once its GPU test
passes (docs/perf-notes.md, twelfth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samebits.kernels.attention_triton import SplitPartials, _fresh, _merge
from samebits.kernels.launch import fast_launch
from samebits.kernels.matmul_triton import BLOCK_K

BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 16, 32, 4, 4  # decode sizes: T <= a few dozen rows


@fast_launch
@triton.jit
def combine_matmul_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, n_chunks_ptr, w_ptr, c_ptr,
    T, N, chunks, HEADS, stride_wn, stride_cm,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c [T, N] = merge(partials) [T, HEADS * D] @ w [N, HEADS * D].T (module docstring)."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    rows = (pid // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < T
    n_c = tl.load(n_chunks_ptr + rows, mask=row_ok, other=0)
    n_c = tl.minimum(tl.maximum(n_c, 0), chunks)  # rows of no sequence hold garbage: stay in bounds
    most = tl.max(n_c, 0)
    kk = tl.arange(0, BLOCK_K)
    b_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + kk[:, None]  # [BLOCK_K, BLOCK_N] of w.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, HEADS * D // BLOCK_K):
        head = (k * BLOCK_K) // D
        dims = (k * BLOCK_K) % D + kk
        m, l_run, o = _fresh(BLOCK_M, BLOCK_K, False)
        for c in range(0, most):
            ok = row_ok & (c < n_c)
            at = (rows.to(tl.int64) * chunks + c) * HEADS + head  # [T, chunks, HEADS]
            m_c = tl.load(part_m_ptr + at, mask=ok, other=float("-inf"))
            l_c = tl.load(part_l_ptr + at, mask=ok, other=0.0)
            acc_c = tl.load(part_acc_ptr + at[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0)
            m, l_run, o = _merge(m, l_run, o, m_c, l_c, acc_c, False)
        a = (o / l_run[:, None]).to(c_ptr.dtype.element_ty)  # combine_kernel's output rounding
        b = tl.load(b_ptrs + k * BLOCK_K, mask=cols[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(
        c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (cols[None, :] < N),
    )


def supported(parts: SplitPartials, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `combine_matmul` takes these: o_proj weight [N, HEADS * D] in the activation dtype
    (bf16 or fp16) with contiguous rows, D a multiple of BLOCK_K."""
    d = parts.acc.shape[-1]
    return (
        dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and d % BLOCK_K == 0
        and weight.shape[1] == parts.acc.shape[2] * d
    )


def combine_matmul(parts: SplitPartials, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The split call's attention output, merged as `combine_kernel` merges it and rounded to
    `dtype`, times o_proj's `weight` [N, HEADS * D] as the Triton matmul computes `F.linear` ->
    [T, N] in `dtype`, in one launch."""
    if not supported(parts, weight, dtype):
        raise ValueError(
            f"combine_matmul: needs a bf16/fp16 o_proj weight [N, heads * D] with contiguous rows and D a "
            f"multiple of {BLOCK_K}; got weight {tuple(weight.shape)} {weight.dtype}, partials "
            f"{tuple(parts.acc.shape)}, dtype {dtype}"
        )
    t, chunks, heads, d = parts.acc.shape
    n = weight.shape[0]
    out = torch.empty(t, n, dtype=dtype, device=weight.device)
    if t:
        grid = (triton.cdiv(t, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
        combine_matmul_kernel[grid](
            parts.m, parts.l, parts.acc, parts.n_chunks, weight, out,
            t, n, chunks, heads, weight.stride(0), out.stride(0),
            D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES, enable_fp_fusion=False,
        )  # fmt: skip
    return out
