"""The host's cost per op launch: stock aten, `batch_invariant()`'s overrides, the Triton GEMM (CUDA)

    python benchmarks/host_dispatch.py

The trainer's micro-batches are small (4 x 128 tokens), so its update is bound by the host
issuing kernels, not by the kernels (docs/performance.md, "The trainer is host-bound"). This
times, per call, the host side of the ops the trainer's layers run most, with inputs so small
that the device is never the bound (calls are issued back to back, one sync at the end):

- `stock`: aten before `batch_invariant()` was ever entered (no override registered);
- `stock, overrides installed`: the same call outside the context once the overrides are
  registered (every later stock call of an overridden op on CUDA passes through their
  Python wrapper: the autograd thread's backward, the stock arms);
- `batch_invariant()`: inside the context (the Triton kernels);
- `matmul_triton.matmul`: the GEMM's launcher called directly (no aten dispatch);
- the raw `matmul_kernel[grid](...)` launch: bound (`kernels.launch.fast_launch`, after its
  first call) and through Triton's `JITFunction.run` (`matmul_kernel.fn[grid]`).

Prints one table of us per call. The overrides cannot be unregistered, so the stock row is
measured first.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

CALLS = 2000


def per_call_us(fn, calls: int = CALLS) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / calls


def ops_under_test():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, 256, device="cuda", generator=g).bfloat16()
    w = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    wg = w.clone().requires_grad_(True)
    xf = x.float()
    return {
        "mm (F.linear, no grad)": lambda: F.linear(x, w),
        "F.linear + backward": lambda: F.linear(x, wg).sum().backward(),
        "sum.dim (fp32 row sum)": lambda: xf.sum(-1),
        "mean (rms-norm style)": lambda: xf.pow(2).mean(-1, keepdim=True),
        "softmax (fp32)": lambda: torch.softmax(xf, -1),
    }


def main() -> None:
    import triton
    from rich.console import Console
    from rich.table import Table

    from samebits.kernels import matmul_triton as mt
    from samebits.kernels.matmul_tiles import tiles_for
    from samebits.numerics.batch_invariant import batch_invariant

    ops = ops_under_test()
    rows: dict[str, dict[str, float]] = {name: {} for name in ops}
    for name, fn in ops.items():
        rows[name]["stock"] = per_call_us(fn)
    with batch_invariant():  # registers the overrides for good
        pass
    for name, fn in ops.items():
        rows[name]["stock, overrides installed"] = per_call_us(fn)
    with batch_invariant():
        for name, fn in ops.items():
            rows[name]["batch_invariant()"] = per_call_us(fn)
    x = torch.randn(16, 256, device="cuda").bfloat16()
    wt = torch.randn(256, 512, device="cuda").bfloat16()
    direct = per_call_us(lambda: mt.matmul(x, wt))
    c = torch.empty(16, 512, device="cuda", dtype=torch.bfloat16)
    bm, bn, warps, stages = tiles_for(16, 512)
    grid = (triton.cdiv(16, bm) * triton.cdiv(512, bn),)

    def raw(kernel=mt.matmul_kernel):
        kernel[grid](
            x, wt, c, c, 16, 512, 256, x.stride(0), x.stride(1), wt.stride(0), wt.stride(1),
            c.stride(0), c.stride(1), HAS_BIAS=False, IEEE=False, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=mt.BLOCK_K, GROUP_M=mt.GROUP_M, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    launch = per_call_us(raw)
    jit = getattr(mt.matmul_kernel, "fn", mt.matmul_kernel)  # SAMEBITS_FAST_LAUNCH=0: the JIT itself
    triton_launch = per_call_us(lambda: raw(jit))
    cols = ["stock", "stock, overrides installed", "batch_invariant()"]
    table = Table(title=f"host us per call (CUDA, tiny inputs, {CALLS} calls back to back)")
    table.add_column("op")
    for col in cols:
        table.add_column(col, justify="right")
    for name, by in rows.items():
        table.add_row(name, *(f"{by[c]:.1f}" for c in cols))
    table.add_row("matmul_triton.matmul (direct)", "", "", f"{direct:.1f}")
    table.add_row("matmul_kernel[grid] (raw launch, bound)", "", "", f"{launch:.1f}")
    table.add_row("matmul_kernel.fn[grid] (raw launch, Triton's run)", "", "", f"{triton_launch:.1f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
