"""Facts about a device that launchers size their grids and pipelines by, read once per device.

Off CUDA (Triton's CPU interpreter, in development) the SM count is 8 and the shared memory
unknown (0). Neither ever decides a bit: they pick how many programs run, or how many loads
are in flight, never an element's reduction order.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (8 off CUDA)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


@functools.cache
def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one block may opt in to on `device`; 0 where unknown (off CUDA,
    or a torch that does not report it)."""
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


@functools.cache
def compute_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of `device`; (0, 0) off CUDA."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def tma_compared(device: torch.device) -> bool:
    """Whether `device` is where TMA-fed tiles were compared bit for bit with the pointer loads:
    NVIDIA compute capability 9.x (Hopper; the H200). ROCm reports 9.x for other hardware, and
    Blackwell's descriptors were not compared, so both keep the pointer loads."""
    return device.type == "cuda" and torch.version.hip is None and compute_capability(device)[0] == 9


def tma_usable(device: torch.device) -> bool:
    """Whether a launcher may load tiles by tensor descriptors on `device` now: `tma_compared`,
    and no CUDA graph being captured on the current stream (the graphs keep the pointer loads,
    whose capture is tested). The one gate of the matmul's and the experts' TMA paths."""
    return tma_compared(device) and not torch.cuda.is_current_stream_capturing()
