"""Triton batch-invariant matmul vs cuBLAS (torch.mm) at Qwen3-30B-A3B linear shapes, one run.

    python benchmarks/matmul.py

Prints one table: time per call (CUDA-graph-free, triton.testing.do_bench median),
achieved TB/s counting A + B + C bytes once, and TFLOP/s, for both arms.
"""

from __future__ import annotations

import torch
import triton

from samebits.kernels.matmul_triton import matmul

# (name, K, N): q_proj, o_proj, router, one expert's gate_up and down, lm_head
SHAPES = [
    ("q_proj", 2048, 4096),
    ("o_proj", 4096, 2048),
    ("expert gate_up", 2048, 1536),
    ("expert down", 768, 2048),
    ("lm_head", 2048, 151936),
]
MS = [1, 8, 64, 256, 4096]


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bf16 matmul: Triton (batch invariant) vs cuBLAS")
    for col in ("shape", "M", "triton us", "cublas us", "triton/cublas", "triton TB/s", "triton TFLOP/s"):
        table.add_column(col)
    for name, k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in MS:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_tr = triton.testing.do_bench(lambda a=a, w=w: matmul(a, w.t()), warmup=25, rep=100)
            t_cb = triton.testing.do_bench(lambda a=a, w=w: a @ w.t(), warmup=25, rep=100)
            nbytes = 2 * (m * k + k * n + m * n)
            table.add_row(
                name,
                str(m),
                f"{t_tr * 1e3:.1f}",
                f"{t_cb * 1e3:.1f}",
                f"{t_tr / t_cb:.2f}",
                f"{nbytes / t_tr / 1e9:.2f}",
                f"{2 * m * n * k / t_tr / 1e9:.1f}",
            )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
