"""Host -> device copies that never wait for the device.

A copy from pageable host memory goes through the driver's own staging: a plain `copy_`
waits for the stream (the step in flight, under async scheduling, engine/core.py), and a
`non_blocking` one may still block the host while it stages. From pinned memory the copy is
queued behind the stream's work and the host goes on; PyTorch's caching host allocator keeps
the pinned block until the copy is done.
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


def copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy host `src` into `dst` (a CUDA graph's static input buffer), queued behind the
    stream's work as `to_device` is; a plain copy on the CPU (the CPU tests of the fill)."""
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
