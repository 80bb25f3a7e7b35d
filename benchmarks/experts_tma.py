"""Prefill experts fed by TMA: same bits as `experts_triton`? Faster? (an experiment, CUDA sm_90+)

    python benchmarks/experts_tma.py [--tokens 2048,4096,8192] [--configs "128,128,8,4;128,128,8,3"]
        [--out experts_tma.json]

At prefill sizes `experts_triton`'s gate_up and down kernels (the table's (128, 128, 8, 4)
tiles, row blocks in the grid) run at ~316 TFLOP/s on the H200, a third of the tensor peak
(docs/perf-notes.md). Their A operand is gathered: gate_up loads x's rows through `order` (pair
-> token) with pointer loads, and both kernels load the weight tiles as [BLOCK_K, BLOCK_N]
pointer grids. This benchmark asks whether feeding the same MMAs by TMA closes that:

- x is copied once into expert order (`x[order // top_k]`, one index_select: a copy, so
  exact), and the gate_up kernel here loads its [BLOCK_M, BLOCK_K] x tiles and
  [BLOCK_N, BLOCK_K] gate and up tiles with tensor descriptors; the down kernel loads the
  intermediate (already in expert order) and its weight tiles the same way.
- Rows of a tile past its expert's last row belong to the next expert (or are TMA's zero
  fill past the tensor's end): their products are computed and never stored, and no stored
  element reads them, so each stored element is still one fp32 accumulator walking its K
  from 0 up in BLOCK_K steps, one `tl.dot` a step, as in `experts_triton`.
- The epilogues (silu(gate) * up with its roundings; the routing weight and the scatter to
  the slot) are `experts_triton`'s (`store_gate_up`, `store_down`).

For each T (uniform random routing at the Qwen3-30B-A3B shape: 128 experts, top-8, H 2048,
I 768, bf16) it checks that the intermediate and the weighted slot outputs equal
`experts_triton.experts_forward(..., sum_slots=False)`'s bit for bit, and times (CUDA events,
the mean of --reps calls back to back) the current kernels, the current kernels with gate_up reading the sorted
copy of x (the gather alone, apart from TMA), and copy + the TMA kernels at each --configs tile
(BLOCK_M, BLOCK_N, num_warps, num_stages), as TFLOP/s of 6 * pairs * H * I. Not used by the
engine; if it wins with the same bits, the kernels move into `experts_triton` behind the
tile table's prefill entry.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from samebits.kernels import experts_triton
from samebits.kernels.experts_tiles import BLOCK_K, TILES_FROM_PAIRS, tiles_for

E, TOP_K, H, INTER = 128, 8, 2048, 768
LARGE_FROM_PAIRS = TILES_FROM_PAIRS[-1][0]  # the prefill entry (row blocks in the grid, large tiles)


@triton.jit
def gate_up_tma_kernel(
    xs_desc, w_desc, h_ptr, offsets_ptr, H, INTER, stride_hn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """`experts_triton.gate_up_kernel` (rows in the grid) on x in expert order, by TMA."""
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    e, m_lo, m_hi, end = experts_triton._m_range(offsets_ptr, tl.program_id(0), BLOCK_M, True, E, E_PAD)
    gate_row = e * (2 * INTER) + col0
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        in_rows = rows < end
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            x = xs_desc.load([m0, k0])  # [BM, BK]
            acc_gate = tl.dot(x, w_desc.load([gate_row, k0]).T, acc_gate)
            acc_up = tl.dot(x, w_desc.load([gate_row + INTER, k0]).T, acc_up)
        experts_triton.store_gate_up(acc_gate, acc_up, h_ptr, rows, in_rows, cols, INTER, stride_hn)


@triton.jit
def down_tma_kernel(
    h_desc, w_desc, out_ptr, weights_ptr, order_ptr, offsets_ptr, H, INTER, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """`experts_triton.down_kernel` (rows in the grid), its operands by TMA."""
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    e, m_lo, m_hi, end = experts_triton._m_range(offsets_ptr, tl.program_id(0), BLOCK_M, True, E, E_PAD)
    w_row = e * H + col0
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        in_rows = rows < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            acc = tl.dot(h_desc.load([m0, k0]), w_desc.load([w_row, k0]).T, acc)
        experts_triton.store_down(acc, out_ptr, weights_ptr, order_ptr, rows, in_rows, cols, H, stride_on)


def experts_tma(x, top_k_index, top_k_weights, gate_up, down, tiles):
    """-> (intermediate [pairs, I] in expert order, weighted slot outputs [T, K, H] fp32)."""
    t, k = top_k_index.shape
    e, two_i, h = gate_up.shape
    i = two_i // 2
    block_m, block_n, warps, stages = tiles
    order, offsets = experts_triton._route(top_k_index, e)
    xs = x.index_select(0, (order // k).long())  # x in expert order: one copy
    inter = torch.empty(t * k, i, dtype=x.dtype, device=x.device)
    rows_axis = triton.cdiv(t * k, block_m) + min(e, t * k)
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, E=e, E_PAD=triton.next_power_of_2(e))
    gate_up_tma_kernel[(rows_axis, triton.cdiv(i, block_n))](
        TensorDescriptor.from_tensor(xs, [block_m, BLOCK_K]),
        TensorDescriptor.from_tensor(gate_up.view(e * two_i, h), [block_n, BLOCK_K]),
        inter, offsets, h, i, inter.stride(0),
        num_warps=warps, num_stages=stages, **consts,
    )  # fmt: skip
    per_slot = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
    down_tma_kernel[(rows_axis, triton.cdiv(h, block_n))](
        TensorDescriptor.from_tensor(inter, [block_m, BLOCK_K]),
        TensorDescriptor.from_tensor(down.view(e * h, i), [block_n, BLOCK_K]),
        per_slot, top_k_weights, order, offsets, h, i, per_slot.stride(0),
        num_warps=warps, num_stages=stages, **consts,
    )  # fmt: skip
    return inter, per_slot.view(t, k, h)


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
    tokens_list = [int(v) for v in args.tokens.split(",")]
    small = [t for t in tokens_list if t * TOP_K < LARGE_FROM_PAIRS]
    if small:
        raise SystemExit(f"--tokens {small}: below the prefill tiles' entry ({LARGE_FROM_PAIRS} pairs)")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def record(row: dict) -> None:  # written after every row, so a stopped run keeps what it measured
        rows.append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)

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
    """`experts_triton`'s two kernels with rows in the grid -> (intermediate, slot outputs
    [T, K, H]); `sorted_x`: gate_up reads x copied into expert order (contiguous rows, an
    identity order) instead of gathering its rows through `order`: the gather alone, apart
    from TMA."""
    t, k = top_k_index.shape
    e, two_i, h = gate_up.shape
    i = two_i // 2
    block_m, block_n, warps, stages = tiles
    order, offsets = experts_triton._route(top_k_index, e)
    a, a_order = x, order
    if sorted_x:
        a = x.index_select(0, (order // k).long())
        a_order = torch.arange(0, t * k * k, k, dtype=torch.int32, device=x.device)  # token = row
    inter = torch.empty(t * k, i, dtype=x.dtype, device=x.device)
    rows_axis = triton.cdiv(t * k, block_m) + min(e, t * k)
    consts = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=warps, num_stages=stages,
        M_IN_GRID=True, E=e, E_PAD=triton.next_power_of_2(e),
    )  # fmt: skip
    experts_triton.gate_up_kernel[(rows_axis, triton.cdiv(i, block_n))](
        a, gate_up, inter, a_order, offsets, h, i, k, a.stride(0), gate_up.stride(0), gate_up.stride(1),
        inter.stride(0), **consts,
    )  # fmt: skip
    per_slot = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
    experts_triton.down_kernel[(rows_axis, triton.cdiv(h, block_n))](
        inter, down, per_slot, top_k_weights, order, offsets, h, i, inter.stride(0), down.stride(0),
        down.stride(1), per_slot.stride(0), **consts,
    )  # fmt: skip
    return inter, per_slot.view(t, k, h)


if __name__ == "__main__":
    main()
