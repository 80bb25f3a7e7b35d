"""The trainer's log-prob line inside batch_invariant(): composite vs fused (CUDA).

    python benchmarks/log_softmax.py --tokens 4096 --vocab 151936

`torch.log_softmax(logits.float() / T, dim=-1)` over `--tokens` rows of the Qwen3
vocabulary, inside `batch_invariant()`, two arms in one run:
- composite: `log_softmax_ref` with the device's tree sum (max, subtract, exp, tree sum,
  log, subtract: three [N, V] float32 temporaries besides the output);
- fused: what batch_invariant() now runs there (`sample_launch.log_softmax`: max, lane
  sums, total, then every id's log-prob; reads the input three times, writes the output).
Prints per arm the forward time, the peak memory it allocated beyond its input, whether the
bits equal the composite's, and the floor: the fused arm's bytes (3 reads of the float32
input + 1 write) over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse

import torch
import triton

from samebits.bench.core import copy_bandwidth
from samebits.kernels.softmax import log_softmax_ref
from samebits.numerics import registry
from samebits.numerics.batch_invariant import batch_invariant


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--temperature", type=float, default=0.7)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/log_softmax.py needs CUDA")
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(args.tokens, args.vocab, device=dev, generator=g) * 3).float() / args.temperature
    tree = registry.pick("tree_sum", "cuda", registry.ANY)
    arms = {
        "composite": lambda: log_softmax_ref(x, -1, torch.float32, tree),
        "fused": lambda: torch.log_softmax(x, dim=-1),
    }
    floor_ms = 1e3 * 4 * x.numel() * 4 / bw
    print(f"[{args.tokens}, {args.vocab}] float32, copy {bw / 1e9:.0f} GB/s, fused floor {floor_ms:.2f} ms")
    outs = {}
    with batch_invariant():
        for name, fn in arms.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            outs[name] = fn()
            torch.cuda.synchronize()
            peak_gb = (torch.cuda.max_memory_allocated() - base) / 1e9
            ms = triton.testing.do_bench(fn, warmup=3, rep=20)
            same = torch.equal(outs[name], outs["composite"])
            print(f"{name:>9}: {ms:8.2f} ms ({ms / floor_ms:.1f}x floor), peak +{peak_gb:.2f} GB, same: {same}")


if __name__ == "__main__":
    main()
