"""Does programmatic dependent launch (PDL) shorten a batch-1 decode step? (CUDA, Hopper)

    python benchmarks/pdl_chain.py [--layers 48] [--json out.json]

A batch-1 decode layer is ~17 launches of a few us each (docs/performance.md,
2026-12-04): the step is the sum of the kernels' fixed costs, not bytes. With PDL a kernel's
programs may be launched while the kernel before it is still finishing; they wait for it at
`gdc_wait()` before touching its outputs. This times a stand-in for the layer's launch
chain in a CUDA graph (as the engine replays decode), `--layers` times over distinct weights
(so they come from memory, not L2): per layer the q+k+v GEMV, an elementwise op on its output,
the o_proj GEMV and the router GEMV, each a copy of samebits' matmul kernel (the same K loop)
with a `gdc_wait()` before its first load and `gdc_launch_dependents()` at its start.

Arms (same kernels, same bits; the table says whether the outputs are equal):
- `plain`: launched as now;
- `pdl`: launched with `launch_pdl=True`, each kernel letting the next launch at its start;
- `pdl-late`: the same, letting the next launch only after its main loop (the usual place: the
  next kernel's programs then wait in `gdc_wait()` without holding SMs the current one needs).
H200, 2026-12-04, `pdl` only: plain 1.439 ms (7.49 us a launch), pdl 2.753 ms (14.34 us).
Nothing in samebits uses PDL; this measures whether it would pay.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES = 16, 32, 64, 4, 6


@triton.jit
def gemv_kernel(
    a_ptr, w_ptr, c_ptr, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LATE: tl.constexpr,
):  # fmt: skip
    """c[:1] = a[:1] @ w.T for w [N, K] (row 0 of a BLOCK_M tile, as the decode GEMMs). LATE: let
    the next kernel launch after the K loop rather than at the start."""
    if not LATE:
        gdc_launch_dependents()
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gdc_wait()  # a is the kernel before's output
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < 1) & (offs_k[None, :] < K - k * BLOCK_K), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_n[None, :] < N) & (offs_k[:, None] < K - k * BLOCK_K), other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if LATE:
        gdc_launch_dependents()
    tl.store(
        c_ptr + offs_m[:, None] * N + offs_n[None, :],
        acc.to(tl.bfloat16),
        mask=(offs_m[:, None] < 1) & (offs_n[None, :] < N),
    )


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, LATE: tl.constexpr):
    """y = 0.5 * x (a stand-in for the norm and rotary launches between the GEMMs)."""
    if not LATE:
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gdc_wait()
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    if LATE:
        gdc_launch_dependents()
    tl.store(y_ptr + offs, (x.to(tl.float32) * 0.5).to(tl.bfloat16), mask=offs < n)


def gemv(a, w, c, pdl: bool, late: bool) -> None:
    n, k = w.shape
    gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        a, w, c, n, k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, LATE=late,
        num_warps=WARPS, num_stages=STAGES, launch_pdl=pdl,
    )  # fmt: skip


def chain(layers: list[dict], x, pdl: bool, late: bool = False) -> torch.Tensor:
    for w in layers:
        gemv(x, w["qkv"], w["qkv_out"], pdl, late)
        scale_kernel[(triton.cdiv(4096, 1024),)](
            w["qkv_out"], w["attn"], 4096, BLOCK=1024, LATE=late, launch_pdl=pdl
        )  # fmt: skip
        gemv(w["attn"], w["o"], w["o_out"], pdl, late)
        gemv(w["o_out"], w["router"], w["router_out"], pdl, late)
        x = w["o_out"]
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * shape[-1] ** -0.5).bfloat16()

    layers = [
        {
            "qkv": randn(5120, 2048), "o": randn(2048, 4096), "router": randn(128, 2048),
            "qkv_out": torch.empty(BLOCK_M, 5120, device="cuda", dtype=torch.bfloat16),
            "attn": torch.zeros(BLOCK_M, 4096, device="cuda", dtype=torch.bfloat16),
            "o_out": torch.empty(BLOCK_M, 2048, device="cuda", dtype=torch.bfloat16),
            "router_out": torch.empty(BLOCK_M, 128, device="cuda", dtype=torch.bfloat16),
        }
        for _ in range(args.layers)
    ]  # fmt: skip
    x = torch.zeros(BLOCK_M, 2048, device="cuda", dtype=torch.bfloat16)
    x[0] = randn(2048)
    launches = 4 * args.layers
    weight_bytes = sum(w[k].numel() * 2 for w in layers for k in ("qkv", "o", "router"))
    out = {"layers": args.layers, "launches": launches, "weight_mb": weight_bytes / 1e6}
    results = {}
    arms = (("plain", False, False), ("pdl", True, False), ("pdl-late", True, True))
    for arm, pdl, late in arms:
        chain(layers, x, pdl, late)
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(lambda pdl=pdl, late=late: chain(layers, x, pdl, late), rep=200)
        results[arm] = (ms, chain(layers, x, pdl, late).clone())
        out[arm] = {"ms": ms, "us_per_launch": 1000 * ms / launches}
    out["same_output"] = all(torch.equal(results["plain"][1], results[a][1]) for a, _, _ in arms)
    print(
        f"{args.layers} layers, {launches} launches, {out['weight_mb']:.0f} MB of weights "
        f"(floor {out['weight_mb'] / 4.3e3:.2f} ms at 4.3 TB/s), CUDA graph replay:"
    )
    for arm, _, _ in arms:
        print(f"  {arm:8s} {out[arm]['ms']:.3f} ms  ({out[arm]['us_per_launch']:.2f} us a launch)")
    print(f"  same output: {out['same_output']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
