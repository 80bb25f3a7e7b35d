"""Batch-invariant matmul for CUDA: a Triton kernel and its launcher.

One BLOCK_K for every shape: the per-element K order is what must never change. The
M/N tiles, warps and stages may follow M and N (measured to keep the bits). No
split-K: each output tile is computed by one program that walks K from 0 up in
BLOCK_K steps, accumulating in fp32, so an output element's bits depend on its own row
and column and K alone, never on M, N or the rows and columns beside it (which is what
lets q/k/v run as one GEMM, `ops.projections`). fp32 inputs use IEEE fp32
products (never TF32). `matmul_ref` in `matmul.py` is the portable version.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from samebits.kernels.device_facts import tma_usable
from samebits.kernels.grid import cdiv
from samebits.kernels.launch import fast_launch
from samebits.kernels.matmul_tiles import tiles_for, tma_tiles_for
from samebits.kernels.pdl import launch_args, pdl_release, pdl_wait

BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 64, 128, 64, 8
NUM_WARPS, NUM_STAGES = 4, 4
FP32_BLOCK_K = 32  # fp32 tiles are twice the bytes; fixed per dtype, so per row it never changes

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# `SAMEBITS_TMA_MATMUL=0`: large calls keep the pointer kernel too (A/B timing; the same bits).
TMA = os.environ.get("SAMEBITS_TMA_MATMUL", "1") != "0"


@fast_launch
@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n  # grouped order: neighbouring programs share B tiles in L2
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    pdl_release(PDL)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc += bias[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _tile_of(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a tile number in the grouped order (neighbours share B tiles in L2)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@triton.jit
def matmul_tma_kernel(
    a_desc, b_desc, c_ptr, bias_ptr, M, N, K, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, B_KMAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
):  # fmt: skip
    """`matmul_kernel`'s products with the operand tiles loaded by tensor descriptors (TMA):
    a [M, K] row-major; b as [N, K] (B_KMAJOR: a weight's `.t()`) or [K, N]. An out-of-bounds
    element loads as 0, as the pointer kernel's masks give, and each output element is the
    same BLOCK_K-step walk of K from 0 with the same dot, so the same bits. PROGRAMS > 0: a
    persistent grid of that many programs, each walking tiles PROGRAMS apart."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles = num_pid_m * num_pid_n
    step = PROGRAMS if PROGRAMS > 0 else tiles
    for tile in tl.range(tl.program_id(0), tiles, step):
        pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([m0, k * BLOCK_K])
            if B_KMAJOR:
                b = b_desc.load([n0, k * BLOCK_K]).T
            else:
                b = b_desc.load([k * BLOCK_K, n0])
            acc = tl.dot(a, b, acc)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc += bias[None, :]
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def tma_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `matmul` may take `matmul_tma` for a (M, K) @ b (K, N): 16-bit operands on a
    device where its bits were compared and no graph capture (`device_facts.tma_usable`), a
    row-major and b K-major or N-major, 16-byte aligned bases and row strides."""
    if a.dtype not in (torch.bfloat16, torch.float16) or not tma_usable(a.device):
        return False
    if a.stride(1) != 1 or a.stride(0) % 8 or a.data_ptr() % 16 or b.data_ptr() % 16:
        return False
    return (b.stride(0) == 1 and b.stride(1) % 8 == 0) or (b.stride(1) == 1 and b.stride(0) % 8 == 0)


def matmul_tma(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] = (128, 128, 8, 3),
    programs: int = 0,
) -> torch.Tensor:
    """`matmul` with TMA-loaded operand tiles (`matmul_tma_kernel`; `tma_fits` must hold);
    `programs` > 0: a persistent grid of that many programs (measured no faster on the H200,
    2026-12-05, docs/performance.md). The same bits as `matmul`, which calls it for large
    products (`matmul_tiles.tma_tiles_for`)."""
    m, k = a.shape
    c = torch.empty(m, b.shape[1], dtype=a.dtype, device=a.device)
    if m and b.shape[1] and k:
        _launch_tma(a, b, c, bias, tiles, programs)
    elif k == 0:
        c.zero_() if bias is None else c.copy_(bias.expand_as(c))
    return c


def _launch_tma(a, b, c, bias, tiles, programs) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = a.shape
    n = b.shape[1]
    block_m, block_n, warps, stages = tiles
    b_kmajor = b.stride(0) == 1
    a_desc = TensorDescriptor.from_tensor(a, [block_m, BLOCK_K])
    b_desc = (
        TensorDescriptor.from_tensor(b.t(), [block_n, BLOCK_K])
        if b_kmajor
        else TensorDescriptor.from_tensor(b, [BLOCK_K, block_n])
    )
    n_tiles = cdiv(m, block_m) * cdiv(n, block_n)
    grid = (min(programs, n_tiles) if programs > 0 else n_tiles,)
    matmul_tma_kernel[grid](
        a_desc, b_desc, c, bias if bias is not None else c, m, n, k, c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, B_KMAJOR=b_kmajor, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        GROUP_M=GROUP_M, PROGRAMS=grid[0] if programs > 0 else 0, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`a @ b (+ bias)` on CUDA for a (M, K), b (K, N), any strides; returns a's dtype.

    Each row's bits are independent of M. a and b share one dtype (bf16, fp16, fp32).
    `tiles` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the fixed
    configuration (`matmul_tiles.tiles_for`'s) for experiments (benchmarks/matmul_configs.py)
    and always runs the pointer kernel; without it large products take the TMA launch
    (`matmul_tiles.tma_tiles_for`, `tma_fits`). BLOCK_K never changes.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul needs (M, K) @ (K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    if not (a.is_cuda and b.is_cuda):
        raise ValueError("matmul (Triton) needs CUDA tensors; use matmul_ref on the CPU")
    if a.dtype != b.dtype or a.dtype not in _DTYPES:
        raise ValueError(f"matmul needs a and b of one dtype in {_DTYPES}, got {a.dtype} and {b.dtype}")
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_() if bias is None else c.copy_(bias.expand(m, n))
    if bias is not None and (bias.shape != (n,) or not bias.is_cuda):
        raise ValueError(f"bias must be a CUDA tensor of shape ({n},), got {tuple(bias.shape)}")
    ieee = a.dtype == torch.float32
    if tiles is None and TMA and not ieee:
        tma = tma_tiles_for(m, n)
        if tma is not None and tma_fits(a, b):
            _launch_tma(a, b, c, bias, tma, 0)
            return c
    block_k = FP32_BLOCK_K if ieee else BLOCK_K
    block_m, block_n, warps, stages = tiles or tiles_for(m, n)
    grid = (cdiv(m, block_m) * cdiv(n, block_n),)
    matmul_kernel[grid](
        a,
        b,
        c,
        bias if bias is not None else c,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        HAS_BIAS=bias is not None,
        IEEE=ieee,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=GROUP_M,
        num_warps=warps,
        num_stages=stages,
        **launch_args(a.device),
    )
    return c


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched `a @ b` for a (B, M, K), b (B, K, N): one `matmul` per batch entry."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]:
        raise ValueError(f"bmm needs (B, M, K) @ (B, K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    for i in range(a.shape[0]):
        out[i] = matmul(a[i], b[i])
    return out
