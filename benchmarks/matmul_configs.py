"""Which Triton tile choices keep the per-row bits? And what do they cost? (CUDA, one run)

    python benchmarks/matmul_configs.py

For each Qwen3-30B-A3B linear shape and each (BLOCK_M, BLOCK_N, warps, stages)
with BLOCK_K fixed, compares the output bitwise with the default configuration
and times it. A configuration whose bits equal the default's for every shape
may be chosen per M without breaking batch invariance.
"""

from __future__ import annotations

import torch
import triton

from samebits.kernels.matmul_triton import BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS, matmul

SHAPES = [
    ("q_proj", 2048, 4096),
    ("k_proj", 2048, 512),
    ("q+k+v", 2048, 5120),
    ("o_proj", 4096, 2048),
    ("router", 2048, 128),
    ("lm_head", 2048, 151936),
    ("expert gate_up", 2048, 1536),
    ("expert down", 768, 2048),
]
CONFIGS = [
    (BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES),
    (64, 64, 4, 4),
    (64, 32, 4, 4),
    (64, 32, 4, 6),
    (64, 64, 4, 6),
    (64, 128, 8, 3),
    (128, 128, 8, 3),
    (32, 64, 4, 4),
    (16, 64, 4, 4),
    (16, 32, 4, 6),
    (16, 16, 2, 6),
    (64, 16, 4, 6),
    (32, 32, 4, 6),
    (16, 32, 2, 8),
    (16, 64, 4, 8),
    # for the wide lm_head at M = 65..256, where (128, 128) reads its 622 MB twice: one row block
    (256, 64, 8, 3),
    (256, 128, 8, 3),
    (128, 256, 8, 3),
]
MS = [1, 8, 64, 256]


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Triton matmul tile choices (BLOCK_K fixed): same bits as default? time (us)")
    table.add_column("BM,BN,warps,stages")
    for name, _, _ in SHAPES:
        table.add_column(name)
    g = torch.Generator(device="cuda").manual_seed(0)
    data = {}
    for name, k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        a = torch.randn(max(MS), k, device="cuda", generator=g).bfloat16()
        data[name] = (a, w, matmul(a, w.t(), tiles=CONFIGS[0]))
    for cfg in CONFIGS:
        cells = []
        for name, _, _ in SHAPES:
            a, w, ref = data[name]
            same = all(torch.equal(matmul(a[:m], w.t(), tiles=cfg), ref[:m]) for m in MS)
            times = [
                triton.testing.do_bench(lambda a=a, w=w, m=m, cfg=cfg: matmul(a[:m], w.t(), tiles=cfg))
                for m in (1, 64, 256)
            ]
            cells.append(f"{'same' if same else 'DIFF'} " + "/".join(f"{t * 1e3:.0f}" for t in times))
        table.add_row(str(cfg), *cells)
    Console(width=240).print(table)
    print("cells: bits vs default at M in", MS, "; time at M=1 / M=64 / M=256 in us")


if __name__ == "__main__":
    main()
