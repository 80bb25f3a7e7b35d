"""Prefill experts fed by TMA: the same bits as the pointer-fed kernels? Faster? (CUDA sm_90+)

    python benchmarks/experts_tma.py [--tokens 2048,4096,8192] [--configs "128,128,8,4;64,256,8,3"]
        [--reps 20] [--out experts_tma.json]

At prefill sizes `experts_triton`'s gate_up and down kernels (the table's (128, 128, 8, 4)
tiles, row blocks in the grid) run at ~316 TFLOP/s on the H200, a third of the tensor peak
(docs/perf-notes.md). Their A operand is gathered: gate_up loads x's rows through `order` (pair
-> token) with pointer loads, and both kernels load the weight tiles as [BLOCK_K, BLOCK_N]
pointer grids. `experts_triton.experts_tma` (the engine's path only with
SAMEBITS_TMA_EXPERTS=1, `experts_triton.TMA_PREFILL`) feeds the same MMAs by TMA:

- x is copied once into expert order (`x[order // top_k]`, one index_select: a copy, so
  exact); gate_up loads [BLOCK_M, BLOCK_K] x tiles and [BLOCK_N, BLOCK_K] gate and up tiles
  with tensor descriptors; down loads the intermediate (already in expert order) and its
  weight tiles the same way.
- Rows of a tile past its expert's last row belong to the next expert (or are TMA's zero
  fill past the tensor's end): their products are computed and never stored, and no stored
  element reads them, so each stored element is still one fp32 accumulator walking its K
  from 0 up in BLOCK_K steps, one `tl.dot` a step.
- The epilogues are the pointer kernels' (`store_gate_up`, `store_down`).

For each T (uniform random routing at the Qwen3-30B-A3B shape: 128 experts, top-8, H 2048,
I 768, bf16) it checks that the intermediate and the weighted slot outputs equal the pointer
kernels' (`experts_forward(..., sum_slots=False)` with TMA off) bit for bit, and times (CUDA
events, the mean of --reps calls back to back) the pointer kernels, the pointer kernels with
gate_up reading the sorted copy of x (the gather's cost alone), and the TMA path at each
--configs tile (BLOCK_M, BLOCK_N, num_warps, num_stages), as TFLOP/s of 6 * pairs * H * I,
and the copy of x alone. If TMA wins with the same bits, TMA_PREFILL goes on (after the GPU
test, the 48-layer probe and `samebits bench` prefill with it).
"""

from __future__ import annotations

import argparse
import functools

import torch

from samebits.bench.report import RowLog
from samebits.kernels import experts_triton
from samebits.kernels.experts_tiles import TILES_FROM_PAIRS, tiles_for

E, TOP_K, H, INTER = 128, 8, 2048, 768
LARGE_FROM_PAIRS = TILES_FROM_PAIRS[-1][0]  # the prefill entry (row blocks in the grid, large tiles)


def experts_tma(x, top_k_index, top_k_weights, gate_up, down, tiles):
    """`experts_triton.experts_tma` at these tiles -> (intermediate, slot outputs [T, K, H])."""
    t, k = top_k_index.shape
    order, offsets = experts_triton._route(top_k_index, gate_up.shape[0])
    inter, per_slot = experts_triton.experts_tma(x, order, offsets, k, top_k_weights, gate_up, down, tiles)
    return inter, per_slot.view(t, k, -1)


def _inputs(t: int, g: torch.Generator):
    x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    down = (torch.randn(E, H, INTER, device="cuda", generator=g) * INTER**-0.5).bfloat16()
    logits = torch.randn(t, E, device="cuda", generator=g)
    weights, index = torch.softmax(logits, -1).topk(TOP_K, -1)
    return x, index, weights.bfloat16().contiguous(), gate_up, down


def _mean_ms(fn, reps: int) -> float:
    """ms a call: `reps` calls back to back between one pair of events, after one warm-up
    (so the host's launch work overlaps the device's, as in the engine)."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2048,4096,8192")
    p.add_argument("--configs", default="128,128,8,4;128,128,8,3;64,256,8,3;64,128,4,4")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    experts_triton.TMA_PREFILL = False  # the reference arm: the pointer kernels, whatever the environment
    tokens_list = [int(v) for v in args.tokens.split(",")]
    small = [t for t in tokens_list if t * TOP_K < LARGE_FROM_PAIRS]
    if small:
        raise SystemExit(f"--tokens {small}: below the prefill tiles' entry ({LARGE_FROM_PAIRS} pairs)")
    g = torch.Generator(device="cuda").manual_seed(0)
    record = RowLog(args.out, device=torch.cuda.get_device_name()).add

    print(f"{'T':>6} {'arm':<28} {'us':>9} {'TFLOP/s':>8}  same bits (intermediate, slots)", flush=True)
    for t in tokens_list:
        inputs = _inputs(t, g)
        x, index, weights, gate_up, down = inputs
        flops = 6 * t * TOP_K * H * INTER
        want = experts_triton.experts_forward(x, index, weights, gate_up, down, sum_slots=False)
        table = tiles_for(t * TOP_K)
        want_inter, _ = experts_pointer(*inputs, table, sorted_x=False)
        arms = [
            (
                f"experts_triton {table}",
                functools.partial(experts_triton.experts_forward, *inputs, sum_slots=False),
            ),
            (f"sorted x, pointers {table}", functools.partial(experts_pointer, *inputs, table, True)),
        ] + [(f"tma {c}", functools.partial(experts_tma, *inputs, c)) for c in configs]
        for name, fn in arms:
            try:
                same = "reference"
                if not name.startswith("experts_triton"):
                    inter_b, slots_b = fn()
                    same = [torch.equal(want_inter, inter_b), torch.equal(want, slots_b)]
                    del inter_b, slots_b
                ms = _mean_ms(fn, args.reps)
            except Exception as exc:  # a tile that does not fit, compile or run: say so, go on
                print(f"{t:>6} {name:<28} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                record(dict(tokens=t, arm=name, error=f"{type(exc).__name__}: {exc}"[:500]))
                continue
            print(f"{t:>6} {name:<28} {1000 * ms:>9.1f} {flops / ms / 1e9:>8.1f}  {same}", flush=True)
            record(dict(tokens=t, arm=name, us=1000 * ms, tflops=flops / ms / 1e9, same=same))
        tokens = (experts_triton._route(index, E)[0] // TOP_K).long()
        copy_ms = _mean_ms(functools.partial(x.index_select, 0, tokens), args.reps)
        print(f"{t:>6} {'(of which the copy of x)':<28} {1000 * copy_ms:>9.1f}", flush=True)
        record(dict(tokens=t, arm="copy of x", us=1000 * copy_ms))


def experts_pointer(x, top_k_index, top_k_weights, gate_up, down, tiles, sorted_x: bool):
    """`experts_triton.experts_pointer` with rows in the grid -> (intermediate, slot outputs
    [T, K, H]); `sorted_x`: gate_up reads x copied into expert order (contiguous rows, an
    identity order) instead of gathering its rows through `order`: the gather's cost alone,
    apart from TMA."""
    t, k = top_k_index.shape
    order, offsets = experts_triton._route(top_k_index, gate_up.shape[0])
    x_order = None
    if sorted_x:
        x = x.index_select(0, order // k)
        x_order = torch.arange(0, t * k * k, k, dtype=torch.int32, device=x.device)  # token = row
    args = (x, order, offsets, k, top_k_weights, gate_up, down, tiles, True)
    inter, per_slot = experts_triton.experts_pointer(*args, x_order=x_order)
    return inter, per_slot.view(t, k, -1)


if __name__ == "__main__":
    main()
