"""Batch-invariant matmul, portable torch version (CPU; the test oracle).

Stock CPU GEMMs pick their blocking by M: the same row computed at M=1 and at
M=5 gives different bits (measured: fp32 `torch.mm`, MKL). Here every row is
computed inside a GEMM of one fixed shape, `(ROW_TILE, K) @ (K, N)`: the rows of
A are copied, ROW_TILE at a time, into a fresh zero-padded fp32 buffer (fresh
so that its alignment, which MKL's code path may depend on, is always the
allocator's), and B is always used in one layout (`_as_fp32_nt`: MKL's AVX2 path
gives other bits for a transposed B than for its contiguous copy), so a row's K
reduction order depends only on K and N, never on M, on its place in the batch
or on how the caller laid B out. bf16 inputs are computed in fp32 and rounded once.
"""

from __future__ import annotations

import torch

ROW_TILE = 16


def matmul_ref(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`a @ b (+ bias)` for a (M, K), b (K, N); each row's bits independent of M.

    Accumulates in fp32 and returns a's dtype. Call it with grad mode off or
    through the aten overrides (autograd sits above them).
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul_ref needs (M, K) @ (K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    m, k = a.shape
    n = b.shape[1]
    b32 = _as_fp32_nt(b)
    out32 = torch.empty(m, n, dtype=torch.float32, device=a.device)
    for start in range(0, m, ROW_TILE):
        rows = min(ROW_TILE, m - start)
        tile = torch.zeros(ROW_TILE, k, dtype=torch.float32, device=a.device)
        tile[:rows].copy_(a[start : start + rows])
        acc = torch.empty(ROW_TILE, n, dtype=torch.float32, device=a.device)
        torch.mm(tile, b32, out=acc)  # the out= overload: the stock kernel, never our override
        out32[start : start + rows].copy_(acc[:rows])
    if bias is not None:
        out32 += bias.to(torch.float32)
    return out32 if a.dtype == torch.float32 else out32.to(a.dtype)


def _as_fp32_nt(b: torch.Tensor) -> torch.Tensor:
    """b (K, N) in fp32, laid out as the transpose of a row-major (N, K): the layout of
    `F.linear`'s `weight.t()`, so a linear's fp32 weight is used in place. MKL's AVX2 kernels give
    other bits for the same values in another layout (measured: a transposed view against its
    contiguous copy), so every b is brought to this one layout, whatever the caller passed."""
    if b.dtype == torch.float32 and b.stride(0) == 1 and (b.shape[1] <= 1 or b.stride(1) == b.shape[0]):
        return b
    out = torch.empty(b.shape[1], b.shape[0], dtype=torch.float32, device=b.device)
    return out.copy_(b.t()).t()


def bmm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched `a @ b` for a (B, M, K), b (B, K, N), one `matmul_ref` per batch entry."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]:
        raise ValueError(f"bmm_ref needs (B, M, K) @ (B, K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.shape[0] == 0:
        return a.new_empty(0, a.shape[1], b.shape[2])
    return torch.stack([matmul_ref(a[i], b[i]) for i in range(a.shape[0])])


def adjacent_rows(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """Weights [N_i, K] as one [sum N_i, K] view when they are contiguous and lie back to back
    in one storage (as the loader reads a layer's q/k/v), else None."""
    first = weights[0]
    end = first.storage_offset()
    for w in weights:
        if (
            w.dim() != 2
            or not w.is_contiguous()
            or w.storage_offset() != end
            or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or w.shape[1] != first.shape[1]
        ):
            return None
        end += w.numel()
    return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))
