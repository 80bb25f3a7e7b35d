"""Cost of `samebits rl`'s weight digests: sha256 on the host vs the fast device checksum.

    python benchmarks/digest_cost.py            # CUDA when visible (8 GiB), else CPU (0.5 GiB)
    python benchmarks/digest_cost.py --gib 61   # the full Qwen3-30B-A3B bf16 size (needs the memory)

Prints one table: seconds, GB/s, the time scaled to the whole 61 GB model, and the peak
device memory the arm allocated beyond the weights, for `--digest-kind sha256` (copy to
the host, hashlib) and `--digest-kind fast` (`samebits.engine.digest.fast_digest` where
the tensors live: all eager, and the default, which fuses tensors of >= 32 MiB into one
torch.compile'd kernel), over tensors of Qwen3-30B-A3B's shapes (fused experts
[128, 1536, 2048] and [128, 2048, 768], attention, router, norms) adding up to --gib GiB
of bf16. Each arm digests every tensor once, as one `samebits rl` sync check does per side.
"""

from __future__ import annotations

import argparse
import time

import torch

from samebits.engine.digest import FUSED_MIN_BYTES, fast_digest, sha256_digest

MODEL_BYTES = 61.06e9  # Qwen3-30B-A3B in bf16, hub layout (48 layers, embed + lm_head)

# one layer of Qwen3-30B-A3B, bf16: (name, shape); the same tensors as the NaN-check benchmark
from finite_check import LAYER  # noqa: E402 - a sibling script (benchmarks/ is on the path when run)


def _tensors(gib: float, device) -> list[tuple[str, torch.Tensor]]:
    """Layers of LAYER's tensors while they fit in `gib` GiB (one that does not is skipped)."""
    out, total, budget = [], 0, gib * 2**30
    for i in range(10_000):
        added = 0
        for name, shape in LAYER:
            nbytes = 2 * torch.Size(shape).numel()
            if total + nbytes <= budget:
                out.append(
                    (f"model.layers.{i}.{name}", torch.randn(shape, device=device, dtype=torch.bfloat16))
                )
                total, added = total + nbytes, added + 1
        if not added:
            break
    return out


def _time(fn, device) -> tuple[float, float]:
    """-> (seconds, peak MiB allocated beyond what was allocated before) of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    s = time.perf_counter() - t0
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else float("nan")
    return s, extra


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--gib", type=float, default=None, help="GiB of bf16 tensors (default 8 on CUDA, 0.5 on CPU)"
    )
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gib = args.gib if args.gib is not None else (8.0 if device.type == "cuda" else 0.5)
    named = _tensors(gib, device)
    nbytes = sum(t.numel() * 2 for _, t in named)
    fast_digest(named[-1][1], fused=False)  # warm-up: kernels loaded, constants on the device
    compile_s, _ = _time(lambda: fast_digest(torch.zeros(2**16, device=device), fused=True), device)
    arms = {
        "sha256 (host copy + hashlib)": lambda: [sha256_digest(t) for _, t in named],
        f"fast, eager (on {device.type})": lambda: [fast_digest(t, fused=False) for _, t in named],
        f"fast, default: fused >= {FUSED_MIN_BYTES >> 20} MiB": lambda: [fast_digest(t) for _, t in named],
    }
    title = (
        f"weight digests over {nbytes / 2**30:.2f} GiB bf16, {len(named)} tensors, {device} "
        f"(fused kernel compiled once, in {compile_s:.1f} s, not counted)"
    )
    table = Table(title=title)
    for col in ("kind", "s", "GB/s", "61 GB model, s", "peak extra MiB"):
        table.add_column(col)
    for arm, fn in arms.items():
        s, extra = _time(fn, device)
        table.add_row(
            arm, f"{s:.3f}", f"{nbytes / s / 1e9:.2f}", f"{s * MODEL_BYTES / nbytes:.1f}", f"{extra:.0f}"
        )
    Console().print(table)


if __name__ == "__main__":
    main()
