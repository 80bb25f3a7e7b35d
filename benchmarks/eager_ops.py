"""Host cost of a samebits op call: through the custom op vs the eager direct call (`EagerOp`).

    python benchmarks/eager_ops.py                  # CPU (CUDA when available)
    python benchmarks/eager_ops.py --device cpu --json out.json

Each op of `numerics/ops.py` and the attention op, on inputs so small that the kernel is a
few us, called back to back (one device sync at the end on CUDA): us a call through
`torch.ops.samebits.<op>` (custom_op's dispatcher and Python wrappers) and through the name
samebits exports (an `EagerOp`: the same kernel, called directly). Then the experts with
autograd recording, forward + backward, through the op's registered autograd and through
`_ExpertsGrad`. The difference is what `numerics/eager_op.py` takes off each call; the
trainer pays it for the experts and attention every layer of every micro-batch. On the CPU
the experts' and attention's kernels are the portable ones (ms a call, loops per expert and
per sequence): their rows there are within the host's noise; on CUDA each is a few launches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def per_call_us(fns: dict, device: str, calls: int, rounds: int = 7) -> dict[str, float]:
    """name -> the median over `rounds` of the mean us a call over `calls` back-to-back calls,
    the functions taking turns round by round (a drifting host moves both alike)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for fn in fns.values():
        for _ in range(20):
            fn()
    means: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            means[name].append(1e6 * (time.perf_counter() - t0) / calls)
    return {name: statistics.median(m) for name, m in means.items()}


def calls_under_test(device: str) -> dict:
    """name -> (the exported EagerOp call, the custom op call) on tiny inputs."""
    from samebits.model import attention as attn
    from samebits.model.attention import AttentionBatch
    from samebits.numerics import ops

    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).bfloat16().to(device)

    t, h, e, k, i, heads, d = 4, 128, 8, 2, 64, 4, 64
    x, w, res = r(t, h), r(h), r(t, h)
    q, kv = r(t, heads, d), r(t, 1, d)
    pos = torch.arange(t, device=device)[None]
    inv = ops.rotary_inv_freq(d, 1e6).to(device)
    cos, sin = ops.rotary_cos_sin(q, pos, inv, 1.0)
    logits = r(t, e)
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    weights = torch.softmax(torch.randn(t, k, generator=g), -1).bfloat16().to(device)
    gate_up, down = r(e, 2 * i, h), r(e, h, i)
    batch = AttentionBatch.packed([t], device)
    fields = (batch.block_table, batch.query_start_loc, batch.query_lens, batch.seq_lens, batch.max_query_len)
    sam = torch.ops.samebits
    plain = {
        "rms_norm": (ops.rms_norm, sam.rms_norm, (x, w, 1e-6)),
        "add_rms_norm": (ops.add_rms_norm, sam.add_rms_norm, (x, res, w, 1e-6)),
        "rotary_cos_sin": (ops.rotary_cos_sin, sam.rotary_cos_sin, (q, pos, inv, 1.0)),
        "apply_rotary": (ops.apply_rotary, sam.apply_rotary, (q, kv, cos[0], sin[0], 1)),
        "router": (ops.router, sam.router, (logits, k, True)),
        "experts": (ops.experts, sam.experts, (x, index, weights, gate_up, down)),
        "paged_attention": (attn._paged_attention, sam.paged_attention, (q, kv, kv, *fields, 0.125, 1)),
    }
    out = {name: (lambda f=f, a=a: f(*a), lambda o=o, a=a: o(*a)) for name, (f, o, a) in plain.items()}
    xg = x.clone().requires_grad_(True)
    grad = torch.ones_like(x)

    def trained(fn):
        return lambda: fn(xg, index, weights, gate_up, down).backward(grad)

    out["experts, forward + backward"] = (trained(ops.experts), trained(sam.experts))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--json", default=None, help="write the table as JSON here")
    args = p.parse_args()
    from rich.console import Console
    from rich.table import Table

    rows = {}
    for name, (eager, op) in calls_under_test(args.device).items():
        calls = args.calls // 10 if "backward" in name else args.calls
        try:
            us = per_call_us({"op_us": op, "eager_us": eager}, args.device, calls)
        except Exception as e:  # one call this device refuses: the row says so, the rest still run
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        rows[name] = {**us, "saved_us": us["op_us"] - us["eager_us"]}
    table = Table(title=f"host us a call, {args.device}, tiny inputs (median of 7 interleaved means)")
    for col in ("call", "torch.ops.samebits", "samebits (EagerOp)", "saved"):
        table.add_column(col, justify="left" if col == "call" else "right")
    for name, row in rows.items():
        if "error" in row:
            table.add_row(name, row["error"], "", "")
            continue
        table.add_row(name, *(f"{row[k]:.1f}" for k in ("op_us", "eager_us", "saved_us")))
    Console(width=120).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
