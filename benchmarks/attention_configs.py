"""Decode attention: which launch choices keep the bits, and what they cost (CUDA)

    python benchmarks/attention_configs.py --batches 1,64,256 --context 1024

At the Qwen3-30B-A3B attention shape (32 query heads, 4 kv heads, head dim 128, bf16,
paged cache of 16-token pages), one query per sequence at `--context` keys: runs
`attention_triton.attention` with the split on and off and with each (num_warps,
num_stages) below (BLOCK_M, BLOCK_N and CHUNK fixed: they set the bits), compares the
output bitwise with the default launch, and times it against the memory floor (the K/V
bytes read once at the copy bandwidth measured in the same run).
"""

from __future__ import annotations

import argparse

import torch
import triton

from samebits.kernels import attention_triton as at

H, KVH, D, PAGE = 32, 4, 128, 16
LAUNCHES = [(4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (2, 2)]


def _inputs(batch: int, context: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-context // PAGE)
    slots = batch * pages * PAGE
    k = torch.randn(slots, KVH, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(slots, KVH, D, device="cuda", generator=g).bfloat16()
    perm = torch.randperm(batch * pages, device="cuda", generator=g).int()  # scattered pages
    table = perm.view(batch, pages).contiguous()
    q = torch.randn(batch, H, D, device="cuda", generator=g).bfloat16()
    i32 = dict(dtype=torch.int32, device="cuda")
    meta = (table, torch.arange(batch, **i32), torch.ones(batch, **i32), torch.full((batch,), context, **i32))
    return q, k, v, meta


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from samebits.bench.core import copy_bandwidth

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    default = (at.NUM_WARPS, at.NUM_STAGES)
    table = Table(title=f"decode attention at {args.context} keys: same bits as the default? us (x floor)")
    table.add_column("split, warps, stages")
    batches = [int(b) for b in args.batches.split(",")]
    cells: dict[tuple, list[str]] = {}
    for b in batches:
        q, k, v, meta = _inputs(b, args.context)
        floor = 1e6 * 2 * b * args.context * KVH * D * 2 / bw
        table.add_column(f"B={b} (floor {floor:.0f} us)", justify="right")

        def call(split, q=q, k=k, v=v, meta=meta):
            return at.attention(q, k, v, *meta, 1, D**-0.5, PAGE, split=split)

        ref = call(None)
        for split in (False, True):
            for launch in LAUNCHES:
                at.NUM_WARPS, at.NUM_STAGES = launch
                try:
                    same = "same" if torch.equal(call(split), ref) else "DIFF"
                    us = 1000 * triton.testing.do_bench(lambda s=split: call(s), warmup=10, rep=50)
                    cell = f"{same} {us:.0f} ({us / floor:.1f}x)"
                except Exception as e:  # a launch that does not fit (shared memory): say so
                    cell = f"fails: {type(e).__name__}"
                finally:
                    at.NUM_WARPS, at.NUM_STAGES = default
                cells.setdefault((split, *launch), []).append(cell)
    for (split, w, s), row in cells.items():
        table.add_row(f"{'split' if split else 'one program'}, {w}, {s}", *row)
    Console().print(table)


if __name__ == "__main__":
    main()
