"""Host us of samebits' CUDA launchers with their Triton kernels stubbed out: no device needed.

    PYTHONPATH=/path/to/triton python benchmarks/launcher_host.py     # Triton importable, any machine

The trainer's micro-batches are bound by host time (docs/performance.md), and each CUDA op's
host time is its launcher's Python (checks, allocations, grid and block arithmetic, the
launch keywords) plus the C launcher and the driver. This times the first part on any
machine: the launchers run on CPU tensors posing as CUDA ones, every `*_kernel[grid](...)`
launch replaced by a no-op, at the trainer's shapes (a 512-token micro-batch of the
Qwen3-30B-A3B layer). Prints us a call (median of 7 means, `eager_ops.per_call_us`), and
with `--profile` the top functions by own time. It found Triton 3.6's host `cdiv` / `next_power_of_2` at ~7 us a
call (`kernels/grid.py`). A probe: nothing it runs computes anything.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats

import torch
from eager_ops import per_call_us  # noqa: E402 - a sibling script (benchmarks/ is on the path when run)

MODULES = ("matmul_triton", "norm_rope_triton", "norm_backward_triton", "attention_launch", "experts_launch")


class _NoLaunch:
    """Stands in for a launched kernel: `kernel[grid](...)` does nothing."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def stub_launches() -> dict:
    """Import the launcher modules with every kernel launch, launch keyword and device fact
    stubbed; CPU tensors report `is_cuda` -> {module name: module}."""
    torch.Tensor.is_cuda = property(lambda self: True)
    mods = {}
    for name in MODULES:
        mod = mods[name] = importlib.import_module(f"samebits.kernels.{name}")
        for attr in dir(mod):
            if attr.endswith("_kernel") and type(getattr(mod, attr)).__name__ in ("FastLaunch", "JITFunction"):
                setattr(mod, attr, _NoLaunch(getattr(mod, attr)))
        for attr, value in (("launch_args", lambda d: {}), ("sm_count", lambda d: 132)):
            if hasattr(mod, attr):
                setattr(mod, attr, value)
        if hasattr(mod, "shared_memory_per_block"):
            mod.shared_memory_per_block = lambda d: 232448  # an H200's opt-in shared memory
    return mods


def calls(mods: dict) -> dict:
    """name -> a launcher call at a 512-token micro-batch of the 30B-A3B layer (bf16)."""
    from samebits.model.attention import AttentionBatch

    bf = torch.bfloat16
    t, h, e, k, i = 512, 2048, 128, 8, 768
    x, w = torch.randn(t, h, dtype=bf), torch.ones(h, dtype=bf)
    wq = torch.randn(h, 4096, dtype=bf)
    index, weights = torch.randint(0, e, (t, k)), torch.rand(t, k, dtype=bf)
    gate_up, down = torch.empty(e, 2 * i, h, dtype=bf), torch.empty(e, h, i, dtype=bf)
    q, kv = torch.randn(t, 32, 128, dtype=bf), torch.randn(t, 4, 128, dtype=bf)
    b = AttentionBatch.packed([128] * 4, "cpu")
    fields = (b.block_table, b.query_start_loc, b.query_lens, b.seq_lens, b.max_query_len)
    m = mods
    return {
        "matmul (q_proj)": lambda: m["matmul_triton"].matmul(x, wq),
        "rms_norm": lambda: m["norm_rope_triton"].rms_norm(x, w, 1e-6),
        "rms_norm_backward (dx, dw)": lambda: m["norm_backward_triton"].rms_norm_backward(
            x, x, w, 1e-6, (True, True)
        ),
        "paged_attention (4 x 128)": lambda: m["attention_launch"].paged_attention(
            q, kv, kv, *fields, 0.088, 1
        ),
        "route_pairs": lambda: m["experts_launch"].route_pairs(index, e),
        "experts_forward": lambda: m["experts_launch"].experts_forward(x, index, weights, gate_up, down),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", action="store_true", help="also print each launcher's top functions")
    args = p.parse_args()
    from rich.console import Console
    from rich.table import Table

    mods = stub_launches()
    table = Table(title="launcher host us a call, kernels stubbed (median of 7 means)")
    table.add_column("launcher")
    table.add_column("us", justify="right")
    for name, fn in calls(mods).items():
        table.add_row(name, f"{per_call_us({name: fn}, 'cpu', args.calls)[name]:.1f}")
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(lambda fn=fn: [fn() for _ in range(args.calls)])
            print(f"== {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    Console(width=100).print(table)


if __name__ == "__main__":
    main()
