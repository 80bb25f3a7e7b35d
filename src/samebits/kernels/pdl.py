"""Programmatic dependent launch (PDL) between the decode step's kernels: on where supported.

A batch-1 decode step is ~11 short launches a layer (docs/performance.md, 2026-12-04):
each kernel's launch and ramp-up come after the one before has finished. With PDL (CUDA,
compute capability 9.0 and later) a kernel launched with `launch_pdl=True` may be scheduled
while the kernel before it in the stream is still running, once every program of that one has
called `gdc_launch_dependents()` (or exited); it then waits in `gdc_wait()` until the kernel
before has completed and its memory is visible. `benchmarks/pdl_chain.py` measured a chain of
decode-sized GEMVs in a CUDA graph on the H200: 7.49 us a launch plain, 6.94 with the trigger
after each kernel's main loop, 14.57 with it at the start (the waiting programs then hold SMs
the running kernel needs).

Each decode kernel takes a `PDL` constexpr (False by default, which compiles both calls below
out: the kernel is the one it was) and calls `pdl_wait(PDL)` before its first access to global
memory, reads and writes alike, so nothing it touches can race the kernel before it, and
`pdl_release(PDL)` after its main loop. Nothing of the arithmetic changes, so neither do the bits.
`launch_args(device)` is what each launcher adds to its launch: `PDL=True, launch_pdl=True`
where PDL is on, else nothing.

On by default: `samebits bench` on the H200 (48 layers, 1k context, exact, through `generate`,
2026-12-04, docs/performance.md) gave 4.31 ms a token at batch 1 against 4.41 off,
19.29-19.33 against 19.45-19.54 at 64, 26.78-26.93 against 27.07-27.08 at 256, and the 48-layer
probe with it on 0 mismatches in every exact arm. Set SAMEBITS_PDL=0 in the environment to turn
it off for a process.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("SAMEBITS_PDL", "1") != "0"
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_ON = {"PDL": True, "launch_pdl": True}
_OFF: dict = {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the kernel before in the stream (a no-op unless PDL)."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel in the stream be scheduled (a no-op unless PDL)."""
    if PDL:
        gdc_launch_dependents()


def supported(device: torch.device) -> bool:
    """PDL needs a CUDA (not ROCm) device of compute capability 9.0 or later, compiled kernels."""
    return device.type == "cuda" and _cuda_supported(device.index)


@functools.cache
def _cuda_supported(index: int | None) -> bool:
    return torch.version.hip is None and not _INTERPRET and torch.cuda.get_device_capability(index)[0] >= 9


def launch_args(device: torch.device) -> dict:
    """The launch keywords for a decode kernel on `device`: PDL on where ENABLED and supported."""
    return _ON if ENABLED and supported(device) else _OFF
