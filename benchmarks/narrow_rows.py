"""Sampling rows that ask top-k / top-p: one batched narrowing against a pass per row.

    python benchmarks/narrow_rows.py --batches 1,64,256 --vocab 151936          # CUDA if present
    python benchmarks/narrow_rows.py --device cpu --batches 16 --vocab 151936

Times `sampler.sample` (host work, device work and the read-back of the tokens: what a step
waits on) over `--batches` rows of random float32 logits, every row at temperature 1 and:
- plain: no narrowing (the fused race, `sample_plain`), the floor the others are read against;
- top-k 50 / top-p 0.95 / both: `narrow_rows` in passes of `NARROW_ROWS` rows (the sampler
  now), and the same with one row a pass (`NARROW_ROWS = 1`: what the per-row loop before it
  launched, a topk or a sort and a scan per row).
- the same with the race op by op (`kernels.sample.race`: its noise in int64 [N, V]
  temporaries, ~450 bytes per (row, token)) where the registry now runs one launch on CUDA.
Each arm's tokens and log-probs are compared with the batched arm's (a row's nucleus is its
own, so one pass per row must give the same bits; the op-by-op race is the kernel's oracle).
"""

from __future__ import annotations

import argparse
import time

import torch

from samebits.engine import sampler
from samebits.engine.sampler import SampleRequest
from samebits.kernels.sample import race
from samebits.numerics import registry
from samebits.requests import SamplingParams

ARMS = {
    "plain": dict(),
    "top-k 50": dict(top_k=50),
    "top-p 0.95": dict(top_p=0.95),
    "top-k 50 + top-p 0.95": dict(top_k=50, top_p=0.95),
}


def _time(fn, device: torch.device, reps: int) -> tuple[float, object]:
    out = fn()  # warm-up (and the result compared)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()  # `sample` reads its tokens back: each call ends when the device has
    return (time.perf_counter() - t0) / reps * 1e3, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    device = torch.device(args.device)
    batched_rows = sampler.NARROW_ROWS
    print(f"{device} vocab {args.vocab}, passes of {batched_rows} rows; ms a call (sample + read back)")
    for batch in (int(b) for b in args.batches.split(",")):
        g = torch.Generator(device=device).manual_seed(batch)
        logits = torch.randn(batch, args.vocab, device=device, generator=g) * 3
        for name, over in ARMS.items():
            reqs = [SampleRequest(SamplingParams(seed=i, **over), i, 0) for i in range(batch)]
            call = lambda reqs=reqs, logits=logits: sampler.sample(logits, reqs)  # noqa: E731
            cells = {"now": _time(call, device, args.reps)}
            if over:
                sampler.NARROW_ROWS = 1
                try:
                    cells["one row a pass"] = _time(call, device, args.reps)
                finally:
                    sampler.NARROW_ROWS = batched_rows
                entry = registry.TABLE["race"][device.type]
                registry.TABLE["race"][device.type] = {registry.ANY: race}
                try:
                    cells["op-by-op race"] = _time(call, device, args.reps)
                finally:
                    registry.TABLE["race"][device.type] = entry
            ms, want = cells.pop("now")
            line = f"batch {batch:>4} {name:>22}: {ms:9.2f}"
            for label, (other, got) in cells.items():
                line += f" | {label} {other:9.2f} ({other / ms:.1f}x, same bits: {got == want})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
