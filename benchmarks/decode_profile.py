"""Where a decode step's GPU time goes: every kernel of one step, by name, at the real shape.

    python benchmarks/decode_profile.py --layers 2 --batches 1,64,256 --arms exact,fast

Writes a random Qwen3-30B-A3B-shaped checkpoint of `--layers` layers (or reuses `--dir`),
builds one eager engine (no CUDA graphs, so the profiler sees each launch), then, once
that one is freed, one with graphs (two 48-layer engines do not fit an H100), and per arm
and batch:
- profiles `--steps` eager decode steps of B sequences at `--context` tokens of KV
  (`torch.profiler`, CUDA kernels only) and prints each kernel's launches and GPU time per
  step, the busiest first, with the sum of all kernel time per step;
- times the CUDA-graph replay of the same step, so replay minus kernel time is what the
  launches and gaps cost inside the graph;
- times the sampler alone on random [B, V] logits, op by op and fused (eager).
Per-layer cost is (kernel time - the part outside the layers) / layers; run two layer
counts to separate them. `--json` writes every table.

`--prefill B` (B > 0) also profiles, per arm, one `generate` of B prompts of `--context`
tokens with max_tokens=1 (the prefill `samebits bench` times as tok/s; the engine's own
prefill budget per step): its wall time, the kernels' time inside it (the rest is host time
and gaps), and every kernel by name, as above.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict
from pathlib import Path

import torch


def kernel_table(llm, batch: int, context: int, steps: int) -> dict[str, list[float]]:
    """name -> [launches per step, GPU us per step] over `steps` eager decode steps."""
    from torch.profiler import ProfilerActivity, profile

    from samebits.bench.core import decode_batch

    with decode_batch(llm, batch, context) as (b, reqs), llm.runner.profile.context():
        for _ in range(3):
            llm.runner.run(b, reqs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                llm.runner.run(b, reqs)
            torch.cuda.synchronize()
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = table[e.name]
            row[0] += 1 / steps
            row[1] += e.time_range.elapsed_us() / steps
    return dict(table)


def prefill_table(llm, batch: int, context: int) -> tuple[float, dict[str, list[float]]]:
    """(wall ms, name -> [launches, GPU us]) of one generate of `batch` fresh prompts of
    `context` tokens with max_tokens=1, after a warm-up call on other prompts."""
    from torch.profiler import ProfilerActivity, profile

    from samebits.bench.generate import random_prompts, timed_generate

    vocab = llm.config.vocab_size
    timed_generate(llm, random_prompts(vocab, batch, context, seed=1), 1)
    wall = 1000 * timed_generate(llm, random_prompts(vocab, batch, context, seed=2), 1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_generate(llm, random_prompts(vocab, batch, context, seed=3), 1)
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            table[e.name][0] += 1
            table[e.name][1] += e.time_range.elapsed_us()
    return wall, dict(table)


def _kernel_rows(table, kernels: dict[str, list[float]], top: int) -> list[tuple[str, float, float]]:
    """Fill a rich table with the `top` busiest kernels; -> every (name, launches, us), busiest first."""
    busy = sum(us for _, us in kernels.values()) or 1.0
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    for name, (n, us) in ranked[:top]:
        table.add_row(name[:90], f"{n:.0f}", f"{us:.1f}", f"{100 * us / busy:.1f}%")
    return [(name, n, us) for name, (n, us) in ranked]


def replay_ms(llm, batch: int, context: int, steps: int) -> float | None:
    from samebits.bench.core import engine_step_ms, replay_ms

    engine_step_ms(llm, batch, context, steps)
    return replay_ms.get((llm.runner.profile.name, batch))


def sampler_ms(vocab: int, batch: int, reps: int = 20) -> dict[str, float]:
    """The plain decode sample alone on random bf16 logits [batch, vocab] (T = 0.7 rows), eager,
    inside batch_invariant(): op by op (`composite.sample_plain`) and fused (`sample_launch`)."""
    from samebits.engine.sampler import SampleRequest, row_inputs
    from samebits.kernels import sample_launch
    from samebits.numerics import composite, registry
    from samebits.numerics.batch_invariant import batch_invariant
    from samebits.requests import SamplingParams

    logits = torch.randn(batch, vocab, device="cuda").bfloat16()
    reqs = [SampleRequest(SamplingParams(temperature=0.7), i, 3) for i in range(batch)]
    args = [t.cuda() for t in row_inputs(reqs)]
    arms = {
        "op by op": lambda: composite.sample_plain(logits, *args, registry._multiply_by_reciprocals),
        "fused": lambda: sample_launch.sample(logits, *args),
    }
    out = {}
    with batch_invariant():
        for name, fn in arms.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            out[name] = 1000 * (time.perf_counter() - t0) / reps
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--arms", default="exact,fast")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="kernels listed per table")
    p.add_argument("--dir", default="/dev/shm/samebits-profile")
    p.add_argument("--json", default=None)
    p.add_argument("--prefill", type=int, default=0, help="also profile a prefill of N prompts (0: none)")
    args = p.parse_args()
    from rich.console import Console
    from rich.table import Table

    from samebits.bench import write_random_checkpoint
    from samebits.engine.llm import LLM

    console = Console(width=160)
    batches = [int(b) for b in args.batches.split(",")]
    path = Path(args.dir)
    if not (path / "config.json").is_file():
        write_random_checkpoint(path, args.layers, seed=0)
    limits = dict(device="cuda", max_num_seqs=max(batches + [args.prefill]), max_model_len=args.context + 64)
    # one engine at a time: two copies of the 48-layer weights (~61 GB each) do not fit an H100
    eager = LLM(path, cuda_graphs=False, **limits)
    layers = eager.config.num_hidden_layers
    out = {"layers": layers, "context": args.context, "points": []}
    for arm in args.arms.split(","):
        eager.set_numerics(arm)
        for b in batches:
            kernels = kernel_table(eager, b, args.context, args.steps)
            sample = sampler_ms(eager.config.vocab_size, b)
            busy = sum(us for _, us in kernels.values())
            launches = sum(n for n, _ in kernels.values())
            t = Table(
                title=f"{arm}, batch {b}, {layers} layers: {launches:.0f} launches, {busy / 1000:.2f} ms of "
                "kernels per step; sampler alone " + ", ".join(f"{k} {v:.3f} ms" for k, v in sample.items())
            )
            for col in ("kernel", "launches/step", "us/step", "share"):
                t.add_column(col, justify="left" if col == "kernel" else "right")
            ranked = _kernel_rows(t, kernels, args.top)
            console.print(t)
            out["points"].append(
                {
                    "arm": arm,
                    "batch": b,
                    "launches": launches,
                    "kernel_ms": busy / 1000,
                    "replay_ms": None,
                    "sampler_ms": sample,
                    "kernels": {k: {"launches": n, "us": us} for k, n, us in ranked},
                }
            )
            _write(args.json, out)
        if args.prefill:
            wall, kernels = prefill_table(eager, args.prefill, args.context)
            busy = sum(us for _, us in kernels.values())
            tokens = args.prefill * args.context
            t = Table(
                title=f"{arm}, prefill of {args.prefill} x {args.context} tokens, {layers} layers: "
                f"{wall:.1f} ms ({tokens / wall * 1000:,.0f} tok/s), {busy / 1000:.1f} ms of kernels"
            )
            for col in ("kernel", "launches", "us", "share"):
                t.add_column(col, justify="left" if col == "kernel" else "right")
            ranked = _kernel_rows(t, kernels, args.top)
            console.print(t)
            out.setdefault("prefill", []).append(
                {
                    "arm": arm,
                    "prompts": args.prefill,
                    "wall_ms": wall,
                    "kernel_ms": busy / 1000,
                    "kernels": {k: {"launches": n, "us": us} for k, n, us in ranked},
                }
            )
            _write(args.json, out)
    del eager
    gc.collect()
    torch.cuda.empty_cache()
    graphed = LLM(path, **limits)
    for point in out["points"]:
        graphed.set_numerics(point["arm"])
        point["replay_ms"] = replay = replay_ms(graphed, point["batch"], args.context, args.steps * 4)
        console.print(
            f"{point['arm']}, batch {point['batch']}: graph replay {replay or float('nan'):.2f} ms, "
            f"kernels {point['kernel_ms']:.2f} ms per step (replay - kernels: launches and gaps)"
        )
        _write(args.json, out)


def _write(path: str | None, out: dict) -> None:
    """The JSON so far (after every point, so a run stopped part way keeps what it measured)."""
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)


if __name__ == "__main__":
    main()
