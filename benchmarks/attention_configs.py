"""Decode and prefill attention: which paths keep the bits, and what they cost (CUDA)

    python benchmarks/attention_configs.py --batches 1,16,32,64,128,256 --context 1024 \
        [--baseline old_attention_triton.py] [--launches] [--chunks 64,128] [--json out.json]

At the Qwen3-30B-A3B attention shape (32 query heads, 4 kv heads, head dim 128, bf16,
paged cache of 16-token pages), one query per sequence at `--context` keys: runs
`attention_launch.attention` on each path (64-row tiles or transposed 16-row tiles, keys in
one program or split into parallel programs, merged by a second launch or by the last of them
to finish), compares the output bitwise with the default
path, and times it in a CUDA graph (as the engine replays decode) against the memory floor:
the K/V bytes read once at the copy bandwidth measured in the same run. Then packed prefill
(8 x `--context`, eager). `--baseline FILE`: also time another version of the kernels (e.g.
`git show REV:src/samebits/kernels/attention_triton.py > old.py`) on its default path, through
its own `attention` where the file has one, else through this launcher.
`--launches`: also sweep (num_warps, num_stages) on each path (they must not change bits).
`--chunks`: also time the default path with other chunk sizes (a chunk size is part of every
row's bits, engine and trainer alike: the question is which size to build in).
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch
import triton

from samebits.kernels import attention_launch as at
from samebits.kernels.attention_plan import plan
from samebits.kernels.attention_triton import BLOCK_N, CHUNK
from samebits.kernels.device_facts import sm_count

H, KVH, D, PAGE = 32, 4, 128, 16
LAUNCHES = [(4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (2, 2)]
PATHS = {  # name: (split, transposed, merge_last)
    "64 rows, one program": (False, False, None),
    "64 rows, split": (True, False, False),
    "64 rows, split, merged in the last program": (True, False, True),
    "16 rows transposed, one program": (False, True, None),
    "16 rows transposed, split": (True, True, False),
    "16 rows transposed, split, merged in the last program": (True, True, True),
}


def _inputs(batch: int, context: int, seed: int = 0, queries: int = 1):
    """K/V of `batch` sequences of `context` keys on scattered pages, `queries` queries each."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-context // PAGE)
    slots = batch * pages * PAGE
    k = torch.randn(slots, KVH, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(slots, KVH, D, device="cuda", generator=g).bfloat16()
    perm = torch.randperm(batch * pages, device="cuda", generator=g).int()  # scattered pages
    table = perm.view(batch, pages).contiguous()
    q = torch.randn(batch * queries, H, D, device="cuda", generator=g).bfloat16()
    i32 = dict(dtype=torch.int32, device="cuda")
    meta = (
        table,
        torch.arange(batch, **i32) * queries,
        torch.full((batch,), queries, **i32),
        torch.full((batch,), context, **i32),
    )
    return q, k, v, meta


def _load(path: str, name: str = "attention_baseline"):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if hasattr(mod, "attention"):
        return mod
    launcher = _load(at.__file__, "attention_baseline_launch")  # this launcher over the file's kernels
    launcher.attention_kernel, launcher.combine_kernel = mod.attention_kernel, mod.combine_kernel
    return launcher


def _graph_us(fn) -> float:
    fn()
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=50)


def decode_paths(batches, context, baseline, launches, bw, chunks=()) -> dict:
    """{"B=b": each path's bits (same as the default?) and CUDA-graph us, at each batch}."""
    return {f"B={b}": _decode_batch(b, context, baseline, launches, bw, chunks) for b in batches}


def _decode_batch(b, context, baseline, launches, bw, chunks) -> dict:
    q, k, v, meta = _inputs(b, context)
    row = {"floor_us": 1e6 * 2 * b * context * KVH * D * 2 / bw}
    ref = at.attention(q, k, v, *meta, 1, D**-0.5, PAGE)
    path = plan(1, b, KVH, H // KVH, D, q.dtype, sm_count(q.device))
    row["default"] = (
        f"split={path.split}, transposed={path.transposed}, "
        f"merged in the last program={path.merge_last}, "
        f"launch=({path.warps}, {path.stages})"
    )

    def call(split=None, tr=None, last=None, chunk=CHUNK, launch=None):
        return at.attention(
            q, k, v, *meta, 1, D**-0.5, PAGE, split=split, transposed=tr, merge_last=last, chunk=chunk,
            launch=launch,
        )  # fmt: skip

    for chunk in chunks:  # the default path with other chunk sizes: other bits, by design
        row[f"default path, chunk {chunk} (other bits)"] = {
            "same_bits": torch.equal(call(chunk=chunk), ref),
            "us": _graph_us(lambda chunk=chunk: call(chunk=chunk)),
        }
    for name, (split, tr, last) in PATHS.items():
        for launch in launches:
            p = plan(1, b, KVH, H // KVH, D, q.dtype, sm_count(q.device), split, tr)
            warps, stages = launch or (p.warps, p.stages)
            label = f"{name}, " + ("the plan's launch" if launch is None else f"{warps} warps, {stages} stages")
            try:
                same = torch.equal(call(split, tr, last, launch=launch), ref)
                row[label] = {
                    "launch": [warps, stages],
                    "same_bits": same,
                    "us": _graph_us(
                        lambda split=split, tr=tr, last=last, lc=launch: call(split, tr, last, launch=lc)
                    ),
                }
            except Exception as e:  # a launch that does not fit (shared memory): say so
                row[label] = {"error": f"{type(e).__name__}: {e}"[:200]}
    if baseline is not None:

        def old():
            return baseline.attention(q, k, v, *meta, 1, D**-0.5, PAGE)

        row["baseline default"] = {"us": _graph_us(old), "same_bits": torch.equal(old(), ref)}
    return row


def prefill(nseq, context, baseline, chunks=()) -> dict:
    q, k, v, meta = _inputs(nseq, context, queries=context)
    flops = 4 * nseq * H * D * context * (context + 1) / 2  # QK^T and PV over the causal half

    def run(mod, **kw):
        return mod.attention(q, k, v, *meta, context, D**-0.5, PAGE, **kw)

    res = {}
    arms = [("current", at, {}), ("baseline", baseline, {})]
    arms += [(f"chunk {c} (other bits)", at, {"chunk": c}) for c in chunks]
    for name, mod, kw in arms:
        if mod is None:
            continue
        us = 1000 * triton.testing.do_bench(lambda m=mod, kw=kw: run(m, **kw), warmup=10, rep=50)
        res[name] = {"us": us, "TFLOP/s": flops / us / 1e6}
    return res


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from samebits.bench.core import copy_bandwidth

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-seqs", type=int, default=8)
    p.add_argument("--baseline", default=None, help="another attention_triton.py to time beside this one")
    p.add_argument("--launches", action="store_true", help="sweep (num_warps, num_stages) too")
    p.add_argument(
        "--chunks",
        default="",
        help="also time the default path with these chunk sizes (other bits), e.g. 64,128",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    chunks = [int(c) for c in args.chunks.split(",") if c]
    if any(c <= 0 or c % BLOCK_N for c in chunks):
        p.error(f"--chunks: each a positive multiple of the key block ({BLOCK_N}), got {args.chunks}")
    baseline = _load(args.baseline) if args.baseline else None
    bw = copy_bandwidth(torch.device("cuda"))
    launches = [None, *LAUNCHES] if args.launches else [None]
    batches = [int(b) for b in args.batches.split(",")]
    res = {
        "gpu": torch.cuda.get_device_name(),
        "copy_bandwidth_GBps": bw / 1e9,
        "decode": decode_paths(batches, args.context, baseline, launches, bw, chunks),
        "prefill": prefill(args.prefill_seqs, args.context, baseline, chunks),
    }
    table = Table(
        title=f"decode attention at {args.context} keys, CUDA graph: same bits as the default? us (x floor)"
    )
    table.add_column("path")
    names = [n for n in next(iter(res["decode"].values())) if n not in ("floor_us", "default")]
    for b in batches:
        table.add_column(f"B={b} (floor {res['decode'][f'B={b}']['floor_us']:.0f} us)", justify="right")
    for name in names:
        cells = []
        for b in batches:
            row = res["decode"][f"B={b}"]
            c = row[name]
            floor = row["floor_us"]
            same = "same" if c.get("same_bits") else "DIFF"
            lc = f" {tuple(c['launch'])}" if "the plan's" in name and "launch" in c else ""
            cells.append(c["error"] if "error" in c else f"{same} {c['us']:.1f} ({c['us'] / floor:.2f}x){lc}")
        table.add_row(name, *cells)
    console = Console(width=200)
    console.print(table)
    console.print({f"B={b}": res["decode"][f"B={b}"]["default"] for b in batches})
    console.print("prefill", res["prefill"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
