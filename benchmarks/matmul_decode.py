"""The decode GEMMs' tiles as the engine runs them: CUDA graph, weights from DRAM. (CUDA)

    python benchmarks/matmul_decode.py [--ms 1,8,64,256] [--configs "64,32,4,6;16,16,2,12"]
        [--tma-configs "64,128,4,4;128,128,8,3"] [--shapes q+k+v,o_proj,router] [--replays 20]
        [--bandwidth 4.3e12] [--out matmul_decode.json]

`benchmarks/matmul_configs.py` times each tile eagerly on one weight, which then sits in the
H200's 50 MB L2 and behind ~20 us of host launch: at decode sizes it measures neither the
bytes nor the latency the engine sees. Here each shape gets enough distinct weight copies
to pass L2, one `matmul_triton.matmul` per copy is captured in a CUDA graph (PDL as the
engine launches them), and a call's time is the replay's over the copies.

Why other tiles might win at small M: a decode GEMM reads its weight once and is bound by
the bytes in flight. (64, 32, 4, 6) at M = 1 gives o_proj (K 4096, N 2048) 64 programs,
each with 6 stages x 4 KB of weight in flight: ~1.5 MB over the whole GPU, against the
~4 MB that the H200's bandwidth times its ~1 us latency asks for (measured 12.9 us against a
3.9 us floor, H200, 2026-12-04); the router (N 128) gets 4 programs. Narrower BLOCK_N gives
more programs, deeper stages more bytes each, BLOCK_M 16 a smaller x tile per stage.

Every configuration is checked for the same bits (BLOCK_K never changes, so each element's K
order should not; module docstring of `matmul_triton`): its M rows against the launcher's at
that M, and 4096 rows through it against the launcher's 4096-row (trainer-sized) launch (bf16
outputs hide most fp32 differences, so a few rows alone would rarely show another K order).
`--tma-configs` times `matmul_tma` (operand tiles loaded by tensor descriptors, the prefill
GEMMs' launch) at these sizes, captured in the graph the same way (its descriptors are encoded
on the host at capture and replayed by value), checked for the same bits the same way.
Prints us a call and the fraction of the floor (weight bytes over --bandwidth); writes JSON
with --out after every row. A configuration that wins with the same bits goes into
`matmul_tiles.tiles_for` by (M, N).
"""

from __future__ import annotations

import argparse

import torch

from samebits.bench.report import RowLog
from samebits.kernels.matmul_tiles import tiles_for
from samebits.kernels.matmul_triton import matmul, matmul_tma

SHAPES = {  # name -> (K, N) of the Qwen3-30B-A3B decode GEMMs
    "q+k+v": (2048, 5120),
    "o_proj": (4096, 2048),
    "router": (2048, 128),
    "lm_head": (2048, 151936),
}
L2_BYTES = 50 << 20
ROWS_CHECKED = 4096  # rows each tile is checked on, beside the timed M


def _product(a, w, tiles, tma: bool) -> torch.Tensor:
    return matmul_tma(a, w.t(), tiles=tiles) if tma else matmul(a, w.t(), tiles=tiles)


def _call_us(a, weights, tiles, replays: int, tma: bool = False) -> float:
    run = [lambda w=w: _product(a, w, tiles, tma) for w in weights]
    for f in run:  # compile and warm up outside the capture
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in run:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(stop) / replays / len(weights)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default="1,8,64,256")
    p.add_argument("--shapes", default="q+k+v,o_proj,router")
    p.add_argument(
        "--configs",
        default="16,32,4,6;16,32,4,8;16,32,4,12;16,16,2,8;16,16,2,12;16,16,4,12;32,32,4,8;16,64,4,8;64,16,4,8",
        help="(BLOCK_M, BLOCK_N, warps, stages) tiles beside the launcher's own, ';'-separated",
    )
    p.add_argument(
        "--tma-configs",
        default="",
        help="(BLOCK_M, BLOCK_N, warps, stages) tiles of the TMA-fed kernel (matmul_tma), ';'-separated",
    )
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the floor (the copy rate)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    configs = [(False, tuple(int(v) for v in c.split(","))) for c in args.configs.split(";") if c]
    configs += [(True, tuple(int(v) for v in c.split(","))) for c in args.tma_configs.split(";") if c]
    g = torch.Generator(device="cuda").manual_seed(0)
    record = RowLog(args.out, device=torch.cuda.get_device_name(), bandwidth=args.bandwidth).add

    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        nbytes = k * n * 2
        copies = max(1, -(-3 * L2_BYTES // nbytes))
        weights = [(torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16() for _ in range(copies)]
        x = torch.randn(max(ms), k, device="cuda", generator=g).bfloat16()
        floor_us = 1e6 * nbytes / args.bandwidth
        mb = nbytes / 1e6
        head = f"{name}: K {k}, N {n}, {mb:.1f} MB of weight ({copies} copies), floor {floor_us:.1f} us"
        print(f"\n{head}", flush=True)
        print(f"{'tiles':<18}" + "".join(f"{'M=' + str(m):>16}" for m in ms))
        many = torch.randn(ROWS_CHECKED, k, device="cuda", generator=g).bfloat16()
        trainer_rows = matmul(many, weights[0].t())  # the launcher's tiles at this M (a trainer's)
        for tma, tiles in [(False, None), *configs]:
            label = "launcher's" if tiles is None else ("tma " if tma else "") + ",".join(map(str, tiles))
            cells = []
            for m in ms:
                a = x[:m]
                chosen = tiles or tiles_for(m, n)
                try:
                    # the bits: these M rows as the launcher computes them; ROWS_CHECKED rows
                    # through these tiles against the trainer-sized launch (module docstring)
                    same = torch.equal(_product(a, weights[0], chosen, tma), matmul(a, weights[0].t()))
                    same = same and torch.equal(_product(many, weights[0], chosen, tma), trainer_rows)
                    us = _call_us(a, weights, chosen, args.replays, tma)
                except Exception as exc:  # a tile that does not fit: say so, go on
                    cells.append("failed")
                    record(
                        dict(shape=name, m=m, tiles=chosen, tma=tma, error=f"{type(exc).__name__}: {exc}"[:300])
                    )
                    continue
                cells.append(f"{us:.1f}{'' if same else ' DIFF'} ({floor_us / us:.2f})")
                record(dict(shape=name, m=m, tiles=chosen, tma=tma, launcher=tiles is None, us=us, same=same))
            print(f"{label:<18}" + "".join(f"{c:>16}" for c in cells), flush=True)
    print("\ncells: us a call in a CUDA graph (of the floor); DIFF: other bits than the launcher's tiles")


if __name__ == "__main__":
    main()
