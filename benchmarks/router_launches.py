"""The router after its linear: four launches around torch.topk, or one. Same bits? Cost?

    python benchmarks/router_launches.py [--tokens 1,64,256,4096]

At the Qwen3-30B-A3B router shape (128 experts, top-8, bf16 logits), times
`router_triton.router` (softmax kernel, torch.topk's gather and sort, renorm kernel) and
`router_one_launch.router` in a CUDA graph (as the engine replays decode), and says whether
their weights and indices are equal, on random logits and on logits with expert 3j+1 tied to
expert 3j (where only torch.topk's tie order makes them equal).
"""

from __future__ import annotations

import argparse

import torch
import triton

from samebits.kernels import router_one_launch, router_triton

E, K = 128, 8


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


if __name__ == "__main__":
    main()
