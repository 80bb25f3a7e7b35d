"""Prefill-sized tiles that keep the bits: attention rows per tile, TMA-fed dense GEMMs (CUDA)

    python benchmarks/prefill_tiles.py [--parts attention,experts,matmul] [--json out.json]

Attention (Qwen3-30B-A3B heads: 32 query, 4 kv, head dim 128, bf16, 16-token pages): packed
prefill of `--seqs` x `--context` and a chunked prefill (the second half of each sequence
over its cached first half), each at (token, head) rows per tile in {64, 128, 256} and a few
(warps, stages), compared bitwise with the default launch and timed eagerly (TFLOP/s over the
causal half). A 64-key block's work per K/V load grows with the rows of a tile, so more rows
read the keys from L2 fewer times; a row's own operations are the same.

Experts (`--tokens`): the pointer loads against TMA (gate_up's weights, down's operands) at
several tiles, compared bitwise with the table's launch.

Dense GEMMs at prefill sizes (`--ms`): the pointer kernel at the table's tiles and at wider
ones, `matmul_tma` (operand tiles loaded by tensor descriptors) in one program per tile and
in a persistent grid of one program a SM, each compared bitwise with the table's launch,
and cuBLAS (`torch.mm`, outside batch_invariant) for scale.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from samebits.kernels import attention_launch as at
from samebits.kernels import matmul_triton as mt
from samebits.kernels.device_facts import sm_count
from samebits.kernels.matmul_tiles import tiles_for

H, KVH, D, PAGE = 32, 4, 128, 16
ROWS = (64, 128, 256)
LAUNCHES = ((4, 3), (8, 2), (8, 3), (4, 2))
SHAPES = {"q+k+v": (2048, 5120), "o_proj": (4096, 2048), "router": (2048, 128), "lm_head": (2048, 151936)}
TILES = ((128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (128, 64, 4, 4))


def _us(fn) -> float:
    return 1000 * triton.testing.do_bench(fn, warmup=10, rep=60)


def _cache(nseq: int, context: int, g: torch.Generator):
    pages = -(-context // PAGE)
    k = torch.randn(nseq * pages * PAGE, KVH, D, device="cuda", generator=g).bfloat16()
    v = torch.randn_like(k)
    table = torch.randperm(nseq * pages, device="cuda", generator=g).int().view(nseq, pages).contiguous()
    return k, v, table


def attention_part(nseq: int, context: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    k, v, table = _cache(nseq, context, g)
    i32 = dict(dtype=torch.int32, device="cuda")
    res = {}
    for name, q_len in (("packed prefill", context), ("chunked prefill, second half", context // 2)):
        q = torch.randn(nseq * q_len, H, D, device="cuda", generator=g).bfloat16()
        meta = (
            table,
            torch.arange(nseq, **i32) * q_len,
            torch.full((nseq,), q_len, **i32),
            torch.full((nseq,), context, **i32),
        )
        done = context - q_len
        flops = 4 * nseq * H * D * (q_len * done + q_len * (q_len + 1) / 2)

        def call(rows=None, launch=None, q=q, meta=meta, q_len=q_len):
            return at.attention(q, k, v, *meta, q_len, D**-0.5, PAGE, rows=rows, launch=launch)

        ref = call()
        row = {}
        for rows in ROWS:
            for launch in LAUNCHES:
                label = f"rows {rows}, {launch[0]} warps, {launch[1]} stages"
                try:
                    out = call(rows, launch)
                    us = _us(lambda r=rows, lc=launch: call(r, lc))
                    row[label] = {"same_bits": torch.equal(out, ref), "us": us, "TFLOP/s": flops / us / 1e6}
                except Exception as e:  # a launch that does not fit (shared memory, registers): say so
                    row[label] = {"error": f"{type(e).__name__}: {e}"[:200]}
                print(name, label, row[label], flush=True)
        res[name] = row
    return res


def matmul_part(ms: list[int], shapes: list[str]) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    sms = sm_count(torch.device("cuda"))
    res = {}
    for shape in shapes:
        kdim, n = SHAPES[shape]
        w = (torch.randn(n, kdim, device="cuda", generator=g) * 0.02).bfloat16()
        for m in ms:
            if shape == "lm_head" and m > 2048:
                continue
            x = torch.randn(m, kdim, device="cuda", generator=g).bfloat16()
            flops = 2 * m * kdim * n
            ref = mt.matmul(x, w.t(), tiles=tiles_for(m, n))  # the pointer kernel at the table's tiles
            small = mt.matmul(x[:16], w.t())  # the decode launch's rows: the row invariance
            row = {"table tiles": str(tiles_for(m, n)), "rows = 16-row launch": torch.equal(ref[:16], small)}
            row.update(_matmul_arms(x, w, ref, flops, sms, f"{shape} M={m}", tiles_for(m, n)))
            res[f"{shape} M={m}"] = row
    return res


def _matmul_arms(x, w, ref, flops, sms, name, table) -> dict:
    arms = [
        ("pointer, table", lambda: mt.matmul(x, w.t(), tiles=table)),
        ("matmul (the default)", lambda: mt.matmul(x, w.t())),
    ]
    arms += [(f"pointer {t}", lambda t=t: mt.matmul(x, w.t(), tiles=t)) for t in TILES]
    arms += [(f"tma {t}", lambda t=t: mt.matmul_tma(x, w.t(), tiles=t)) for t in TILES]
    arms += [(f"tma persistent {t}", lambda t=t: mt.matmul_tma(x, w.t(), tiles=t, programs=sms)) for t in TILES]
    arms += [("cublas", lambda: torch.mm(x, w.t()))]
    row = {}
    for label, fn in arms:
        try:
            out = fn()
            us = _us(fn)
            row[label] = {"same_bits": torch.equal(out, ref), "us": us, "TFLOP/s": flops / us / 1e6}
        except Exception as e:
            row[label] = {"error": f"{type(e).__name__}: {e}"[:200]}
        print(name, label, row[label], flush=True)
    return row


EXPERT_TILES = ((128, 128, 8, 4), (128, 128, 8, 3), (64, 256, 8, 3))
DOWN_TILES = ((128, 256, 8, 3), (256, 128, 8, 3), (128, 256, 8, 4), (64, 256, 8, 4))


def experts_part(tokens: list[int]) -> dict:
    """The Qwen3-30B-A3B experts (128, top-8, H 2048, I 768) at prefill sizes: pointer loads
    against TMA for gate_up's weights, down's operands or both, at the table's tiles and others
    (row blocks in the grid), each compared bitwise with the table's pointer launch."""
    from samebits.kernels.experts_launch import experts_forward
    from samebits.kernels.experts_tiles import tiles_for as experts_tiles

    e, k, h, inter = 128, 8, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    down = (torch.randn(e, h, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    res = {}
    for t in tokens:
        x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        weights, index = torch.softmax(torch.randn(t, e, device="cuda", generator=g), -1).topk(k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
        flops = 2 * t * k * 3 * h * inter

        def call(tiles=None, tma=(False, False), down_tiles=None, args=(x, index, weights, gate_up, down)):
            return experts_forward(*args, tiles=tiles, m_in_grid=True, tma=tma, down_tiles=down_tiles)

        ref = call(experts_tiles(t * k))
        row = {"table tiles": str(experts_tiles(t * k))}
        for tiles in EXPERT_TILES:
            for tma in ((False, False), (True, False), (False, True), (True, True)):
                label = f"{tiles}, tma gate_up {tma[0]}, down {tma[1]}"
                try:
                    out = call(tiles, tma)
                    us = _us(lambda tiles=tiles, tma=tma: call(tiles, tma))
                    row[label] = {"same_bits": torch.equal(out, ref), "us": us, "TFLOP/s": flops / us / 1e6}
                except Exception as ex:
                    row[label] = {"error": f"{type(ex).__name__}: {ex}"[:200]}
                print(f"experts T={t}", label, row[label], flush=True)
        table = experts_tiles(t * k)
        for dt in DOWN_TILES:  # down's own tiles beside the table's gate_up
            for tma in ((False, False), (False, True), (True, True)):
                label = f"table gate_up, down {dt}, tma gate_up {tma[0]}, down {tma[1]}"
                try:
                    out = call(table, tma, dt)
                    us = _us(lambda dt=dt, tma=tma, tb=table: call(tb, tma, dt))
                    row[label] = {"same_bits": torch.equal(out, ref), "us": us, "TFLOP/s": flops / us / 1e6}
                except Exception as ex:
                    row[label] = {"error": f"{type(ex).__name__}: {ex}"[:200]}
                print(f"experts T={t}", label, row[label], flush=True)
        res[f"T={t}"] = row
    return res


def norms_part(tokens: list[int]) -> dict:
    """The two RMSNorms of a layer at prefill sizes (H 2048, bf16): the input norm that sums the
    experts' 8 fp32 slot outputs first, and the post-attention add + norm, at several warps,
    against their bytes at the copy bandwidth; bits compared with the default launch."""
    from samebits.bench.core import copy_bandwidth
    from samebits.kernels.norm_rope_triton import rms_norm, slot_add_rms_norm

    bw = copy_bandwidth(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    h, k = 2048, 8
    w = torch.randn(h, device="cuda", generator=g).bfloat16()
    res = {}
    for t in tokens:
        slots = torch.randn(t, k, h, device="cuda", generator=g)
        r = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        arms = {
            "slot norm": (lambda wp, a=(slots, r, w): slot_add_rms_norm(*a, 1e-6, wp), t * h * (4 * k + 2 * 3)),
            "add + norm": (lambda wp, a=(x, w, 1e-6, r): rms_norm(*a, wp), t * h * 2 * 4),
        }
        for name, (fn, nbytes) in arms.items():
            ref = fn(None)
            row = {"floor_us": 1e6 * nbytes / bw}
            for wp in (None, 2, 4, 8, 16):
                out = fn(wp)
                us = _us(lambda fn=fn, wp=wp: fn(wp))
                row[f"warps {wp or 'default'}"] = {
                    "same_bits": all(torch.equal(a, b) for a, b in zip(out, ref, strict=True)),
                    "us": us,
                }
            print(f"T={t} {name}", row, flush=True)
            res[f"T={t} {name}"] = row
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="attention,matmul")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--ms", default="1024,4096,8192")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default="2048,8192", help="experts part: tokens (top-8 pairs = 8x)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    parts = args.parts.split(",")
    res = {"gpu": torch.cuda.get_device_name()}
    if "attention" in parts:
        res["attention"] = attention_part(args.seqs, args.context)
    if args.json:
        json.dump(res, open(args.json, "w"), indent=1)
    if "norms" in parts:
        res["norms"] = norms_part([int(t) for t in args.tokens.split(",")])
    if "experts" in parts:
        res["experts"] = experts_part([int(t) for t in args.tokens.split(",")])
    if "matmul" in parts:
        res["matmul"] = matmul_part([int(m) for m in args.ms.split(",")], args.shapes.split(","))
    if args.json:
        json.dump(res, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
