"""The MoE experts at decode sizes: which tiles fill the H200 when a batch routes few pairs? (CUDA)

    python benchmarks/experts_decode.py [--tokens 1,4,16,64,256] [--layers 8] [--json out.json]
        [--configs "64,128,4,3,walk;32,64,4,4,grid"]

At one decode token the experts read 8 experts' gate, up and down weights (37.7 MB at the
Qwen3-30B-A3B shape: 128 experts, top-8, H 2048, I 768), 8.8 us at 4.3 TB/s; the 2026-12-04
profile measured gate_up + down at 40 us a layer (docs/performance.md). With the
small tiles (64, 64, 4, 3) and one program per (expert, column tile), gate_up runs 96 programs
with rows (8 experts x 12 column tiles) among 1,536, each streaming a 512 KB weight slab:
fewer programs than SMs, each on a short pipeline. Narrower column tiles give more programs
with rows; row blocks in the grid (`m_in_grid`) drop the programs of experts with no rows.

For each T and each (BLOCK_M, BLOCK_N, warps, stages, rows in grid), BLOCK_K fixed, times the
whole `experts_forward` (route, gate_up, down, slot sum) in a CUDA graph over `--layers`
layers of distinct weights (so they come from memory, not L2, as in a 48-layer step), us a
layer, and compares the output bitwise with the table's choice. Floor: the touched experts'
bytes at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from samebits.kernels.experts_launch import experts_forward
from samebits.kernels.experts_tiles import m_in_grid_for, tiles_for

E, K, H, INTER = 128, 8, 2048, 768
CONFIGS = [  # (BLOCK_M, BLOCK_N, warps, stages), rows in grid
    ((64, 64, 4, 3), False),
    ((64, 64, 4, 3), True),
    ((16, 64, 4, 4), True),
    ((16, 64, 4, 6), True),
    ((16, 32, 4, 4), True),
    ((16, 32, 4, 6), True),
    ((16, 32, 2, 6), True),
    ((16, 16, 2, 6), True),
    ((16, 128, 4, 4), True),
    ((32, 32, 4, 4), True),
    ((32, 64, 4, 4), True),
    ((64, 32, 4, 4), True),
]


def _config(text: str) -> tuple[tuple[int, int, int, int], bool]:
    *nums, rows = text.split(",")
    if len(nums) != 4 or rows not in ("grid", "walk"):
        raise SystemExit(f"--configs: want 'BM,BN,warps,stages,grid|walk', got {text!r}")
    return tuple(int(n) for n in nums), rows == "grid"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,4,16,64,256")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--configs",
        default=None,
        help="tiles to time instead of the built-in list: 'BM,BN,warps,stages,grid|walk;...'",
    )
    args = p.parse_args()
    configs = CONFIGS if args.configs is None else [_config(c) for c in args.configs.split(";") if c]
    from samebits.bench.core import copy_bandwidth

    tokens = [int(x) for x in args.tokens.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [
        (
            (torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * H**-0.5).bfloat16(),
            (torch.randn(E, H, INTER, device="cuda", generator=g) * INTER**-0.5).bfloat16(),
        )
        for _ in range(args.layers)
    ]
    x = torch.randn(max(tokens), H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(max(tokens), E, device="cuda", generator=g)
    weights, index = torch.softmax(logits, -1).topk(K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    bw = copy_bandwidth(torch.device("cuda"))
    per_expert = 3 * H * INTER * 2
    out: dict = {"bandwidth_gbs": bw / 1e9, "layers": args.layers, "rows": []}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; {args.layers} layers of distinct weights; us a layer")
    header = f"{'tiles, rows in grid':28s}" + "".join(f"{'T=' + str(t):>16s}" for t in tokens)
    floors = {t: 1e6 * index[:t].unique().numel() * per_expert / bw for t in tokens}
    print(f"{'floor':28s}" + "".join(f"{floors[t]:>16.1f}" for t in tokens))
    print(header)
    best: dict[int, tuple[float, str]] = {}
    for t in tokens:
        auto = (tiles_for(t * K), m_in_grid_for(t * K))
        print(f"  (T={t}: the table's choice is {auto})")
    for tiles, in_grid in configs:
        label = f"{tiles} {'grid' if in_grid else '-'}"
        cells, row = [], {"tiles": tiles, "m_in_grid": in_grid}
        for t in tokens:
            ref = experts_forward(x[:t], index[:t], weights[:t], *layers[0])
            got = experts_forward(x[:t], index[:t], weights[:t], *layers[0], tiles=tiles, m_in_grid=in_grid)
            same = torch.equal(ref, got)

            def step(t=t, tiles=tiles, in_grid=in_grid):
                for gu, dn in layers:
                    experts_forward(x[:t], index[:t], weights[:t], gu, dn, tiles=tiles, m_in_grid=in_grid)

            us = 1000 * triton.testing.do_bench_cudagraph(step, rep=100) / args.layers
            cells.append(f"{'' if same else 'DIFF '}{us:.1f}")
            row[f"T={t}"] = {"us": us, "same_bits": same}
            if same and (t not in best or us < best[t][0]):
                best[t] = (us, label)
        out["rows"].append(row)
        print(f"{label:28s}" + "".join(f"{c:>16s}" for c in cells))
    print(
        "fastest with the table's bits: " + "; ".join(f"T={t}: {b[1]} {b[0]:.1f} us" for t, b in best.items())
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
