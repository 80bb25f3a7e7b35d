"""Host -> device copies that never wait for the device.

A `non_blocking` copy from pageable host memory still waits for the stream (CUDA stages it
through its own buffer once the stream reaches it), so a step built while the step before
runs (async scheduling, engine/core.py) would wait for that step at its first input copy.
From pinned memory the copy is queued and the host goes on; PyTorch's caching host
allocator keeps the pinned block until the copy is done.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`, queued behind the stream's work on CUDA (the tensor itself
    elsewhere: on the CPU a `.to` is a no-op)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
