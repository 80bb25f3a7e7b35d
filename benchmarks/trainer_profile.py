"""Where the trainer's time goes: samebits kernels vs stock transformers, forward and backward (CUDA).

    python benchmarks/trainer_profile.py --layers 8 --dir /dev/shm/q8 --seqs 4 --tokens 128

For each arm (samebits experts + attention under `batch_invariant()`; stock `grouped_mm` +
`sdpa` on cuBLAS), on one packed micro-batch of `--seqs` x `--tokens` tokens with the experts
frozen (as in the RL runs): the wall time of a no-grad forward (the recompute) and of a
forward+backward (the update), the GPU-busy time inside them (sum of kernel times from the
profiler: wall >> busy means the host is the bound), and the top ops by GPU time, by host
self time and by host time including callees (which autograd nodes and modules the host
time goes to). Each arm in its own process (`--arms`): `batch_invariant()`'s overrides,
once registered, sit on every later stock call. `samebits-before` is the trainer before
`trainer/forwards.py` and the experts' closed-form backward (run it in its own process too).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch

ARMS = {
    "samebits": ({}, True),
    # the trainer before the closed-form backwards (2026-12-04): transformers' linears and norms
    # under the overrides, and the experts' backward by autograd through a grouped_mm recompute
    "samebits-before": ({"samebits_forwards": False}, True),
    "stock": (
        {"experts_implementation": "grouped_mm", "attn_implementation": "sdpa", "samebits_forwards": False},
        False,
    ),
}


def _recompute_experts_backward() -> None:
    """The experts' CUDA backward as before the closed form (for the samebits-before arm)."""
    from samebits.kernels.experts import experts_grouped_mm
    from samebits.numerics import registry

    registry.TABLE["experts_backward"]["cuda"] = {
        registry.ANY: registry._grads_by_recompute(experts_grouped_mm, invariant=False)
    }


def step(model, data, exact: bool, backward: bool) -> None:
    from samebits import trainer
    from samebits.numerics.batch_invariant import batch_invariant

    with torch.set_grad_enabled(backward), batch_invariant() if exact else contextlib.nullcontext():
        lps = trainer.token_logprobs(model, data, [1] * len(data), packed=True, with_grad=backward)
    if backward:
        (-torch.cat(lps).mean()).backward()
        model.zero_grad(set_to_none=True)


def measure(
    model, data, exact: bool, backward: bool, reps: int, top: int, stacks: tuple[str, ...] = ()
) -> tuple[float, float, str]:
    """-> (wall ms, GPU-busy ms, top ops by GPU and by host time) per step, after a warm-up step.
    `stacks`: also the Python stacks that called each of these ops, by host time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step(model, data, exact, backward)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step(model, data, exact, backward)
    torch.cuda.synchronize()
    wall = 1000 * (time.perf_counter() - t0) / reps
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    extra = {}
    if stacks:  # without the verbose config the profiler records no Python frames
        from torch._C._profiler import _ExperimentalConfig

        extra = {"with_stack": True, "experimental_config": _ExperimentalConfig(verbose=True)}
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], **extra
    ) as prof:  # verbose: Python frames
        step(model, data, exact, backward)
        torch.cuda.synchronize()
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
    events = prof.key_averages()
    # kernel (device-side) events only, as the table's "Self CUDA time total" counts them
    busy = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU) / 1000
    keys = ("self_device_time_total", "self_cpu_time_total", "cpu_time_total")  # the last: host, inclusive
    tables = [events.table(sort_by=key, row_limit=top) for key in keys]
    tables.append(f"allocator retries (cudaFree of cached blocks, a device sync) in the step: {retries}")
    if stacks:
        by_stack = [e for e in prof.key_averages(group_by_stack_n=12) if e.key in stacks]
        for e in sorted(by_stack, key=lambda e: -e.self_cpu_time_total)[:top]:
            stack = "\n    ".join(e.stack or ["(no Python stack)"])
            tables.append(
                f"{e.key}: {e.count} calls, host self {e.self_cpu_time_total / 1000:.2f} ms\n    {stack}"
            )
    return wall, busy, "\n".join(tables)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: write --layers random)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dir", default="/dev/shm/samebits-trainer-profile")
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--top", type=int, default=15, help="kernels listed per arm and pass")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument(
        "--stacks", default="", help="comma-separated ops (e.g. aten::index) to list by calling stack"
    )
    args = p.parse_args()
    from samebits import trainer
    from samebits.bench import free_memory, write_random_checkpoint

    model_path = args.model or write_random_checkpoint(Path(args.dir), args.layers, seed=0)
    g = torch.Generator().manual_seed(0)
    stacks = tuple(x for x in args.stacks.split(",") if x)
    summary = []
    for arm in args.arms.split(","):
        impl, exact = ARMS[arm]
        if arm == "samebits-before":
            _recompute_experts_backward()
        model = trainer.load_hf_model(model_path, device="cuda", **impl)
        for n, prm in model.named_parameters():
            prm.requires_grad_("mlp.experts" not in n)
        data = [torch.randint(0, model.config.vocab_size, (args.tokens,), generator=g).tolist()]
        data *= args.seqs
        for backward in (False, True):
            model.train(backward)
            wall, busy, table = measure(model, data, exact, backward, args.reps, args.top, stacks)
            name = f"{arm} {'forward+backward' if backward else 'forward (no grad)'}"
            summary.append((name, wall, busy))
            print(f"\n== {name}: wall {wall:.1f} ms, GPU busy {busy:.1f} ms\n{table}", flush=True)
        del model
        free_memory()
    print(f"\n{args.seqs} x {args.tokens} tokens packed, experts frozen")
    for name, wall, busy in summary:
        print(f"{name:36s} wall {wall:8.1f} ms   GPU busy {busy:8.1f} ms")


if __name__ == "__main__":
    main()
