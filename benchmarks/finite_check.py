"""Cost of the loaders' NaN/inf check (`checkpoint_checks.refuse_non_finite`), one run.

    python benchmarks/finite_check.py            # CUDA when visible, else CPU
    python benchmarks/finite_check.py --gib 61   # the full Qwen3-30B-A3B bf16 size (needs the memory)

Prints one table: seconds and GB/s for the check (one `aminmax` per tensor, one host sync)
and for the `isfinite(t).all()` it replaced, over tensors of Qwen3-30B-A3B's shapes
(fused experts [128, 1536, 2048] and [128, 2048, 768], attention, norms) adding up to
--gib GiB of bf16.
"""

from __future__ import annotations

import argparse
import time

import torch

from samebits.model.checkpoint_checks import refuse_non_finite

# one layer of Qwen3-30B-A3B, bf16: (name, shape)
LAYER = [
    ("experts.gate_up_proj", (128, 1536, 2048)),
    ("experts.down_proj", (128, 2048, 768)),
    ("q_proj", (4096, 2048)),
    ("k_proj", (512, 2048)),
    ("v_proj", (512, 2048)),
    ("o_proj", (2048, 4096)),
    ("gate", (128, 2048)),
    ("q_norm", (128,)),
    ("input_layernorm", (2048,)),
]


def _tensors(gib: float, device) -> list[tuple[str, torch.Tensor]]:
    out, total, i = [], 0, 0
    while total < gib * 2**30:
        for name, shape in LAYER:
            t = torch.randn(shape, device=device, dtype=torch.bfloat16)
            out.append((f"model.layers.{i}.{name}", t))
            total += t.numel() * 2
        i += 1
    return out


def _time(fn, device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="GiB of bf16 tensors (default 2)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    named = _tensors(args.gib, device)
    nbytes = sum(t.numel() * 2 for _, t in named)
    arms = {
        "aminmax per tensor (samebits)": lambda: refuse_non_finite(named, "bench"),
        "isfinite(t).all() per tensor": lambda: [bool(torch.isfinite(t).all()) for _, t in named],
    }
    table = Table(title=f"finite check over {nbytes / 2**30:.1f} GiB bf16, {len(named)} tensors, {device}")
    for col in ("arm", "s", "GB/s"):
        table.add_column(col)
    for arm, fn in arms.items():
        s = _time(fn, device)
        table.add_row(arm, f"{s:.3f}", f"{nbytes / s / 1e9:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
