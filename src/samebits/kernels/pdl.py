"""Programmatic dependent launch (PDL) between the decode step's kernels: on where supported.

A batch-1 decode step is ~11 short launches a layer (docs/perf-notes.md, thirteenth session):
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
docs/perf-notes.md fourteenth session) gave 4.31 ms a token at batch 1 against 4.41 off,
19.29-19.33 against 19.45-19.54 at 64, 26.78-26.93 against 27.07-27.08 at 256, and the 48-layer
probe with it on 0 mismatches in every exact arm. Set SAMEBITS_PDL=0 in the environment to turn
it off for a process.

Two more uses of that overlap, which change no arithmetic either (`SAMEBITS_PDL_PREFETCH=0`
turns both off):
- a kernel of at most one program per SM (a decode-sized norm or split attention) may let the
  next kernel be scheduled as soon as it has waited (`pdl_release_early`), rather than after its
  main loop: all of its programs are then already resident, so the next kernel's programs only
  take SMs it leaves idle;
- a decode GEMM asks L2 for its weight rows (`prefetch_rows_l2`) before it waits. The weights
  are never the kernel before's output; and a prefetch only moves lines from memory into L2,
  the point of coherence every load goes through, so a line the kernel before is writing is
  still read after that kernel's write. The GEMM's loads then find the weights in L2 while the
  kernel before runs, instead of starting from memory latency once it ends.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from samebits.kernels.device_facts import sm_count

ENABLED = os.environ.get("SAMEBITS_PDL", "1") != "0"
PREFETCH = os.environ.get("SAMEBITS_PDL_PREFETCH", "1") != "0"
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


@triton.jit
def pdl_release_early(PDL: tl.constexpr, EARLY: tl.constexpr):
    """With EARLY, let the next kernel be scheduled now (a no-op unless PDL; a later
    `pdl_release` is then a no-op as well). Call it after `pdl_wait`, or kernels cascade."""
    if PDL and EARLY:
        gdc_launch_dependents()


# cp.async.bulk.prefetch (sm_90): bring [address, address + size) into L2; size a multiple of 16
_BULK_PREFETCH = tl.constexpr(
    "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)


@triton.jit
def prefetch_rows_l2(row_ptrs, row_bytes, CHUNKS: tl.constexpr):
    """Ask L2 for the rows of `row_bytes` bytes starting at each of `row_ptrs` (1-D, 16-byte
    aligned; `row_bytes` a multiple of 16), each row as CHUNKS bulk prefetches spread over the
    program's threads. A hint: it loads nothing into registers and changes no value read."""
    chunk = tl.cdiv(row_bytes, CHUNKS * 16) * 16
    start = tl.arange(0, CHUNKS)[None, :] * chunk
    size = tl.minimum(chunk, row_bytes - start)
    addr = row_ptrs.to(tl.int64)[:, None] + start
    tl.inline_asm_elementwise(_BULK_PREFETCH, "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


def rows_prefetchable(data_ptr: int, row_stride_bytes: int, row_bytes: int, elements_stride: int) -> bool:
    """Whether `prefetch_rows_l2` may take these rows: contiguous (elements_stride 1), and every
    row's start and length 16-byte aligned, as the bulk prefetch needs."""
    return elements_stride == 1 and data_ptr % 16 == 0 and row_stride_bytes % 16 == 0 and row_bytes % 16 == 0


def supported(device: torch.device) -> bool:
    """PDL needs a CUDA (not ROCm) device of compute capability 9.0 or later, compiled kernels."""
    return device.type == "cuda" and _cuda_supported(device.index)


@functools.cache
def _cuda_supported(index: int | None) -> bool:
    return torch.version.hip is None and not _INTERPRET and torch.cuda.get_device_capability(index)[0] >= 9


def launch_args(device: torch.device, early_programs: int | None = None) -> dict:
    """The launch keywords for a decode kernel on `device`: PDL on where ENABLED and supported.
    `early_programs`: the grid's programs, for a kernel with an EARLY constexpr
    (`pdl_release_early`); EARLY where they fit one to an SM and PREFETCH is on."""
    if not (ENABLED and supported(device)):
        return _OFF
    if early_programs is None:
        return _ON
    return {**_ON, "EARLY": PREFETCH and early_programs <= sm_count(device)}


def prefetch_on(device: torch.device) -> bool:
    """Whether decode GEMMs on `device` prefetch their weights into L2 before they wait."""
    return PREFETCH and ENABLED and supported(device)
