"""The router: four launches around torch.topk, or one; its linear apart, or in the same launch.
Same bits? Cost?

    python benchmarks/router_launches.py [--tokens 1,64,256,4096]

At the Qwen3-30B-A3B router shape (hidden 2048, 128 experts, top-8, bf16), in a CUDA graph (as
the engine replays decode), us a call:
- after the linear: `router_triton.router` (softmax kernel, torch.topk's gather and sort,
  renorm kernel) against `router_one_launch.router`, on random logits and on logits with
  expert 3j+1 tied to expert 3j (where only torch.topk's tie order makes them equal);
- with the linear: the Triton matmul then the one-launch router against
  `router_one_launch.gate` (one launch; 48 distinct gate weights cycled, so they come from
  memory as in a 48-layer step). Floor: the gate weight's 0.5 MB at 4.3 TB/s = 0.12 us.
"""

from __future__ import annotations

import argparse

import torch
import triton

from samebits.kernels import matmul_triton, router_one_launch, router_triton

E, K, H, LAYERS = 128, 8, 2048, 48


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,64,256,4096")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'T':>6} {'four launches us':>17} {'one launch us':>14}  same bits (random, tied)")
    for t in (int(x) for x in args.tokens.split(",")):
        logits = torch.randn(t, E, device="cuda", generator=g).bfloat16()
        tied = logits.clone()
        tied[:, 1::3] = tied[:, 0::3][:, : tied[:, 1::3].shape[1]]
        same = []
        for x in (logits, tied):
            a = router_triton.router(x, K, True)
            b = router_one_launch.router(x, K, True)
            same.append(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
        us = [
            1000 * triton.testing.do_bench_cudagraph(lambda f=f, x=logits: f(x, K, True), rep=50)
            for f in (router_triton.router, router_one_launch.router)
        ]
        print(f"{t:>6} {us[0]:>17.1f} {us[1]:>14.1f}  {same}")
    print(f"\n{'T':>6} {'matmul + router us':>19} {'gate us':>8}  same bits")
    gates = [torch.randn(E, H, device="cuda", generator=g).bfloat16() * H**-0.5 for _ in range(LAYERS)]
    for t in (int(x) for x in args.tokens.split(",")):
        x = torch.randn(t, H, device="cuda", generator=g).bfloat16()

        def apart(x=x):
            for w in gates:
                router_one_launch.router(matmul_triton.matmul(x, w.t()), K, True)

        def fused(x=x):
            for w in gates:
                router_one_launch.gate(x, w, K, True)

        a = router_one_launch.router(matmul_triton.matmul(x, gates[0].t()), K, True)
        b = router_one_launch.gate(x, gates[0], K, True)
        same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        us = [1000 * triton.testing.do_bench_cudagraph(f, rep=50) / LAYERS for f in (apart, fused)]
        print(f"{t:>6} {us[0]:>19.1f} {us[1]:>8.1f}  {same}")


if __name__ == "__main__":
    main()
