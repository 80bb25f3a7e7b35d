"""Facts about this CPU's stock kernels that some negative controls rely on, measured once.

Stock CPU GEMMs are not batch invariant because MKL picks its kernel and blocking by shape; how
much shows depends on the CPU. On AVX-512 machines the bf16 GEMM gives a row other bits at
another M; on an AVX2-only CPU (seen: AMD EPYC, torch 2.13.0's MKL) the bf16 GEMM gives every
row the same bits at every M, so a whole bf16 model on stock kernels can be batch invariant
there, and a control that expects it not to be has nothing to show. Such controls carry
`needs_varying_stock_bf16`: skipped, with this reason, where the probe finds no variation; they
run wherever it does. The GPU tests keep their own controls.
"""

from __future__ import annotations

import pytest
import torch


def _stock_bf16_gemm_rows_vary() -> bool:
    """Whether stock bf16 `torch.mm` at a released model's width gives rows other bits when
    computed among 1, 3 or 17 rows than among 20, for most of four random operand pairs.

    One pair is not enough: on an AVX-512 AMD EPYC (torch 2.13.0's MKL) one element of one
    row in ~12 pairs differed, and whether it did followed the operands' memory alignment, so
    a single probe enabled controls whose own operands showed nothing (2026-12-05)."""
    varied = 0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        b = (torch.randn(2048, 1536, generator=g) * 2048**-0.5).bfloat16()
        a = torch.randn(20, 2048, generator=g).bfloat16()
        full = torch.mm(a, b)
        varied += any(not torch.equal(torch.mm(a[:m], b), full[:m]) for m in (1, 3, 17))
    return varied >= 3


STOCK_BF16_GEMM_ROWS_VARY = _stock_bf16_gemm_rows_vary()

needs_varying_stock_bf16 = pytest.mark.skipif(
    not STOCK_BF16_GEMM_ROWS_VARY,
    reason="this CPU's stock bf16 GEMM gives a row the same bits at every M (an AVX2-only MKL path): "
    "the stock kernels this control runs are batch invariant here (tests/cpu_facts.py)",
)
