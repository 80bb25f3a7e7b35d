"""Which Triton tile choices of the MoE experts keep the bits? And what do they cost? (CUDA)

    python benchmarks/experts_configs.py [--tokens 1,8,...] [--only SUBSTRING]

At the Qwen3-30B-A3B experts shape (128 experts, top-8, H 2048, I 768) and T tokens routed at
random, runs `experts_forward` with each (BLOCK_M, BLOCK_N, warps, stages), BLOCK_K fixed,
compares the output bitwise with the small-batch configuration at every T, and times it at
each T against its floor: the larger of the weights of the experts the batch touches, read
once at the copy bandwidth measured in the same run, and the FLOPs at the tensor peak. A
configuration whose bits equal the default's everywhere may enter the tile table
(`kernels/experts_tiles.py`). The "auto" row is the table's choice; the "BLOCK_K 32" row is
for information only (samebits never changes BLOCK_K; on the H200 the MMAs add K in 16-wide
steps in order, so it may well keep the bits too), and so is the last row, torch's stock
grouped GEMM (`experts_grouped_mm`, other bits by design: the fast profile ran it until it
measured slower than the Triton kernel at every T here).
"""

from __future__ import annotations

import torch
import triton

from samebits.kernels.experts import experts_grouped_mm
from samebits.kernels.experts_launch import experts_forward
from samebits.kernels.experts_tiles import SMALL_TILES

E, K, H, INTER = 128, 8, 2048, 768
CONFIGS = (
    [  # (label, experts_forward keyword arguments); the first is the reference
        (f"{SMALL_TILES} small", dict(tiles=SMALL_TILES)),
        ("auto (tiles_for)", dict()),
        ("BLOCK_K 32 (info)", dict(tiles=SMALL_TILES, block_k=32)),
    ]
    + [
        (str(tiles), dict(tiles=tiles))
        for tiles in (
            (16, 32, 4, 4),
            (16, 64, 4, 4),
            (32, 32, 4, 4),
            (32, 64, 4, 3),
            (64, 32, 4, 4),
            (64, 128, 4, 3),
            (128, 64, 8, 3),
            (128, 128, 8, 3),
        )
    ]
    + [  # the row blocks in the grid (experts_triton._m_range): one program per block of an expert
        (f"{tiles} rows in grid", dict(tiles=tiles, m_in_grid=True))
        for tiles in (
            (64, 64, 4, 3),
            (64, 128, 4, 3),
            (128, 64, 8, 3),
            (128, 128, 8, 3),
            (128, 128, 8, 4),
            (128, 128, 4, 4),
            (128, 256, 8, 2),
            (256, 128, 8, 3),
            (64, 256, 8, 3),
            (256, 64, 8, 4),
        )
    ]
)
TOKENS = [1, 8, 64, 256, 512, 1024, 2048, 4096, 8192]
PEAK_TFLOPS = 989  # H100/H200 dense bf16 tensor peak: the FLOP floor of large T


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts T")
    p.add_argument("--only", default="", help="run only the configurations whose label contains this")
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    configs = [CONFIGS[0]] + [c for c in CONFIGS[1:] if args.only in c[0]]
    from rich.console import Console
    from rich.table import Table

    from samebits.bench.core import copy_bandwidth

    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    down = (torch.randn(E, H, INTER, device="cuda", generator=g) * INTER**-0.5).bfloat16()
    x = torch.randn(max(tokens), H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(max(tokens), E, device="cuda", generator=g)
    weights, index = torch.softmax(logits, -1).topk(K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    bw = copy_bandwidth(torch.device("cuda"))
    per_expert = 3 * H * INTER * 2  # bytes of one expert's gate, up and down

    def run(t, kw):
        return experts_forward(x[:t], index[:t], weights[:t], gate_up, down, **kw)

    ref = {t: run(t, configs[0][1]) for t in tokens}
    table = Table(title="Triton experts tile choices (BLOCK_K fixed): same bits as the default? us (x floor)")
    table.add_column("BM,BN,warps,stages")
    floors = {}
    for t in tokens:
        touched = index[:t].unique().numel()
        flops = t * K * 3 * H * INTER * 2  # gate, up and down of every routed pair
        floors[t] = max(1e6 * touched * per_expert / bw, flops / (PEAK_TFLOPS * 1e6))
        table.add_column(f"T={t} (floor {floors[t]:.0f} us)")
    for label, kw in configs:
        cells = []
        for t in tokens:
            try:
                same = torch.equal(run(t, kw), ref[t])
            except triton.runtime.errors.OutOfResources as e:  # a tile this GPU cannot hold
                cells.append(f"no: {e.name}")
                continue
            us = triton.testing.do_bench(lambda t=t, kw=kw: run(t, kw)) * 1e3
            cells.append(f"{'same' if same else 'DIFF'} {us:.0f} ({us / floors[t]:.1f}x)")
        table.add_row(label, *cells)
        print(label, *cells, flush=True)  # as it goes: the table comes at the end
    cells = []  # the stock grouped GEMM (other bits by design): where the fast profile switches to it
    for t in tokens:
        args = (x[:t], index[:t], weights[:t], gate_up, down)
        us = triton.testing.do_bench(lambda args=args: experts_grouped_mm(*args)) * 1e3
        cells.append(f"{us:.0f} ({us / floors[t]:.1f}x)")
    table.add_row("torch._grouped_mm (stock, info)", *cells)
    Console(width=240).print(table)


if __name__ == "__main__":
    main()
