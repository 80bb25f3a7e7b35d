"""Which Triton tile choices of the MoE experts keep the bits? And what do they cost? (CUDA)

    python benchmarks/experts_configs.py

At the Qwen3-30B-A3B experts shape (128 experts, top-8, H 2048, I 768) and T tokens routed at
random, runs `experts_forward` with each (BLOCK_M, BLOCK_N, warps, stages), BLOCK_K fixed,
compares the output bitwise with the default configuration at every T, and times it at each T
against the memory floor: the weights of the experts the batch touches, read once, at the
copy bandwidth measured in the same run. A configuration whose bits equal the default's
everywhere may be chosen per batch range (the issue's "tiles chosen per batch range").
"""

from __future__ import annotations

import torch
import triton

from samebits.kernels.experts_triton import BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS, experts_forward

E, K, H, INTER = 128, 8, 2048, 768
CONFIGS = [
    (BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES),
    (16, 32, 4, 4),
    (16, 64, 4, 4),
    (32, 32, 4, 4),
    (32, 64, 4, 3),
    (64, 32, 4, 4),
    (64, 128, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
]
TOKENS = [1, 8, 64, 256, 1024, 4096]


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from samebits.bench.core import copy_bandwidth

    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    down = (torch.randn(E, H, INTER, device="cuda", generator=g) * INTER**-0.5).bfloat16()
    x = torch.randn(max(TOKENS), H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(max(TOKENS), E, device="cuda", generator=g)
    weights, index = torch.softmax(logits, -1).topk(K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    bw = copy_bandwidth(torch.device("cuda"))
    per_expert = 3 * H * INTER * 2  # bytes of one expert's gate, up and down

    def run(t, cfg):
        return experts_forward(x[:t], index[:t], weights[:t], gate_up, down, tiles=cfg)

    ref = {t: run(t, CONFIGS[0]) for t in TOKENS}
    table = Table(title="Triton experts tile choices (BLOCK_K fixed): same bits as the default? us (x floor)")
    table.add_column("BM,BN,warps,stages")
    floors = {}
    for t in TOKENS:
        touched = index[:t].unique().numel()
        floors[t] = 1e6 * touched * per_expert / bw
        table.add_column(f"T={t} (floor {floors[t]:.0f} us)")
    for cfg in CONFIGS:
        cells = []
        for t in TOKENS:
            same = torch.equal(run(t, cfg), ref[t])
            us = triton.testing.do_bench(lambda t=t, cfg=cfg: run(t, cfg)) * 1e3
            cells.append(f"{'same' if same else 'DIFF'} {us:.0f} ({us / floors[t]:.1f}x)")
        table.add_row(str(cfg), *cells)
    Console(width=240).print(table)


if __name__ == "__main__":
    main()
